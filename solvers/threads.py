"""Threads per rank (``train.threads`` = T): T Python threads run the ``nogil`` kernels of a
pass over fixed row blocks of the rank's shard, so one rank with T threads does the work of T
ranks with one copy of the model state and one AllReduce participant.

**Blocks.** :func:`split_rows` cuts rows ``start..stop-1`` into T contiguous blocks with about
equal work, counting a row's non-zeros plus one (its intercept), read from ``indptr``: the
cuts depend only on (indptr, T), so a given T cuts a shard the same way on every run.

**Passes.** :meth:`RowThreads.run` calls ``work(i, lo, hi, tick)`` for block i in thread i of
a pool created once per run (:func:`solvers.api.train` opens and closes it). Each call walks
its own block with :meth:`~solvers.shard.Shard.chunks` and calls ``tick(rows)`` after each
range with the rows of its block done so far. The calling thread collects the ticks and calls
the pass's ``on_rows(rows_done)`` (progress heartbeats, which may raise to abandon the run)
with the sum over blocks: monotone, and always from the calling thread. When ``on_rows`` or a
block raises, the other blocks stop at their next tick, the pass waits for them all and the
error is raised (a block's own error before ``on_rows``'s, the lowest block first). The
results come back in block order; the callers reduce them in that order (thread 0, 1, …, T−1),
so the gradient, curvature, coarse and loss passes give the same bits on every run for a given
T. The online pass is Hogwild (:meth:`solvers.online.OnlineLearner._local_pass`): lock-free on
shared weights, not reproducible for T > 1.

**T = 1** runs ``work(0, start, stop, tick)`` on the calling thread with ``tick`` calling
``on_rows`` directly: no pool, no queue, no extra memory, and the passes keep the arithmetic
(and so the bits) of a single sequential pass.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

R = TypeVar("R")
Tick = Callable[[int], None]
Work = Callable[[int, int, int, Tick], R]


class _Stopped(Exception):
    """Raised inside a block's tick when the pass is being abandoned."""


def split_rows(indptr: np.ndarray, parts: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """``parts + 1`` cuts ``start = c_0 ≤ c_1 ≤ … ≤ c_parts = stop``: block i is rows c_i..c_{i+1}-1,
    c_i the first row at which the work before it (non-zeros + rows, from ``start``) reaches
    i/parts of the total. Deterministic in (indptr, parts, start, stop)."""
    n = indptr.shape[0] - 1
    stop = n if stop is None else stop
    cuts = np.empty(parts + 1, dtype=np.int64)
    cuts[0], cuts[parts] = start, stop
    if parts > 1:
        base = int(indptr[start]) + start
        total = int(indptr[stop]) + stop - base
        rows = np.arange(start, stop + 1, dtype=np.int64)
        work = indptr[start : stop + 1] + rows - base  # work before row r, r = start..stop
        targets = (np.arange(1, parts, dtype=np.int64) * total) // parts
        cuts[1:parts] = start + np.searchsorted(work, targets, side="left")
    return cuts


def split_positions(indptr: np.ndarray, order: np.ndarray, parts: int) -> np.ndarray:
    """:func:`split_rows` over the positions of a permutation ``order`` of the rows: block i is
    positions c_i..c_{i+1}-1 of ``order``, cut by the work of the rows at those positions."""
    n = order.shape[0]
    cuts = np.empty(parts + 1, dtype=np.int64)
    cuts[0], cuts[parts] = 0, n
    if parts > 1:
        work = np.diff(indptr)[order]
        work += 1
        np.cumsum(work, out=work)
        targets = (np.arange(1, parts, dtype=np.int64) * (int(work[-1]) if n else 0)) // parts
        cuts[1:parts] = np.searchsorted(work, targets, side="left") + 1
        np.minimum(cuts, n, out=cuts)
    return cuts


class RowThreads:
    """A rank's T threads (see the module docstring). A context manager: the pool's threads
    start at the first pass with T > 1 and end when the run closes it."""

    def __init__(self, threads: int = 1):
        if int(threads) < 1:
            raise ValueError(f"threads = {threads}: must be >= 1")
        self.size = int(threads)
        self._pool: ThreadPoolExecutor | None = None
        self._cuts: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(indptr) -> (indptr, cuts)

    def __enter__(self) -> RowThreads:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pool's threads (waits for them); the object may be used again after."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._cuts.clear()

    def blocks(self, indptr: np.ndarray) -> np.ndarray:
        """The cuts of all rows of a shard into :attr:`size` blocks (:func:`split_rows`), computed
        once per index array."""
        if self.size == 1:
            return np.array([0, indptr.shape[0] - 1], dtype=np.int64)
        hit = self._cuts.get(id(indptr))
        if hit is None or hit[0] is not indptr:
            hit = (indptr, split_rows(indptr, self.size))
            self._cuts[id(indptr)] = hit
        return hit[1]

    def run(self, work: Work, cuts: np.ndarray, on_rows: Callable[[int], None] | None = None) -> list:
        """``[work(i, cuts[i], cuts[i+1], tick) for each block i]`` (see the module docstring)."""
        parts = cuts.shape[0] - 1
        if parts == 1:
            return [work(0, int(cuts[0]), int(cuts[1]), on_rows or _ignore)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="terascale-rows")
        events: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def block(i: int) -> Any:
            def tick(rows: int) -> None:
                if stop.is_set():
                    raise _Stopped
                events.put((i, rows))

            try:
                return work(i, int(cuts[i]), int(cuts[i + 1]), tick)
            except BaseException:
                stop.set()  # the other blocks stop at their next tick
                raise
            finally:
                events.put((i, None))

        futures = [self._pool.submit(block, i) for i in range(parts)]
        done = [0] * parts
        running = parts
        failure: BaseException | None = None
        while running:
            i, rows = events.get()
            while True:  # take every waiting event before reporting once
                if rows is None:
                    running -= 1
                else:
                    done[i] = rows
                try:
                    i, rows = events.get_nowait()
                except queue.Empty:
                    break
            if on_rows is not None and failure is None and running:
                try:
                    on_rows(sum(done))
                except BaseException as e:  # noqa: BLE001 - re-raised once every block has stopped
                    failure = e
                    stop.set()
        errors = [f.exception() for f in futures]
        own = next((e for e in errors if e is not None and not isinstance(e, _Stopped)), None)
        if own is not None:
            raise own
        if failure is not None:
            raise failure
        results = [f.result() for f in futures]
        if on_rows is not None:
            on_rows(sum(done))
        return results


def _ignore(rows: int) -> None:
    pass


#: The single-thread instance (no pool): what passes use when no run gave them its threads.
SERIAL = RowThreads(1)
