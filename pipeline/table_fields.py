"""A table spec's fields on a batch of Arrow columns: each field becomes a small *token table*
(each distinct token's bytes and hashed index) and, per row, ids into it (a ``Part``). A
categorical column is dictionary-encoded (a Parquet column read as a dictionary keeps its own,
reduced to the entries the batch uses when it is large; an integer column's distinct values are
found by a hash table), so each distinct value of a batch is formatted and hashed once, not once
per row; a numeric column's distinct buckets likewise. The parts of a batch write their counts
and ids into shared arrays (``Out``), read from Arrow's buffers without copies. The rules are
``pipeline.table_spec``'s; ``pipeline.table_kernel`` crosses and assembles the parts. No pyspark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numba import njit

from terascale.pipeline.arrow_arrays import filled, from_numpy, numpy_type, valid_mask
from terascale.pipeline.arrow_arrays import values as values_of
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


class Flat:
    """A flat array that a batch's parts append to in order (their ``ids`` or their ``vals``),
    so the parts' arrays end up back to back without a final concatenation. ``room(k)`` is the
    next k slots to write into, ``commit(k)`` appends the first k of them and returns them.
    Growing copies the array: a part's earlier view keeps its (equal) values."""

    def __init__(self, dtype, capacity: int):
        self.buf = np.empty(max(capacity, 1), dtype)
        self.size = 0

    def room(self, k: int) -> np.ndarray:
        if self.size + k > self.buf.shape[0]:
            grown = np.empty(max(2 * self.buf.shape[0], self.size + k), self.buf.dtype)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        return self.buf[self.size : self.size + k]

    def commit(self, k: int) -> np.ndarray:
        self.size += k
        return self.buf[self.size - k : self.size]

    def append(self, a: np.ndarray) -> np.ndarray:
        self.room(a.shape[0])[:] = a
        return self.commit(a.shape[0])

    def array(self) -> np.ndarray:
        return self.buf[: self.size]


@dataclass
class Out:
    """Where a part writes: ``cnt`` its row of the batch's counts (int32, one per row), ``ids``
    and ``vals`` the batch's flat int32 ids and float32 values."""

    cnt: np.ndarray
    ids: Flat
    vals: Flat

    def part(self, cnt: np.ndarray, ids: np.ndarray, vals: np.ndarray | None, table: tuple, bad: np.ndarray | None
             ) -> Part:
        """The Part of arrays computed elsewhere, copied into this output."""
        if ids.shape[0] and ids.max() >= np.iinfo(self.ids.buf.dtype).max:
            raise ValueError("a field or cross with too many distinct tokens in one batch; use smaller batches")
        self.cnt[:] = cnt
        return Part(self.cnt, self.ids.append(ids), None if vals is None else self.vals.append(vals), *table, bad)


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
    """uint8 data and offsets (int32, or int64 for a large type) of a string or binary array,
    not copied; a null's range is arbitrary (often empty)."""
    n = len(arr)
    bufs = arr.buffers()
    if n == 0 or bufs[1] is None:
        return np.zeros(0, np.uint8), np.zeros(1, np.int64)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    off = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32, count=n + 1 + arr.offset)[arr.offset:]
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
        codes = filled(arr.indices, 0).astype(np.int64, copy=False)
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
    """Which entries of a string or binary array are empty or null."""
    _, off = _string_buffers(d)
    empty = off[1:] == off[:-1]
    if d.null_count:
        empty |= ~valid_mask(d)
    return empty


_NO_BITS = np.zeros(0, np.uint8)


def _validity(arr: pa.Array) -> tuple[np.ndarray, int]:
    """The validity bitmap of ``arr`` (uint8, not copied) and the bit of its first element; -1
    when it has no nulls. Element r is valid when bit ``first + r`` (LSB first) is set."""
    if arr.null_count == 0:
        return _NO_BITS, -1
    return np.frombuffer(arr.buffers()[0], np.uint8), arr.offset


@njit(cache=True, inline="always")
def _is_valid(bits, first, r):
    return first < 0 or (bits[(first + r) >> 3] >> ((first + r) & 7)) & 1 == 1


