"""GPU local solvers (TPA-SCD) for CoCoA / SCD, and a trainer that uses them.

``GpuDualLocalSolver`` / ``GpuPrimalLocalSolver`` play the role of ``local_solver``'s CPU
solvers: H epochs of SCD on a worker's CoCoA subproblem, run by the TPA-SCD kernels of
``gpu_kernels`` (one thread block per coordinate, in-block shared-memory reduction, atomic
shared-vector updates). The training data (CSR rows for the dual, CSC columns for the primal),
the labels, weights, norms and the local variables stay on the device across epochs and rounds;
per round the shared vector goes up and the updated one comes back through pinned host buffers
(``cuda.pinned_array``), as in Parnell et al. Sec. V-A. The epoch permutations are those of the
CPU solver (``epoch_rng``); the permutation of each epoch is uploaded (through a pinned buffer).

Two ways to drive them:

* ``solve(local, shared, sigma, epochs, seed, rank, round_index)`` -- the CPU solvers' call, so a
  ``DualProblem`` / ``PrimalProblem`` can use a GPU solver unchanged (``train_cocoa_gpu`` does
  that). Those classes own the local variables on the host (line search, gap, checkpoints), so
  in this mode the local vector also crosses the bus each round.
* ``load_local(local)`` once, then per round ``run(shared, ...)`` -> the updated shared vector
  (only the shared vector crosses) and ``commit(gamma)`` (local += gamma * delta, on the device);
  ``local()`` downloads the local vector when it is needed (gap, checkpoint, model).

Device arrays are CuPy arrays on a real GPU when CuPy is installed (the ``gpu`` extra,
``cupy-cuda12x``), else numba.cuda device arrays; under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) everything runs on the CPU with numba's device arrays, which is how
the kernels are tested without a GPU. CuPy is imported only inside the real-GPU code path and
nothing here touches the driver at import time.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable

import numpy as np

from solvers.data import CSRData
from solvers.scd.local_solver import epoch_rng
from solvers.scd.partition import FeatureBlock

DEFAULT_MAX_THREADS = 256


def simulator_enabled() -> bool:
    """True when numba.cuda is the CPU simulator (``NUMBA_ENABLE_CUDASIM=1`` before import)."""
    try:
        from numba import config
    except Exception:  # noqa: BLE001 - numba missing: no simulator either
        return False
    return bool(getattr(config, "ENABLE_CUDASIM", 0))


def gpu_available() -> tuple[bool, str]:
    """(usable, reason): whether the TPA-SCD kernels can run here, and a message saying why (not)."""
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - report any import problem as the reason
        return False, f"numba.cuda cannot be imported ({exc}); install numba-cuda (the gpu extra)"
    if simulator_enabled():
        return True, "numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU, slowly"
    try:
        if not cuda.is_available():
            try:  # ask the driver for the reason (no driver, no device, ...)
                cuda.current_context()
            except Exception as exc:  # noqa: BLE001
                return False, f"no usable CUDA device: {exc}"
            return False, "no usable CUDA device (numba.cuda.is_available() is False)"
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        cc = dev.compute_capability
        if cc < (6, 0):
            return False, f"CUDA device {name} has compute capability {cc}; float64 atomics need >= 6.0"
        return True, f"CUDA device {name} (compute capability {cc[0]}.{cc[1]})"
    except Exception as exc:  # noqa: BLE001 - any driver error means no usable GPU
        return False, f"no usable CUDA device: {exc}"


def select_device(address: str | None) -> None:
    """Use the GPU Spark assigned to this task (its resource address, e.g. "0"), if any."""
    if address is None or simulator_enabled():
        return
    from numba import cuda

    cuda.select_device(int(address))


def _require_gpu() -> None:
    ok, reason = gpu_available()
    if not ok:
        raise RuntimeError(f"TPA-SCD needs a CUDA device: {reason}")


def _default_threads(nnz: int, n_coords: int) -> int:
    """Threads per block: a power of two near the mean non-zeros per coordinate, in [32, 256]
    (a warp at least on a real device); 2 under the simulator (every thread is a Python thread)."""
    if simulator_enabled():
        return 2
    mean = nnz / max(n_coords, 1)
    t = 32
    while t < mean and t < DEFAULT_MAX_THREADS:
        t *= 2
    return t


class _Device:
    """Device arrays and transfers: CuPy on a real GPU when installed, numba.cuda otherwise."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        self.cp = None
        if not simulator_enabled():
            try:
                import cupy  # optional extra (cupy-cuda12x), only on real-GPU paths

                self.cp = cupy
            except ImportError:
                self.cp = None

    def put(self, host: np.ndarray):
        host = np.ascontiguousarray(host)
        if self.cp is not None:
            return self.cp.asarray(host)
        return self.cuda.to_device(host)

    def empty_like_host(self, host: np.ndarray):
        return self.put(np.zeros_like(host))

    def pinned(self, n: int, dtype) -> np.ndarray:
        return self.cuda.pinned_array(n, dtype=dtype)

    def upload(self, dev, host: np.ndarray) -> None:
        if self.cp is not None:
            dev.set(host)
        else:
            dev.copy_to_device(host)

    def download(self, dev, host: np.ndarray) -> None:
        if self.cp is not None:
            dev.get(out=host)
        else:
            dev.copy_to_host(host)

    def copy(self, dst, src) -> None:
        """Device-to-device copy of equal-length arrays."""
        if self.cp is not None:
            dst[...] = src
        else:
            dst.copy_to_device(src)

    def synchronize(self) -> None:
        if self.cp is not None:
            self.cp.cuda.get_current_stream().synchronize()
        self.cuda.synchronize()


