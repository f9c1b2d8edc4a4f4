"""Feature values of a shard as the kernels read them: dense, binary, or binary with exceptions.

A shard stores its values in one of three layouts, told apart by the lengths of ``values``
(float32) and ``vpos`` (int64):

- **binary** (``values`` and ``vpos`` empty): every value is 1, nothing stored. Hashed click
  features are counts of a token in a row, 1 but for the rare row where two tokens of the row
  collide in one bucket.
- **binary with exceptions** (``vpos`` non-empty): the values are 1 except at the positions
  ``vpos`` (ascending, into ``indices``), whose values are ``values[e]``, e = 0, 1, ...: a few
  bytes per exception instead of 4 per non-zero.
- **dense** (``vpos`` empty, ``values`` of length nnz): one value per non-zero.

Every kernel starts a row with :func:`row_start` (inlined), which says how to read its values:
PLAIN (x = 1, no load), DENSE, or EXCEPTIONS (:func:`value_at`); the loops branch on that
row-level mode, which the branch predictor and LLVM's loop unswitching make nearly free. The value is
the stored float32 (1 is exact), so the three layouts of the same matrix give the same bits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit

ONE = np.float32(1.0)
PLAIN = 0  # a row whose values are all 1
DENSE = 1  # a row of a dense shard
EXCEPTIONS = 2  # a row holding exceptions


@njit(inline="always")
def row_start(values, vpos, a, b, cur):
    """(cur, mode) for the row with entries ``a..b-1``: mode PLAIN (x = 1, nothing to read),
    DENSE (x = values[k]) or EXCEPTIONS (read with :func:`value_at` from e = cur). ``cur`` is
    the cursor into ``vpos`` left by the previous row (0 at the start): rows in stored order
    move it forward a step at a time, a row before it (a shuffled order) or the first row of a
    call that starts past the first exception (a chunk of a pass) finds it by bisection."""
    ne = vpos.shape[0]
    if ne == 0:
        return 0, DENSE if values.shape[0] > 0 else PLAIN
    if (cur > 0 and vpos[cur - 1] >= a) or (cur == 0 and vpos[0] < a):  # a chunk's first row: no walk from 0
        cur = np.searchsorted(vpos, a)
    while cur < ne and vpos[cur] < a:
        cur += 1
    return cur, EXCEPTIONS if cur < ne and vpos[cur] < b else PLAIN


@njit(inline="always")
def value_at(values, vpos, k, e):
    """(x_k as float32, e for entry k + 1) in an EXCEPTIONS row, entries in order from its
    first, ``e`` from :func:`row_start`."""
    if e < vpos.shape[0] and vpos[e] == k:
        return values[e], e + 1
    return ONE, e


def exceptions(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, vpos) of the exceptions of a dense float32 value array (the entries ≠ 1)."""
    vpos = np.flatnonzero(values != 1.0).astype(np.int64)
    return np.ascontiguousarray(values[vpos], dtype=np.float32), vpos


def dense_is_smaller(n_exceptions: int, nnz: int) -> bool:
    """The layout rule of every sink: dense values (4 bytes per non-zero) once the exceptions
    (12 bytes each: an int64 position and a float32 value) would take more."""
    return 3 * n_exceptions > nnz


def dense(values: np.ndarray, vpos: np.ndarray, nnz: int) -> np.ndarray:
    """The dense float32 values (length nnz) of any layout."""
    if vpos.shape[0] == 0 and values.shape[0] == nnz:
        return values
    out = np.ones(nnz, np.float32)
    out[vpos] = values
    return out


def densified(data):
    """``data`` (a CSRData or a Shard) with dense values: the same object when they already
    are (solvers whose kernels read one value per non-zero: SCD, the GPU)."""
    n = data.indices.shape[0]
    if data.vpos.shape[0] == 0 and data.values.shape[0] == n:
        return data
    return dataclasses.replace(data, values=dense(data.values, data.vpos, n), vpos=np.zeros(0, np.int64))
