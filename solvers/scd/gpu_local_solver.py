"""GPU local solvers (TPA-SCD) for CoCoA / SCD with device-resident local variables (the GPU
twins of ``local_solver``).

``GpuDualLocalSolver`` / ``GpuPrimalLocalSolver`` hold one rank's share of a CoCoA problem on
the device: the training data (CSR rows for the dual, CSC columns for the primal), labels,
weights, norms, the local variables of the committed point ``x0`` and of the round's proposal
``x``, and the shared vector ``w`` of the committed point. Their per-round API:

* ``set_shared(shared)`` -- upload the host's shared vector after the CoCoA step (one vector up);
* ``run(sigma, epochs, seed, rank, round)`` -- H TPA-SCD epochs (``gpu_kernels``) from ``x0`` and
  ``w``, the epoch permutations made on the device (``gpu_shuffle``) -> ``u`` (one vector down):
  ``shared + sigma * (local change of the shared vector)``;
* reductions over the local variables (gap pieces, line-search pieces, logistic derivatives;
  ``gpu_reduce_kernels``) -> a few scalars down;
* ``commit(gamma)`` -- ``x0 += gamma (x - x0)`` on the device (nothing crosses);
* ``load_local`` / ``local()`` -- the local vector up / down, only on a restore or when a
  checkpoint or the model needs it.

Host buffers of vector transfers are pinned (``cuda.pinned_array``), as in Parnell et al. Sec. V-A.
``gpu_problem`` wraps these into the round loop's ``Problem``; ``gpu.train_cocoa_gpu`` runs it.
"""

from __future__ import annotations

import abc

import numpy as np

from terascale.solvers.catalogue import loss_by_id
from terascale.solvers.data import CSRData
from terascale.solvers.scd.gpu_device import (
    MAX_REDUCE_BLOCKS,
    Device,
    block_threads,
    coord_grid,
    launch_shape,
    require_gpu,
    resident_blocks,
)
from terascale.solvers.scd.partition import FeatureBlock

__all__ = ["GpuDualLocalSolver", "GpuPrimalLocalSolver"]

_REDUCE_COLUMNS = 3


class _GpuLocalSolver(abc.ABC):
    """Common machinery: x0 / x, the shared vector w and its working copy u, the order buffer,
    and deterministic reductions that bring back ``_REDUCE_COLUMNS`` scalars."""

    def __init__(self, n_coords: int, n_shared: int, nnz: int, threads_per_block: int | None,
                 blocks: int | None) -> None:
        from terascale.solvers.scd import gpu_kernels as gk
        from terascale.solvers.scd import gpu_reduce_kernels as rk

        require_gpu()
        self.gk, self.rk = gk, rk
        self.dev = Device()
        tpb = block_threads(threads_per_block, nnz, n_coords)
        if blocks is not None and blocks < 1:
            raise ValueError(f"blocks: {blocks} is not allowed; expected an integer >= 1 or None")
        self.tpb = tpb
        self.n = n_coords
        # one block per coordinate (the paper); fewer blocks loop over the permutation
        self.blocks = max(1, n_coords if blocks is None else min(int(blocks), n_coords))
        dev = self.dev
        self.x0 = dev.put(np.zeros(n_coords))
        self.x = dev.put(np.zeros(n_coords))
        self.w = dev.put(np.zeros(n_shared))
        self.u = dev.empty(n_shared, np.float64)
        self.order = dev.empty(max(n_coords, 1), np.int64)[:n_coords]
        self.part = dev.empty((MAX_REDUCE_BLOCKS, _REDUCE_COLUMNS), np.float64)
        self.out = dev.empty(_REDUCE_COLUMNS, np.float64)
        self.h_x = dev.pinned(n_coords, np.float64)
        self.h_w = dev.pinned(n_shared, np.float64)
        self.h_u = dev.pinned(n_shared, np.float64)
        self.h_out = dev.pinned(_REDUCE_COLUMNS, np.float64)

    # -- the resident API ------------------------------------------------------------------

    def load_local(self, local: np.ndarray) -> None:
        """Upload the local variables of the committed point (at the start, or after a restore)."""
        if local.shape != (self.n,):
            raise ValueError(f"local vector has shape {local.shape}; expected ({self.n},)")
        if self.n:
            np.copyto(self.h_x, local)
            self.dev.upload(self.x0, self.h_x)
            self.dev.copy(self.x, self.x0)

    def set_shared(self, shared: np.ndarray) -> None:
        """Upload the shared vector of the committed point (reused by the reductions and ``run``)."""
        np.copyto(self.h_w, shared)
        self.dev.upload(self.w, self.h_w)

    def run(self, sigma: float, epochs: int, seed: int, rank: int, round_index: int) -> np.ndarray:
        """H epochs from ``x0`` and ``w`` into ``x`` and ``u``; -> u on the host (a pinned buffer,
        valid until the next call): ``w + sigma * (local change of the shared vector)``."""
        from terascale.solvers.scd.gpu_shuffle import domain_bits, epoch_keys, permutation_kernel

        dev = self.dev
        dev.copy(self.u, self.w)
        if self.n:
            dev.copy(self.x, self.x0)
        half, mask = domain_bits(self.n)
        grid, threads = launch_shape(self.n, 256)
        for e in range(epochs if self.n else 0):
            dev.launch(permutation_kernel, grid, threads, self.order, self.n, half, mask,
                       *epoch_keys(seed, rank, round_index, e))
            self._epoch(sigma)
        dev.download(self.u, self.h_u)
        return self.h_u

    def commit(self, gamma: float) -> None:
        """local = x0 + gamma (x - x0) on the device (x = x0 afterwards)."""
        if self.n:
            grid, threads = launch_shape(self.n, 256)
            self._commit(grid, threads, float(gamma))

    def local(self) -> np.ndarray:
        """The committed local variables on the host (a pinned buffer, valid until the next call)."""
        if self.n:
            self.dev.download(self.x0, self.h_x)
        return self.h_x

    def traffic(self) -> dict[str, int]:
        return self.dev.traffic()

    def _reduce(self, kernel, grid: int, threads: int, args: tuple, n_sum: int) -> np.ndarray:
        """Launch ``kernel(*args, part)`` on ``grid`` blocks, combine the rows in block order
        (columns < n_sum summed, the others minimised) -> the scalars (a host copy)."""
        self.dev.launch(kernel, grid, threads, *args, self.part,
                        shared=self.gk.shared_bytes(threads))
        self.dev.launch(self.rk.finish_partials, 1, _REDUCE_COLUMNS, self.part, grid, n_sum,
                        self.out)
        self.dev.download(self.out, self.h_out)
        return self.h_out.copy()

    # -- per formulation ----------------------------------------------------------------------

    @abc.abstractmethod
    def _epoch(self, sigma: float) -> None:
        """One TPA-SCD epoch over this solver's coordinates (the formulation's kernel launch)."""

    @abc.abstractmethod
    def _commit(self, grid: int, threads: int, gamma: float) -> None:
        """The formulation's commit kernel."""


