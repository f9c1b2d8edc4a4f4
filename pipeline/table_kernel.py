"""The bulk featurizer of a table spec: Arrow columns in, CSR rows out, bit for bit the reference
(``pipeline.table_spec.record_row``).

Every field becomes a small *token table* (each distinct token's bytes and hashed index) and,
per row, ids into it: a categorical column is dictionary-encoded (a Parquet column read as a
dictionary keeps its own), so each distinct value of a batch is formatted and hashed once, not
once per row; a numeric column's distinct buckets likewise. A cross hashes each distinct
combination of its fields' token ids once. The rows are then assembled (fields in order, then
crosses), sorted and merged by one compiled pass. Arrays and scalars only below the Arrow
layer; no pyspark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numba import njit

from terascale.pipeline.hashing import hash_buffers
from terascale.pipeline.rowkernels import REASON_CODES, valid_utf8
from terascale.pipeline.table_spec import MISSING_SUFFIX, Field, TableSpec, field_seed
from terascale.solvers.constraints import ConfigError

BAD_LABEL = REASON_CODES["bad_label"]
BAD_WEIGHT = REASON_CODES["bad_weight"]
BAD_NUMERIC = REASON_CODES["bad_numeric"]
TOO_MANY = REASON_CODES["too_many_features"]
INVALID_UTF8 = REASON_CODES["invalid_utf8"]
LABEL, WEIGHT = "__label", "__weight"  # the label's and the weight's columns in a batch
MAX_GROUP = 254
LOG_BUCKET_MIN = 2.0**62  # a log-bucketed value below minus this is bad_numeric


class SchemaError(ConfigError):
    """A column the spec names is missing, or of a type its field cannot take (a usage error:
    the job stops before any Spark work, exit code 2)."""


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _categorical_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _categorical_type(t.value_type)
    return _is_text(t) or pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_date(t)


def type_problem(kind: str, t: pa.DataType) -> str | None:
    """Why a column of Arrow type ``t`` cannot feed a field of ``kind`` (or the label /
    weight: kind ``label`` / ``weight``); None when it can."""
    if kind == "label":
        ok = _is_number(t) or pa.types.is_boolean(t)
        want = "a boolean or a number (0/1, -1/+1 or a click count)"
    elif kind == "weight":
        ok = _is_number(t)
        want = "a number"
    elif kind == "categorical":
        ok = _categorical_type(t)
        want = ("a string, an integer, a boolean or a date (a double or a timestamp: make it numeric with bucketing, "
                "or cast it in an expr)")
    elif kind == "numeric":
        ok = _is_number(t) or pa.types.is_boolean(t)
        want = "a number (a string: cast it in an expr, e.g. expr: cast(price as double))"
    elif kind == "multi":
        ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and _categorical_type(t.value_type)
        want = "an array of strings, integers, booleans or dates"
    else:
        ok = pa.types.is_map(t) and (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)) and (_is_number(t.item_type) or pa.types.is_boolean(t.item_type))
        want = "a map<string, number>"
    return None if ok else f"must be {want}"


def check_schema(spec: TableSpec, schema: pa.Schema, columns: list[tuple[str, str, str]], where: str) -> None:
    """Every (what, column, kind) of ``columns`` is in ``schema`` with a type its kind takes;
    else SchemaError naming the column, its type and ``where`` (the file or table)."""
    for what, col, kind in columns:
        if col not in schema.names:
            close = [n for n in schema.names if n.lower() == col.lower()]
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it has {', '.join(schema.names[:20])}" + (
                ", ..." if len(schema.names) > 20 else "")
            raise SchemaError(f"{what}: column {col!r} is not in {where}{hint}")
        t = schema.field(col).type
        problem = type_problem(kind, t)
        if problem:
            raise SchemaError(f"{what}: column {col!r} of {where} is {t}, which {problem}")


@dataclass
class Part:
    """One field's (or cross's) tokens of a batch: per row ``cnt`` tokens, flat ``ids`` into the
    token table (``data``/``off`` its bytes, ``index`` the hashed indices), ``vals`` their
    float32 values (None: all 1), ``bad`` a reason code per row (0: fine)."""

    cnt: np.ndarray
    ids: np.ndarray
    vals: np.ndarray | None
    data: np.ndarray
    off: np.ndarray
    index: np.ndarray
    bad: np.ndarray | None = None


# ---------------------------------------------------------------------------------------------
# Token tables


@njit(cache=True)
def _prefixed(prefix, data, off, valid):
    """Bytes prefix + data[off[i]:off[i+1]] of each entry (an entry not ``valid`` gets the
    prefix alone; the caller never uses it)."""
    n = off.shape[0] - 1
    out_off = np.zeros(n + 1, np.int64)
    for i in range(n):
        ln = off[i + 1] - off[i] if valid[i] else 0
        out_off[i + 1] = out_off[i] + prefix.shape[0] + ln
    out = np.empty(max(out_off[n], 1), np.uint8)
    for i in range(n):
        p = out_off[i]
        for j in range(prefix.shape[0]):
            out[p + j] = prefix[j]
        p += prefix.shape[0]
        if valid[i]:
            for j in range(off[i], off[i + 1]):
                out[p] = data[j]
                p += 1
    return out, out_off


@njit(cache=True)
def _check_utf8(data, off):
    n = off.shape[0] - 1
    ok = np.ones(n, np.bool_)
    for i in range(n):
        ok[i] = valid_utf8(data, off[i], off[i + 1])
    return ok


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """uint8 data and int64 offsets of a (large_)string/binary array without nulls in its slots' use."""
    arr = arr.cast(pa.large_binary()) if not pa.types.is_large_binary(arr.type) else arr
    bufs = arr.buffers()
    n = len(arr)
    off = np.frombuffer(bufs[1], dtype=np.int64, count=n + 1 + arr.offset)[arr.offset:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return data, off


def _table(prefix: bytes, values: pa.Array, seed: int, mask: int, missing: bool, utf8: bool
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Token table ``prefix + value`` for each distinct value (plus, when ``missing``, the
    missing token last); returns data, offsets, indices and, for binary values, which are valid UTF-8."""
    data, off = _string_buffers(values)
    valid_mask = np.ones(len(values), np.bool_)
    ok = _check_utf8(data, off) if utf8 else None
    tdata, toff = _prefixed(np.frombuffer(prefix, np.uint8), data, off, valid_mask)
    if missing:
        tdata, toff = _append(tdata, toff, prefix[:-1] + MISSING_SUFFIX.encode())
    return tdata, toff, hash_buffers(tdata, toff, seed) & mask, ok


def _append(data: np.ndarray, off: np.ndarray, token: bytes) -> tuple[np.ndarray, np.ndarray]:
    end = int(off[-1])
    data = np.concatenate([data[:end], np.frombuffer(token, np.uint8)])
    return data, np.append(off, end + len(token))


def _single_table(token: bytes, seed: int, mask: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.frombuffer(token, np.uint8).copy()
    off = np.array([0, len(token)], np.int64)
    return data, off, hash_buffers(data, off, seed) & mask


# ---------------------------------------------------------------------------------------------
# Categorical values: distinct values and per-element codes


def _canonical_codes(arr: pa.Array) -> tuple[np.ndarray, pa.Array, bool]:
    """(codes int64 per element, -1 = missing; distinct canonical texts; binary?) of a column of
    categorical values. Empty strings are missing."""
    t = arr.type
    if pa.types.is_dictionary(t):
        codes = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
        codes[~_valid(arr)] = -1
        dictionary, binary = _dictionary_text(arr.dictionary)
        empty = _empty(dictionary)
        if empty.any():
            codes[(codes >= 0) & empty[np.maximum(codes, 0)]] = -1
        return codes, dictionary, binary
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        enc = pc.dictionary_encode(arr)
        return _canonical_codes(enc)
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_date32(t) or pa.types.is_date64(t):
        return _canonical_codes(pc.dictionary_encode(arr))  # each distinct value formatted once
    raise SchemaError(f"type {t} cannot be categorical")


def _dictionary_text(d: pa.Array) -> tuple[pa.Array, bool]:
    """The canonical texts of a dictionary's values (integers in decimal, booleans true/false,
    dates YYYY-MM-DD: Arrow's casts to string) and whether they are raw bytes."""
    t = d.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return d, False
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return d, True
    if pa.types.is_date64(t):
        d = d.cast(pa.date32())
    if pa.types.is_integer(d.type) or pa.types.is_boolean(d.type) or pa.types.is_date32(d.type):
        return d.cast(pa.string()), False
    raise SchemaError(f"type {t} cannot be categorical")


def _empty(d: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(pc.equal(pc.binary_length(d), 0), True).to_numpy(zero_copy_only=False))


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), np.bool_)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))


