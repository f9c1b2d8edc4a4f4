"""The in-memory training data every solver takes: one shard as a CSR matrix plus labels.

Built by ``pipeline.dataset`` straight from Parquet (an Arrow ``list<int32>`` column's offsets
and values are the CSR ``indptr`` and ``indices``), or by tests from scipy matrices. Kernels take
the arrays, never this object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: A feature group map (uint8 per feature: the field it came from, see ``pipeline.groups``)
#: holds this for a feature in no group.
NO_GROUP = 255


@dataclass(frozen=True)
class CSRData:
    indptr: np.ndarray  # int64 (n_rows + 1,)
    indices: np.ndarray  # int32 (nnz,), sorted and unique within a row
    values: np.ndarray  # float32: (nnz,) dense, (0,) all ones, or the exceptions' values (len(vpos),)
    labels: np.ndarray  # float32 (n_rows,), 0 or 1 (for squared loss: any real target)
    weights: np.ndarray  # float32 (n_rows,), importance weights > 0
    n_features: int  # 2^bits
    #: int64 ascending positions (into ``indices``) of the values ≠ 1 when ``values`` holds only
    #: those; empty otherwise (the layouts: :mod:`solvers.kernels.values`)
    vpos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: arrays backed by files (the local shard cache, ``pipeline.shard_cache``): a pass walks at
    #: most ``chunk_rows`` rows at a time (0: no limit of its own) and ``release(a, b)`` drops
    #: rows a..b-1 from this process's memory after it (``solvers.shard.Shard.chunks``)
    chunk_rows: int = field(default=0, compare=False)
    release: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.indptr.shape != (n + 1,) or self.weights.shape != (n,):
            raise ValueError(f"inconsistent CSR shapes: indptr {self.indptr.shape}, labels {n}, weights {self.weights.shape}")
        if self.vpos.shape[0] > 0 and self.values.shape != self.vpos.shape:
            raise ValueError(f"inconsistent CSR value exceptions: {self.values.shape} values at {self.vpos.shape} positions")
        if (self.vpos.shape[0] == 0 and self.values.shape not in (self.indices.shape, (0,))) or int(self.indptr[-1]) != self.indices.shape[0]:
            raise ValueError(f"inconsistent CSR: indptr[-1]={int(self.indptr[-1])}, indices {self.indices.shape}, values {self.values.shape}")

    @property
    def n_rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    @property
    def binary(self) -> bool:
        """Every value is 1: nothing stored (the kernels take x_ij = 1)."""
        return self.values.shape[0] == 0

    def full_values(self) -> np.ndarray:
        """The values, one float32 per non-zero, whatever the layout."""
        from terascale.solvers.kernels.values import dense

        return dense(self.values, self.vpos, self.nnz)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.indptr, self.indices, self.values, self.vpos, self.labels, self.weights))

    @classmethod
    def from_scipy(cls, x, labels, weights=None, n_features: int | None = None) -> CSRData:
        """From a scipy.sparse matrix (tests, reference data)."""
        x = x.tocsr()
        x.sort_indices()
        n = x.shape[0]
        return cls(
            indptr=x.indptr.astype(np.int64),
            indices=x.indices.astype(np.int32),
            values=x.data.astype(np.float32),
            labels=np.asarray(labels, dtype=np.float32),
            weights=np.ones(n, np.float32) if weights is None else np.asarray(weights, dtype=np.float32),
            n_features=int(n_features if n_features is not None else x.shape[1]),
        )

    def to_scipy(self):
        import scipy.sparse as sp

        return sp.csr_matrix((self.full_values(), self.indices, self.indptr), shape=(self.n_rows, self.n_features))

    @classmethod
    def empty(cls, n_features: int) -> CSRData:
        return cls(np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32),
                   np.zeros(0, np.float32), np.zeros(0, np.float32), n_features)

    def take_rows(self, mask: np.ndarray) -> CSRData:
        """The rows where ``mask`` is true, as a new CSR matrix (order kept)."""
        mask = np.asarray(mask, dtype=bool)
        lens = np.diff(self.indptr)
        keep = np.repeat(mask, lens)
        indptr = np.zeros(int(mask.sum()) + 1, np.int64)
        np.cumsum(lens[mask], out=indptr[1:])
        values, vpos = self.values, self.vpos
        if vpos.shape[0] > 0:  # exceptions: their rows' new starts plus their offsets in the row
            rows = np.searchsorted(self.indptr, vpos, side="right") - 1
            kept = mask[rows]
            new_row = np.cumsum(mask) - 1
            vpos = indptr[new_row[rows[kept]]] + (vpos[kept] - self.indptr[rows[kept]])
            values = values[kept]
        elif not self.binary:
            values = values[keep]
        return CSRData(indptr, self.indices[keep], values, self.labels[mask], self.weights[mask], self.n_features,
                       vpos.astype(np.int64, copy=False))

    def split_held_out(self, held: np.ndarray) -> tuple[CSRData, CSRData]:
        """(train, holdout): the rows where ``held`` is false, and those where it is true (both
        copies, order kept). Which rows are held out is decided by each row's identity, not its
        position here (``solvers.holdout``; ``pipeline.dataset.holdout_mask`` for a shard)."""
        held = np.asarray(held, dtype=bool)
        if held.shape != (self.n_rows,):
            raise ValueError(f"held-out mask of shape {held.shape} for {self.n_rows} rows")
        return self.take_rows(~held), self.take_rows(held)
