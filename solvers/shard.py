"""A shard's arrays in the dtypes the kernels are compiled for, and their local checks.

:meth:`Shard.from_csr` converts a :class:`~solvers.data.CSRData` (copying an array only when
its dtype or layout differs), so every kernel is compiled once. :func:`find_problem` is the
local half of input validation (the collective half is :mod:`solvers.setup`): it returns the
first violation of the data contract, naming the array, the position and the value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError, NonFiniteInputError

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
        """(a, b) ranges of at most ``rows`` (default :data:`CHUNK_ROWS`) rows covering rows ``start..stop-1`` in order (all
        rows by default). Every pass over the shard goes through this: with :attr:`release`
        set, rows a..b-1 are released when the caller asks for the next range (or ends the
        loop), so a pass holds about one range of a file-backed shard at a time."""
        stop = self.n_rows if stop is None else stop
        rows = rows or CHUNK_ROWS
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

    def weight_sum(self) -> float:
        """Σ importance weights (float64)."""
        return float(np.sum(self.weights, dtype=np.float64))


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def find_problem(data: CSRData, shard: Shard, what: str, loss: str) -> InvalidInputError | None:
    """The first violation of the data contract in ``data`` (called ``what``), or None.

    Checks: 1 ≤ n_features < 2^31; indptr from 0, non-decreasing; indices in [0, n_features)
    (on the original array, before any int32 conversion); values, labels and weights finite
    after conversion to float32; weights ≥ 0; labels 0 or 1 for the logistic and hinge losses.
    """
    nf = data.n_features
    if not 1 <= nf <= _MAX_FEATURES:
        return InvalidInputError(f"{what}: n_features = {nf}: must be in [1, {_MAX_FEATURES}]")
    n = data.labels.shape[0]
    if data.indptr.shape != (n + 1,) or int(data.indptr[0]) != 0 or np.any(np.diff(data.indptr) < 0):
        return InvalidInputError(f"{what}: indptr must start at 0 and never decrease")
    idx = data.indices
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= nf):
        k = _first_bad((idx < 0) | (idx >= nf))
        return InvalidInputError(
            f"{what}: indices[{k}] = {int(idx[k])} is outside [0, n_features = {nf})"
        )
    vp = shard.vpos
    if vp.size and (int(vp[0]) < 0 or int(vp[-1]) >= idx.shape[0] or np.any(np.diff(vp) <= 0)):
        return InvalidInputError(f"{what}: vpos must be strictly ascending positions in [0, nnz = {idx.shape[0]})")
    for name in ("values", "labels", "weights"):
        arr = getattr(shard, name)
        finite = np.isfinite(arr)
        if not finite.all():
            k = _first_bad(~finite)
            pos = int(vp[k]) if name == "values" and vp.size else k
            row = f" (row {int(np.searchsorted(data.indptr, pos, side='right')) - 1})" if name == "values" else ""
            return NonFiniteInputError(f"{what}: {name}[{k}] = {float(arr[k])}{row} is not finite")
    if np.any(shard.weights < 0):
        k = _first_bad(shard.weights < 0)
        return InvalidInputError(f"{what}: weights[{k}] = {float(shard.weights[k])}: must be >= 0")
    k = loss_spec(loss).check_labels(shard.labels)
    if k >= 0:
        return InvalidInputError(
            f"{what}: labels[{k}] = {float(shard.labels[k])}: the {loss} loss takes labels 0 or 1"
        )
    return None