@njit(cache=True)
def _dict_rows(idx, bits, first, entry, miss, cnt, ids, bad):
    """Rows of dictionary indices ``idx`` (validity ``bits``/``first``): a null has no token,
    else ``entry[idx[r]]`` is its token id (-1: none; -2: none, and bad[r] = INVALID_UTF8); with
    ``miss`` >= 0 a row without a token gets id ``miss``. Writes cnt (0/1 per row) and the ids
    (room for one per row); returns their number, or -1 when an index is out of the dictionary."""
    m = entry.shape[0]
    if m == 0:
        entry = np.full(1, -1, entry.dtype)
    w = 0
    out_of_range = False
    for r in range(idx.shape[0]):  # branch-free but for the rare -2
        valid = _is_valid(bits, first, r)
        k = np.int64(idx[r])
        out_of_range |= valid and (k < 0 or k >= m)
        e = entry[min(max(k, 0), max(m - 1, 0))] if valid else -1
        if e == -2:
            bad[r] = INVALID_UTF8
            e = -1
        e = miss if e < 0 else e
        ids[w] = e
        has = e >= 0
        w += has
        cnt[r] = has
    return -1 if out_of_range else w


@njit(cache=True)
def _mark_used(idx, bits, first, live, used):
    """used[k] for each dictionary entry k that a valid element refers to, when live[k];
    returns the number of such entries."""
    m = live.shape[0]
    c = 0
    for r in range(idx.shape[0]):
        if _is_valid(bits, first, r):
            k = idx[r]
            if k >= 0 and k < m and live[k] and not used[k]:
                used[k] = True
                c += 1
    return c


_FIB = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: multiplicative hashing


@njit(cache=True)
def _int_rows(x, bits, first, miss, cnt, ids, firsts):
    """Rows of integers ``x`` (validity ``bits``/``first``): the distinct values are numbered in
    order of first appearance (``firsts[j]``: the row of value j's first appearance), found
    with an open-addressing hash table (linear probing, at most a quarter full, each slot a
    (value, number) pair); a valid row's token id is its value's number, a null has none, or
    with ``miss`` the id after the last number. Writes cnt (0/1 per row) and the ids (room for
    one per row); returns (ids written, distinct values)."""
    cap = 1024
    shift = np.uint64(64 - 10)
    tab = np.full(2 * cap, -1, np.int64)
    k = 0
    w = 0
    nulls = False
    for r in range(x.shape[0]):
        if not _is_valid(bits, first, r):
            nulls = True
            ids[w] = -1
            w += miss
            cnt[r] = miss
            continue
        v = np.int64(x[r])
        h = np.int64((np.uint64(v) * np.uint64(_FIB)) >> shift)
        while True:
            s = tab[2 * h + 1]
            if s < 0:
                tab[2 * h] = v
                tab[2 * h + 1] = k
                firsts[k] = r
                s = k
                k += 1
                if 4 * k > cap:
                    cap *= 2
                    shift -= np.uint64(1)
                    tab = np.full(2 * cap, -1, np.int64)
                    for j in range(k):
                        u = np.int64(x[firsts[j]])
                        g = np.int64((np.uint64(u) * np.uint64(_FIB)) >> shift)
                        while tab[2 * g + 1] >= 0:
                            g = (g + 1) & (cap - 1)
                        tab[2 * g] = u
                        tab[2 * g + 1] = j
                break
            if tab[2 * h] == v:
                break
            h = (h + 1) & (cap - 1)
        ids[w] = s
        w += 1
        cnt[r] = 1
    if miss and nulls:
        for j in range(w):
            if ids[j] < 0:
                ids[j] = k
    return w, k


@njit(cache=True)
def _code_rows(codes, miss, cnt, ids):
    """Rows of one token id each (``codes``, -1: none; with ``miss`` >= 0 a row without one
    gets id ``miss``): writes cnt (0/1 per row) and the ids; returns their number."""
    w = 0
    for r in range(codes.shape[0]):
        e = codes[r]
        if e < 0:
            e = miss
        if e >= 0:
            ids[w] = e
            w += 1
            cnt[r] = 1
        else:
            cnt[r] = 0
    return w


