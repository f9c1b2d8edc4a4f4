"""CoCoA on the dual (data by example): SDCA local solvers, shared vector w = w(alpha).

Each rank keeps its shard's dual variables ``alpha_k`` and the replicated primal vector
``w = (1/(lam N)) sum_i c_i alpha_i x_i`` (length n_features + 1, the last entry the intercept
feature's coefficient). A round: the local solver proposes ``dalpha_k`` on the subproblem with
sigma'; ``dw_k = (1/(lam N)) sum_{i in k} c_i dalpha_i x_i``; one allreduce sums the ``dw_k``
(and the scalars); then ``alpha_k += gamma dalpha_k`` and ``w += gamma dw``.

``DualProblemBase`` is the host half every implementation shares (w, dw, the objectives, gamma,
the model); ``DualProblem`` keeps alpha on the host and runs the CPU local solver, and
``gpu_problem.GpuDualProblem`` keeps alpha on the GPU.

Gap pieces of the current point: ``P(w) = (1/N) sum c phi(x.w) + (lam/2)||w||^2`` and
``D(alpha) = (1/N) sum c h(alpha) - (lam/2)||w||^2``, so ``gap = (1/N)(sum c phi - sum c h) + lam ||w||^2``.
"""

from __future__ import annotations

import abc
import math

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import (
    apply_dual_step,
    axpy,
    dual_objective_sums,
    dual_objective_sums_chunked,
    scaled_difference,
)
from terascale.solvers.scd.line_search import (
    dual_line_sums,
    fixed_gamma,
    hinge_gamma,
    local_sigma,
    logistic_gamma,
    logistic_line_derivs,
    ridge_dual_gamma,
    seq_dot,
    squared_hinge_gamma,
)
from terascale.solvers.scd.local_solver import DualLocalSolver, numba_threads
from terascale.solvers.scd.losses import HINGE, LOGISTIC, SQUARED, SQUARED_HINGE, loss_code
from terascale.solvers.scd.params import CocoaParams
from terascale.solvers.scd.rounds import GapThenProposal

EVAL_CHUNKS = 64  # row ranges of the threaded gap pass (fixed: the sums do not depend on threads)


class DualProblemBase(GapThenProposal, abc.ABC):
    """The host side of dual CoCoA: the replicated w, the round's dw, objectives, gamma, model.
    Subclasses keep alpha and provide ``eval_pieces``, ``propose``, ``apply``, ``snapshot``,
    ``restore`` and the local sums ``_line_sums`` / ``_logistic_derivs``."""

    eval_len = 2
    previous_gamma: float | None = None

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float):
        self.data, self.comm, self.p = data, comm, params
        self.loss = loss_code(params.loss)
        self.n_weight = n_weight
        self.sigma = local_sigma(params.aggregation, comm.size)
        self.w = np.zeros(data.n_features + 1)
        self.dw = np.zeros(data.n_features + 1)
        adaptive = params.aggregation == "adaptive"
        self.line_len = (2 + (comm.size if self.loss != SQUARED else 0)) if adaptive else 0

    @property
    def shared_len(self) -> int:
        return self.w.shape[0]

    def objectives(self, sums: np.ndarray) -> tuple[float, float]:
        half = 0.5 * self.p.l2 * seq_dot(self.w, self.w)
        return sums[0] / self.n_weight + half, sums[1] / self.n_weight - half

    def shared_delta(self) -> np.ndarray:
        return self.dw

    def line_pieces(self) -> np.ndarray:
        if not self.line_len:
            return np.zeros(0)
        p0, p1, gmax = self._line_sums()
        out = np.zeros(self.line_len)
        out[0], out[1] = p0, p1
        if self.loss != SQUARED:
            out[2 + self.comm.rank] = gmax
        return out

    def gamma(self, dw: np.ndarray, sums: np.ndarray) -> float:
        k = self.comm.size
        if self.p.aggregation != "adaptive":
            return fixed_gamma(self.p.aggregation, k)
        lam, n_w = self.p.l2, self.n_weight
        wd, dd = seq_dot(self.w, dw), seq_dot(dw, dw)
        if self.loss == SQUARED:
            return ridge_dual_gamma(sums[0], sums[1], wd, dd, lam, n_w)
        gmax = float(np.min(sums[2:2 + k]))
        if self.loss == HINGE:
            return hinge_gamma(sums[0], wd, dd, lam, n_w, gmax)
        if self.loss == SQUARED_HINGE:
            return squared_hinge_gamma(sums[0], sums[1], wd, dd, lam, n_w, gmax)
        if self.loss == LOGISTIC:
            return self._logistic_gamma(wd, dd, gmax)
        raise ValueError(f"no adaptive aggregation for loss id {self.loss!r}")

    def _logistic_gamma(self, wd: float, dd: float, gmax: float) -> float:
        def derivs(g: float) -> tuple[float, float]:
            s1, s2 = self._logistic_derivs(g)
            r = self.comm.allreduce_scalars([s1, s2])
            return r[0], r[1]

        # Newton from the last round's gamma (it changes little from round to round): fewer
        # evaluations than from 1/K
        prev = self.previous_gamma
        start = prev if prev is not None and math.isfinite(prev) and prev > 0.0 else 1.0 / self.comm.size
        return logistic_gamma(derivs, wd, dd, self.p.l2, self.n_weight, gmax, start=start)

    def model(self) -> np.ndarray:
        """beta (n_features + 1,), float64, identical on every rank."""
        return self.w.copy()

    def _check_fit(self, local: np.ndarray, shared: np.ndarray) -> None:
        n = (self.data.n_rows,)
        if local.shape != n or shared.shape != self.w.shape:
            raise ValueError(
                f"resume state does not fit this shard: alpha {local.shape} vs {n}, "
                f"w {shared.shape} vs {self.w.shape}"
            )

    @abc.abstractmethod
    def _line_sums(self) -> tuple[float, float, float]:
        """(p0, p1, gmax) of the line search over this rank's alpha and dalpha."""

    @abc.abstractmethod
    def _logistic_derivs(self, gamma: float) -> tuple[float, float]:
        """This rank's first and second derivative sums of the logistic line search at gamma."""


