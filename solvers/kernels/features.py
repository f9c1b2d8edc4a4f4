"""Feature-index kernels for :mod:`solvers.active`: occurrence counts, renumbering, and the
presence marks the ranks agree on (packed as digits of float words).

numpy's ``bincount`` and fancy indexing first widen an int32 index array to intp (a copy of
the whole shard's indices); these loops read it in place.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from terascale.solvers.kernels.prefetch import prefetch_row


@njit(cache=True, nogil=True)
def count_features(indices, counts):
    """counts[j] += number of entries equal to j (``counts`` uint32: half the cache footprint
    of float64, and no shard holds 2^32 entries of one feature)."""
    for k in range(indices.shape[0]):
        counts[indices[k]] += 1


@njit(cache=True, nogil=True)
def renumber(indices, position, out):
    """out[k] = position[indices[k]]; returns the smallest value written (-1 flags an index
    outside the set), or 0 when there are no entries."""
    lowest = 0
    for k in range(indices.shape[0]):
        p = position[indices[k]]
        out[k] = p
        if p < lowest:
            lowest = p
    return lowest


#: How many entries ahead :func:`number_by_first_use` prefetches ``slot`` (an int32 per feature,
#: too large for the cache at CTR bit counts, read at random).
LOOKAHEAD = 256


@njit(cache=True, nogil=True)
def number_by_first_use(indices, slot, out, next_slot):
    """out[k] = slot[indices[k]], where a feature whose slot is still -1 gets ``next_slot``
    (then next_slot + 1, ...) at its first use. Returns the next free slot."""
    n = indices.shape[0]
    for k in range(n):
        if k + LOOKAHEAD < n:
            prefetch_row(slot, indices[k + LOOKAHEAD])
        j = indices[k]
        s = slot[j]
        if s < 0:
            s = next_slot
            slot[j] = s
            next_slot += 1
        out[k] = s
    return next_slot


@njit(cache=True, nogil=True)
def load_column(src, where, table, col):
    """table[s, col] = src[where[s]] for every slot s, and table[-1, col] = src[-1] (the
    intercept, kept last)."""
    for s in range(where.shape[0]):
        table[s, col] = src[where[s]]
    table[table.shape[0] - 1, col] = src[src.shape[0] - 1]


@njit(cache=True, nogil=True)
def store_column(table, col, where, dst):
    """dst[where[s]] = table[s, col] for every slot s, and dst[-1] = table[-1, col]."""
    for s in range(where.shape[0]):
        dst[where[s]] = table[s, col]
    dst[dst.shape[0] - 1] = table[table.shape[0] - 1, col]


@njit(cache=True, nogil=True)
def scatter_ids(src, ids, out):
    """out[ids[c]] = src[c] for every c < len(ids), and out[-1] = src[-1] (the intercept). With
    ``ids`` ascending the writes stream through ``out`` (numpy's fancy assignment first widens
    and checks the indices)."""
    for c in range(ids.shape[0]):
        out[ids[c]] = src[c]
    out[out.shape[0] - 1] = src[src.shape[0] - 1]


@njit(cache=True, nogil=True)
def mark_features(indices, marks):
    """marks[j] = 1 for every feature j among ``indices`` (uint8 marks)."""
    for k in range(indices.shape[0]):
        marks[indices[k]] = 1


@njit(cache=True, nogil=True)
def pack_marks(marks, base, digits, out):
    """out[w] = Σᵢ marks[w·digits + i]·baseⁱ over i < digits (0/1 marks; entries past the end
    count 0): ``digits`` marks per word, as base-``base`` digits."""
    n = marks.shape[0]
    for w in range(out.shape[0]):
        v = 0
        p = 1
        for k in range(w * digits, min(n, (w + 1) * digits)):
            if marks[k] != 0:
                v += p
            p *= base
        out[w] = v


@njit(cache=True, nogil=True)
def unpack_marks(words, base, digits, present):
    """present[k] = 1 where the base-``base`` digit k of the summed ``words`` (see
    :func:`pack_marks`) is non-zero: some rank marked k."""
    n = present.shape[0]
    for w in range(words.shape[0]):
        v = np.int64(words[w])
        for k in range(w * digits, min(n, (w + 1) * digits)):
            present[k] = 1 if v % base != 0 else 0
            v //= base
