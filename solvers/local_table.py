"""One rank's working table for the L-BFGS passes: its own features, laid out for the cache.

The L-BFGS vectors live in the agreed compact numbering (:mod:`solvers.active`), the same on
every rank. A rank's CSR pass only touches the features of its own shard, so it works on a
table of those alone, numbered in the order the shard first uses them: the features of the
first rows, which include almost every frequent one, share a few hundred cache lines, and a
rare feature's cell sits next to those of the features of the same and nearby rows, so the
pass walks the cold part of the table almost sequentially instead of missing the cache once
per rare entry. Numbering needs no collective: it is built before the set is agreed, and its
feature list is what the rank contributes to the agreement.

The table interleaves θ_j with its gradient (and Hessian-diagonal) accumulators
(:func:`solvers.kernels.objective.loss_grad_hess_table`). Each evaluation gathers θ into
column 0, runs the pass and scatters the sums back to compact numbering. The numbering changes
where a number is stored, never which numbers are added in which order, so the sums are bit
for bit those of a pass over the compact-numbered shard.

Threads (:mod:`solvers.threads`): with T > 1 a pass cuts the rows into T blocks; the blocks
share θ, but block b > 0 adds its sums into a table of its own (:meth:`LocalTable.thread_table`:
θ copied into its column 0, zero accumulators), which :meth:`LocalTable.merge_threads` adds into
the table in block order. That costs (T − 1) × (rows × columns × 8 B) beside the table: the
2-column tables are kept for every evaluation, the 3-column ones (the Hessian pass) are dropped
at the next :meth:`LocalTable.load`. The curvature and coarse passes only read the table and
share it. With T = 1 there are no other tables.

One table per ``train`` call (:func:`working_table`): the numbering depends on the rows alone,
so every L-BFGS phase of the call (a regularization path's steps, :mod:`solvers.regpath`) binds
the same table to its own agreed set. Data handed over (``Inputs.consume``) are renumbered in
place once, so the rows need no second copy of their indices: a shard in the local shard cache
(``pipeline.shard_cache``) is renumbered in its own file and streams every pass, a path's as a
fixed λ's; data not handed over are copied once (4 bytes per non-zero).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from terascale.solvers.active import ActiveFeatures
from terascale.solvers.kernels import coarse as KC
from terascale.solvers.kernels import objective as K
from terascale.solvers.kernels.features import load_column, number_by_first_use, store_column
from terascale.solvers.kernels.sampling import SAMPLE_RUN
from terascale.solvers.shard import Shard
from terascale.solvers.threads import SERIAL, RowThreads


class LocalTable:
    """``shard``: this rank's rows with indices in local numbering; ``ids[s]``: the feature of
    local slot s; after :meth:`bind`, ``compact_of[s]``: its compact coordinate."""

    def __init__(self, shard: Shard, in_place: bool = False):
        """``in_place``: write the local numbering over ``shard.indices`` instead of into a new
        array (4 bytes per non-zero less, and no fresh pages to fault in); the shard's indices
        are then this table's, no longer feature ids."""
        slot = np.full(shard.n_features, -1, dtype=np.int32)  # by feature id
        indices = shard.indices if in_place else np.empty(shard.indices.shape, dtype=np.int32)
        n_slots = 0
        for a, b in shard.chunks():  # the numbering carries over from range to range
            z0, z1 = shard.indptr[a], shard.indptr[b]
            n_slots = number_by_first_use(shard.indices[z0:z1], slot, indices[z0:z1], n_slots)
        used = np.flatnonzero(slot >= 0)
        self.ids = np.empty(n_slots, dtype=np.int64)
        self.ids[slot[used]] = used
        self.shard = dataclasses.replace(shard, indices=indices, n_features=n_slots)
        self.compact_of = np.zeros(0, dtype=np.int32)
        self.n_compact = 0
        self._pair: np.ndarray | None = None
        self._current = self._table(2)
        self._theta: np.ndarray | None = None  # the θ array column 0 of _current was loaded from
        self._threads: dict[int, list[np.ndarray]] = {}  # columns -> the tables of blocks 1, 2, …

    def bind(self, space: ActiveFeatures) -> LocalTable:
        """Map the slots to ``space``'s compact coordinates; raises ValueError if the shard
        holds a feature outside it."""
        compact_of = space.position[self.ids]
        if compact_of.size and int(compact_of.min()) < 0:
            raise ValueError("the shard holds a feature outside the agreed active set")
        self.compact_of = compact_of
        self.n_compact = space.size
        self._theta = None  # column 0 holds no θ of this numbering
        return self

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def _table(self, columns: int) -> np.ndarray:
        """The 2-column table is kept for every evaluation; a 3-column one (the Hessian pass, once
        per run) is made for that pass and dropped at the next :meth:`load`."""
        if columns != 2:
            return np.empty((self.size + 1, columns), dtype=np.float64)
        if self._pair is None:
            self._pair = np.empty((self.size + 1, 2), dtype=np.float64)
        return self._pair

    def load(self, theta: np.ndarray, with_hessian: bool) -> None:
        """Start an evaluation at ``theta`` (compact, intercept last): θ into column 0, zero
        accumulators."""
        t = self._table(3 if with_hessian else 2)
        if not with_hessian:
            self._threads.pop(3, None)
        t[:, 1:] = 0.0
        load_column(theta, self.compact_of, t, 0)
        self._current, self._theta = t, theta

    def load_direction(self, theta: np.ndarray, p: np.ndarray) -> None:
        """Start a curvature pass: θ into column 0, the direction p into column 1 (compact)."""
        t = self._table(2)
        load_column(theta, self.compact_of, t, 0)
        load_column(p, self.compact_of, t, 1)
        self._current, self._theta = t, theta

    def prepare_threads(self, blocks: int) -> None:
        """Tables for blocks 1..blocks-1 of the current pass (allocated here, filled by each block's
        thread in :meth:`thread_table`); nothing for one block."""
        if blocks <= 1:
            return
        cols = self._current.shape[1]
        mine = self._threads.setdefault(cols, [])
        while len(mine) < blocks - 1:
            mine.append(np.empty((self.size + 1, cols), dtype=np.float64))

    def thread_table(self, block: int) -> np.ndarray:
        """The table block ``block`` of a threaded pass works on: the table itself for block 0,
        else its own (:meth:`prepare_threads`) with θ copied into column 0 and zero accumulators."""
        t = self._current
        if block == 0:
            return t
        mine = self._threads[t.shape[1]][block - 1]
        mine[:, 0] = t[:, 0]
        mine[:, 1:] = 0.0
        return mine

    def merge_threads(self, blocks: int, want_grad: bool, want_hess: bool) -> None:
        """Add the accumulator columns of blocks 1..blocks-1 into the table's, in block order."""
        t = self._current
        cols = [c for c, on in ((1, want_grad), (2, want_hess and t.shape[1] > 2)) if on]
        for mine in self._threads.get(t.shape[1], [])[: blocks - 1]:
            for c in cols:
                t[:, c] += mine[:, c]

    def curvature_rows(self, loss_id: int, start: int, stop: int, stride: int, sums: np.ndarray) -> tuple[int, int]:
        """The curvature kernel over the sampled rows of ``start..stop-1`` (see
        :meth:`load_direction` and :func:`solvers.kernels.objective.curvature_along`)."""
        s = self.shard
        return K.curvature_along(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, self._current,
                                 loss_id, start, stop, stride, sums)

    def pass_rows(self, loss_id: int, want_grad: bool, want_hess: bool, start: int, stop: int,
                  loss_sum: float, table: np.ndarray | None = None) -> tuple[float, int, int]:
        """The kernel over rows ``start..stop-1`` (see :meth:`load`) on the table, or on a
        block's ``table`` (:meth:`thread_table`): (loss_sum, status, row)."""
        s = self.shard
        t = self._current if table is None else table
        return K.loss_grad_hess_table(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, t, loss_id,
                                      want_grad, want_hess and t.shape[1] > 2, start, stop, loss_sum)

    def coarse_sums(self, theta: np.ndarray, group: np.ndarray, n_groups: int, loss_id: int,
                    stride: int, E: np.ndarray, threads: RowThreads = SERIAL) -> str | None:
        """Add this rank's estimate of Σᵢ hᵢ·ℓ''ᵢ·aᵢ·aᵢᵀ (:mod:`solvers.kernels.coarse`; θ and
        ``group`` compact) into E: the rows r with r % stride == 0, scaled by the shard's
        weight over theirs. Returns the problem (a non-finite margin) or None. Each block of
        ``threads`` makes one kernel call over its rows (block 0 into E, the others into
        matrices of their own, added in block order)."""
        s = self.shard
        t = self._current
        if self._theta is not theta:  # column 0 does not hold θ yet (the start evaluation's does)
            t = self._table(2)
            load_column(theta, self.compact_of, t, 0)
            self._current, self._theta = t, theta
        local_group = group[self.compact_of]
        rows, step = s, stride
        if s.release is not None:  # a file-backed shard: its sample gathered into memory (Shard.sampled)
            rows, step = s.sampled(stride), 1

        def work(i: int, lo: int, hi: int, tick):
            mine = E if i == 0 else np.zeros_like(E)
            used, status, row = 0.0, KC.OK, -1
            for a, b in rows.chunks(lo, hi, rows=max(hi - lo, 1)):  # one call: its sums are per call
                used, status, row = KC.coarse_rows(rows.indptr, rows.indices, rows.values, rows.vpos, rows.labels,
                                                   rows.weights, t, local_group, n_groups, loss_id, a, b, step, mine)
            return used, status, row, mine

        parts = threads.run(work, threads.blocks(rows.indptr))
        bad = next((p for p in parts if p[1] != KC.OK), None)
        if bad is not None:
            row = bad[2]
            if step != stride:  # the gathered row's number in the shard
                row = row // SAMPLE_RUN * stride * SAMPLE_RUN + row % SAMPLE_RUN
            return f"rank-local non-finite margin at row {row}"
        used = parts[0][0]
        for p in parts[1:]:
            used += p[0]
            E += p[3]
        if used > 0.0:
            E *= s.weight_sum() / used
        return None

    def unload(self, grad: np.ndarray, hess: np.ndarray) -> None:
        """Write the accumulated sums into ``grad`` / ``hess`` (compact, intercept last; the
        coordinates of other ranks' features are left as they are; skipped when empty)."""
        t = self._current
        for col, out in ((1, grad), (2, hess)):
            if out.shape[0] > 0:
                store_column(t, col, self.compact_of, out)


def working_table(inputs) -> LocalTable:
    """``inputs``' working table (:class:`~solvers.setup.Inputs`), made on first use from its
    training rows (in place when they were handed over, ``inputs.consume``) and kept for the rest
    of the ``train`` call: after an in-place numbering the rows hold local numbers, so it is never
    made from them again (module docstring)."""
    if inputs.table is None:
        inputs.table = LocalTable(inputs.train, in_place=inputs.consume)
    return inputs.table
