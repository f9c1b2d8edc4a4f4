"""The bulk featurizer of a table spec: Arrow columns in, CSR rows out, bit for bit the reference
(``pipeline.table_spec.record_row``).

The fields become parts (``pipeline.table_fields``: each distinct value of a batch hashed once);
a cross hashes each distinct combination of its fields' token ids once; the rows are then
assembled (fields in order, then crosses), sorted and merged by one compiled pass. Arrays and
scalars only below the Arrow layer; no pyspark.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from numba import njit

from terascale.pipeline.arrow_arrays import filled, valid_mask
from terascale.pipeline.hashing import hash_buffers
from terascale.pipeline.rowkernels import REASON_CODES
from terascale.pipeline.table_fields import PARTS, Flat, Out, Part, as_float64, numbers
from terascale.pipeline.table_schema import SchemaError
from terascale.pipeline.table_spec import TableSpec, field_seed

BAD_LABEL = REASON_CODES["bad_label"]
BAD_WEIGHT = REASON_CODES["bad_weight"]
BAD_NUMERIC = REASON_CODES["bad_numeric"]
TOO_MANY = REASON_CODES["too_many_features"]
LABEL, WEIGHT = "__label", "__weight"  # the label's and the weight's columns in a batch
MAX_GROUP = 254


# ---------------------------------------------------------------------------------------------
# Crosses


@njit(cache=True)
def _cross_pairs(cnts, starts, ids, vals, sizes, out_key, out_val, out_cnt, row_ok):
    """Per row, every combination of the k parts' tokens (first part slowest): key = the
    mixed-radix number of the token ids, value = the float32 product in part order."""
    k = cnts.shape[0]
    n = cnts.shape[1]
    dig = np.zeros(k, np.int64)
    w = 0
    for r in range(n):
        total = 1
        for p in range(k):
            total *= cnts[p, r]
        if not row_ok[r]:
            total = 0
        out_cnt[r] = total
        for c in range(total):
            rem = c
            for p in range(k - 1, -1, -1):
                dig[p] = rem % cnts[p, r]
                rem //= cnts[p, r]
            key = np.int64(0)
            v = np.float32(1.0)
            for p in range(k):
                j = starts[p, r] + dig[p]
                key = key * sizes[p] + ids[p, j]
                v = np.float32(v * vals[p, j])
            out_key[w] = key
            out_val[w] = v
            w += 1
    return w


@njit(cache=True)
def _cross_bytes(keys, sizes, datas, offs):
    """Bytes tokA ^ tokB [^ tokC] of each mixed-radix key."""
    k = sizes.shape[0]
    n = keys.shape[0]
    out_off = np.zeros(n + 1, np.int64)
    dig = np.zeros(k, np.int64)
    for i in range(n):
        rem = keys[i]
        ln = k - 1
        for p in range(k - 1, -1, -1):
            dig[p] = rem % sizes[p]
            rem //= sizes[p]
            ln += offs[p, dig[p] + 1] - offs[p, dig[p]]
        out_off[i + 1] = out_off[i] + ln
    out = np.empty(max(out_off[n], 1), np.uint8)
    for i in range(n):
        rem = keys[i]
        for p in range(k - 1, -1, -1):
            dig[p] = rem % sizes[p]
            rem //= sizes[p]
        w = out_off[i]
        for p in range(k):
            if p > 0:
                out[w] = 94  # '^'
                w += 1
            for q in range(offs[p, dig[p]], offs[p, dig[p] + 1]):
                out[w] = datas[p, q]
                w += 1
    return out, out_off


def _pad(arrs: list[np.ndarray], dtype) -> np.ndarray:
    m = max(max(a.shape[0] for a in arrs), 1)
    out = np.zeros((len(arrs), m), dtype)
    for i, a in enumerate(arrs):
        out[i, : a.shape[0]] = a
    return out


def cross_part(parts: list[Part], row_ok: np.ndarray, seed: int, mask: int) -> Part:
    n = row_ok.shape[0]
    cnts = np.stack([p.cnt.astype(np.int64) for p in parts])
    starts = np.zeros_like(cnts)
    for i, p in enumerate(parts):
        starts[i, 1:] = np.cumsum(p.cnt[:-1])
    sizes = np.array([len(p.index) for p in parts], np.int64)
    if float(np.prod(sizes.astype(np.float64))) >= 2.0**62:
        raise ValueError("a cross of fields with too many distinct tokens in one batch; use smaller batches")
    ids = _pad([p.ids.astype(np.int64) for p in parts], np.int64)
    vals = _pad([p.vals if p.vals is not None else np.ones(p.ids.shape[0], np.float32) for p in parts], np.float32)
    total = int(np.where(row_ok, np.prod(cnts, axis=0), 0).sum())
    key = np.empty(max(total, 1), np.int64)
    val = np.empty(max(total, 1), np.float32)
    cnt = np.zeros(n, np.int64)
    w = _cross_pairs(cnts, starts, ids, vals, sizes, key, val, cnt, row_ok)
    key, val = key[:w], val[:w]
    uniq, inv = np.unique(key, return_inverse=True)
    datas = _pad([p.data[: int(p.off[-1])] for p in parts], np.uint8)
    offs = _pad([p.off for p in parts], np.int64)
    data, off = _cross_bytes(uniq, sizes, datas, offs)
    index = hash_buffers(data, off, seed) & mask
    all_one = all(p.vals is None for p in parts)
    return Part(cnt.astype(np.int32), inv.astype(np.int64), None if all_one else val, data, off, index)


# ---------------------------------------------------------------------------------------------
# Assembly


RANK_SORT_MAX = 64  # rows up to this many entries sort by branch-free ranking, longer ones by merge sort


@njit(cache=True)  # not inlined: LLVM vectorizes the ranking loop only in its own function
def _rank_sort(bi, m, key, srt, pad):
    """srt[:m] = the positions of bi[:m] in stable ascending order (m <= RANK_SORT_MAX): each
    entry's rank is the number of smaller keys index << 6 | position (unique), padded with
    ``pad`` (the keys' largest value) to a multiple of 16 lanes, branch-free. ``key``: int32
    when the indices fit 25 bits (twice the lanes of int64), else int64."""
    mm = (m + 15) & ~15
    for j in range(m):
        key[j] = (np.int64(bi[j]) << 6) | j
    for j in range(m, mm):
        key[j] = pad
    for i in range(m):
        ki = key[i]
        rank = np.uint32(0)  # a 32-bit count: numba would widen an int to 64 bits, half the lanes
        for j in range(mm):
            rank = np.uint32(rank + np.uint32(key[j] < ki))
        srt[rank] = ki & 63


TILE_ROWS = 1024  # rows assembled together: their entries (about 12 bytes each) stay in the cache


@njit(cache=True)
def _assemble(cnt, pmax, ids, istart, tables, tstart, vals, vstart, row_ok, tokens, out_ptr, out_idx, out_val,
              out_multi, seen, key, pad):
    """The good rows, compacted: row r takes part p's next cnt[p, r] token ids from ``ids``
    (part p's from ``istart[p]``), each the hashed index ``tables[tstart[p] + id]``, and its
    values from ``vals`` at ``vstart[p]`` (1 when that is -1), in part order. The entries are
    sorted by index (stable: equal indices keep token order) and merged (values summed in
    float64 in token order, then float32). ``tokens[r]``: row r's entries (0 for a bad row, as
    ``_count_rows`` writes them); ``pmax[p]``: part p's largest count in a row.
    ``seen[tstart[p] + id]`` is set for every token of a good row. Returns the non-zeros
    written. ``key`` (RANK_SORT_MAX + 16 entries) and ``pad``: the ranking's keys and their
    largest value (``_rank_sort``).

    Rows go in tiles of TILE_ROWS: part by part, each tile's entries are gathered into a buffer
    (one part's token table is read at a time, and the buffer stays in the cache; row by row,
    30 parts' tables competed for it), each row's slots followed by one spare slot; then each
    row of the tile is sorted and merged. A part of at most one token a row is gathered without
    branches: every row writes its next slot (its spare one when it has no token or is bad) and
    moves on by its count, ids and values read at a position clamped to the part's last."""
    n_parts, n = cnt.shape
    t_cap = 0
    for a in range(0, n, TILE_ROWS):
        b = min(a + TILE_ROWS, n)
        t_cap = max(t_cap, tokens[a:b].sum() + (b - a))
    bi = np.empty(max(t_cap, RANK_SORT_MAX), np.int32)  # a row's entries: at most its tile's
    srt = np.empty(max(t_cap, RANK_SORT_MAX), np.int64)
    tile_idx = np.empty(max(t_cap, 1), np.int32)
    tile_val = np.empty(max(t_cap, 1), np.float32)
    start = np.empty(TILE_ROWS + 1, np.int64)
    cur = np.empty(TILE_ROWS, np.int64)
    iend = np.empty(n_parts, np.int64)  # one past each part's last id
    for p in range(n_parts):
        iend[p] = istart[p + 1] if p + 1 < n_parts else ids.shape[0]
    ci = istart.copy()
    cv = vstart.copy()
    w = 0
    k = 0
    for a in range(0, n, TILE_ROWS):
        b = min(a + TILE_ROWS, n)
        start[0] = 0
        for r in range(a, b):
            start[r - a + 1] = start[r - a] + tokens[r] + 1
            cur[r - a] = start[r - a]
        for p in range(n_parts):
            i = ci[p]
            t0 = tstart[p]
            v = cv[p]
            if pmax[p] == 0:
                continue
            if pmax[p] == 1:  # branch-free: ids and values read at a clamped position
                last = iend[p] - 1
                dv = v - i  # a value's position = its id's + dv
                for r in range(a, b):
                    c = cnt[p, r]
                    ok = np.int64(row_ok[r])
                    q = cur[r - a]
                    j = min(i, last)
                    e = t0 + ids[j]
                    tile_idx[q] = tables[e]
                    seen[e] |= (c & ok) != 0
                    tile_val[q] = vals[j + dv] if v >= 0 else np.float32(1.0)
                    cur[r - a] = q + c * ok
                    i += c
                ci[p] = i
                if v >= 0:
                    cv[p] = i + dv
                continue
            for r in range(a, b):
                c = cnt[p, r]
                if row_ok[r]:
                    q = cur[r - a]
                    for j in range(c):
                        e = t0 + ids[i + j]
                        tile_idx[q + j] = tables[e]
                        seen[e] = True
                    if v >= 0:
                        for j in range(c):
                            tile_val[q + j] = vals[v + j]
                    else:
                        for j in range(c):
                            tile_val[q + j] = np.float32(1.0)
                    cur[r - a] = q + c
                i += c
                if v >= 0:
                    v += c
            ci[p] = i
            cv[p] = v
        for r in range(b - a):
            if not row_ok[a + r]:
                continue
            s = start[r]
            m = tokens[a + r]
            for j in range(m):
                bi[j] = tile_idx[s + j]
            if m <= RANK_SORT_MAX:
                # rank of each entry = entries smaller, ties broken by position (stable): unique keys
                # index << 6 | position, padded to a multiple of 16 lanes; branch-free, vectorizes
                _rank_sort(bi, m, key, srt, pad)
            else:
                order = np.argsort(bi[:m], kind="mergesort")
                for j in range(m):
                    srt[j] = order[j]
            dup = False
            for j in range(1, m):
                dup |= bi[srt[j]] == bi[srt[j - 1]]
            multi = False
            if not dup:  # the usual row: no index twice, nothing to sum
                for j in range(m):
                    q = srt[j]
                    x = tile_val[s + q]
                    out_idx[w + j] = bi[q]
                    out_val[w + j] = x
                    multi |= x != np.float32(1.0)
                w += m
                out_multi[k] = multi
                k += 1
                out_ptr[k] = w
                continue
            j = 0
            while j < m:
                q = srt[j]
                ix = bi[q]
                acc = np.float64(tile_val[s + q])
                j += 1
                while j < m and bi[srt[j]] == ix:
                    acc += np.float64(tile_val[s + srt[j]])
                    j += 1
                v = np.float32(acc)
                out_idx[w] = ix
                out_val[w] = v
                multi = multi or v != np.float32(1.0)
                w += 1
            out_multi[k] = multi
            k += 1
            out_ptr[k] = w
    return w


@njit(cache=True)
def _lower_groups(seen, tables, tstart, groups):
    """groups[index] lowered to p (at most MAX_GROUP) for each token of part p a good row used
    (``seen``): a bucket's group is the smallest part number among the tokens hashed into it,
    found once per distinct token of the batch, not once per entry."""
    n_parts = tstart.shape[0]
    for p in range(n_parts):
        end = tstart[p + 1] if p + 1 < n_parts else tables.shape[0]
        g = min(p, MAX_GROUP)
        for e in range(tstart[p], end):
            if seen[e]:
                ix = tables[e]
                if g < groups[ix]:
                    groups[ix] = g


@dataclass
class Rows:
    """A batch's good rows as CSR (``multi``: the row has a value other than 1) with their
    labels and weights; ``status`` a reason code per input row (0: a row of the output)."""

    labels: np.ndarray
    weights: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    multi: np.ndarray
    status: np.ndarray


def _labels(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    t = arr.type
    valid = valid_mask(arr)
    if pa.types.is_boolean(t):
        y = filled(arr, False).astype(np.float64)
        return y.astype(np.float32), valid
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise SchemaError(f"type {t} cannot be the label (a boolean or a number)")
    x = filled(as_float64(arr), np.nan)
    ok = valid & ((x > 0) | (x == 0) | (x == -1))
    return (x > 0).astype(np.float32), ok


def _weights(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    x, valid = numbers(arr)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    ok = valid & np.isfinite(x32) & (x >= 0)
    return x32, ok


@njit(cache=True)
def _first_reason(status, bad):
    """status[r] = bad[r] where the row has no reason yet."""
    for r in range(status.shape[0]):
        if status[r] == 0 and bad[r] != 0:
            status[r] = bad[r]


@njit(cache=True)
def _projected_too_many(cnt, n_fields, crosses, limit, status):
    """status[r] = TOO_MANY for each row without a reason whose projected tokens exceed
    ``limit``: in float64, the fields' counts (cnt's first n_fields rows) summed in order, then
    per cross (a row of field numbers, -1 padded) the product of its fields' counts."""
    for r in range(status.shape[0]):
        if status[r] != 0:
            continue
        s = 0.0
        for p in range(n_fields):
            s += np.float64(cnt[p, r])
        for c in range(crosses.shape[0]):
            v = np.float64(cnt[crosses[c, 0], r])
            for j in range(1, crosses.shape[1]):
                if crosses[c, j] >= 0:
                    v *= np.float64(cnt[crosses[c, j], r])
            s += v
        if s > limit:
            status[r] = TOO_MANY


@njit(cache=True)
def _count_rows(cnt, limit, status, tokens, pmax):
    """status[r] = TOO_MANY for each row without a reason with more than ``limit`` tokens (all
    parts); tokens[r] = the row's tokens, 0 for a row with a reason; returns their sum.
    pmax[p] = part p's largest count in a row (any row). The counts are summed part by part
    (rows contiguous: the loop vectorizes)."""
    n = status.shape[0]
    for r in range(n):
        tokens[r] = 0
    for p in range(cnt.shape[0]):
        hi = np.int32(0)
        for r in range(n):
            tokens[r] += cnt[p, r]
            hi = max(hi, cnt[p, r])
        pmax[p] = hi
    total = 0
    for r in range(n):
        if status[r] != 0:
            tokens[r] = 0
        elif tokens[r] > limit:
            status[r] = TOO_MANY
            tokens[r] = 0
        else:
            total += tokens[r]
    return total


@njit(cache=True)
def _all_finite(x):
    """Whether every float32 of x is finite: no exponent field all ones (a max of integers,
    which vectorizes)."""
    u = x.view(np.uint32)
    e = np.uint32(0)
    for i in range(u.shape[0]):
        e = max(e, u[i] & np.uint32(0x7F800000))
    return e != np.uint32(0x7F800000)


def _capacity(spec: TableSpec, col: dict, n: int) -> tuple[int, int]:
    """Likely totals of the fields' ids and values: one per row for a single-token field, for
    a multi or map field its elements plus one per row (a missing token)."""
    n_ids, n_vals = 0, 0
    for f in spec.fields:
        arr = col[f.name]
        if f.kind in ("multi", "map") and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
                                           or pa.types.is_map(arr.type)):
            k = n + max(arr.offsets[-1].as_py() - arr.offsets[0].as_py(), 0) if len(arr) else 0
        else:
            k = n
        n_ids += k
        if (f.kind == "numeric" and f.bucketing == "none") or f.kind == "map":
            n_vals += k
    return n_ids, n_vals


def featurize_batch(spec: TableSpec, bits: int, seed: int, batch: pa.RecordBatch | pa.Table,
                    groups: np.ndarray | None = None) -> Rows:
    """The rows of a batch whose columns are ``__label``, optionally ``__weight``, and one column
    per field named as the field; ``groups`` (a group map, ``pipeline.groups``) is lowered for
    the good rows' tokens."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else pa.RecordBatch.from_pylist([], batch.schema)
    n = batch.num_rows
    mask = (1 << bits) - 1
    col = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    status = np.zeros(n, np.int8)
    labels, ok = _labels(col[LABEL])
    status[~ok] = BAD_LABEL
    if WEIGHT in col:
        weights, wok = _weights(col[WEIGHT])
        status[(status == 0) & ~wok] = BAD_WEIGHT
    else:
        weights = np.ones(n, np.float32)
    n_fields = len(spec.fields)
    cnt = np.empty((n_fields + len(spec.crosses), n), np.int32)  # part i's counts: row i
    ids_cap, vals_cap = _capacity(spec, col, n)
    ids_out, vals_out = Flat(np.int32, ids_cap), Flat(np.float32, vals_cap)  # the parts' ids and values, in part order
    parts: list[Part] = []
    named: dict[str, int] = {}
    for i, f in enumerate(spec.fields):
        p = PARTS[f.kind](f, col[f.name], field_seed(f, seed), mask, Out(cnt[i], ids_out, vals_out))
        if p.bad is not None:
            _first_reason(status, p.bad)
        parts.append(p)
        named[f.name] = i
    if spec.crosses:
        crosses = np.full((len(spec.crosses), 3), -1, np.int64)
        for j, c in enumerate(spec.crosses):
            crosses[j, : len(c)] = [named[x] for x in c]
        _projected_too_many(cnt, n_fields, crosses, spec.max_row_features, status)
        row_ok = status == 0
        for j, c in enumerate(spec.crosses):
            p = cross_part([parts[named[x]] for x in c], row_ok, seed, mask)
            if p.vals is not None and not np.isfinite(p.vals).all():  # a product beyond float32
                rows_of = np.repeat(np.arange(n), p.cnt)
                hit = np.zeros(n, np.bool_)
                hit[rows_of[~np.isfinite(p.vals)]] = True
                status[hit & row_ok] = BAD_NUMERIC
            parts.append(Out(cnt[n_fields + j], ids_out, vals_out).part(p.cnt, p.ids, p.vals, (p.data, p.off, p.index), None))
    # without crosses the projected count is the count (sums of int32 counts are exact in float64)
    tokens = np.empty(n, np.int64)
    pmax = np.empty(cnt.shape[0], np.int32)
    nnz = _count_rows(cnt, spec.max_row_features, status, tokens, pmax)
    row_ok = status == 0
    ids = ids_out.array()
    istart = np.zeros(len(parts), np.int64)
    np.cumsum([p.ids.shape[0] for p in parts[:-1]], out=istart[1:])
    tables = np.concatenate([p.index for p in parts] + [np.zeros(0, np.int64)]).astype(np.int32)  # indices < 2^31
    tstart = np.zeros(len(parts), np.int64)
    np.cumsum([p.index.shape[0] for p in parts[:-1]], out=tstart[1:])
    vals = vals_out.array()
    sizes = np.array([p.vals.shape[0] if p.vals is not None else 0 for p in parts], np.int64)
    vstart = np.where([p.vals is not None for p in parts], np.cumsum(sizes) - sizes, -1).astype(np.int64)
    keep = np.flatnonzero(row_ok)
    out_ptr = np.zeros(keep.shape[0] + 1, np.int64)
    idx = np.empty(max(nnz, 1), np.int32)
    val = np.empty(max(nnz, 1), np.float32)
    multi = np.zeros(keep.shape[0], np.bool_)
    seen = np.zeros(tables.shape[0], np.bool_)
    key_type = np.int32 if bits <= 25 else np.int64  # index << 6 | position fits
    key = np.empty(RANK_SORT_MAX + 16, key_type)
    with np.errstate(over="ignore"):
        w = _assemble(cnt, pmax, ids, istart, tables, tstart, vals, vstart, row_ok, tokens, out_ptr, idx, val, multi, seen,
                      key, key_type(np.iinfo(key_type).max))
    if groups is not None:
        _lower_groups(seen, tables, tstart, groups)
    idx, val = idx[:w], val[:w]
    if not _all_finite(val):  # a summed value beyond float32: the row is bad after all
        lens = np.diff(out_ptr)
        bad_row = np.zeros(keep.shape[0], np.bool_)
        bad_row[np.repeat(np.arange(keep.shape[0]), lens)[~np.isfinite(val)]] = True
        status[keep[bad_row]] = BAD_NUMERIC
        entry_ok = np.repeat(~bad_row, lens)
        idx, val = idx[entry_ok], val[entry_ok]
        out_ptr = np.concatenate([[0], np.cumsum(lens[~bad_row])]).astype(np.int64)
        keep, multi = keep[~bad_row], multi[~bad_row]
    return Rows(labels[keep], weights[keep], out_ptr, idx, val, multi, status)
