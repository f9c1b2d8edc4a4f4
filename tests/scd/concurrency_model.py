"""A CPU model of the rows in flight in TPA-SCD's dual epoch on a GPU (what the CUDA simulator,
which runs one block at a time, cannot show).

On a device about τ thread blocks (rows) run at once, so a row reads the shared vector while the
rows started just before it have not yet added their updates. The model makes that exact and
deterministic: the rows go in the epoch's order, row t reads ``u`` holding the updates of rows
``< t - τ + 1`` only (the τ − 1 rows before it are in flight), and its own update lands just
before row ``t + τ`` reads. τ = 1 is the sequential epoch (``dual_kernels.dual_epoch``), step for
step. A GPU's blocks finish in varying order, not in this lock-step, but each still misses about
τ − 1 updates, which is what the damping must absorb.

``DelayedDualProblem`` is ``DualProblem`` (CoCoA's round loop, exact line search, duality gap)
with the epoch replaced by the model, and each row's quadratic coefficient damped as the GPU
solver damps it (``gpu_local_solver.eso_weights`` for τ) or not at all. Used by
``test_gpu_concurrency_model`` and ``bench_gpu_concurrency``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import dual_objective_sums
from terascale.solvers.scd.dual_problem import DualProblem
from terascale.solvers.scd.gpu_local_solver import eso_weights
from terascale.solvers.scd.local_solver import DualLocalSolver, epoch_rng
from terascale.solvers.scd.losses import dual_step


@njit(cache=True)
def damped_row_sq_norms(indptr, indices, values, beta, bias_beta, bias_scale):
    """v_i = bias_beta s² + Σ_j beta_j x_ij² of every row, summed in the order of
    ``gpu_kernels.row_sq_norms_kernel`` (beta = 1: ``dual_kernels.row_sq_norms`` exactly)."""
    n = indptr.shape[0] - 1
    out = np.empty(n)
    for i in range(n):
        acc = bias_beta * bias_scale * bias_scale
        for k in range(indptr[i], indptr[i + 1]):
            v = np.float64(values[k])
            acc += beta[indices[k]] * v * v
        out[i] = acc
    return out


@njit(cache=True)
def _add_row(j, coef, indptr, indices, values, u, bias_scale, bias_index):
    for k in range(indptr[j], indptr[j + 1]):
        u[indices[k]] += coef * np.float64(values[k])
    u[bias_index] += coef * bias_scale


@njit(cache=True)
def delayed_dual_epoch(indptr, indices, values, labels, weights, sqn, alpha, u, order, tau, loss,
                       scale, bias_scale, bias_index):
    """One SDCA epoch over ``order`` in which each row misses the updates of the ``tau - 1``
    rows before it (see the module docstring); the conventions of ``dual_kernels.dual_epoch``."""
    n = order.shape[0]
    rows = np.empty(tau, np.int64)
    coefs = np.zeros(tau)
    for t in range(n):
        slot = t % tau
        if t >= tau:  # row t - tau's update has landed
            _add_row(rows[slot], coefs[slot], indptr, indices, values, u, bias_scale, bias_index)
        i = order[t]
        dot = bias_scale * u[bias_index]
        for k in range(indptr[i], indptr[i + 1]):
            dot += np.float64(values[k]) * u[indices[k]]
        c = np.float64(weights[i])
        a = alpha[i]
        a_new = dual_step(loss, np.float64(labels[i]), a, dot, scale * c * sqn[i])
        alpha[i] = a_new
        rows[slot] = i
        coefs[slot] = scale * c * (a_new - a)
    for t in range(max(n - tau, 0), n):  # the last rows' updates land after the epoch
        slot = t % tau
        _add_row(rows[slot], coefs[slot], indptr, indices, values, u, bias_scale, bias_index)


class DelayedDualLocalSolver(DualLocalSolver):
    """``DualLocalSolver`` (one thread) whose epochs run the model with ``tau`` rows in flight;
    ``damped``: each row's ||x_i||² becomes the ESO's Σ_j β_j x_ij² for ``tau`` (as on a GPU)."""

    def __init__(self, data: CSRData, loss: int, lam: float, n_weight: float, bias_scale: float,
                 bucket_size: int, tau: int, damped: bool) -> None:
        super().__init__(data, loss, lam, n_weight, bias_scale, threads=1, bucket_size=bucket_size)
        self.tau = int(tau)
        if damped and data.n_rows:
            beta, bias_beta = eso_weights(data.indices, data.n_features, data.n_rows, self.tau)
            self.sqn = damped_row_sq_norms(data.indptr, data.indices, data.values, beta, bias_beta,
                                           self.bias_scale)

    def solve_with_gap(self, alpha, w, sigma, epochs, seed, rank, round_index):
        d = self.d
        sums = dual_objective_sums(d.indptr, d.indices, d.values, d.labels, d.weights, alpha, w,
                                   self.loss, self.bias_scale, d.n_features)
        a, u = self.solve(alpha, w, sigma, epochs, seed, rank, round_index)
        return a, u, sums

    def _epochs(self, sigma, epochs, seed, rank, round_index):
        d, s = self.d, self.schedule
        for e in epochs:
            order = s.order(epoch_rng(seed, rank, round_index, e), self.dealt)
            delayed_dual_epoch(d.indptr, self.indices, d.values, d.labels, d.weights, self.sqn,
                               self.alpha, self.u, order, self.tau, self.loss, sigma / self.lam_n,
                               self.bias_scale, self.bias_index)


class DelayedDualProblem(DualProblem):
    """``DualProblem`` with ``DelayedDualLocalSolver`` epochs (one thread: ``params.threads`` is
    not used)."""

    def __init__(self, data, comm, params, n_weight, *, tau: int, damped: bool):
        super().__init__(data, comm, params, n_weight)
        self.solver = DelayedDualLocalSolver(data, self.loss, params.l2, n_weight,
                                             params.bias_scale, params.bucket_size, tau, damped)


def delayed_problem(tau: int, damped: bool):
    """A ``make_problem`` for ``train_cocoa``: the model with ``tau`` rows in flight."""
    return lambda data, comm, params, n_weight: DelayedDualProblem(
        data, comm, params, n_weight, tau=tau, damped=damped)
