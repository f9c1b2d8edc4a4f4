"""CoCoA / SCD on a GPU: the entry point (``train_cocoa_gpu``) and device detection.

The pieces, bottom up: ``gpu_device`` (detection, device selection, counted transfers),
``gpu_local_solver`` (TPA-SCD local solvers with the local variables on the device),
``gpu_problem`` (the round loop's ``Problem`` over them); this module runs ``api.train_cocoa``
with those problems, or falls back to the CPU solver without a usable GPU. Imports only go down
that list.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from terascale.solvers.data import CSRData
from terascale.solvers.kernels.values import densified
from terascale.solvers.scd import api
from terascale.solvers.scd.gpu_device import gpu_available, select_device, simulator_enabled
from terascale.solvers.scd.gpu_local_solver import GpuDualLocalSolver, GpuPrimalLocalSolver
from terascale.solvers.scd.gpu_problem import make_gpu_problem

__all__ = ["GpuDualLocalSolver", "GpuPrimalLocalSolver", "gpu_available", "select_device",
           "simulator_enabled", "train_cocoa_gpu"]


def train_cocoa_gpu(data: CSRData, comm, params, on_round_end: Callable | None = None,
                    threads_per_block: int | None = None, blocks: int | None = None,
                    fallback: bool = True, resume=None, hot_block: bool | None = None):
    """``api.train_cocoa`` with the local variables and TPA-SCD local solvers on the GPU
    (``gpu_problem``; ``params.threads`` / ``bucket_size`` are ignored: the GPU's thread blocks
    are the parallelism; ``hot_block``: ``gpu_problem.make_gpu_problem``'s). Without a usable GPU: a warning naming the reason and the CPU solver
    when ``fallback``, else RuntimeError."""
    data = densified(data)  # the GPU kernels read one value per non-zero
    ok, reason = gpu_available()
    if not ok:
        if not fallback:
            raise RuntimeError(f"TPA-SCD needs a CUDA device: {reason}")
        warnings.warn(f"no GPU for TPA-SCD ({reason}); using the CPU solver", RuntimeWarning,
                      stacklevel=2)
        return api.train_cocoa(data, comm, params, on_round_end, resume)
    factory = functools.partial(make_gpu_problem, threads_per_block=threads_per_block,
                                blocks=blocks, hot_block=hot_block)
    return api.train_cocoa(data, comm, params, on_round_end, resume, make_problem=factory)
