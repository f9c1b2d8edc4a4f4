"""Load a solver's compiled kernels before training starts, while the shard is still being read.

The kernels are compiled once and cached on disk (``cache=True``; ``pipeline.numba_cache`` keeps
the cache across Spark applications), but a fresh process still pays for loading them at their
first call: numba then imports its typing and lowering registries (scipy.linalg among them) and
links the cached code, a noticeable fraction of a second per process, before the first row of
the first pass. :func:`start_warm_up` runs the solver on a tiny generated problem
of the training data's dtypes in a background thread; the train task starts it before it reads
its shard with pyarrow (which releases the GIL) and joins it before training, so the loading
overlaps the read instead of delaying pass 1.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.data import CSRData
from terascale.solvers.params import SolverParams

log = logging.getLogger("terascale.warmup")

_ROWS = 64
_FEATURES = 32


def tiny_problem(seed: int = 0) -> CSRData:
    """A small binary problem with the dtypes of a shard read from Parquet."""
    rng = np.random.default_rng(seed)
    rows = [np.sort(rng.choice(_FEATURES, size=4, replace=False)) for _ in range(_ROWS)]
    indptr = np.zeros(_ROWS + 1, dtype=np.int64)
    np.cumsum([r.size for r in rows], out=indptr[1:])
    flat = np.concatenate(rows).astype(np.int32)
    labels = (rng.random(_ROWS) < 0.5).astype(np.float32)
    return CSRData(indptr, flat, np.ones(flat.size, np.float32), labels, np.ones(_ROWS, np.float32), _FEATURES)


def warm_up(params: SolverParams, holdout_period: int = 0, groups: bool = False) -> None:
    """Train ``params``' solver for a few passes on :func:`tiny_problem` (one process), with
    held-out rows and a group map when the real run has them, so each kernel it will call is
    loaded. The tiny problem has no files, so no row identity (``solvers.holdout``): it holds out
    every ``holdout_period``-th row, which is all the kernels need to see."""
    from terascale.solvers.api import train  # the registry of solvers, plugins included

    data, holdout = tiny_problem(), None
    if holdout_period > 0:
        data, holdout = data.split_held_out(np.arange(_ROWS) % holdout_period == holdout_period - 1)
    gmap = (np.arange(_FEATURES) % 3).astype(np.uint8) if groups else None
    short = dataclasses.replace(params, passes=min(params.passes, 4), online_passes=min(params.online_passes, 1))
    train(data, LocalCommunicator(), short, holdout=holdout, groups=gmap)


def start_warm_up(params: SolverParams, holdout_period: int = 0, groups: bool = False) -> threading.Thread | None:
    """Run :func:`warm_up` in a daemon thread (join it before training); None for GPU runs
    (their start-up is the device's, see ``solvers.scd.gpu``). A failure is logged, never
    raised: the real run then loads the kernels itself, and reports its own errors."""
    if params.device != "cpu":
        return None

    def body() -> None:
        try:
            warm_up(params, holdout_period, groups)
        except Exception as e:  # noqa: BLE001 - only an optimisation; the real run reports real errors
            log.warning("kernel warm-up failed (%s: %s); training loads its kernels itself", type(e).__name__, e)

    thread = threading.Thread(target=body, name="terascale-kernel-warm-up", daemon=True)
    thread.start()
    return thread