class _GpuLocalSolver(abc.ABC):
    """Common machinery: local variables x (and their round start x0), shared vector u, order."""

    def __init__(self, n_coords: int, n_shared: int, nnz: int, threads_per_block: int | None,
                 blocks: int | None) -> None:
        from solvers.scd import gpu_kernels as gk

        _require_gpu()
        self.gk = gk
        self.dev = _Device()
        tpb = _default_threads(nnz, n_coords) if threads_per_block is None else int(threads_per_block)
        if tpb < 1 or tpb > gk.MAX_THREADS or tpb & (tpb - 1):
            raise ValueError(f"threads_per_block: {tpb} is not allowed; expected a power of two "
                             f"in [1, {gk.MAX_THREADS}]")
        if blocks is not None and blocks < 1:
            raise ValueError(f"blocks: {blocks} is not allowed; expected an integer >= 1 or None")
        self.tpb = tpb
        self.n = n_coords
        # one block per coordinate (the paper); fewer blocks loop over the permutation
        self.blocks = max(1, n_coords if blocks is None else min(int(blocks), n_coords))
        self.x = self.dev.put(np.zeros(n_coords))
        self.x0 = self.dev.put(np.zeros(n_coords))
        self.u = self.dev.put(np.zeros(n_shared))
        self.order = self.dev.put(np.zeros(max(n_coords, 1), np.int64))
        self.h_x = self.dev.pinned(n_coords, np.float64)
        self.h_u = self.dev.pinned(n_shared, np.float64)
        self.h_order = self.dev.pinned(max(n_coords, 1), np.int64)
        self.epochs_run = 0

    # -- the resident API ------------------------------------------------------------------

    def load_local(self, local: np.ndarray) -> None:
        """Upload the local variables (once, or after a restore)."""
        if local.shape != (self.n,):
            raise ValueError(f"local vector has shape {local.shape}; expected ({self.n},)")
        np.copyto(self.h_x, local)
        self.dev.upload(self.x, self.h_x)
        self.dev.copy(self.x0, self.x)

    def run(self, shared: np.ndarray, sigma: float, epochs: int, seed: int, rank: int,
            round_index: int) -> np.ndarray:
        """H epochs from the resident local variables and ``shared``; -> u (a pinned buffer,
        valid until the next call): ``shared + sigma * (local change of the shared vector)``."""
        np.copyto(self.h_u, shared)
        self.dev.upload(self.u, self.h_u)
        for e in range(epochs):
            if self.n:
                np.copyto(self.h_order, epoch_rng(seed, rank, round_index, e).permutation(self.n))
                self.dev.upload(self.order, self.h_order)
                self._epoch(sigma)
            self.epochs_run += 1
        self.dev.download(self.u, self.h_u)
        return self.h_u

    def commit(self, gamma: float) -> None:
        """local = x0 + gamma (x - x0) on the device; the next round starts from there."""
        gk = self.gk
        if self.n:
            grid = -(-self.n // 256)
            if gamma != 1.0:
                gk.axpy_kernel[grid, 256](self.x, gamma - 1.0, self._delta())
                self._clamp()
            self.dev.copy(self.x0, self.x)

    def discard(self) -> None:
        """Drop the last round's proposal (local = x0)."""
        self.dev.copy(self.x, self.x0)

    def local(self) -> np.ndarray:
        """The local variables on the host (a pinned buffer, valid until the next call)."""
        self.dev.download(self.x, self.h_x)
        return self.h_x

    def synchronize(self) -> None:
        self.dev.synchronize()

    # -- the CPU solvers' call ----------------------------------------------------------------

    def solve(self, local: np.ndarray, shared: np.ndarray, sigma: float, epochs: int, seed: int,
              rank: int, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Same contract as the CPU local solvers: -> (local after the epochs, u)."""
        self.load_local(local)
        u = self.run(shared, sigma, epochs, seed, rank, round_index)
        return self.local(), u

    # -- per formulation ----------------------------------------------------------------------

    def _delta(self):
        """x - x0 as a device array (only used with gamma != 1)."""
        if self.dev.cp is not None:
            return self.x - self.x0
        d = self.x.copy_to_host() - self.x0.copy_to_host()  # simulator / numba-only fallback
        return self.dev.put(d)

    @abc.abstractmethod
    def _epoch(self, sigma: float) -> None:
        """One TPA-SCD epoch over this solver's coordinates (the formulation's kernel launch)."""

    def _clamp(self) -> None:  # noqa: B027 - optional hook: only the hinge dual clamps to its box
        """Project the local variables back onto their domain (most problems need nothing)."""


class GpuDualLocalSolver(_GpuLocalSolver):
    """SDCA epochs by TPA-SCD on one example shard (the GPU twin of ``DualLocalSolver``):
    local = alpha (n_rows,), shared = w (n_features + 1,), ``scale = sigma / (lam N)``."""

    def __init__(self, data: CSRData, loss: int, lam: float, n_weight: float, bias_scale: float,
                 threads_per_block: int | None = None, blocks: int | None = None) -> None:
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
        self.sqn = put(np.zeros(max(data.n_rows, 1)))
        if data.n_rows:
            grid = -(-data.n_rows // 128)
            self.gk.row_sq_norms_kernel[grid, 128](self.indptr, self.values, self.bias_scale,
                                                   self.sqn)

    def _epoch(self, sigma: float) -> None:
        self.gk.tpa_dual_epoch[self.blocks, self.tpb](
            self.indptr, self.indices, self.values, self.labels, self.weights, self.sqn, self.x,
            self.u, self.order, self.loss, sigma / self.lam_n, self.bias_scale, self.bias_index)

    def _clamp(self) -> None:
        grid = -(-self.n // 256)
        self.gk.clamp_dual_kernel[grid, 256](self.loss, self.labels, self.x)


class GpuPrimalLocalSolver(_GpuLocalSolver):
    """Ridge SCD epochs by TPA-SCD on a block of columns (the GPU twin of ``PrimalLocalSolver``):
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
        self.csq = put(np.zeros(max(m, 1)))
        if m:
            grid = -(-m // 128)
            self.gk.col_sq_norms_kernel[grid, 128](self.colptr, self.rows, self.vals,
                                                   self.weights, self.csq)

    def _epoch(self, sigma: float) -> None:
        self.gk.tpa_primal_epoch[self.blocks, self.tpb](
            self.colptr, self.rows, self.vals, self.labels, self.weights, self.csq, self.x,
            self.u, self.order, self.lam_n, float(sigma))


def attach_gpu_solver(problem, params, n_weight: float, threads_per_block: int | None = None,
                      blocks: int | None = None) -> None:
    """Replace a ``DualProblem`` / ``PrimalProblem``'s CPU local solver by its GPU twin."""
    from solvers.scd.losses import loss_code

    if params.formulation == "dual":
        problem.solver = GpuDualLocalSolver(problem.data, loss_code(params.loss), params.l2,
                                            n_weight, params.bias_scale, threads_per_block, blocks)
    else:
        problem.solver = GpuPrimalLocalSolver(problem.block, params.l2, n_weight,
                                              threads_per_block, blocks)


def train_cocoa_gpu(data: CSRData, comm, params, on_round_end: Callable | None = None,
                    threads_per_block: int | None = None, blocks: int | None = None,
                    fallback: bool = True, resume=None):
    """``api.train_cocoa`` with TPA-SCD local solvers (``params.threads`` / ``bucket_size`` are
    ignored: the GPU's thread blocks are the parallelism). Without a usable GPU: a warning naming
    the reason and the CPU solver when ``fallback``, else RuntimeError."""
    from solvers.scd import api

    ok, reason = gpu_available()
    if not ok:
        if not fallback:
            raise RuntimeError(f"TPA-SCD needs a CUDA device: {reason}")
        warnings.warn(f"no GPU for TPA-SCD ({reason}); using the CPU solver", RuntimeWarning,
                      stacklevel=2)
        return api.train_cocoa(data, comm, params, on_round_end, resume)
    return api.train_cocoa(
        data, comm, params, on_round_end, resume,
        prepare=lambda problem, n_weight: attach_gpu_solver(problem, params, n_weight, threads_per_block, blocks),
    )