@njit(cache=True)
def _number_rows(x, bits, first, miss, cnt, ids, vals, bad):
    """Rows of float64 numbers ``x`` (validity ``bits``/``first``), one token (id 0) with value
    float32(x) when x is finite, its float32 is finite and x != 0; NaN, +-inf or beyond float32
    sets bad[r] = BAD_NUMERIC; with ``miss`` a row without a token gets id 1, value 1. Writes
    cnt (0/1 per row), the ids and vals (room for one per row); returns (ids written, bad rows)."""
    w = 0
    nbad = 0
    for r in range(x.shape[0]):
        c = 0
        if _is_valid(bits, first, r):
            v = x[r]
            v32 = np.float32(v)
            if not (np.isfinite(v) and np.isfinite(v32)):
                bad[r] = BAD_NUMERIC
                nbad += 1
            elif v != 0.0:
                ids[w] = 0
                vals[w] = v32
                w += 1
                c = 1
        if c == 0 and miss:
            ids[w] = 1
            vals[w] = np.float32(1.0)
            w += 1
            c = 1
        cnt[r] = c
    return w, nbad


# ---------------------------------------------------------------------------------------------
# Per-row selection of elements (multi, map) with a cap


@njit(cache=True)
def _select(offsets, keep, cap, truncate, row_bad, bad_code, cnt, sel):
    """Per row, the positions of its kept elements (in order) into ``sel``; ``cnt`` their count.
    More than ``cap`` (> 0): the first ``cap`` (``truncate``) or ``row_bad`` = ``bad_code``."""
    n = offsets.shape[0] - 1
    w = 0
    if cap <= 0:  # every kept element, branch-free (sel has room for one more)
        for r in range(n):
            w0 = w
            for j in range(offsets[r], offsets[r + 1]):
                sel[w] = j
                w += keep[j]
            cnt[r] = w - w0
        return w
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
        offs = arr.offsets.to_numpy()  # of a slice: its own, into the unsliced entries
        start = int(offs[0])
        entries = arr.values.slice(start, int(offs[-1]) - start)
        arr = pa.ListArray.from_arrays(from_numpy(offs - start), entries, mask=arr.is_null() if arr.null_count else None)
    lens = filled(pc.list_value_length(arr), 0)
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
    return filled(as_float64(arr), 0.0), valid


def as_float64(arr: pa.Array) -> pa.Array:
    """A numeric column as float64, each value rounded as Python's float() rounds it: integers
    beyond 2^53 round (no error), decimals go through their text (Arrow's direct cast is not
    correctly rounded)."""
    if pa.types.is_decimal(arr.type):
        return arr.cast(pa.string()).cast(pa.float64())
    return arr.cast(pa.float64(), safe=False)


def _single(f: Field, codes: np.ndarray, table: tuple, bad: np.ndarray | None, out: Out) -> Part:
    """A field of at most one token per row: ``codes`` (-1 = none) into ``table``; with the
    missing token, a row without a token gets the table's last entry."""
    data, off, index = table
    miss = len(index) - 1 if f.missing == "token" else -1
    w = _code_rows(codes, miss, out.cnt, out.ids.room(codes.shape[0]))
    return Part(out.cnt, out.ids.commit(w), None, data, off, index, bad)


def categorical_part(f: Field, arr: pa.Array, seed: int, mask: int, out: Out) -> Part:
    t = arr.type
    if pa.types.is_integer(t):
        return _integer_part(f, arr, seed, mask, out)
    if not pa.types.is_dictionary(t):
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_boolean(t) or pa.types.is_date32(t)
                or pa.types.is_date64(t)):
            raise SchemaError(f"type {t} cannot be categorical")
        arr = pc.dictionary_encode(arr)  # each distinct value formatted once
    return _dictionary_part(f, arr, seed, mask, out)


