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
from terascale.solvers.scd.gpu_hot_solver import HOT_LOSSES, GpuHotDualSolver, device_plan, worth_it
from terascale.solvers.scd.gpu_local_solver import GpuDualLocalSolver, GpuPrimalLocalSolver
from terascale.solvers.scd.line_search import seq_dot
from terascale.solvers.scd.losses import loss_code
from terascale.solvers.scd.params import CocoaParams
from terascale.solvers.scd.primal_problem import PrimalProblemBase
from terascale.solvers.scd.rounds import GapThenProposal


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


class GpuHotDualProblem(GapThenProposal):
    """The dual with the hot features as a primal block (``gpu_hot_solver``), on one rank.

    The shared vector is the point ``w = (u, w_H)`` itself; a round runs the epochs on the device
    and brings w down (``8 S`` bytes); gamma is 1 (the cold steps are SDCA's exact steps with
    sigma' = 1, the hot block's Newton steps take their own line search). Gap pieces:
    ``(Σ c φ(z), Σ c h(α̂), ||w(α̂)||², Σ c h(α), ||w(α)||²)`` with ``α̂ = −φ'(z)``, so
    ``P = Σ c φ / N + λ/2 ||w||²`` and ``D = max over a in (α̂, α) of Σ c h(a) / N − λ/2 ||w(a)||²``."""

    eval_len = 5
    line_len = 0
    previous_gamma: float | None = None

    def __init__(self, data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float,
                 threads_per_block: int | None = None, blocks: int | None = None,
                 hot_tau: int | None = None, chosen=None):
        if comm.size != 1:
            raise ValueError(f"the hot-block GPU dual runs on one rank (its Newton step needs the "
                             f"Hessian of every row); this run has {comm.size}")
        self.data, self.comm, self.p, self.n_weight = data, comm, params, n_weight
        self.solver = GpuHotDualSolver(data, loss_code(params.loss), params.l2, n_weight,
                                       params.bias_scale, threads_per_block, blocks, hot_tau=hot_tau,
                                       chosen=chosen)
        self.w = np.zeros(data.n_features + 1)
        self.w_new = np.zeros_like(self.w)
        self.dw = np.zeros_like(self.w)

    @property
    def shared_len(self) -> int:
        return self.w.shape[0]

    def eval_pieces(self) -> np.ndarray:
        return self.solver.gap_sums()

    def objectives(self, sums: np.ndarray) -> tuple[float, float]:
        lam = self.p.l2
        return (sums[0] / self.n_weight + 0.5 * lam * seq_dot(self.w, self.w),
                max(sums[1] / self.n_weight - 0.5 * lam * sums[2],
                    sums[3] / self.n_weight - 0.5 * lam * sums[4]))

    def propose(self, round_index: int) -> None:
        self.solver.run(self.p.local_epochs, self.p.seed, self.comm.rank, round_index)
        self.solver.model(self.w_new)
        np.subtract(self.w_new, self.w, out=self.dw)

    def shared_delta(self) -> np.ndarray:
        return self.dw

    def line_pieces(self) -> np.ndarray:
        return np.zeros(0)

    def gamma(self, delta: np.ndarray, sums: np.ndarray) -> float:
        return 1.0

    def apply(self, gamma: float, delta: np.ndarray) -> None:
        if gamma != 1.0:
            raise ValueError(f"the hot-block GPU dual takes its epochs whole (gamma 1, not {gamma})")
        np.copyto(self.w, self.w_new)  # the device's point, bit for bit

    def model(self) -> np.ndarray:
        return self.w.copy()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.solver.local().copy(), self.w.copy()

    def restore(self, local: np.ndarray, shared: np.ndarray) -> None:
        if local.shape != (self.data.n_rows,) or shared.shape != self.w.shape:
            raise ValueError(f"resume state does not fit this shard: alpha {local.shape} vs "
                             f"({self.data.n_rows},), w {shared.shape} vs {self.w.shape}")
        self.solver.load(local, shared)
        np.copyto(self.w, shared)


GPU_FORMULATIONS = {"dual": GpuDualProblem, "primal": GpuPrimalProblem}


def hot_block_applies(params: CocoaParams, comm: Communicator) -> bool:
    """Whether ``make_gpu_problem`` picks the hot-block dual by default: the dual of a twice
    differentiable loss (squared, logistic) on one rank."""
    return (params.formulation == "dual" and comm.size == 1
            and loss_code(params.loss) in HOT_LOSSES)


def make_gpu_problem(data: CSRData, comm: Communicator, params: CocoaParams, n_weight: float,
                     threads_per_block: int | None = None, blocks: int | None = None,
                     hot_block: bool | None = None, hot_tau: int | None = None):
    """``api.train_cocoa``'s ``make_problem`` for the GPU: the formulation's GPU problem —
    ``GpuHotDualProblem`` where ``hot_block_applies`` and its plan keeps at least a quarter of
    the rows in flight (``gpu_hot_solver.worth_it``); ``hot_block`` False: the damped TPA-SCD
    dual ``GpuDualProblem``; True: the hot block whatever its plan, or a ValueError saying why not."""
    if params.partition != "fixed":
        raise ValueError(f"cocoa.partition: {params.partition!r} is not available on the GPU; "
                         "expected 'fixed' (or run the CPU solver)")
    applies = hot_block_applies(params, comm)
    if hot_block and not applies:
        raise ValueError("the hot-block GPU dual needs formulation 'dual', loss 'squared' or "
                         f"'logistic' and one rank (got {params.formulation!r}, {params.loss!r}, "
                         f"{comm.size} ranks)")
    if applies and hot_block is not False:
        chosen = device_plan(data, params.bias_scale, threads_per_block, blocks, hot_tau)
        if hot_block or worth_it(chosen):
            return GpuHotDualProblem(data, comm, params, n_weight, threads_per_block, blocks, hot_tau, chosen)
    return GPU_FORMULATIONS[params.formulation](data, comm, params, n_weight, threads_per_block,
                                                blocks)
