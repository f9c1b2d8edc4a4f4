"""The collective interface the solvers program against, and its single-process twin.

Solvers only ever see a :class:`Communicator`: ``rank``, ``size``, ``allreduce`` (sum),
``broadcast``, ``allreduce_scalars``, ``barrier``, ``stats`` and ``close``. With
:class:`LocalCommunicator` (size 1) every solver runs and is tested without sockets; the
spanning-tree :class:`~allreduce.node.TreeNode` implements the same interface across processes.

Arrays are float32 or float64 of any shape and length (including 0); results are new arrays of
the same shape with little-endian dtype (the wire format), never views of the input.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

SUPPORTED_DTYPES = (np.dtype("<f4"), np.dtype("<f8"))
_MAX_CALL_RECORDS = 10_000


def wire_array(arr: Any) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian float32/float64 array (copied only if needed).

    Raises TypeError for any other dtype: summing integers or mixing precisions across ranks
    would silently give different bytes on different machines.
    """
    a = np.asarray(arr)
    if a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8):
        raise TypeError(f"collectives take float32 or float64 arrays, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


class CallStats:
    """Per-call timing records and running totals, shared by every communicator.

    For each call: ``wall_s`` is the call's duration on this rank; ``wait_s`` the time from the
    call until the first chunk of the result was final on this rank, i.e. the stall waiting for
    the slowest rank to enter the collective (plus one chunk's trip through the tree);
    ``transfer_s = wall_s - wait_s`` the time spent streaming the rest. Totals sum them up.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.totals = {"calls": 0, "bytes": 0, "wall_s": 0.0, "wait_s": 0.0, "transfer_s": 0.0}

    def record(self, op: str, arr: np.ndarray, chunks: int, wall_s: float, wait_s: float) -> None:
        wait_s = min(max(wait_s, 0.0), wall_s)
        rec = {
            "op": op,
            "dtype": arr.dtype.name,
            "elements": int(arr.size),
            "bytes": int(arr.nbytes),
            "chunks": chunks,
            "wall_s": wall_s,
            "wait_s": wait_s,
            "transfer_s": wall_s - wait_s,
        }
        if len(self.calls) < _MAX_CALL_RECORDS:
            self.calls.append(rec)
        t = self.totals
        t["calls"] += 1
        t["bytes"] += rec["bytes"]
        t["wall_s"] += wall_s
        t["wait_s"] += wait_s
        t["transfer_s"] += rec["transfer_s"]

    def snapshot(self) -> dict[str, Any]:
        return {"calls": [dict(c) for c in self.calls], "totals": dict(self.totals)}


class Communicator(abc.ABC):
    """Collective operations over ``size`` ranks with a fixed, rank-independent reduction order.

    Every rank must call the same collectives in the same order with arrays of the same length
    and dtype. ``allreduce`` returns bit-identical bytes on every rank.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < size``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks."""

    @abc.abstractmethod
    def allreduce(self, arr: Any) -> np.ndarray:
        """Elementwise sum of ``arr`` over all ranks, returned on every rank as a new array the
        caller owns (it may modify it in place)."""

    @abc.abstractmethod
    def broadcast(self, arr: Any, root: int = 0) -> np.ndarray:
        """Rank ``root``'s ``arr`` on every rank (others pass an array of the same shape)."""

    @abc.abstractmethod
    def allreduce_scalars(self, values: Sequence[float]) -> list[float]:
        """Sum of a few float64 scalars over all ranks (a cheap, latency-bound path)."""

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self.allreduce_scalars(())

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """``{"calls": [per-call dicts], "totals": {...}}``; seconds split into wait and transfer."""

    def totals(self) -> dict[str, Any]:
        """Just the running totals of :meth:`stats` (cheap: no copy of the per-call records)."""
        return self.stats()["totals"]

    @abc.abstractmethod
    def close(self, error: BaseException | None = None) -> None:
        """Release every resource; with ``error``, tell the other ranks why first."""

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)


class WrappedCommunicator(Communicator):
    """A view of ``inner`` that runs ``_ready()`` before every collective (a first-call hook:
    an agreement, a deferred join). ``close`` closes ``inner``; views that do not own it override."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _ready(self) -> Communicator:
        return self.inner

    def allreduce(self, arr: Any) -> np.ndarray:
        return self._ready().allreduce(arr)

    def broadcast(self, arr: Any, root: int = 0) -> np.ndarray:
        return self._ready().broadcast(arr, root)

    def allreduce_scalars(self, values: Sequence[float]) -> list[float]:
        return self._ready().allreduce_scalars(values)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def totals(self) -> dict[str, Any]:
        return self.inner.totals()

    def close(self, error: BaseException | None = None) -> None:
        self.inner.close(error)


class LocalCommunicator(Communicator):
    """The size-1 communicator: every collective is the identity (on a copy).

    It validates its inputs exactly like the tree, so code tested against it fails the same way.
    """

    def __init__(self) -> None:
        self._stats = CallStats()
        self._closed = False

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def _identity(self, op: str, arr: Any) -> np.ndarray:
        if self._closed:
            raise RuntimeError("this communicator is closed")
        t0 = time.perf_counter()
        src = wire_array(arr)
        out = src.copy()
        self._stats.record(op, src, 1, time.perf_counter() - t0, 0.0)
        return out

    def allreduce(self, arr: Any) -> np.ndarray:
        return self._identity("allreduce", arr)

    def broadcast(self, arr: Any, root: int = 0) -> np.ndarray:
        if root != 0:
            raise ValueError(f"broadcast root {root} is not a rank of a size-1 communicator")
        return self._identity("broadcast", arr)

    def allreduce_scalars(self, values: Sequence[float]) -> list[float]:
        return self._identity(
            "allreduce_scalars", np.asarray(values, dtype="<f8").reshape(-1)
        ).tolist()

    def stats(self) -> dict[str, Any]:
        return self._stats.snapshot()

    def totals(self) -> dict[str, Any]:
        return dict(self._stats.totals)

    def close(self, error: BaseException | None = None) -> None:
        self._closed = True
