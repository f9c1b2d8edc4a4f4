"""CoCoA problems whose local variables live on the GPU across rounds (the round loop's
``Problem`` for ``train_cocoa_gpu``).

``GpuDualProblem`` / ``GpuPrimalProblem`` share the host half of ``DualProblem`` /
``PrimalProblem`` (the replicated shared vector, objectives, gamma, model: same code, same bytes
on every rank) and keep the local variables -- alpha of the shard, or beta of the column block --
in a ``gpu_local_solver.GpuDualLocalSolver`` / ``GpuPrimalLocalSolver``. What crosses PCIe in a
round:

=================  ===========================================================  ===============
step               device work                                                  bytes
=================  ===========================================================  ===============
``eval_pieces``    the shared vector of the new point goes up; gap sums          8 S up, 24 down
``propose``        H TPA-SCD epochs (permutations made on the device); u down    8 S down
``line_pieces``    line-search sums over (alpha, dalpha) or (beta, dbeta)        24 down
``gamma``          logistic only: the derivatives at each Newton step            24 down / step
``apply``          ``x0 += gamma (x - x0)`` on the device; ``w += gamma dw`` on   0
                   the host
=================  ===========================================================  ===============

(S = ``shared_len``; a reduction brings back 3 float64s; ``line_pieces`` reduces only with
``aggregation = "adaptive"``.) So an adaptive round moves ``16 S + 48`` bytes (+ 24 per logistic
Newton step), whatever the number of local coordinates; the data went up once, at set-up. The local vector
crosses only in ``snapshot`` (a checkpoint) and ``restore``, and the primal model's block in
``model()``; the dual model is the host's w.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import axpy, scaled_difference
from terascale.solvers.scd.dual_problem import DualProblemBase
from terascale.solvers.scd.gpu_local_solver import GpuDualLocalSolver, GpuPrimalLocalSolver
from terascale.solvers.scd.params import CocoaParams
from terascale.solvers.scd.primal_problem import PrimalProblemBase


class GpuDualProblem(DualProblemBase):
    """Dual CoCoA with alpha on the GPU (see the module docstring)."""

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float,
                 threads_per_block: int | None = None, blocks: int | None = None):
        super().__init__(data, comm, params, n_weight)
        self.solver = GpuDualLocalSolver(data, self.loss, params.l2, n_weight, params.bias_scale,
                                         threads_per_block, blocks)
        self._stale = True  # the device's copy of w is behind the host's

    def _sync_shared(self) -> None:
        if self._stale:
            self.solver.set_shared(self.w)
            self._stale = False

    def eval_pieces(self) -> np.ndarray:
        self._sync_shared()
        return self.solver.objective_sums()

    def propose(self, round_index: int) -> None:
        self._sync_shared()
        u = self.solver.run(self.sigma, self.p.local_epochs, self.p.seed, self.comm.rank,
                            round_index)
        scaled_difference(self.dw, u, self.w, 1.0 / self.sigma)

    def _line_sums(self) -> tuple[float, float, float]:
        return self.solver.line_sums()

    def _logistic_derivs(self, gamma: float) -> tuple[float, float]:
        return self.solver.logistic_derivs(gamma)

    def apply(self, gamma: float, dw: np.ndarray) -> None:
        self.solver.commit(gamma)
        axpy(self.w, gamma, dw)
        self._stale = True

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.solver.local().copy(), self.w.copy()

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        self._check_fit(local, shared)
        self.solver.load_local(local)
        np.copyto(self.w, shared)
        self._stale = True


class GpuPrimalProblem(PrimalProblemBase):
    """Primal ridge CoCoA with the column block's beta on the GPU (see the module docstring)."""

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float,
                 threads_per_block: int | None = None, blocks: int | None = None):
        super().__init__(data, comm, params, n_weight)
        self.solver = GpuPrimalLocalSolver(self.block, params.l2, n_weight, threads_per_block,
                                           blocks)
        self._stale = True

    def _sync_shared(self) -> None:
        if self._stale:
            self.solver.set_shared(self.z)
            self._stale = False

    def eval_pieces(self) -> np.ndarray:
        self._sync_shared()
        return self.solver.eval_sums()

    def propose(self, round_index: int) -> None:
        self._sync_shared()
        u = self.solver.run(self.sigma, self.p.local_epochs, self.p.seed, self.comm.rank,
                            round_index)
        scaled_difference(self.dz, u, self.z, 1.0 / self.sigma)

    def line_pieces(self) -> np.ndarray:
        if not self.line_len:
            return np.zeros(0)
        return np.array(self.solver.line_sums())

    def apply(self, gamma: float, dz: np.ndarray) -> None:
        self.solver.commit(gamma)
        axpy(self.z, gamma, dz)
        self._stale = True

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.solver.local().copy(), self.z.copy()

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        self._check_fit(local, shared)
        self.solver.load_local(local)
        np.copyto(self.z, shared)
        self._stale = True

    def _local_beta(self) -> np.ndarray:
        return self.solver.local()


GPU_FORMULATIONS = {"dual": GpuDualProblem, "primal": GpuPrimalProblem}


def make_gpu_problem(data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float,
                     threads_per_block: int | None = None, blocks: int | None = None):
    """``api.train_cocoa``'s ``make_problem`` for the GPU: the formulation's GPU problem."""
    if params.partition != "fixed":
        raise ValueError(f"cocoa.partition: {params.partition!r} is not available on the GPU; "
                         "expected 'fixed' (or run the CPU solver)")
    return GPU_FORMULATIONS[params.formulation](data, comm, params, n_weight, threads_per_block,
                                                blocks)
