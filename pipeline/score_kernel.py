"""Score Criteo TSV lines straight from their bytes: one pass that parses, hashes, sorts and sums.

For the raw-line scorer (``pipeline.scorer``). featurize's kernel (``criteo_kernel``) writes a
CSR block (indices, counts, the group map's bookkeeping) that the predict path then reads again
to sum margins; here each good line's margin is summed as soon as its row is known, and no CSR
is written. The line walk, the validation and the token hashing are featurize's own helpers
(``criteo_kernel._walk_line``, ``_line_status``, ``_row_indices``), so a line gets the same
reason code and the same indices as in featurize.

The margin of a row is the predict job's (``solvers.kernels.objective.margins`` over the
featurized row): the row's distinct indices in ascending order, each with its count x (float32,
tokens that hash to one index add up), m = intercept (float64), then m += coef[index] * x for
each in turn, the product in float32 added to the float64 m. Same operations in the same order:
the same bits.

Weights are read at random (2^24 float32 = 64 MiB does not fit a cache). A row's weights are
prefetched as soon as its indices are hashed, and its margin is summed only after the next good
line has been parsed, so the misses overlap a whole line's parsing.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from terascale.pipeline.criteo_kernel import (
    FL_SIZE,
    _line_status,
    _row_indices,
    _walk_line,
    find_separators,
)
from terascale.pipeline.hashing import WORDS8_ROWS
from terascale.pipeline.rowkernels import OK, prefetch


@njit(cache=True, inline="always")
def _merge_runs(srt, n, out_idx, out_cnt, o):
    """The runs of equal values of the sorted srt[128:128+n] as (value, count) into out_*[o:]."""
    u = 0
    prev = -1
    for i in range(n):
        x = np.int64(srt[128 + i])
        if x == prev:
            out_cnt[o + u - 1] += np.float32(1.0)
        else:
            out_idx[o + u] = x
            out_cnt[o + u] = np.float32(1.0)
            u += 1
            prev = x
    return u


RANK_LANES = 48  # rows of up to this many tokens (39 fields + 9 conjunctions) sort by counting


@njit(cache=True)  # not inlined: LLVM vectorizes the counting loop only in its own function
def sorted_runs(keys, n, narrow, tmp, t32, out_idx, out_cnt, o):
    """The distinct values of keys[:n] (non-negative) in ascending order into out_idx[o:o+u] and
    how often each occurs (float32) into out_cnt[o:o+u]; returns u.

    ``narrow``: every key is below 2^25. keys holds at least RANK_LANES entries, ``tmp`` (int64)
    and ``t32`` (int32) at least 128 + max(n, 64).

    Up to RANK_LANES narrow keys sort by counting: 32-bit keys (value << 6 | position, so ties
    break by position) padded with +inf to RANK_LANES (a constant: whole 8-lane vectors), and
    for one entry at a time the counts of all entries it is smaller than go up by one; each
    entry's count is its place. Other rows sort by insertion."""
    if narrow and n <= RANK_LANES:
        for j in range(RANK_LANES):
            t32[j] = np.int32((keys[j] << 6) | j) if j < n else np.int32(0x7FFFFFFF)
            t32[64 + j] = 0
        for j in range(n):
            k = t32[j]
            for i in range(RANK_LANES):
                t32[64 + i] += np.int32(t32[i] > k)
        for i in range(n):
            t32[128 + t32[64 + i]] = t32[i] >> 6
        return _merge_runs(t32, n, out_idx, out_cnt, o)
    for i in range(n):
        k = keys[i]
        j = 128 + i - 1
        while j >= 128 and tmp[j] > k:
            tmp[j + 1] = tmp[j]
            j -= 1
        tmp[j + 1] = k
    return _merge_runs(tmp, n, out_idx, out_cnt, o)


@njit(cache=True, inline="always")
def _run_margin(coef, intercept, idx, cnt, o, u):
    """intercept + Σ coef[idx[t]] * cnt[t] over t in o..o+u-1, in that order (module docstring)."""
    m = intercept
    for t in range(o, o + u):
        m += coef[idx[t]] * cnt[t]
    return m


@njit(cache=True)
def score_criteo_block(buf, n_bytes, p, max_line, sel, int_mode, conj, pdata, poff, pword, mask, seed, int_table,
                       seps, scratch, coef, intercept, status, out):
    """Score the lines of buf[p:n_bytes] (p a line start) until status/out are full.

    Returns (n_lines, p past them). Line i gets its reason code (``rowkernels.REASONS``) in
    status[i] and, when good, its margin in out[i] (0 for a bad line). ``seps`` holds at least
    n_bytes - p + 1 entries; the spec's arrays are ``blocks.BlockParser``'s; coef float32 of 2^bits.
    """
    cap = status.shape[0]
    width = max(sel.shape[0] + conj.shape[0], 1)
    fl = np.zeros(FL_SIZE, dtype=np.int64)
    src = np.zeros(width, dtype=np.int64)
    batch = np.zeros((WORDS8_ROWS, max(sel.shape[0], 1)), dtype=np.uint32)
    keys = np.zeros(max(width, 64), dtype=np.int64)
    tmp = np.zeros(128 + max(width, 64), dtype=np.int64)
    t32 = np.zeros(128 + max(width, 64), dtype=np.int32)
    narrow = mask < (1 << 25)
    ring_idx = np.zeros(2 * width, dtype=np.int64)  # the sorted runs of two rows: the pending one, the current one
    ring_cnt = np.zeros(2 * width, dtype=np.float32)
    n_seps, non_ascii = find_separators(buf[p:], n_bytes - p, seps)
    for k in range(n_seps):
        seps[k] += p
    ks = 0
    n_lines = 0
    pend_line = -1  # the last good line, its margin not summed yet
    pend_o = 0
    pend_u = 0
    while p < n_bytes and n_lines < cap:
        ks, e, nxt, nf = _walk_line(buf, n_bytes, seps, n_seps, ks, p, fl)
        li = n_lines
        n_lines += 1
        st = _line_status(buf, p, e, nf, max_line, non_ascii, fl)
        status[li] = st
        out[li] = 0.0
        if st == OK:
            n = _row_indices(buf, n_bytes, fl, sel, conj, int_mode, pdata, poff, pword, mask, seed, int_table, scratch,
                             keys, 0, src, batch)
            for t in range(n):
                prefetch(coef, keys[t])
            o = width if pend_o == 0 else 0
            u = sorted_runs(keys, n, narrow, tmp, t32, ring_idx, ring_cnt, o)
            if pend_line >= 0:
                out[pend_line] = _run_margin(coef, intercept, ring_idx, ring_cnt, pend_o, pend_u)
            pend_line, pend_o, pend_u = li, o, u
        p = nxt
    if pend_line >= 0:
        out[pend_line] = _run_margin(coef, intercept, ring_idx, ring_cnt, pend_o, pend_u)
    return n_lines, p