def _dictionary_part(f: Field, arr: pa.DictionaryArray, seed: int, mask: int, out: Out) -> Part:
    """A dictionary-encoded categorical column. When the dictionary is large beside the batch (a
    column chunk's whole dictionary) it is reduced to the entries the batch uses, so only those
    are formatted and hashed. Empty strings are missing."""
    n = len(arr)
    dictionary, binary = _dictionary_text(arr.dictionary)
    ind = arr.indices
    idx = values_of(ind, numpy_type(ind.type))
    bits, first = _validity(ind)
    live = ~_empty(dictionary)
    m = len(dictionary)
    used = None
    if m > max(1024, n // 4):
        used = np.zeros(m, np.bool_)
        if 2 * _mark_used(idx, bits, first, live, used) > m:
            used = None  # most entries are used: taking them would cost more than it saves
    if used is not None:
        rows = np.flatnonzero(used)  # the table's entries: dictionary entries, ascending
        dictionary = dictionary.take(from_numpy(rows))
        entry = np.full(m, -1, np.int64)
        entry[rows] = np.arange(rows.shape[0])
    else:
        rows = np.arange(m)
        entry = np.where(live, rows, -1)
    data, off, index, ok = _table(f"{f.name}=".encode(), dictionary, seed, mask, f.missing == "token", binary)
    bad = None
    if ok is not None and not ok.all():
        hit = rows[~ok]
        hit = hit[entry[hit] >= 0]
        if hit.shape[0]:
            entry[hit] = -2
            bad = np.zeros(n, np.int8)
    miss = len(index) - 1 if f.missing == "token" else -1
    w = _dict_rows(idx, bits, first, entry, miss, out.cnt, out.ids.room(n), _NO_BAD if bad is None else bad)
    if w < 0:
        raise ValueError(f"field {f.name!r}: a dictionary index beyond its dictionary")
    return Part(out.cnt, out.ids.commit(w), None, data, off, index, bad)


_NO_BAD = np.zeros(0, np.int8)


def _integer_part(f: Field, arr: pa.Array, seed: int, mask: int, out: Out) -> Part:
    """An integer categorical column: each distinct value of the batch formatted once (Arrow's
    cast to string: decimal) and hashed once."""
    n = len(arr)
    x = values_of(arr, numpy_type(arr.type))
    bits, first = _validity(arr)
    firsts = np.empty(n, np.int64)
    missing = f.missing == "token"
    w, k = _int_rows(x, bits, first, missing, out.cnt, out.ids.room(n), firsts)
    text = from_numpy(x[firsts[:k]], arr.type).cast(pa.string())
    data, off, index, _ = _table(f"{f.name}=".encode(), text, seed, mask, missing, False)
    return Part(out.cnt, out.ids.commit(w), None, data, off, index)


def numeric_part(f: Field, arr: pa.Array, seed: int, mask: int, out: Out) -> Part:
    if f.bucketing == "none":
        t = arr.type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)):
            raise SchemaError(f"type {t} cannot be numeric")
        if not pa.types.is_float64(t):
            arr = as_float64(arr)
        n = len(arr)
        data, off, index = _single_table(f.name.encode(), seed, mask)
        if f.missing == "token":
            data, off = _append(data, off, (f.name + MISSING_SUFFIX).encode())
            index = hash_buffers(data, off, seed) & mask
        bad = np.zeros(n, np.int8)
        w, nbad = _number_rows(values_of(arr, np.float64), *_validity(arr), f.missing == "token", out.cnt,
                               out.ids.room(n), out.vals.room(n), bad)
        return Part(out.cnt, out.ids.commit(w), out.vals.commit(w), data, off, index, bad if nbad else None)
    x, valid = numbers(arr)
    finite = np.isfinite(x)
    bad = np.where(valid & ~finite, BAD_NUMERIC, 0).astype(np.int8)
    valid = valid & finite
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
    text = from_numpy(uniq).cast(pa.string())
    data, off, index, _ = _table(f"{f.name}=".encode(), text, seed, mask, f.missing == "token", False)
    return _single(f, codes, (data, off, index), bad, out)


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
    sel = np.empty(int(keep.sum()) + 1, np.int64)
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


def multi_part(f: Field, arr: pa.Array, seed: int, mask: int, out: Out) -> Part:
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
    return out.part(cnt, ids, None, (data, off, index), bad)


def _drop_rows(sel: np.ndarray, offsets: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """The selected positions less those of bad rows (whose count is 0)."""
    if not bad.any():
        return sel
    rows = np.searchsorted(offsets, sel, side="right") - 1
    return sel[bad[rows] == 0]


def map_part(f: Field, arr: pa.Array, seed: int, mask: int, out: Out) -> Part:
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
    return out.part(cnt, ids, vals, (data, off, index), bad)


PARTS = {"categorical": categorical_part, "numeric": numeric_part, "multi": multi_part, "map": map_part}
