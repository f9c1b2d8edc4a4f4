"""A shard's arrays in the dtypes the kernels are compiled for, and their local checks.

:meth:`Shard.from_csr` converts a :class:`~solvers.data.CSRData` (copying an array only when
its dtype or layout differs), so every kernel is compiled once. :func:`find_problem` is the
local half of input validation (the collective half is :mod:`solvers.setup`): it returns the
first violation of the data contract, naming the array, the position and the value.

A shard backed by files (the local shard cache, ``pipeline.shard_cache``) sets
:attr:`Shard.release` and :attr:`Shard.chunk_rows`: every pass walks it through
:meth:`Shard.chunks`, which drops each range of rows from the process's memory once the caller
is done with it, so the shard's bytes resident at once stay within a chunk per thread. Code that
needs a whole column at once (a float64 sum whose bits must not depend on chunking) calls
:meth:`Shard.release_all` after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError, NonFiniteInputError
from terascale.solvers.kernels.sampling import SAMPLE_RUN

_MAX_FEATURES = 2**31 - 1  # indices are int32
#: Rows per kernel call of a pass (:meth:`Shard.chunks`); progress heartbeats come between calls.
CHUNK_ROWS = 1 << 17


@dataclass(frozen=True)
class Shard:
    indptr: np.ndarray  # int64 (n_rows + 1,)
    indices: np.ndarray  # int32 (nnz,)
    values: np.ndarray  # float32 (nnz,), (0,) all ones, or the exceptions' values (see vpos)
    labels: np.ndarray  # float32 (n_rows,)
    weights: np.ndarray  # float32 (n_rows,)
    n_features: int
    #: int64 positions of the values ≠ 1 when ``values`` holds only those, else empty
    #: (:mod:`solvers.kernels.values`)
    vpos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: ``release(a, b)``: drop rows a..b-1 from this process's memory after a pass used them
    #: (arrays backed by a file, the local shard cache); None: the arrays live in memory
    release: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)
    #: at most this many rows per range of :meth:`chunks` (0: :data:`CHUNK_ROWS`): a file-backed
    #: shard's block of rows that fits its memory budget
    chunk_rows: int = field(default=0, compare=False)

    @classmethod
    def from_csr(cls, data: CSRData) -> Shard:
        def conv(a: np.ndarray, dtype) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=dtype)

        return cls(
            indptr=conv(data.indptr, np.int64),
            indices=conv(data.indices, np.int32),
            values=conv(data.values, np.float32),
            labels=conv(data.labels, np.float32),
            weights=conv(data.weights, np.float32),
            n_features=int(data.n_features),
            vpos=conv(data.vpos, np.int64),
            release=data.release,
            chunk_rows=int(data.chunk_rows),
        )

    @property
    def n_rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def binary(self) -> bool:
        """Every value is 1: nothing stored, the kernels take x_ij = 1."""
        return self.values.shape[0] == 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.indptr, self.indices, self.values, self.vpos, self.labels, self.weights))

    def chunks(self, start: int = 0, stop: int | None = None, rows: int | None = None) -> Iterator[tuple[int, int]]:
        """(a, b) ranges of at most ``rows`` (default :data:`CHUNK_ROWS`, or :attr:`chunk_rows`
        when smaller) rows covering rows ``start..stop-1`` in order (all
        rows by default). Every pass over the shard goes through this: with :attr:`release`
        set, rows a..b-1 are released when the caller asks for the next range (or ends the
        loop), so a pass holds about one range of a file-backed shard at a time."""
        stop = self.n_rows if stop is None else stop
        rows = rows or (min(self.chunk_rows, CHUNK_ROWS) if self.chunk_rows > 0 else CHUNK_ROWS)
        for a in range(start, stop, rows):
            b = min(a + rows, stop)
            try:
                yield a, b
            finally:
                if self.release is not None:
                    self.release(a, b)

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def release_all(self) -> None:
        """Drop every row of a file-backed shard from this process's memory (after code that
        read whole columns); nothing for a shard in memory."""
        if self.release is not None:
            self.release(0, self.n_rows)

    def rows(self, a: int, b: int) -> Shard:
        """Rows a..b-1 for a kernel that walks every row it is given (no copy): ``indptr`` is
        ``self.indptr[a:b+1]``, positions into the whole ``indices`` (so it need not start at 0),
        and with value exceptions only those of these rows are kept (their positions absolute
        as well). ``nnz`` and :attr:`binary` stay those of the whole shard's arrays."""
        vpos, values = self.vpos, self.values
        if vpos.shape[0] > 0:
            e0, e1 = np.searchsorted(vpos, [self.indptr[a], self.indptr[b]])
            vpos, values = vpos[e0:e1], values[e0:e1]
        return Shard(self.indptr[a : b + 1], self.indices, values, self.labels[a:b], self.weights[a:b],
                     self.n_features, vpos)

    def sampled(self, stride: int) -> Shard:
        """The rows of every ``stride``-th run of :data:`~solvers.kernels.sampling.SAMPLE_RUN`
        rows (those ``next_sampled`` picks), copied into memory in order, a run at a time (each
        released after it): for a kernel that must see a sample of a file-backed shard in one
        call (its sums are per call), which then walks these rows with stride 1, the same rows
        in the same order, so the same bits. A sample spread over the shard would otherwise map
        most of it, a page-cache folio (up to 2 MiB) around each run."""
        n, step = self.n_rows, SAMPLE_RUN * max(stride, 1)
        spans = [(r, min(r + SAMPLE_RUN, n)) for r in range(0, n, step)]
        exc, dense = self.vpos.shape[0] > 0, not self.binary and self.vpos.shape[0] == 0
        lens, idx, vals, vpos, labels, weights = [], [], [], [], [], []
        z = 0
        for a, b in spans:
            z0, z1 = int(self.indptr[a]), int(self.indptr[b])
            lens.append(np.diff(self.indptr[a : b + 1]))
            idx.append(np.array(self.indices[z0:z1]))
            if dense:
                vals.append(np.array(self.values[z0:z1]))
            elif exc:
                e0, e1 = np.searchsorted(self.vpos, [z0, z1])
                vpos.append(self.vpos[e0:e1] - z0 + z)
                vals.append(np.array(self.values[e0:e1]))
            labels.append(np.array(self.labels[a:b]))
            weights.append(np.array(self.weights[a:b]))
            z += z1 - z0
            if self.release is not None:
                self.release(a, b)
        indptr = np.zeros(sum(x.shape[0] for x in lens) + 1, np.int64)
        np.cumsum(np.concatenate(lens) if lens else np.zeros(0, np.int64), out=indptr[1:])

        def cat(parts: list, dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        return Shard(indptr, cat(idx, np.int32), cat(vals, np.float32), cat(labels, np.float32),
                     cat(weights, np.float32), self.n_features, cat(vpos, np.int64))

    def weight_sum(self) -> float:
        """Σ importance weights (float64, numpy's pairwise sum over the whole column: the same
        bits however the shard is held; a file-backed shard's column is released after it)."""
        total = float(np.sum(self.weights, dtype=np.float64))
        self.release_all()
        return total


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def find_problem(data: CSRData, shard: Shard, what: str, loss: str) -> InvalidInputError | None:
    """The first violation of the data contract in ``data`` (called ``what``), or None.

    Checks, in this order: 1 ≤ n_features < 2^31; indptr from 0, non-decreasing; indices in
    [0, n_features) (on the original array, before any int32 conversion); value exception
    positions strictly ascending in [0, nnz); values, labels and weights finite after
    conversion to float32; weights ≥ 0; labels 0 or 1 for the logistic and hinge losses.
    Each check walks the rows in :meth:`Shard.chunks` (a file-backed shard one block at a time,
    released after it; a shard in memory in one range), the exceptions in blocks of as many.
    """
    nf = data.n_features
    if not 1 <= nf <= _MAX_FEATURES:
        return InvalidInputError(f"{what}: n_features = {nf}: must be in [1, {_MAX_FEATURES}]")
    n = data.labels.shape[0]
    ip = data.indptr
    if ip.shape != (n + 1,) or int(ip[0]) != 0:
        return InvalidInputError(f"{what}: indptr must start at 0 and never decrease")
    step = None if shard.release is not None else max(n, 1)  # in memory: one range

    def ranges():
        return shard.chunks(0, n, step)

    for a, b in ranges():
        if np.any(np.diff(ip[a : b + 1]) < 0):
            return InvalidInputError(f"{what}: indptr must start at 0 and never decrease")
    idx = data.indices
    for a, b in ranges():
        z0 = int(ip[a])
        seg = idx[z0 : int(ip[b])]
        if seg.size and (int(seg.min()) < 0 or int(seg.max()) >= nf):
            k = z0 + _first_bad((seg < 0) | (seg >= nf))
            return InvalidInputError(
                f"{what}: indices[{k}] = {int(idx[k])} is outside [0, n_features = {nf})"
            )
    vp = shard.vpos
    ne = vp.shape[0]
    block = max(ne, 1) if step is not None else shard.chunk_rows or CHUNK_ROWS
    for e0 in range(0, ne, block):  # strictly ascending, across block edges too
        seg = vp[max(e0 - 1, 0) : e0 + block]
        bad = (e0 == 0 and int(seg[0]) < 0) or int(seg[-1]) >= idx.shape[0] or bool(np.any(np.diff(seg) <= 0))
        shard.release_all()
        if bad:
            return InvalidInputError(f"{what}: vpos must be strictly ascending positions in [0, nnz = {idx.shape[0]})")
    if ne:  # the exceptions' values: not aligned with rows
        for e0 in range(0, ne, block):
            seg = shard.values[e0 : e0 + block]
            finite = np.isfinite(seg)
            shard.release_all()
            if not finite.all():
                k = e0 + _first_bad(~finite)
                return _not_finite(what, "values", k, float(shard.values[k]), data.indptr, int(vp[k]))
    elif not shard.binary:
        for a, b in ranges():
            z0 = int(ip[a])
            finite = np.isfinite(shard.values[z0 : int(ip[b])])
            if not finite.all():
                k = z0 + _first_bad(~finite)
                return _not_finite(what, "values", k, float(shard.values[k]), data.indptr, k)
    for name in ("labels", "weights"):
        arr = getattr(shard, name)
        for a, b in ranges():
            finite = np.isfinite(arr[a:b])
            if not finite.all():
                k = a + _first_bad(~finite)
                return _not_finite(what, name, k, float(arr[k]))
    for a, b in ranges():
        neg = shard.weights[a:b] < 0
        if np.any(neg):
            k = a + _first_bad(neg)
            return InvalidInputError(f"{what}: weights[{k}] = {float(shard.weights[k])}: must be >= 0")
    spec = loss_spec(loss)
    for a, b in ranges():
        k = spec.check_labels(shard.labels[a:b])
        if k >= 0:
            return InvalidInputError(
                f"{what}: labels[{a + k}] = {float(shard.labels[a + k])}: the {loss} loss takes labels 0 or 1"
            )
    return None


def _not_finite(what: str, name: str, k: int, value: float, indptr: np.ndarray | None = None,
                pos: int = 0) -> NonFiniteInputError:
    row = f" (row {int(np.searchsorted(indptr, pos, side='right')) - 1})" if indptr is not None else ""
    return NonFiniteInputError(f"{what}: {name}[{k}] = {value}{row} is not finite")
