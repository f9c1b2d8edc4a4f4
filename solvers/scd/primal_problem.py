"""CoCoA on the primal of ridge regression (data by feature), Parnell et al. Algorithms 3-4.

Each rank owns a block of columns (``partition.feature_block``) and its coefficients
``beta_k``; the margins ``z = X beta`` over all rows are replicated. A round: the local solver
proposes ``dbeta_k`` with sigma'; ``dz_k = X_k dbeta_k``; one allreduce sums the ``dz_k`` (and
the scalars of Eq. 7); then ``beta_k += gamma dbeta_k`` and ``z += gamma dz``.

Gap of the current point, with the dual point ``alpha = y - z`` (the optimality map, Eq. 6):
``P = (1/N) sum c (z - y)^2 / 2 + (lam/2) sum_k ||beta_k||^2`` and
``D = (1/N) sum c (y^2 - z^2) / 2 - (lam/2) ||w(alpha)||^2`` with
``w(alpha) = (1/(lam N)) X^T C (y - z)``, whose squared norm is a sum of per-block pieces.
The margin terms come from the replicated ``z`` (the same on every rank); only
``||beta_k||^2`` and ``||w_k(alpha)||^2`` travel in the allreduce.
"""

from __future__ import annotations

import abc

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import axpy, scaled_difference
from terascale.solvers.scd.line_search import fixed_gamma, local_sigma, ridge_primal_gamma, seq_dot
from terascale.solvers.scd.local_solver import PrimalLocalSolver
from terascale.solvers.scd.params import CocoaParams
from terascale.solvers.scd.partition import feature_block
from terascale.solvers.scd.primal_kernels import (
    dual_map_sq_norm,
    residual_direction_sums,
    residual_sums,
)
from terascale.solvers.scd.rounds import GapThenProposal


class PrimalProblemBase(GapThenProposal, abc.ABC):
    """The host side of primal CoCoA: the column block, the replicated z, the round's dz,
    objectives, gamma, model. Subclasses keep beta_k and provide ``eval_pieces``, ``propose``,
    ``line_pieces``, ``apply``, ``snapshot``, ``restore`` and ``_local_beta``."""

    eval_len = 2
    previous_gamma: float | None = None  # set by the loop; the closed-form gammas need no start

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float):
        self.comm, self.p = comm, params
        self.n_weight = n_weight
        self.n_columns = data.n_features + 1
        self.block = feature_block(data, comm, params.bias_scale)
        self.sigma = local_sigma(params.aggregation, comm.size)
        self.n_local = self.block.owned.shape[0]
        n = self.block.labels.shape[0]
        self.z = np.zeros(n)
        self.dz = np.zeros(n)
        self.line_len = 2 if params.aggregation == "adaptive" else 0

    @property
    def shared_len(self) -> int:
        return self.z.shape[0]

    def objectives(self, sums: np.ndarray) -> tuple[float, float]:
        lam, n_w = self.p.l2, self.n_weight
        loss_sum, conj_sum = residual_sums(self.z, self.block.labels, self.block.weights)
        w_sq = sums[1] / (lam * n_w) ** 2
        return loss_sum / n_w + 0.5 * lam * sums[0], conj_sum / n_w - 0.5 * lam * w_sq

    def shared_delta(self) -> np.ndarray:
        return self.dz

    def gamma(self, dz: np.ndarray, sums: np.ndarray) -> float:
        if self.p.aggregation != "adaptive":
            return fixed_gamma(self.p.aggregation, self.comm.size)
        a, b = residual_direction_sums(self.z, dz, self.block.labels, self.block.weights)
        return ridge_primal_gamma(a, b, sums[0], sums[1], self.p.l2, self.n_weight)

    def model(self) -> np.ndarray:
        """beta (n_features + 1,), float64: the blocks summed by an allreduce (disjoint supports,
        so the sum is exact and identical on every rank)."""
        full = np.zeros(self.n_columns)
        full[self.block.owned] = self._local_beta()
        return self.comm.allreduce(full)

    def _check_fit(self, local: np.ndarray, shared: np.ndarray) -> None:
        if local.shape != (self.n_local,) or shared.shape != self.z.shape:
            raise ValueError(
                f"resume state does not fit this block: beta {local.shape} vs ({self.n_local},), "
                f"z {shared.shape} vs {self.z.shape}"
            )

    @abc.abstractmethod
    def _local_beta(self) -> np.ndarray:
        """This rank's block of beta, on the host."""


class PrimalProblem(PrimalProblemBase):
    """One rank's side of primal (by-feature) CoCoA for ridge regression, on the CPU."""

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float):
        super().__init__(data, comm, params, n_weight)
        self.solver = PrimalLocalSolver(self.block, params.l2, n_weight, params.threads,
                                        params.bucket_size)
        self.beta = np.zeros(self.n_local)
        self.dbeta = np.zeros(self.n_local)

    def eval_pieces(self) -> np.ndarray:
        b = self.block
        return np.array([seq_dot(self.beta, self.beta),
                         dual_map_sq_norm(b.colptr, b.rows, b.vals, b.labels, b.weights, self.z)])

    def propose(self, round_index: int) -> None:
        beta, u = self.solver.solve(self.beta, self.z, self.sigma, self.p.local_epochs,
                                    self.p.seed, self.comm.rank, round_index)
        np.subtract(beta, self.beta, out=self.dbeta)
        scaled_difference(self.dz, u, self.z, 1.0 / self.sigma)

    def line_pieces(self) -> np.ndarray:
        if not self.line_len:
            return np.zeros(0)
        return np.array([seq_dot(self.beta, self.dbeta), seq_dot(self.dbeta, self.dbeta)])

    def apply(self, gamma: float, dz: np.ndarray) -> None:
        axpy(self.beta, gamma, self.dbeta)
        axpy(self.z, gamma, dz)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.beta.copy(), self.z.copy()

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        self._check_fit(local, shared)
        np.copyto(self.beta, local)
        np.copyto(self.z, shared)

    def _local_beta(self) -> np.ndarray:
        return self.beta
