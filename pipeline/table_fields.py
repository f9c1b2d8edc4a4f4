"""A table spec's fields on a batch of Arrow columns: each field becomes a small *token table*
(each distinct token's bytes and hashed index) and, per row, ids into it (a ``Part``). A
categorical column is dictionary-encoded (a Parquet column read as a dictionary keeps its own,
reduced to the entries the batch uses), so each distinct value of a batch is formatted and
hashed once, not once per row; a numeric column's distinct buckets likewise. The rules are
``pipeline.table_spec``'s; ``pipeline.table_kernel`` crosses and assembles the parts. No pyspark.
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
from terascale.pipeline.table_schema import SchemaError
from terascale.pipeline.table_spec import MISSING_SUFFIX, Field

BAD_NUMERIC = REASON_CODES["bad_numeric"]
TOO_MANY = REASON_CODES["too_many_features"]
INVALID_UTF8 = REASON_CODES["invalid_utf8"]
LOG_BUCKET_MIN = 2.0**62  # a log-bucketed value below minus this is bad_numeric


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
        codes[~valid_mask(arr)] = -1
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


def valid_mask(arr: pa.Array) -> np.ndarray:
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


def numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float64 values and validity of a numeric column (booleans as 0/1)."""
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)):
        raise SchemaError(f"type {t} cannot be numeric")
    valid = valid_mask(arr)
    return as_float64(arr).fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64, copy=False), valid


def as_float64(arr: pa.Array) -> pa.Array:
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
    x, valid = numbers(arr)
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
    x, xvalid = numbers(items)
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
