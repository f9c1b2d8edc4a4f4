"""Row-level numba helpers shared by the format parsers: reasons, UTF-8, numbers, sort+merge,
the group-map update.

Everything here takes arrays and scalars only (no Python objects) so the parsers can inline it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from terascale.pipeline.hashing import is_byte_index, unaligned_load

# Reason codes of a malformed line. 0 is a good line. The names are the public quarantine reasons.
OK = 0
EMPTY_LINE = 1
LINE_TOO_LONG = 2
INVALID_UTF8 = 3
WRONG_FIELD_COUNT = 4
BAD_LABEL = 5
BAD_INTEGER = 6
INDEX_OUT_OF_RANGE = 7
UNPARSABLE = 8
# table rows (pipeline.table_kernel)
BAD_WEIGHT = 9
BAD_NUMERIC = 10
TOO_MANY_FEATURES = 11
BAD_TIME = 12

REASONS = (
    "ok",
    "empty_line",
    "line_too_long",
    "invalid_utf8",
    "wrong_field_count",
    "bad_label",
    "bad_integer",
    "index_out_of_range",
    "unparsable",
    "bad_weight",
    "bad_numeric",
    "too_many_features",
    "bad_time",  # a table row whose time column (featurize.time_column) is null
)
REASON_CODES = {name: code for code, name in enumerate(REASONS)}

# Exact powers of ten in float64 (10^0 .. 10^22), for correctly rounded fast-path parsing.
POW10 = np.array([10.0**k for k in range(23)], dtype=np.float64)


@njit(cache=True, inline="always")
def valid_utf8(buf, start, end):
    """True when buf[start:end] is well-formed UTF-8 (no overlongs, surrogates or > U+10FFFF)."""
    i = start
    while i < end:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            need = 1
            lo, hi = 0x80, 0xBF
        elif 0xE0 <= c <= 0xEF:
            need = 2
            lo = 0xA0 if c == 0xE0 else 0x80
            hi = 0x9F if c == 0xED else 0xBF
        elif 0xF0 <= c <= 0xF4:
            need = 3
            lo = 0x90 if c == 0xF0 else 0x80
            hi = 0x8F if c == 0xF4 else 0xBF
        else:
            return False
        if i + need >= end:  # continuation bytes run past the end
            return False
        b = buf[i + 1]
        if b < lo or b > hi:
            return False
        for j in range(2, need + 1):
            b = buf[i + j]
            if b < 0x80 or b > 0xBF:
                return False
        i += need + 1
    return True


@njit(cache=True, inline="always")
def parse_int(buf, start, end):
    """Parse ``[+-]?[0-9]{1,18}`` in buf[start:end]. Returns (ok, value)."""
    n = end - start
    if n <= 0:
        return False, np.int64(0)
    p = start
    neg = False
    c = buf[p]
    if c == 45 or c == 43:  # '-' '+'
        neg = c == 45
        p += 1
    digits = end - p
    if digits < 1 or digits > 18:
        return False, np.int64(0)
    v = np.int64(0)
    while p < end:
        d = np.int64(buf[p]) - 48
        if d < 0 or d > 9:
            return False, np.int64(0)
        v = v * 10 + d
        p += 1
    return True, -v if neg else v


_ZEROS8 = np.uint64(0x3030303030303030)  # '0' * 8
_NIBBLE_HI = np.uint64(0xF0F0F0F0F0F0F0F0)
_SIXES = np.uint64(0x0606060606060606)
_LANES2 = np.uint64(0x000000FF000000FF)


@njit(cache=True, inline="always")
def parse_int_swar(buf, start, end):
    """:func:`parse_int` (same results) reading up to 8 digits as one 8-byte word, without a
    branch per digit: the digits moved to the word's top bytes behind '0's, checked to be all
    '0'..'9' at once and combined pairwise (2, 4, then 8 digits). Longer values, and values
    whose word would pass the end of buf, go to :func:`parse_int`."""
    n = end - start
    if n <= 0:
        return False, np.int64(0)
    c = buf[start]
    sign = (c == 45) | (c == 43)  # '-' '+'
    p = start + sign
    digits = n - sign
    if digits < 1 or digits > 8 or p + 8 > buf.shape[0]:
        return parse_int(buf, start, end)
    sh = np.uint64(64 - 8 * digits)
    w = (load_u64(buf, p) << sh) | ((_ZEROS8 >> np.uint64(56 - sh)) >> np.uint64(8))
    if (w & _NIBBLE_HI) != _ZEROS8 or ((w + _SIXES) & _NIBBLE_HI) != _ZEROS8:
        return False, np.int64(0)
    x = w - _ZEROS8
    x = x * np.uint64(10) + (x >> np.uint64(8))
    x = (((x & _LANES2) * np.uint64(100 + (1000000 << 32)))
         + (((x >> np.uint64(16)) & _LANES2) * np.uint64(1 + (10000 << 32)))) >> np.uint64(32)
    v = np.int64(x & np.uint64(0xFFFFFFFF))
    return True, -v if c == 45 else v


@njit(cache=True, inline="always")
def parse_float(buf, start, end, pow10):
    """Parse a finite decimal ``[+-]?digits[.digits][(e|E)[+-]?digits]``. Returns (ok, value).

    Up to 19 significant digits are kept. When the decimal exponent is within +-22 and the
    mantissa below 2^53 the result is correctly rounded (one exact IEEE operation); otherwise it
    is within a few ulps, which is far below float32 precision (the stored type).
    """
    p = start
    if p >= end:
        return False, 0.0
    neg = False
    c = buf[p]
    if c == 45 or c == 43:
        neg = c == 45
        p += 1
    mant = np.int64(0)
    sig = 0
    exp10 = 0
    ndig = 0
    while p < end and 48 <= buf[p] <= 57:
        if sig < 19:
            mant = mant * 10 + (np.int64(buf[p]) - 48)
            if mant != 0:
                sig += 1
        else:
            exp10 += 1
        ndig += 1
        p += 1
    if p < end and buf[p] == 46:  # '.'
        p += 1
        while p < end and 48 <= buf[p] <= 57:
            if sig < 19:
                mant = mant * 10 + (np.int64(buf[p]) - 48)
                exp10 -= 1
                if mant != 0:
                    sig += 1
            ndig += 1
            p += 1
    if ndig == 0:
        return False, 0.0
    if p < end and (buf[p] == 101 or buf[p] == 69):  # 'e' 'E'
        p += 1
        eneg = False
        if p < end and (buf[p] == 45 or buf[p] == 43):
            eneg = buf[p] == 45
            p += 1
        if p >= end:
            return False, 0.0
        e = 0
        while p < end and 48 <= buf[p] <= 57:
            if e < 100000:
                e = e * 10 + (buf[p] - 48)
            p += 1
        exp10 += -e if eneg else e
    if p != end:
        return False, 0.0
    if mant == 0:
        v = 0.0
    elif 0 <= exp10 <= 22 and mant < (1 << 53):
        v = np.float64(mant) * pow10[exp10]
    elif -22 <= exp10 < 0 and mant < (1 << 53):
        v = np.float64(mant) / pow10[-exp10]
    elif exp10 > 308 + 19:
        return False, 0.0
    elif exp10 < -400:
        v = 0.0
    else:
        v = np.float64(mant) * (10.0**exp10)
    if not np.isfinite(v):
        return False, 0.0
    return True, -v if neg else v


@njit(cache=True, inline="always")
def write_int(v, out, pos):
    """Write the decimal digits of int64 v at out[pos:]; return the new position."""
    if v < 0:
        out[pos] = 45
        pos += 1
        v = -v
    if v == 0:
        out[pos] = 48
        return pos + 1
    n = 0
    t = v
    while t > 0:
        n += 1
        t //= 10
    q = pos + n - 1
    while v > 0:
        out[q] = 48 + (v % 10)
        v //= 10
        q -= 1
    return pos + n


@njit(cache=True, inline="always")
def sort_merge_row(indices, values, start, end):
    """Sort indices[start:end] ascending; merge duplicates by adding values. Returns new end."""
    for i in range(start + 1, end):
        ki = indices[i]
        kv = values[i]
        j = i - 1
        while j >= start and indices[j] > ki:
            indices[j + 1] = indices[j]
            values[j + 1] = values[j]
            j -= 1
        indices[j + 1] = ki
        values[j + 1] = kv
    if end - start < 2:
        return end
    w = start
    for i in range(start + 1, end):
        if indices[i] == indices[w]:
            values[w] += values[i]
        else:
            w += 1
            indices[w] = indices[i]
            values[w] = values[i]
    return w + 1


@njit(cache=True)
def count_lines(buf, n_bytes):
    """Number of newline bytes in buf[:n_bytes]."""
    c = 0
    for i in range(n_bytes):
        if buf[i] == 10:
            c += 1
    return c


@intrinsic
def prefetch(typingctx, arr, i):
    """Hint the CPU to start loading the cache line of arr[i] (1-D array, no bounds check).

    Random reads of a large table (the group map) miss the cache; issued well before the read
    (``lower_groups``: GROUP_PREFETCH entries ahead), many misses are in flight at once.
    """
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty, ity = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = builder.gep(ary.data, [context.cast(builder, args[1], ity, types.intp)])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.void(arr, i), codegen


@intrinsic
def load_u64(typingctx, arr, i):
    """The 8 bytes arr[i:i+8] of a 1-D uint8 array as a little-endian uint64 (one unaligned
    load; no bounds check: the caller guarantees i + 8 <= len(arr))."""
    if not is_byte_index(arr, i):
        return None
    return types.uint64(arr, i), unaligned_load(64, widen=False)


@intrinsic
def trailing_zeros(typingctx, x):
    """Number of trailing zero bits of an unsigned integer (its bit width for 0)."""
    if not isinstance(x, types.Integer) or x.signed:
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return x(x), codegen


GROUP_PREFETCH = 256  # group-map entries prefetched ahead (chosen by measurement: docs/pages/explanation/design-notes.md)


@njit(cache=True)
def lower_groups(groups, indices, entry_group, start, end):
    """groups[i] = min(groups[i], g) for each entry (i, g) of indices/entry_group[start:end].

    The map (up to 64 MiB) is read at random and its rarely used buckets miss every cache. Done
    in the row loop, each row would wait for its own misses; here, in one tight pass per block
    that prefetches GROUP_PREFETCH entries ahead, many misses are in flight at once.
    """
    ahead = min(end, start + GROUP_PREFETCH)
    for k in range(start, ahead):
        prefetch(groups, indices[k])
    for k in range(start, end):
        if ahead < end:
            prefetch(groups, indices[ahead])
            ahead += 1
        x = indices[k]
        g = entry_group[k]
        if g < groups[x]:
            groups[x] = g
