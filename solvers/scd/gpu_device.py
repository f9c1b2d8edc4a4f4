"""The device under the GPU solvers: detection, device arrays and counted host<->device transfers.

Device arrays are CuPy arrays on a real GPU when CuPy is installed (the ``gpu-cuda12`` or
``gpu-cuda13`` extra: ``cupy-cuda12x`` or ``cupy-cuda13x``), else numba.cuda device arrays; under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) everything runs on the CPU with numba's device arrays, which is how
the kernels are tested without a GPU. CuPy is imported only inside the real-GPU code path and
nothing here touches the driver at import time.

Every host<->device copy goes through :class:`Device`, which counts the bytes and copies in each
direction (``traffic()``), so tests can check what crosses PCIe per CoCoA round.
"""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_MAX_THREADS = 256
MAX_REDUCE_BLOCKS = 4096  # grid of a reduction at most: rows of its partial-sums buffer
_SIMULATOR_LOCK = threading.Lock()  # the simulator runs one kernel at a time, process-wide


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


def require_gpu() -> None:
    ok, reason = gpu_available()
    if not ok:
        raise RuntimeError(f"TPA-SCD needs a CUDA device: {reason}")


def default_threads(nnz: int, n_coords: int) -> int:
    """Threads per block: a power of two near the mean non-zeros per coordinate, in [32, 256]
    (a warp at least on a real device); 2 under the simulator (every thread is a Python thread)."""
    if simulator_enabled():
        return 2
    mean = nnz / max(n_coords, 1)
    t = 32
    while t < mean and t < DEFAULT_MAX_THREADS:
        t *= 2
    return t


def block_threads(requested: int | None, nnz: int, n_coords: int) -> int:
    """Threads per block of a coordinate kernel: ``requested``, checked (a power of two in
    [1, ``DEFAULT_MAX_THREADS``]), or ``default_threads`` when None."""
    tpb = default_threads(nnz, n_coords) if requested is None else int(requested)
    if tpb < 1 or tpb > DEFAULT_MAX_THREADS or tpb & (tpb - 1):
        raise ValueError(f"threads_per_block: {tpb} is not allowed; expected a power of two "
                         f"in [1, {DEFAULT_MAX_THREADS}]")
    return tpb


def launch_shape(n: int, per_block: int) -> tuple[int, int]:
    """(grid, threads) of an element-wise kernel over ``n`` items (grid-stride loops inside).

    A function of ``n`` only, so a reduction's partial sums always fall the same way: real
    device 256 threads and at most 4096 blocks; simulator 4 threads and at most 2 blocks (every
    simulated thread is a Python thread, every block a polling loop)."""
    if simulator_enabled():
        return max(1, min(-(-n // 4), 2)), 4
    return max(1, min(-(-n // per_block), MAX_REDUCE_BLOCKS)), per_block


def resident_blocks(threads_per_block: int) -> int:
    """How many blocks of ``threads_per_block`` threads can run at once: 1 under the simulator
    (its blocks run one after another); on a device the SM count times the blocks an SM holds by
    its thread limit (an upper bound: registers or shared memory may hold fewer)."""
    if simulator_enabled():
        return 1
    from numba import cuda

    dev = cuda.get_current_device()
    per_sm = min(int(getattr(dev, "MAX_BLOCKS_PER_MULTIPROCESSOR", 32)),
                 int(getattr(dev, "MAX_THREADS_PER_MULTI_PROCESSOR", 2048)) // max(1, int(threads_per_block)))
    return max(1, int(dev.MULTIPROCESSOR_COUNT) * max(1, per_sm))


def coord_grid(n: int) -> int:
    """Blocks of a block-per-coordinate reduction over ``n`` coordinates (grid-stride beyond)."""
    return max(1, min(n, 2 if simulator_enabled() else MAX_REDUCE_BLOCKS))


class Device:
    """Device arrays and counted transfers: CuPy on a real GPU when installed, numba.cuda otherwise."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        self.cp = None
        if not simulator_enabled():
            try:
                import cupy  # optional extra (gpu-cuda12 / gpu-cuda13), only on real-GPU paths

                self.cp = cupy
            except ImportError:
                self.cp = None
        self.bytes_up = self.bytes_down = self.uploads = self.downloads = 0

    def traffic(self) -> dict[str, int]:
        """Bytes and copies host->device (up) and device->host (down) so far."""
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "uploads": self.uploads, "downloads": self.downloads}

    def _count_up(self, host: np.ndarray) -> None:
        self.bytes_up += int(host.nbytes)
        self.uploads += 1

    def put(self, host: np.ndarray):
        """A new device array holding ``host`` (a counted upload)."""
        host = np.ascontiguousarray(host)
        self._count_up(host)
        if self.cp is not None:
            return self.cp.asarray(host)
        return self.cuda.to_device(host)

    def empty(self, shape, dtype):
        """An uninitialised device array (no transfer)."""
        if self.cp is not None:
            return self.cp.empty(shape, dtype=dtype)
        return self.cuda.device_array(shape, dtype=dtype)

    def pinned(self, n: int, dtype) -> np.ndarray:
        return self.cuda.pinned_array(n, dtype=dtype)

    def upload(self, dev, host: np.ndarray) -> None:
        self._count_up(host)
        if self.cp is not None:
            dev.set(host)
        else:
            dev.copy_to_device(host)

    def download(self, dev, host: np.ndarray) -> None:
        self.bytes_down += int(host.nbytes)
        self.downloads += 1
        if self.cp is not None:
            dev.get(out=host)
        else:
            dev.copy_to_host(host)

    def copy(self, dst, src) -> None:
        """Device-to-device copy of equal-length arrays (no PCIe traffic)."""
        if self.cp is not None:
            dst[...] = src
        else:
            dst.copy_to_device(src)

    def launch(self, kernel, grid: int, threads: int, *args, shared: int = 0) -> None:
        """``kernel[grid, threads, 0, shared](*args)`` (``shared``: bytes of dynamic shared
        memory per block); under the simulator one launch at a time in the process (it cannot
        run two kernels concurrently, e.g. K ranks in threads)."""
        if self.cp is None and simulator_enabled():
            with _SIMULATOR_LOCK:
                kernel[grid, threads, 0, shared](*args)
        else:
            kernel[grid, threads, 0, shared](*args)

    def synchronize(self) -> None:
        if self.cp is not None:
            self.cp.cuda.get_current_stream().synchronize()
        self.cuda.synchronize()