# ---------------------------------------------------------------------------------------------
# Per-row selection of elements (multi, map) with a cap


@njit(cache=True)
def _select(offsets, keep, cap, truncate, row_bad, bad_code, cnt, sel):
    """Per row, the positions of its kept elements (in order) into ``sel``; ``cnt`` their count.
    More than ``cap`` (> 0): the first ``cap`` (``truncate``) or ``row_bad`` = ``bad_code``."""
    n = offsets.shape[0] - 1
    w = 0
    for r in range(n):
        c = 0
        for j in range(offsets[r], offsets[r + 1]):
            if keep[j]:
                c += 1
        if cap > 0 and c > cap:
            if not truncate:
                if row_bad[r] == 0:
                    row_bad[r] = bad_code
                cnt[r] = 0
                continue
            c = cap
        k = 0
        for j in range(offsets[r], offsets[r + 1]):
            if k == c:
                break
            if keep[j]:
                sel[w] = j
                w += 1
                k += 1
        cnt[r] = c
    return w


def _flat(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Row offsets (a null list has no elements) and the elements of a list or map column."""
    if pa.types.is_map(arr.type):  # a map is a list of (key, value) structs
        arr = pa.ListArray.from_arrays(arr.offsets, arr.values, mask=arr.is_null() if arr.null_count else None)
    lens = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return offsets, pc.list_flatten(arr)


# ---------------------------------------------------------------------------------------------
# Fields


@njit(cache=True)
def _log_buckets(x, valid, out):
    for i in range(x.shape[0]):
        if valid[i]:
            v = x[i]
            out[i] = math.floor(v) if v <= 2 else math.floor(math.log(v) ** 2)


def _numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float64 values and validity of a numeric column (booleans as 0/1)."""
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)):
        raise SchemaError(f"type {t} cannot be numeric")
    valid = _valid(arr)
    return _float64(arr).fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64, copy=False), valid


