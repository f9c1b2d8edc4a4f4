"""Feature-index kernels for :mod:`solvers.active`: occurrence counts and renumbering.

numpy's ``bincount`` and fancy indexing first widen an int32 index array to intp (a copy of
the whole shard's indices); these loops read it in place (about 5x faster on a 33M-entry shard).
"""

from __future__ import annotations

from numba import njit


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