class DualProblem(DualProblemBase):
    """One rank's side of dual CoCoA on the CPU (see the module docstring)."""

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float):
        super().__init__(data, comm, params, n_weight)
        self.solver = DualLocalSolver(data, self.loss, params.l2, n_weight, params.bias_scale,
                                      params.threads, params.bucket_size)
        self.alpha = np.zeros(data.n_rows)
        self.dalpha = np.zeros(data.n_rows)

    def eval_pieces(self) -> np.ndarray:
        d = self.data
        args = (d.indptr, d.indices, d.values, d.labels, d.weights, self.alpha, self.w, self.loss,
                self.p.bias_scale, d.n_features)
        if self.p.threads == 1:
            return np.array(dual_objective_sums(*args))
        with numba_threads(self.p.threads):  # the gap pass costs half an epoch: share it too
            return np.array(dual_objective_sums_chunked(*args, EVAL_CHUNKS))

    def propose(self, round_index: int) -> None:
        a, u = self.solver.solve(self.alpha, self.w, self.sigma, self.p.local_epochs,
                                 self.p.seed, self.comm.rank, round_index)
        np.subtract(a, self.alpha, out=self.dalpha)
        scaled_difference(self.dw, u, self.w, 1.0 / self.sigma)

    def evaluate_and_propose(self, round_index: int) -> np.ndarray:
        a, u, sums = self.solver.solve_with_gap(self.alpha, self.w, self.sigma,
                                                self.p.local_epochs, self.p.seed,
                                                self.comm.rank, round_index)
        np.subtract(a, self.alpha, out=self.dalpha)
        scaled_difference(self.dw, u, self.w, 1.0 / self.sigma)
        return np.array(sums)

    def _line_sums(self) -> tuple[float, float, float]:
        d = self.data
        return dual_line_sums(self.loss, d.labels, d.weights, self.alpha, self.dalpha)

    def _logistic_derivs(self, gamma: float) -> tuple[float, float]:
        d = self.data
        return logistic_line_derivs(d.labels, d.weights, self.alpha, self.dalpha, gamma)

    def apply(self, gamma: float, dw: np.ndarray) -> None:
        apply_dual_step(self.loss, self.data.labels, self.alpha, self.dalpha, gamma)
        axpy(self.w, gamma, dw)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.alpha.copy(), self.w.copy()

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        self._check_fit(local, shared)
        np.copyto(self.alpha, local)
        np.copyto(self.w, shared)