def _float64(arr: pa.Array) -> pa.Array:
    """A numeric column as float64, each value rounded as Python's float() rounds it: integers
    beyond 2^53 round (no error), decimals go through their text (Arrow's direct cast is not
    correctly rounded)."""
    if pa.types.is_decimal(arr.type):
        return arr.cast(pa.string()).cast(pa.float64())
    return arr.cast(pa.float64(), safe=False)


def _single(f: Field, codes: np.ndarray, vals: np.ndarray | None, table: tuple, bad: np.ndarray | None) -> Part:
    """A field of at most one token per row: ``codes`` (-1 = none) into ``table``; with the
    missing token, a row without a token gets the table's last entry."""
    data, off, index = table
    if f.missing == "token":
        codes = np.where(codes < 0, len(index) - 1, codes)
        if vals is not None:
            vals = np.where(codes == len(index) - 1, np.float32(1), vals).astype(np.float32)
    has = codes >= 0
    return Part(has.astype(np.int32), codes[has], None if vals is None else vals[has], data, off, index, bad)


def _used(codes: np.ndarray, dictionary: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Codes and dictionary reduced to the entries the batch uses, when the dictionary is large
    beside the batch (a column chunk's whole dictionary): only those are formatted and hashed."""
    if len(dictionary) <= max(1024, codes.shape[0] // 4):
        return codes, dictionary
    used, remap = _distinct_ints(codes[codes >= 0])
    out = np.full(codes.shape[0], -1, np.int64)
    out[codes >= 0] = remap
    return out, dictionary.take(pa.array(used))


def categorical_part(f: Field, arr: pa.Array, seed: int, mask: int) -> Part:
    codes, dictionary, binary = _canonical_codes(arr)
    codes, dictionary = _used(codes, dictionary)
    data, off, index, ok = _table(f"{f.name}=".encode(), dictionary, seed, mask, f.missing == "token", binary)
    bad = None
    if ok is not None and not ok.all():
        hit = (codes >= 0) & ~ok[np.maximum(codes, 0)]
        bad = np.where(hit, INVALID_UTF8, 0).astype(np.int8)
        codes = np.where(hit, -1, codes)
    return _single(f, codes, None, (data, off, index), bad)


def numeric_part(f: Field, arr: pa.Array, seed: int, mask: int) -> Part:
    x, valid = _numbers(arr)
    finite = np.isfinite(x)
    bad = np.where(valid & ~finite, BAD_NUMERIC, 0).astype(np.int8)
    valid = valid & finite
    if f.bucketing == "none":
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
        big = valid & ~np.isfinite(x32)
        bad[big] = BAD_NUMERIC
        valid = valid & ~big
        has = valid & (x != 0.0)
        data, off, index = _single_table(f.name.encode(), seed, mask)
        if f.missing == "token":
            data, off = _append(data, off, (f.name + MISSING_SUFFIX).encode())
            index = hash_buffers(data, off, seed) & mask
        codes = np.where(has, 0, -1).astype(np.int64)
        return _single(f, codes, x32, (data, off, index), bad)
    if f.bucketing == "quantile" and not f.boundaries:
        raise ValueError(f"field {f.name!r}: bucketing quantile without learned boundaries (the featurize job "
                         "learns them and writes them into the spec)")
    b = np.zeros(x.shape[0], np.int64)
    if f.bucketing == "log":
        huge = valid & (x < -LOG_BUCKET_MIN)  # floor(x) would not fit an int64
        bad[huge] = BAD_NUMERIC
        valid = valid & ~huge
        _log_buckets(x, valid, b)
    else:
        b = np.searchsorted(np.asarray(f.boundaries, np.float64), x, side="right").astype(np.int64)
    uniq, inv = _distinct_ints(b[valid])
    codes = np.full(x.shape[0], -1, np.int64)
    codes[valid] = inv
    text = pa.array(uniq).cast(pa.string())
    data, off, index, _ = _table(f"{f.name}=".encode(), text, seed, mask, f.missing == "token", False)
    return _single(f, codes, None, (data, off, index), bad)


def _distinct_ints(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(v, return_inverse=True), by a lookup table when the values span a small range
    (bucket numbers: no sort)."""
    if v.shape[0] == 0:
        return v, v
    lo, hi = int(v.min()), int(v.max())
    if hi - lo >= 1 << 16:
        return np.unique(v, return_inverse=True)
    seen = np.zeros(hi - lo + 1, np.bool_)
    seen[v - lo] = True
    uniq = np.flatnonzero(seen)
    code = np.cumsum(seen) - 1
    return uniq + lo, code[v - lo]


def _capped(f: Field, offsets: np.ndarray, keep: np.ndarray, bad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = offsets.shape[0] - 1
    cnt = np.zeros(n, np.int32)
    sel = np.empty(max(int(keep.sum()), 1), np.int64)
    w = _select(offsets, keep, f.max_values, f.overflow == "truncate", bad, TOO_MANY, cnt, sel)
    return cnt, sel[:w]


def _with_missing(f: Field, cnt: np.ndarray, ids: np.ndarray, vals: np.ndarray | None, n_table: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Insert the missing token (id ``n_table - 1``) into the rows without a token."""
    if f.missing != "token" or (cnt > 0).all():
        return cnt, ids, vals
    empty = cnt == 0
    starts = np.zeros(cnt.shape[0] + 1, np.int64)
    np.cumsum(cnt, out=starts[1:])
    pos = starts[:-1][empty]  # insert before the next row's tokens
    ids = np.insert(ids, pos, n_table - 1)
    if vals is not None:
        vals = np.insert(vals, pos, np.float32(1))
    return np.where(empty, 1, cnt).astype(np.int32), ids, vals


def multi_part(f: Field, arr: pa.Array, seed: int, mask: int) -> Part:
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise SchemaError(f"type {arr.type} cannot be multi (an array of strings, integers or booleans)")
    n = len(arr)
    offsets, elems = _flat(arr)
    codes, dictionary, binary = _canonical_codes(elems)
    data, off, index, ok = _table(f"{f.name}=".encode(), dictionary, seed, mask, f.missing == "token", binary)
    bad = np.zeros(n, np.int8)
    keep = codes >= 0
    if ok is not None and not ok.all():
        hit = keep & ~ok[np.maximum(codes, 0)]
        if hit.any():
            rows = np.repeat(np.arange(n), np.diff(offsets))
            bad[np.unique(rows[hit])] = INVALID_UTF8
    cnt, sel = _capped(f, offsets, keep, bad)
    cnt[bad != 0] = 0
    ids = _drop_rows(sel, offsets, bad)
    cnt, ids, _ = _with_missing(f, cnt, codes[ids], None, len(index))
    return Part(cnt, ids, None, data, off, index, bad)


def _drop_rows(sel: np.ndarray, offsets: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """The selected positions less those of bad rows (whose count is 0)."""
    if not bad.any():
        return sel
    rows = np.searchsorted(offsets, sel, side="right") - 1
    return sel[bad[rows] == 0]


def map_part(f: Field, arr: pa.Array, seed: int, mask: int) -> Part:
    if not pa.types.is_map(arr.type):
        raise SchemaError(f"type {arr.type} cannot be map (a map<string, number>)")
    n = len(arr)
    offsets, entries = _flat(arr)
    keys, items = entries.field(0), entries.field(1)
    if not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)):
        raise SchemaError(f"type {arr.type} cannot be map (the keys must be strings)")
    codes, dictionary, _ = _canonical_codes(keys)
    x, xvalid = _numbers(items)
    data, off, index, _ = _table(f"{f.name}=".encode(), dictionary, seed, mask, f.missing == "token", False)
    rows = np.repeat(np.arange(n), np.diff(offsets))
    live = (codes >= 0) & xvalid
    bad = np.zeros(n, np.int8)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    nonfinite = live & ~np.isfinite(x32)
    if nonfinite.any():
        bad[np.unique(rows[nonfinite])] = BAD_NUMERIC
    keep = live & (x != 0.0) & np.isfinite(x32)
    cnt, sel = _capped(f, offsets, keep, bad)
    cnt[bad != 0] = 0
    sel = _drop_rows(sel, offsets, bad)
    cnt, ids, vals = _with_missing(f, cnt, codes[sel], x32[sel], len(index))
    return Part(cnt, ids, vals, data, off, index, bad)


PARTS = {"categorical": categorical_part, "numeric": numeric_part, "multi": multi_part, "map": map_part}


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
    valid = _valid(arr)
    if pa.types.is_boolean(t):
        y = np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=np.float64)
        return y.astype(np.float32), valid
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise SchemaError(f"type {t} cannot be the label (a boolean or a number)")
    x = np.asarray(_float64(arr).fill_null(np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)
    ok = valid & ((x > 0) | (x == 0) | (x == -1))
    return (x > 0).astype(np.float32), ok


def _weights(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    x, valid = _numbers(arr)
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
