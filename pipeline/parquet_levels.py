"""Kernels of the rows writer (``pipeline.parquet_rows``): a list column's repetition and
definition levels, RLE-encoded per row, and the BYTE_STREAM_SPLIT transposition. No pyspark.

Levels (Parquet's Dremel encoding of one list column whose elements are required): a row of L
values has L entries, the first with repetition level 0 and the others 1, each with definition
level ``max_def``; an empty list is one entry (repetition 0, definition ``max_def - 1``), a null
list (an optional column) one entry at definition 0. They are written in the RLE/bit-packing
hybrid, here RLE runs only: a run is ``varint(count << 1)`` then the value in one byte (the
levels' bit width is at most 2). Consecutive equal levels share a run, so a page of non-empty
rows has one run of definition levels and at most two runs of repetition levels per row.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True, inline="always")
def _put_run(out, w, value, count):
    c = count << 1
    while c >= 0x80:
        out[w] = (c & 0x7F) | 0x80
        w += 1
        c >>= 7
    out[w] = c
    out[w + 1] = value
    return w + 2


MAX_RUN_BYTES = 11  # a run's header (a varint of a count below 2^62) and its value byte


@njit(cache=True)
def list_levels(lens, present, max_def, rep_out, def_out):
    """The levels of rows with ``lens`` values each (``present[r]`` false: a null list) as RLE
    runs into ``rep_out`` and ``def_out`` (each at least ``2 * MAX_RUN_BYTES`` bytes a row);
    returns (repetition bytes, definition bytes, level entries, null entries)."""
    rw = 0
    dw = 0
    rv = -1  # the open run's value and count
    rc = 0
    dv = -1
    dc = 0
    entries = 0
    nulls = 0
    for r in range(lens.shape[0]):
        m = lens[r]
        if not present[r]:
            d, m = 0, 0
        elif m == 0:
            d = max_def - 1
        else:
            d = max_def
        k = m if m > 0 else 1
        entries += k
        if m == 0:
            nulls += 1
        # repetition: 0, then k - 1 ones
        if rv == 0:
            rc += 1
        else:
            if rc > 0:
                rw = _put_run(rep_out, rw, rv, rc)
            rv, rc = 0, 1
        if k > 1:
            rw = _put_run(rep_out, rw, rv, rc)
            rv, rc = 1, k - 1
        # definition: k entries at d
        if d == dv:
            dc += k
        else:
            if dc > 0:
                dw = _put_run(def_out, dw, dv, dc)
            dv, dc = d, k
    if rc > 0:
        rw = _put_run(rep_out, rw, rv, rc)
    if dc > 0:
        dw = _put_run(def_out, dw, dv, dc)
    return rw, dw, entries, nulls



@njit(cache=True)
def byte_stream_split4(x, out):
    """BYTE_STREAM_SPLIT of 4-byte little-endian values whose bytes are ``x`` into ``out``:
    byte j of value i goes to ``out[j * n + i]`` (n values)."""
    n = x.shape[0] // 4
    for i in range(n):
        out[i] = x[4 * i]
        out[n + i] = x[4 * i + 1]
        out[2 * n + i] = x[4 * i + 2]
        out[3 * n + i] = x[4 * i + 3]
