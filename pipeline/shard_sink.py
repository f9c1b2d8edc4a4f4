"""Where a shard's rows go while it is read: the sink interface and the in-memory sink.

:func:`pipeline.dataset.read_shard` reads a shard one row group at a time and hands each Arrow
chunk's rows to a sink, already split into training and held-out rows, so that a rank never
holds the whole shard twice (as Arrow tables beside the CSR, or as the CSR beside its split
halves). A sink appends rows and, at :meth:`ShardSink.finish`, returns them as a
:class:`~solvers.data.CSRData`.

:class:`MemorySink` keeps the arrays in this process. Its index array is reserved at the
planned non-zeros plus a margin with ``np.empty``, whose pages the kernel maps only when they
are first written: the unused reserve costs address space, not memory. Only the values other
than 1 are kept, with their positions (the layouts of :mod:`solvers.kernels.values`): hashed
click data stores a value only where two tokens of a row share a bucket.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from terascale.solvers.data import CSRData
from terascale.solvers.kernels.values import dense, dense_is_smaller, exceptions


class ShardSink(Protocol):
    def append(self, lengths: np.ndarray, indices: np.ndarray, values: np.ndarray | None,
               labels: np.ndarray, weights: np.ndarray) -> None:
        """Append rows: row i has ``lengths[i]`` non-zeros (int64), whose feature ids are the
        next ``lengths[i]`` entries of ``indices`` (int32) and whose values are those of
        ``values`` (float32), or all 1 when ``values`` is None."""

    def finish(self, n_features: int) -> CSRData:
        """The rows appended, in order."""

    def close(self) -> None:
        """Free what the sink holds (after :meth:`finish`, or when reading failed)."""


class MemorySink:
    """A :class:`ShardSink` into numpy arrays in this process (see the module docstring).
    ``rows``: exact number of rows to come (more raise ValueError); ``nnz_hint``: the planned
    non-zeros (the reserve grows by half when they are exceeded, one copy)."""

    def __init__(self, rows: int, nnz_hint: int):
        self.indptr = np.empty(rows + 1, np.int64)
        self.indptr[0] = 0
        self.labels = np.empty(rows, np.float32)
        self.weights = np.empty(rows, np.float32)
        self.indices = np.empty(max(int(nnz_hint * 1.05) + 4096, 0), np.int32)
        self.exc_pos: list[np.ndarray] = []  # positions and values of the values ≠ 1
        self.exc_val: list[np.ndarray] = []
        self.r = 0
        self.z = 0

    def append(self, lengths, indices, values, labels, weights) -> None:
        m, span = lengths.shape[0], indices.shape[0]
        r, z = self.r, self.z
        if r + m > self.labels.shape[0]:
            raise ValueError(f"MemorySink: {r + m} rows appended, {self.labels.shape[0]} planned")
        if z + span > self.indices.shape[0]:
            grown = np.empty(max(z + span, self.indices.shape[0] * 3 // 2), np.int32)
            grown[:z] = self.indices[:z]
            self.indices = grown
        np.cumsum(lengths, out=self.indptr[r + 1 : r + m + 1])
        self.indptr[r + 1 : r + m + 1] += z
        self.indices[z : z + span] = indices
        if values is not None:
            val, ex = exceptions(values)
            if ex.size:
                self.exc_pos.append(ex + z)
                self.exc_val.append(val)
        self.labels[r : r + m] = labels
        self.weights[r : r + m] = weights
        self.r, self.z = r + m, z + span

    def finish(self, n_features: int) -> CSRData:
        """The rows, binary or with exceptions, or dense when exceptions (12 bytes each) would
        take more than dense values (4 bytes per non-zero)."""
        r, z = self.r, self.z
        if r != self.labels.shape[0]:
            raise ValueError(f"MemorySink: {r} rows appended, {self.labels.shape[0]} planned")
        vpos = np.concatenate(self.exc_pos) if self.exc_pos else np.zeros(0, np.int64)
        values = np.concatenate(self.exc_val) if self.exc_val else np.zeros(0, np.float32)
        if dense_is_smaller(vpos.shape[0], z):
            values, vpos = dense(values, vpos, z), np.zeros(0, np.int64)
        return CSRData(self.indptr, self.indices[:z], values, self.labels, self.weights, n_features, vpos)

    def close(self) -> None:
        self.indptr = self.indices = self.labels = self.weights = None  # type: ignore[assignment]
        self.exc_pos, self.exc_val = [], []
