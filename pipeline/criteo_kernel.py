"""Criteo TSV block parser and hasher (numba; no Python objects on the hot path).

A block is a uint8 array holding whole lines. For each line the kernel validates it (empty, too
long, UTF-8, 40 fields, label 0/1, integer fields), builds the feature tokens of
``pipeline.spec`` in a scratch buffer, hashes them with murmur3 and writes one CSR row of sorted,
unique indices (colliding tokens add their values). Bad lines get a reason code and no row.
Optionally it also records which field each bucket came from (the group map, ``pipeline.groups``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from terascale.pipeline.hashing import (
    WORDS8_ROWS,
    load_u32,
    murmur3_32,
    murmur3_32_prefixed,
    murmur3_32_words8,
)
from terascale.pipeline.rowkernels import (
    BAD_INTEGER,
    BAD_LABEL,
    EMPTY_LINE,
    INVALID_UTF8,
    LINE_TOO_LONG,
    OK,
    WRONG_FIELD_COUNT,
    load_u64,
    lower_groups,
    parse_int_swar,
    trailing_zeros,
    valid_utf8,
    write_int,
)

N_INT = 13
N_CAT = 26
N_COLS = 1 + N_INT + N_CAT  # label + features
FL_LEN = N_COLS  # a line's columns (``_walk_line``): fl[c] = start of column c, fl[FL_LEN + c] its length,
FL_INT = 2 * N_COLS  # fl[FL_INT + k] = the value of integer field k (``_line_status``)
FL_SIZE = 2 * N_COLS + N_INT


def field_prefixes() -> tuple[np.ndarray, np.ndarray]:
    """Token prefixes ``I1=`` .. ``C26=`` of the 39 feature fields as (bytes, offsets)."""
    names = [f"I{k}=" for k in range(1, N_INT + 1)] + [f"C{k}=" for k in range(1, N_CAT + 1)]
    data = np.frombuffer("".join(names).encode(), dtype=np.uint8).copy()
    off = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=off[1:])
    return data, off


def prefix_words(pdata: np.ndarray, poff: np.ndarray) -> np.ndarray:
    """Each field's token prefix (3 or 4 bytes): its bytes as a little-endian number in the low 32
    bits (murmur3's first block, ``hashing.murmur3_32_prefixed``), its length above."""
    out = np.zeros(poff.shape[0] - 1, dtype=np.int64)
    for f in range(out.shape[0]):
        b = bytes(pdata[poff[f] : poff[f + 1]])
        if not 3 <= len(b) <= 4:
            raise ValueError(f"field prefix {b!r} is not 3 or 4 bytes")
        out[f] = int.from_bytes(b, "little") | (len(b) << 32)
    return out


def field_id(name: str) -> int:
    """Feature field number 0..38 of a Criteo field name (I1..I13 -> 0..12, C1..C26 -> 13..38)."""
    return int(name[1:]) - 1 if name[0] == "I" else N_INT + int(name[1:]) - 1


INT_TABLE_LO = -1024  # raw integer values in [LO, HI) hash through a precomputed table
INT_TABLE_HI = 65536


@njit(cache=True, inline="always")
def bucket_of(v, int_mode):
    if int_mode == 1 or v <= 2:
        return v
    lg = math.log(np.float64(v))
    return np.int64(math.floor(lg * lg))


@njit(cache=True, inline="always")
def _write_token(f, buf, fl, int_mode, pdata, poff, out, pos):
    """Write the token of present feature field f (its columns in fl, ``_walk_line``) at out[pos:]."""
    for q in range(poff[f], poff[f + 1]):
        out[pos] = pdata[q]
        pos += 1
    if f < N_INT:
        return write_int(bucket_of(fl[FL_INT + f], int_mode), out, pos)
    s = fl[f + 1]
    for q in range(fl[FL_LEN + f + 1]):
        out[pos] = buf[s + q]
        pos += 1
    return pos


@njit(cache=True)
def build_int_table(int_mode, pdata, poff, mask, seed):
    """Hashed index of every integer field's token for raw values in [INT_TABLE_LO, INT_TABLE_HI)."""
    width = INT_TABLE_HI - INT_TABLE_LO
    table = np.zeros((N_INT, width), dtype=np.int32)
    scratch = np.zeros(64, dtype=np.uint8)
    for f in range(N_INT):
        for k in range(width):
            pos = 0
            for q in range(poff[f], poff[f + 1]):
                scratch[pos] = pdata[q]
                pos += 1
            pos = write_int(bucket_of(np.int64(k + INT_TABLE_LO), int_mode), scratch, pos)
            table[f, k] = murmur3_32(scratch, 0, pos, seed) & mask
    return table


RANK_SORT_MAX = 64  # rows up to this many entries sort by branchless ranking, longer ones by insertion


@njit(cache=True)  # not inlined: LLVM vectorizes the ranking loop only in its own function
def _sort_count_row(indices, values, start, end, tmp, row_group, entry_group):
    """Sort indices[start:end], merge duplicates into counts in values. Returns the new end.

    row_group[j] is the group of token start + j; entry_group[start:new end] gets the smallest
    group of the tokens merged into each entry.
    """
    n = end - start
    if n <= RANK_SORT_MAX:
        # rank of each entry = entries smaller, ties broken by position: branchless, vectorizes
        # unique keys (index << 6 | position), padded with +inf to a multiple of 8 lanes
        m = (n + 7) & ~7
        for j in range(n):
            tmp[j] = (np.int64(indices[start + j]) << 6) | j
        for j in range(n, m):
            tmp[j] = np.int64(1) << 62
        for i in range(n):
            k = tmp[i]
            rank = np.uint32(0)  # a 32-bit count: numba would widen an int to 64 bits
            for j in range(m):
                rank = np.uint32(rank + np.uint32(tmp[j] < k))
            tmp[64 + rank] = k
        for i in range(n):
            k = tmp[64 + i]
            indices[start + i] = k >> 6
            entry_group[start + i] = row_group[k & 63]
    else:
        for i in range(n):
            entry_group[start + i] = row_group[i]
        for i in range(start + 1, end):
            k = indices[i]
            g = entry_group[i]
            j = i - 1
            while j >= start and indices[j] > k:
                indices[j + 1] = indices[j]
                entry_group[j + 1] = entry_group[j]
                j -= 1
            indices[j + 1] = k
            entry_group[j + 1] = g
    if n == 0:
        return end
    w = start
    values[w] = 1.0
    for i in range(start + 1, end):
        if indices[i] == indices[w]:
            values[w] += 1.0
            entry_group[w] = min(entry_group[w], entry_group[i])
        else:
            w += 1
            indices[w] = indices[i]
            entry_group[w] = entry_group[i]
            values[w] = 1.0
    return w + 1


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_TABS = np.uint64(0x0909090909090909)
_NEWLINES = np.uint64(0x0A0A0A0A0A0A0A0A)
_HIGH = np.uint64(0x8080808080808080)
_GATHER = np.uint64(0x0102040810204080)  # moves bit 8k to bit 56 + k (k = 0..7), no carries


@njit(cache=True, inline="always")
def _separator_bits(w):
    """Bit k set when byte k of the little-endian word w is a tab or a newline (exact per byte:
    a zero byte of w ^ 0x09.. or w ^ 0x0A.. is found without borrows between bytes)."""
    x1 = w ^ _TABS
    x2 = w ^ _NEWLINES
    z = ~(((((x1 & _LOW7) + _LOW7) | x1) & (((x2 & _LOW7) + _LOW7) | x2)) | _LOW7)
    return ((z >> np.uint64(7)) * _GATHER) >> np.uint64(56)


@njit(cache=True)
def find_separators(buf, n_bytes, seps):
    """Positions of every tab and newline in buf[:n_bytes] into seps, in order.

    Returns (count, any_non_ascii). ``seps`` must hold at least ``count_separators`` + 1 entries.
    64 bytes at a time: a bit map of their separators from eight 8-byte words, then one
    position per set bit; the last bytes one at a time (branchless compaction).
    """
    k = 0
    hib = np.uint64(0)
    i = 0
    while i + 64 <= n_bytes:
        bm = np.uint64(0)
        for q in range(8):
            w = load_u64(buf, i + 8 * q)
            hib |= w
            bm |= _separator_bits(w) << np.uint64(8 * q)
        while bm != 0:
            seps[k] = i + np.int64(trailing_zeros(bm))
            k += 1
            bm &= bm - np.uint64(1)
        i += 64
    non_ascii = (hib & _HIGH) != 0
    for j in range(i, n_bytes):
        c = buf[j]
        non_ascii |= c >= 128
        seps[k] = j
        k += (c == 9) | (c == 10)
    return k, non_ascii


@njit(cache=True)
def count_separators(buf, n_bytes):
    k = 0
    for i in range(n_bytes):
        c = buf[i]
        k += (c == 9) | (c == 10)
    return k


@njit(cache=True, inline="always")
def _walk_line(buf, n_bytes, seps, n_seps, ks, p, fl):
    """The columns of the line starting at p, from the separators seps[ks:n_seps]
    (``find_separators``): start and length of its first N_COLS columns into fl. Returns (ks
    past the line, e = the line's end without a CR, nxt = the next line's start, nf = its
    number of columns)."""
    nf = 0
    fl[0] = p
    while ks < n_seps and buf[seps[ks]] == 9:
        q = seps[ks]
        if nf < N_COLS:
            fl[FL_LEN + nf] = q - fl[nf]
        nf += 1
        if nf < N_COLS:
            fl[nf] = q + 1
        ks += 1
    if ks < n_seps:
        e = seps[ks]  # the newline
        ks += 1
    else:
        e = n_bytes
    nxt = e + 1
    if e > p and buf[e - 1] == 13:  # CRLF
        e -= 1
    if nf < N_COLS:
        fl[FL_LEN + nf] = e - fl[nf]
    return ks, e, nxt, nf + 1


@njit(cache=True, inline="always")
def _line_status(buf, p, e, nf, max_line, non_ascii, fl):
    """The reason code of the line buf[p:e] of nf columns (``_walk_line``); for a good line the
    integer values go to fl[FL_INT:]. Feature field f of a good line is present (has a token)
    when its column is not empty: fl[FL_LEN + f + 1] > 0."""
    if e == p:
        return EMPTY_LINE
    if e - p > max_line:
        return LINE_TOO_LONG
    if non_ascii and not valid_utf8(buf, p, e):
        return INVALID_UTF8
    if nf != N_COLS:
        return WRONG_FIELD_COUNT
    if fl[FL_LEN] != 1 or (buf[p] != 48 and buf[p] != 49):
        return BAD_LABEL
    for k in range(N_INT):
        ln = fl[FL_LEN + k + 1]
        if ln > 0:
            c0 = fl[k + 1]
            ok, v = parse_int_swar(buf, c0, c0 + ln)
            if not ok:
                return BAD_INTEGER
            fl[FL_INT + k] = v
    return OK


@njit(cache=True, inline="always")
def _row_indices(buf, n_bytes, fl, sel, conj, int_mode, pdata, poff, pword, mask, seed, int_table, scratch, out, o,
                 src, batch):
    """Write the hashed indices of a good line's tokens (fields in ``sel`` order, then the
    conjunctions; empty fields have none) at out[o:]; src[t] = the source of token t (j for
    field sel[j], len(sel) + j for conjunction j). Returns the number of tokens.

    Integers in the table's range are looked up (``build_int_table``), categorical values of
    8 bytes (Criteo's usual) hashed together after the loop (``murmur3_32_words8``; ``batch``
    of shape (WORDS8_ROWS, len(sel))), other categorical values hashed in place
    (``murmur3_32_prefixed``), other tokens written to ``scratch`` and hashed."""
    n = 0
    nb = 0
    for j in range(sel.shape[0]):
        f = sel[j]
        ln = fl[FL_LEN + f + 1]
        if f < N_INT:  # no branch on emptiness: an empty field's entry is written, then overwritten
            v = fl[FL_INT + f]  # (stale when empty)
            if INT_TABLE_LO <= v < INT_TABLE_HI:
                k = np.int64(int_table[f, v - INT_TABLE_LO])
            elif ln > 0:
                pos = _write_token(f, buf, fl, int_mode, pdata, poff, scratch, 0)
                k = murmur3_32(scratch, 0, pos, seed) & mask
            else:
                k = np.int64(0)
        else:
            s = fl[f + 1]
            w = pword[f]
            if (ln == 8 or ln == 0) and s + 8 <= n_bytes:  # batched (an empty field's entry is overwritten)
                batch[0, nb] = load_u32(buf, s)
                batch[1, nb] = load_u32(buf, s + 4)
                batch[2, nb] = w & 0xFFFFFFFF
                batch[3, nb] = (w >> 32) == 4
                batch[4, nb] = j
                nb += ln == 8
                continue
            if ln == 0:
                continue
            k = murmur3_32_prefixed(w & 0xFFFFFFFF, w >> 32, buf, s, ln, seed, n_bytes) & mask
        out[o + n] = k
        src[n] = j
        n += ln > 0
    if nb > 0:
        murmur3_32_words8(batch, nb, seed, mask, out, o + n)
        for i in range(nb):
            src[n + i] = batch[4, i]
        n += nb
    for j in range(conj.shape[0]):
        a = conj[j, 0]
        b = conj[j, 1]
        if fl[FL_LEN + a + 1] == 0 or fl[FL_LEN + b + 1] == 0:
            continue
        pos = _write_token(a, buf, fl, int_mode, pdata, poff, scratch, 0)
        scratch[pos] = 94  # '^'
        pos = _write_token(b, buf, fl, int_mode, pdata, poff, scratch, pos + 1)
        out[o + n] = murmur3_32(scratch, 0, pos, seed) & mask
        src[n] = sel.shape[0] + j
        n += 1
    return n


@njit(cache=True)
def parse_criteo_block(
    buf, n_bytes, max_line, sel, int_mode, conj, pdata, poff, pword, mask, seed, int_table, seps, tmp,
    status, line_start, line_len, labels, indptr, indices, values, row_multi, scratch,
    groups, sel_group, conj_group, entry_group,
):
    """Parse buf[:n_bytes]. Returns (n_lines, n_rows, nnz).

    sel: int64 feature field ids in token order; int_mode 0 = log_squared, 1 = identity;
    conj: int64 (C, 2) field id pairs; pdata, poff from ``field_prefixes``, pword from ``prefix_words``;
    mask = 2^bits - 1; int_table from ``build_int_table``; seps sized by ``count_separators`` + 1;
    tmp at least as long as the longest row.
    Group map (``pipeline.groups``): sel_group[j] / conj_group[j] (uint8) are the groups of the
    tokens of field sel[j] / conjunction j; entry_group (uint8, per non-zero) gets the smallest
    group of each entry's tokens; groups (uint8, 2^bits entries, or empty for none) gets
    groups[i] = min(groups[i], g) for every entry (i, g) of a good line.
    Output arrays are sized by the caller (status/line_* per line, labels/indptr/row_multi per
    row, indices/values per non-zero).
    """
    fl = np.zeros(FL_SIZE, dtype=np.int64)
    tok_group = np.concatenate((sel_group, conj_group))
    src = np.zeros(sel.shape[0] + conj.shape[0], dtype=np.int64)
    batch = np.zeros((WORDS8_ROWS, max(sel.shape[0], 1)), dtype=np.uint32)
    row_group = np.zeros(sel.shape[0] + conj.shape[0], dtype=np.uint8)  # group of each token of the row
    track = groups.shape[0] > 0
    n_seps, non_ascii = find_separators(buf, n_bytes, seps)
    ks = 0
    n_lines = 0
    n_rows = 0
    nnz = 0
    indptr[0] = 0
    p = 0
    while p < n_bytes:
        ks, e, nxt, nf = _walk_line(buf, n_bytes, seps, n_seps, ks, p, fl)
        li = n_lines
        n_lines += 1
        line_start[li] = p
        line_len[li] = e - p
        st = _line_status(buf, p, e, nf, max_line, non_ascii, fl)
        status[li] = st
        if st == OK:
            labels[n_rows] = 1.0 if buf[p] == 49 else 0.0
            r0 = nnz
            n = _row_indices(buf, n_bytes, fl, sel, conj, int_mode, pdata, poff, pword, mask, seed, int_table, scratch,
                             indices, r0, src, batch)
            for t in range(n):
                row_group[t] = tok_group[src[t]]
            nnz += n
            raw = nnz
            nnz = _sort_count_row(indices, values, r0, raw, tmp, row_group, entry_group)
            row_multi[n_rows] = nnz != raw
            n_rows += 1
            indptr[n_rows] = nnz
        p = nxt
    if track:
        lower_groups(groups, indices, entry_group, 0, nnz)
    return n_lines, n_rows, nnz
