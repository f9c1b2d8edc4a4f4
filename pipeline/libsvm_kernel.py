"""LibSVM block parser (numba): ``label idx:val idx:val ...`` -> CSR rows.

Labels -1/+1 or 0/1 (any finite spelling, e.g. ``+1`` or ``1.0``) map to 0/1. Indices are shifted
by the configured base (1 for standard files) and must fall in [0, 2^bits); values are finite
decimals. Tokens are separated by spaces or tabs. Duplicate indices within a row add up.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from terascale.pipeline.rowkernels import (
    BAD_LABEL,
    EMPTY_LINE,
    INDEX_OUT_OF_RANGE,
    INVALID_UTF8,
    LINE_TOO_LONG,
    OK,
    UNPARSABLE,
    lower_groups,
    parse_float,
    sort_merge_row,
    valid_utf8,
)

FLOAT32_MAX = 3.4028234663852886e38


@njit(cache=True, inline="always")
def _is_space(c):
    return c == 32 or c == 9


@njit(cache=True)
def parse_libsvm_block(
    buf, n_bytes, max_line, base, n_buckets, pow10,
    status, line_start, line_len, labels, indptr, indices, values, row_multi, groups, entry_group,
):
    """Parse buf[:n_bytes]. Returns (n_lines, n_rows, nnz). Same output layout as the Criteo kernel.

    groups: uint8 group map of n_buckets entries, or empty for none; every index of a good row
    gets group 0 (LibSVM rows have one group, ``pipeline.groups``). entry_group: uint8 zeros, at
    least one per non-zero (read, not written).
    """
    n_lines = 0
    n_rows = 0
    nnz = 0
    indptr[0] = 0
    p = 0
    while p < n_bytes:
        e = p
        hib = 0
        while e < n_bytes and buf[e] != 10:
            hib |= buf[e]
            e += 1
        nxt = e + 1
        if e > p and buf[e - 1] == 13:
            e -= 1
        li = n_lines
        n_lines += 1
        line_start[li] = p
        line_len[li] = e - p
        # trim trailing spaces so "1 3:1 " parses
        end = e
        while end > p and _is_space(buf[end - 1]):
            end -= 1
        st = OK
        if end == p:
            st = EMPTY_LINE
        elif e - p > max_line:
            st = LINE_TOO_LONG
        elif hib >= 128 and not valid_utf8(buf, p, e):
            st = INVALID_UTF8
        else:
            q = p
            while q < end and _is_space(buf[q]):
                q += 1
            t = q
            while t < end and not _is_space(buf[t]):
                t += 1
            ok, lab = parse_float(buf, q, t, pow10)
            if not ok or not (lab == 1.0 or lab == 0.0 or lab == -1.0):
                st = BAD_LABEL
            else:
                r0 = nnz
                q = t
                while q < end:
                    while q < end and _is_space(buf[q]):
                        q += 1
                    if q >= end:
                        break
                    t = q
                    colon = -1
                    while t < end and not _is_space(buf[t]):
                        if buf[t] == 58 and colon < 0:
                            colon = t
                        t += 1
                    if colon <= q or colon == t - 1:
                        st = UNPARSABLE
                        break
                    idx = np.int64(0)
                    good = colon - q <= 12
                    for k in range(q, colon):
                        d = np.int64(buf[k]) - 48
                        if d < 0 or d > 9:
                            good = False
                            break
                        idx = idx * 10 + d
                    if not good:
                        st = UNPARSABLE
                        break
                    ok, v = parse_float(buf, colon + 1, t, pow10)
                    if not ok or abs(v) > FLOAT32_MAX:  # values are stored as float32
                        st = UNPARSABLE
                        break
                    idx -= base
                    if idx < 0 or idx >= n_buckets:
                        st = INDEX_OUT_OF_RANGE
                        break
                    indices[nnz] = idx
                    values[nnz] = v
                    nnz += 1
                    q = t
                if st == OK:
                    labels[n_rows] = 1.0 if lab == 1.0 else 0.0
                    raw = nnz
                    nnz = sort_merge_row(indices, values, r0, raw)
                    multi = nnz != raw
                    for k in range(r0, nnz):
                        if values[k] != 1.0:
                            multi = True
                    row_multi[n_rows] = multi
                    n_rows += 1
                    indptr[n_rows] = nnz
                else:
                    nnz = r0
        status[li] = st
        p = nxt
    if groups.shape[0] > 0:
        lower_groups(groups, indices, entry_group, 0, nnz)
    return n_lines, n_rows, nnz
