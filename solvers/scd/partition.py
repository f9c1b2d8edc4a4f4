"""Data by feature for primal SCD: this rank's block of columns over *all* rows, as CSC.

Primal SCD updates one coefficient at a time and needs that feature's whole column, while the
training data arrives sharded by example. With K ranks, feature ``m`` (the augmented constant
feature is ``m = n_features``) belongs to rank ``m mod K``; every rank receives every shard once
(K broadcasts, rank order; that order also numbers the rows globally), keeps the entries of its
own columns and transposes them. The cost is one pass of the whole data set through every rank,
paid once before the first round; the kept block is about 1/K of the non-zeros. With K = 1 this
is a local CSR -> CSC transpose.

Integer arrays travel as floats: row pointers as float64 (exact below 2^53), column indices as
float32 when n_features <= 2^24 (exact) and float64 otherwise. The values of a shard whose values
are all 1 (binary hashed features) are not sent. A shard may be empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.primal_kernels import csc_count, csc_fill, filter_owned


@dataclass(frozen=True)
class FeatureBlock:
    """Columns ``owned`` (global feature indices, ascending) of the whole data set, as CSC."""

    colptr: np.ndarray  # int64 (len(owned) + 1,)
    rows: np.ndarray  # int32 (nnz,), global row numbers
    vals: np.ndarray  # float32 (nnz,)
    owned: np.ndarray  # int64 (n_local_features,)
    labels: np.ndarray  # float32 (n_rows_total,)
    weights: np.ndarray  # float32 (n_rows_total,)
    row_offset: int  # first global row of this rank's own shard


def owned_features(n_columns: int, rank: int, size: int) -> np.ndarray:
    """Global indices of the columns that rank ``rank`` updates (m mod size == rank)."""
    return np.arange(rank, n_columns, size, dtype=np.int64)


def shards_in_rank_order(data: CSRData, comm: Communicator):
    """Yield (root, indptr, indices, values, labels, weights) of every rank's shard, rank order."""
    k, me = comm.size, comm.rank
    slots = [0.0] * (3 * k)
    ones = bool(np.all(data.values == 1.0))  # binary features: no values to send
    slots[3 * me:3 * me + 3] = float(data.n_rows), float(data.nnz), float(ones)
    sizes = comm.allreduce_scalars(slots)
    index_dtype = np.float32 if data.n_features <= 1 << 24 else np.float64  # exact integers
    for root in range(k):
        n, nnz, all_ones = int(sizes[3 * root]), int(sizes[3 * root + 1]), sizes[3 * root + 2] == 1.0
        own = root == me

        def send(a, length, dtype, exact=False, own=own, root=root):
            """Rank ``root``'s array as ``dtype`` on every rank. The root keeps its own cast
            (the same values as everywhere else), or with ``exact`` (integers that the wire
            dtype holds exactly) the array itself: no cast back."""
            if own:
                mine = np.asarray(a, dtype=dtype)
                comm.broadcast(mine, root)
                return a if exact else mine
            return comm.broadcast(np.zeros(length, dtype), root)

        ptr = send(data.indptr, n + 1, np.float64, exact=True).astype(np.int64, copy=False)
        idx = send(data.indices, nnz, index_dtype, exact=True).astype(np.int32, copy=False)
        val = np.ones(nnz, np.float32) if all_ones else send(data.values, nnz, np.float32)
        lab = send(data.labels, n, np.float32)
        wts = send(data.weights, n, np.float32)
        yield root, ptr, idx, val, lab, wts


def feature_block(data: CSRData, comm: Communicator, bias_scale: float) -> FeatureBlock:
    """Gather this rank's columns (and the constant column if it owns it) over all rows."""
    d = data.n_features
    n_columns = d + (1 if bias_scale > 0.0 else 0)
    owned = owned_features(n_columns, comm.rank, comm.size)
    col_slot = np.full(d, -1, np.int64)
    feat = owned[owned < d]
    col_slot[feat] = np.arange(feat.shape[0])
    if comm.size == 1:
        pieces = [(data.indptr, data.indices, data.values)]
        labels, weights, row_offset = data.labels, data.weights, 0
    else:
        pieces, labs, wts, row_offset, offset = [], [], [], 0, 0
        for root, ptr, idx, val, lab, wt in shards_in_rank_order(data, comm):
            if root == comm.rank:
                row_offset = offset
            pieces.append(filter_owned(ptr, idx, val, col_slot))
            labs.append(lab)
            wts.append(wt)
            offset += lab.shape[0]
        labels, weights = np.concatenate(labs), np.concatenate(wts)
    colptr, rows, vals = _transpose(pieces, feat.shape[0])
    if n_columns > d and owned[-1] == d:  # the constant column: every row, value bias_scale
        n = labels.shape[0]
        colptr = np.append(colptr, colptr[-1] + n)
        rows = np.concatenate([rows, np.arange(n, dtype=np.int32)])
        vals = np.concatenate([vals, np.full(n, bias_scale, np.float32)])
    return FeatureBlock(colptr, rows, vals, owned, labels, weights, row_offset)


def _transpose(pieces, n_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR blocks (row order) with local column slots -> one CSC over all their rows."""
    counts = np.zeros(n_cols + 1, np.int64)
    for _, slots, _ in pieces:
        csc_count(slots, counts)
    colptr = np.cumsum(counts)
    nnz = int(colptr[-1])
    rows = np.empty(nnz, np.int32)
    vals = np.empty(nnz, np.float32)
    fill = colptr[:-1].copy()
    offset = 0
    for ptr, slots, val in pieces:
        csc_fill(ptr, slots, val, offset, fill, rows, vals)
        offset += ptr.shape[0] - 1
    return colptr, rows, vals