def eso_weights(indices: np.ndarray, n_features: int, n_rows: int, tau: int) -> tuple[np.ndarray, float]:
    """Per-feature weights beta_j of the expected separable overapproximation for ``tau``
    coordinates updated at once (Richtárik & Takáč, parallel coordinate descent, τ-nice sampling):
    beta_j = 1 + (ω_j − 1)(τ − 1) / max(1, n − 1), ω_j the rows holding feature j, n the rows;
    the constant feature is in every row (ω = n, beta = τ). (beta, the constant's beta).

    TPA-SCD's dual epoch runs up to τ rows at once, each reading the shared vector as the
    others left it; a row's step is damped as if its quadratic coefficient were
    sum_j beta_j x_ij² instead of ||x_i||². A feature in few rows keeps beta ≈ 1; one in every
    row (the constant) gets τ: without it, τ concurrent steps on the constant overshoot by about
    τ and the epoch diverges once τ exceeds about 2λN (seen on an H100 at τ ≈ 2,000). τ = 1 (the
    simulator, or one block): beta = 1, the sequential step exactly."""
    scale = (tau - 1) / max(1, n_rows - 1)
    beta = np.bincount(indices, minlength=n_features).astype(np.float64)  # ω, then beta in place
    beta -= 1.0
    np.maximum(beta, 0.0, out=beta)
    beta *= scale
    beta += 1.0
    return beta, float(1.0 + max(n_rows - 1, 0) * scale)


