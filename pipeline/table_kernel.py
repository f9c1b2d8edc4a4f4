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

from terascale.pipeline.hashing import hash_buffers
from terascale.pipeline.rowkernels import REASON_CODES
from terascale.pipeline.table_fields import PARTS, Part, as_float64, numbers, valid_mask
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
def _rank_sort(bi, m, key, srt):
    """srt[:m] = the positions of bi[:m] in stable ascending order (m <= RANK_SORT_MAX): each
    entry's rank is the number of smaller keys index << 6 | position (unique), padded to a
    multiple of 8 lanes, branch-free."""
    mm = (m + 7) & ~7
    for j in range(m):
        key[j] = (bi[j] << 6) | j
    for j in range(m, mm):
        key[j] = np.int64(1) << 62
    for i in range(m):
        ki = key[i]
        rank = 0
        for j in range(mm):
            rank += np.int64(key[j] < ki)
        srt[rank] = ki & 63


@njit(cache=True)
def _assemble(cnt, ids, istart, tables, tstart, vals, vstart, row_ok, cap, out_ptr, out_idx, out_val, out_multi,
              groups, use_groups):
    """The good rows, compacted: row r takes part p's next cnt[p, r] token ids from ``ids``
    (part p's from ``istart[p]``), each the hashed index ``tables[tstart[p] + id]``, and its
    values from ``vals`` at ``vstart[p]`` (1 when that is -1), in part order. The entries are
    sorted by index (stable: equal indices keep token order) and merged (values summed in
    float64 in token order, then float32). A merged entry's group is its smallest part number
    (at most 254); ``groups`` is lowered to it. Returns the non-zeros written."""
    n_parts, n = cnt.shape
    cur = istart.copy()
    vcur = vstart.copy()
    bi = np.empty(max(cap, RANK_SORT_MAX), np.int64)
    bv = np.empty(cap, np.float32)
    bg = np.empty(cap, np.uint8)
    key = np.empty(max(cap, RANK_SORT_MAX) + 8, np.int64)
    srt = np.empty(max(cap, RANK_SORT_MAX), np.int64)
    w = 0
    k = 0
    for r in range(n):
        m = 0
        for p in range(n_parts):
            c = cnt[p, r]
            if row_ok[r]:
                base = cur[p]
                for j in range(c):
                    bi[m] = tables[tstart[p] + ids[base + j]]
                    bv[m] = vals[vcur[p] + j] if vstart[p] >= 0 else np.float32(1.0)
                    bg[m] = min(p, 254)
                    m += 1
            cur[p] += c
            if vstart[p] >= 0:
                vcur[p] += c
        if not row_ok[r]:
            continue
        if m <= RANK_SORT_MAX:
            # rank of each entry = entries smaller, ties broken by position (stable): unique keys
            # index << 6 | position, padded to a multiple of 8 lanes; branch-free, vectorizes
            _rank_sort(bi, m, key, srt)
        else:
            order = np.argsort(bi[:m], kind="mergesort")
            for i in range(m):
                srt[i] = order[i]
        multi = False
        j = 0
        while j < m:
            q = srt[j]
            ix = bi[q]
            acc = np.float64(bv[q])
            g = bg[q]
            j += 1
            while j < m and bi[srt[j]] == ix:
                acc += np.float64(bv[srt[j]])
                g = min(g, bg[srt[j]])
                j += 1
            v = np.float32(acc)
            out_idx[w] = ix
            out_val[w] = v
            multi = multi or v != np.float32(1.0)
            if use_groups and g < groups[ix]:
                groups[ix] = g
            w += 1
        out_multi[k] = multi
        k += 1
        out_ptr[k] = w
    return w


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
        y = np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=np.float64)
        return y.astype(np.float32), valid
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise SchemaError(f"type {t} cannot be the label (a boolean or a number)")
    x = np.asarray(as_float64(arr).fill_null(np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)
    ok = valid & ((x > 0) | (x == 0) | (x == -1))
    return (x > 0).astype(np.float32), ok


def _weights(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    x, valid = numbers(arr)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    ok = valid & np.isfinite(x32) & (x >= 0)
    return x32, ok


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
    parts: list[Part] = []
    named: dict[str, Part] = {}
    for f in spec.fields:
        p = PARTS[f.kind](f, col[f.name], field_seed(f, seed), mask)
        if p.bad is not None:
            status[(status == 0) & (p.bad != 0)] = p.bad[(status == 0) & (p.bad != 0)]
        parts.append(p)
        named[f.name] = p
    row_ok = status == 0
    projected = np.zeros(n, np.float64)  # every token the row would have, crosses counted before they are built
    for p in parts:
        projected += p.cnt
    for c in spec.crosses:
        projected += np.prod(np.stack([named[x].cnt.astype(np.float64) for x in c]), axis=0)
    status[row_ok & (projected > spec.max_row_features)] = TOO_MANY
    row_ok = status == 0
    for c in spec.crosses:
        p = cross_part([named[x] for x in c], row_ok, seed, mask)
        if p.vals is not None and not np.isfinite(p.vals).all():  # a product beyond float32
            rows_of = np.repeat(np.arange(n), p.cnt)
            hit = np.zeros(n, np.bool_)
            hit[rows_of[~np.isfinite(p.vals)]] = True
            status[hit & row_ok] = BAD_NUMERIC
        parts.append(p)
    row_ok = status == 0
    counts = np.zeros(n, np.int64)
    for p in parts:
        counts += p.cnt
    too_many = row_ok & (counts > spec.max_row_features)
    status[too_many] = TOO_MANY
    row_ok = status == 0
    cnt = np.stack([p.cnt for p in parts]) if parts else np.zeros((0, n), np.int32)
    ids = np.concatenate([p.ids for p in parts] + [np.zeros(0, np.int64)]).astype(np.int64, copy=False)
    istart = np.zeros(len(parts), np.int64)
    np.cumsum([p.ids.shape[0] for p in parts[:-1]], out=istart[1:])
    tables = np.concatenate([p.index for p in parts] + [np.zeros(0, np.int64)]).astype(np.int64, copy=False)
    tstart = np.zeros(len(parts), np.int64)
    np.cumsum([p.index.shape[0] for p in parts[:-1]], out=tstart[1:])
    with_vals = [p.vals for p in parts if p.vals is not None]
    vals = np.concatenate(with_vals + [np.zeros(0, np.float32)]).astype(np.float32, copy=False)
    sizes = np.array([p.vals.shape[0] if p.vals is not None else 0 for p in parts], np.int64)
    vstart = np.where([p.vals is not None for p in parts], np.cumsum(sizes) - sizes, -1).astype(np.int64)
    keep = np.flatnonzero(row_ok)
    nnz = int(counts[keep].sum())
    out_ptr = np.zeros(keep.shape[0] + 1, np.int64)
    idx = np.empty(max(nnz, 1), np.int32)
    val = np.empty(max(nnz, 1), np.float32)
    multi = np.zeros(keep.shape[0], np.bool_)
    use_groups = groups is not None
    with np.errstate(over="ignore"):
        w = _assemble(cnt, ids, istart, tables, tstart, vals, vstart, row_ok, max(int(counts[keep].max(initial=0)), 1), out_ptr, idx,
                      val, multi, groups if use_groups else np.zeros(1, np.uint8), use_groups)
    idx, val = idx[:w], val[:w]
    if not np.isfinite(val).all():  # a summed value beyond float32: the row is bad after all
        lens = np.diff(out_ptr)
        bad_row = np.zeros(keep.shape[0], np.bool_)
        bad_row[np.repeat(np.arange(keep.shape[0]), lens)[~np.isfinite(val)]] = True
        status[keep[bad_row]] = BAD_NUMERIC
        entry_ok = np.repeat(~bad_row, lens)
        idx, val = idx[entry_ok], val[entry_ok]
        out_ptr = np.concatenate([[0], np.cumsum(lens[~bad_row])]).astype(np.int64)
        keep, multi = keep[~bad_row], multi[~bad_row]
    return Rows(labels[keep], weights[keep], out_ptr, idx, val, multi, status)
