"""Per-thread replicas of the hot features for the Hogwild online pass (``threads`` = T > 1;
the layout, the relabelling and the merge rule are in :mod:`solvers.kernels.hot`).

**Which features.** The features occurring in at least :data:`MIN_SHARE` of a sample of the
shard's rows, at most :data:`MAX_HOT` of them (the most frequent; ties by id): the sample is
:data:`SAMPLE_RANGES` evenly spaced ranges of :data:`SAMPLE_ROWS` rows each, so choosing reads a
bounded part of the shard. A given shard and T choose the same set on every run.

**When.** Only when the caller handed its data over (``Inputs.consume``: the relabelling
writes the shard's index array in place) and T > 1; otherwise the pass is plain Hogwild on the shared
table. :meth:`HotReplicas.relabel` runs once before the first pass that uses them (on the
rank's threads, one block of rows each), :meth:`HotReplicas.unlabel` when the online phase ends
(before anything else reads feature ids from the shard: the objective, L-BFGS's table). Between
them the shard's indices hold n + 1 + q for hot feature q; the online learner takes the marks of
its features from the relabelling (:meth:`HotReplicas.take_marks`).

**Layout.** Each thread's block starts on a :data:`ALIGN`-byte boundary of memory and spans a
whole number of them, so no cache line, nor the pair of lines that x86's adjacent-line
prefetcher moves together, holds rows of two threads. The table is allocated aligned for it:
numpy's large arrays start 16 bytes past a page (the allocator's header), and with blocks
placed only by row number thread 0's intercept replica shared a line with thread 1's two
hottest features whenever (H + 1) mod 4 ∈ {1, 2}, which took the 2-thread pass from 1.85× to
1.4× one thread's rate on the 2M-row benchmark (docs/pages/explanation/design-notes.md).

**Cost.** The state table grows by at most 8 + T·stride rows (16 B each, stride = H + 1 rounded
up to :data:`ALIGN` bytes); relabelling holds a slot map of 2 B per feature and a bitmap of one
bit per feature until it is done, and makes a mark of 1 B per feature: the features the shard
holds, which the online learner would otherwise find with a walk of its own, on one thread, at
its first averaging (:meth:`HotReplicas.take_marks`).
"""

from __future__ import annotations

import numpy as np

from terascale.solvers.kernels.hot import merge_replicas, relabel, seed_replicas, unlabel
from terascale.solvers.kernels.online import STATE_COLUMNS, S
from terascale.solvers.shard import Shard
from terascale.solvers.threads import RowThreads

MIN_SHARE = 1.0 / 1024.0
MAX_HOT = 4096
SAMPLE_RANGES = 16
SAMPLE_ROWS = 4096
ALIGN = 128  # bytes: two 64-byte cache lines (the adjacent-line prefetcher's unit)
ROW_BYTES = STATE_COLUMNS * 4  # a float32 state row
ROWS_PER_ALIGN = ALIGN // ROW_BYTES


def choose_hot(shard: Shard) -> np.ndarray:
    """The hot feature ids (int64, most frequent first; see the module docstring)."""
    n = shard.n_rows
    if n <= SAMPLE_RANGES * SAMPLE_ROWS:
        ranges = [(0, n)]
    else:  # evenly spaced, not overlapping: (n - SAMPLE_ROWS) / (SAMPLE_RANGES - 1) > SAMPLE_ROWS
        starts = np.linspace(0, n - SAMPLE_ROWS, SAMPLE_RANGES).astype(np.int64)
        ranges = [(int(a), int(a) + SAMPLE_ROWS) for a in starts]
    rows = sum(b - a for a, b in ranges)
    sample = np.concatenate([np.asarray(shard.indices[shard.indptr[a] : shard.indptr[b]]) for a, b in ranges])
    ids, counts = np.unique(sample, return_counts=True)
    keep = counts >= max(1.0, MIN_SHARE * rows)
    ids, counts = ids[keep], counts[keep]
    order = np.lexsort((ids, -counts))[:MAX_HOT]
    return ids[order].astype(np.int64)


class HotReplicas:
    """The replicas of one online learner (module docstring). ``table`` is the extended state
    table (:meth:`extended_table`); the learner's canonical table is its first n + 1 rows."""

    def __init__(self, hot_ids: np.ndarray, n_features: int, threads: int):
        self.hot_ids = hot_ids
        self.n = n_features
        self.threads = threads
        h = hot_ids.shape[0]
        self.stride = -(-(h + 1) // ROWS_PER_ALIGN) * ROWS_PER_ALIGN
        self.first = -(-(n_features + 1) // ROWS_PER_ALIGN) * ROWS_PER_ALIGN  # thread 0's block
        self.relabelled = False
        self._marks: np.ndarray | None = None  # made by relabel, until take_marks

    def extended_table(self) -> np.ndarray:
        """A zero state table with the replica blocks below the canonical rows (the intercept's
        normalizer 1, as :func:`~solvers.kernels.online.new_state`), its first byte on an
        :data:`ALIGN` boundary, so that every block is (module docstring)."""
        rows = self.first + self.threads * self.stride
        raw = np.zeros(rows * ROW_BYTES + ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % ALIGN
        state = raw[skip : skip + rows * ROW_BYTES].view(np.float32).reshape(rows, STATE_COLUMNS)
        state[self.n, S] = 1.0
        return state

    def kernel_args(self, i: int) -> tuple[int, int, int]:
        """(n_features, offset, bias) of :func:`~solvers.kernels.online.online_pass` for thread i."""
        base = self.first + i * self.stride
        return self.n, base - (self.n + 1), base + self.hot_ids.shape[0]

    def relabel(self, shard: Shard, threads: RowThreads) -> None:
        """Relabel the hot features' entries of the shard in place, on the rank's threads."""
        if self.relabelled:
            return
        hot_bits = np.zeros((self.n + 7) // 8, dtype=np.uint8)
        np.bitwise_or.at(hot_bits, self.hot_ids >> 3, (1 << (self.hot_ids & 7)).astype(np.uint8))
        hot_slot = np.zeros(self.n, dtype=np.int16)
        hot_slot[self.hot_ids] = np.arange(self.hot_ids.shape[0], dtype=np.int16)
        marks = np.zeros(self.n, dtype=np.uint8)

        def work(i: int, lo: int, hi: int, tick) -> None:
            for a, b in shard.chunks(lo, hi):
                relabel(shard.indices, shard.indptr[a], shard.indptr[b], hot_bits, hot_slot, self.n, marks)

        threads.run(work, threads.blocks(shard.indptr))
        self.relabelled = True
        self._marks = marks

    def take_marks(self) -> np.ndarray | None:
        """The marks of the features in the shard (uint8, 1 where a row holds the feature) made by
        :meth:`relabel`, handed over once (None after, or before any relabelling)."""
        marks, self._marks = self._marks, None
        return marks

    def unlabel(self, shard: Shard, threads: RowThreads) -> None:
        """Give the shard back its feature ids (exactly those before :meth:`relabel`)."""
        if not self.relabelled:
            return

        def work(i: int, lo: int, hi: int, tick) -> None:
            for a, b in shard.chunks(lo, hi):
                unlabel(shard.indices, shard.indptr[a], shard.indptr[b], self.hot_ids, self.n)

        threads.run(work, threads.blocks(shard.indptr))
        self.relabelled = False

    def seed(self, table: np.ndarray) -> None:
        seed_replicas(table, self.hot_ids, self.n, self.first, self.stride, self.threads)

    def merge(self, table: np.ndarray) -> None:
        merge_replicas(table, self.hot_ids, self.n, self.first, self.stride, self.threads)