class GpuDualLocalSolver(_GpuLocalSolver):
    """SDCA by TPA-SCD on one example shard (the GPU twin of ``DualLocalSolver`` and of
    ``DualProblem``'s local sums): local = alpha (n_rows,), shared = w (n_features + 1,)."""

    def __init__(self, data: CSRData, loss: int, lam: float, n_weight: float, bias_scale: float,
                 threads_per_block: int | None = None, blocks: int | None = None) -> None:
        if not loss_by_id(loss).dual:  # ValueError for an unknown id: the kernels cannot raise
            raise ValueError(f"loss {loss_by_id(loss).name!r} has no dual (SDCA) step")
        super().__init__(data.n_rows, data.n_features + 1, data.nnz, threads_per_block, blocks)
        self.loss = int(loss)
        self.lam_n = float(lam) * float(n_weight)
        self.bias_scale = float(bias_scale)
        self.bias_index = data.n_features
        put = self.dev.put
        self.indptr = put(data.indptr.astype(np.int64))
        self.indices = put(data.indices.astype(np.int32))
        self.values = put(data.values.astype(np.float32))
        self.labels = put(data.labels.astype(np.float32))
        self.weights = put(data.weights.astype(np.float32))
        self.sqn = self.dev.empty(max(data.n_rows, 1), np.float64)
        self.concurrency = min(self.blocks, resident_blocks(self.tpb))
        if data.n_rows:
            beta, bias_beta = eso_weights(data.indices, data.n_features, data.n_rows, self.concurrency)
            grid = -(-data.n_rows // 128)
            self.dev.launch(self.gk.row_sq_norms_kernel, grid, 128, self.indptr, self.indices, self.values,
                            self.dev.put(beta), bias_beta, self.bias_scale, self.sqn)

    def _epoch(self, sigma: float) -> None:
        self.dev.launch(
            self.gk.tpa_dual_epoch, self.blocks, self.tpb, self.indptr, self.indices, self.values,
            self.labels, self.weights, self.sqn, self.x, self.u, self.order, self.loss,
            sigma / self.lam_n, self.bias_scale, self.bias_index,
            shared=self.gk.shared_bytes(self.tpb))

    def _commit(self, grid: int, threads: int, gamma: float) -> None:
        self.dev.launch(self.rk.commit_dual_kernel, grid, threads, self.loss, self.labels, self.x,
                        self.x0, gamma, self.n)

    def objective_sums(self) -> np.ndarray:
        """(sum c phi(x_i . w), sum c h(alpha_i)) at the committed point (``dual_objective_sums``)."""
        if not self.n:
            return np.zeros(2)
        args = (self.indptr, self.indices, self.values, self.labels, self.weights, self.x0, self.w,
                self.n, self.loss, self.bias_scale, self.bias_index)
        return self._reduce(self.rk.dual_eval_partials, coord_grid(self.n), self.tpb, args, 2)[:2]

    def line_sums(self) -> tuple[float, float, float]:
        """(p0, p1, gamma_max) of ``dual_line_sums`` for the proposal dalpha = x - x0."""
        if not self.n:
            return 0.0, 0.0, np.inf
        grid, threads = launch_shape(self.n, 256)
        args = (self.loss, self.labels, self.weights, self.x, self.x0, self.n)
        r = self._reduce(self.rk.dual_line_partials, grid, threads, args, 2)
        return float(r[0]), float(r[1]), float(r[2])

    def logistic_derivs(self, gamma: float) -> tuple[float, float]:
        """``logistic_line_derivs`` at alpha + gamma dalpha (two scalars down)."""
        if not self.n:
            return 0.0, 0.0
        grid, threads = launch_shape(self.n, 256)
        args = (self.labels, self.weights, self.x, self.x0, self.n, float(gamma))
        r = self._reduce(self.rk.logistic_partials, grid, threads, args, 2)
        return float(r[0]), float(r[1])


class GpuPrimalLocalSolver(_GpuLocalSolver):
    """Ridge SCD by TPA-SCD on a block of columns (the GPU twin of ``PrimalLocalSolver``):
    local = beta (block), shared = the margins z of all rows."""

    def __init__(self, block: FeatureBlock, lam: float, n_weight: float,
                 threads_per_block: int | None = None, blocks: int | None = None) -> None:
        m = block.colptr.shape[0] - 1
        n = block.labels.shape[0]
        super().__init__(m, n, int(block.colptr[-1]), threads_per_block, blocks)
        self.lam_n = float(lam) * float(n_weight)
        put = self.dev.put
        self.colptr = put(block.colptr.astype(np.int64))
        self.rows = put(block.rows.astype(np.int32))
        self.vals = put(block.vals.astype(np.float32))
        self.labels = put(block.labels.astype(np.float32))
        self.weights = put(block.weights.astype(np.float32))
        self.csq = self.dev.empty(max(m, 1), np.float64)
        if m:
            grid = -(-m // 128)
            self.dev.launch(self.gk.col_sq_norms_kernel, grid, 128, self.colptr, self.rows,
                            self.vals, self.weights, self.csq)

    def _epoch(self, sigma: float) -> None:
        self.dev.launch(
            self.gk.tpa_primal_epoch, self.blocks, self.tpb, self.colptr, self.rows, self.vals,
            self.labels, self.weights, self.csq, self.x, self.u, self.order, self.lam_n,
            float(sigma), shared=self.gk.shared_bytes(self.tpb))

    def _commit(self, grid: int, threads: int, gamma: float) -> None:
        self.dev.launch(self.rk.commit_primal_kernel, grid, threads, self.x, self.x0, gamma,
                        self.n)

    def eval_sums(self) -> np.ndarray:
        """(||beta_k||^2, (lam N)^2 ||w_k(y - z)||^2) at the committed point, z = the shared w."""
        if not self.n:
            return np.zeros(2)
        args = (self.colptr, self.rows, self.vals, self.labels, self.weights, self.x0, self.w,
                self.n)
        return self._reduce(self.rk.primal_eval_partials, coord_grid(self.n), self.tpb, args, 2)[:2]

    def line_sums(self) -> tuple[float, float]:
        """(<beta, dbeta>, ||dbeta||^2) for the proposal dbeta = x - x0."""
        if not self.n:
            return 0.0, 0.0
        grid, threads = launch_shape(self.n, 256)
        r = self._reduce(self.rk.primal_line_partials, grid, threads, (self.x, self.x0, self.n), 2)
        return float(r[0]), float(r[1])
