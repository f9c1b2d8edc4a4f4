"""Numba kernels of the click-log generator (``pipeline.generate``).

Two kernels, both compiled lazily and cached on disk (``cache=True``):

- :func:`sample_chunk` turns raw 64-bit random words (40 per row) into one chunk of rows:
  integer values, categorical value codes, the planted model's margin and click probability,
  and the label.
- :func:`format_chunk` writes those rows as Criteo TSV lines into a preallocated ``uint8``
  buffer, replacing the rows marked malformed by a malformed line of the requested kind.

Everything here takes arrays and scalars only. All 32-bit hashing is done in int64 with an
explicit mask (``& MASK32``), so numba never mixes signed and unsigned types; the pure-Python
twins in ``pipeline.generate`` (:func:`pipeline.generate.token_weight`) use the very same
formulas and tests check that both agree.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from terascale.pipeline.rowkernels import write_int

MASK32 = 0xFFFFFFFF
WORDS_PER_ROW = 40  # 13 integer fields + 26 categorical fields + 1 label draw
N_INT = 13
N_CAT = 26
MISSING_CODE = -1  # categorical code of a missing value
MISSING_INT = np.iinfo(np.int64).min  # integer value of a missing field
MAX_VALID_LINE = 400  # bytes: 1 + 13 * (1 + 11) + 26 * (1 + 8) + 1 = 392, rounded up
LONG_FIELD_CHARS = 70000  # hex chars of the padded field of a ``line_too_long`` line

# Malformed kinds, in the order of ``pipeline.generate.MALFORMED_KINDS``; -1 = a valid row.
K_WRONG_FIELD_COUNT = 0
K_BAD_INTEGER = 1
K_BAD_LABEL = 2
K_INVALID_UTF8 = 3
K_EMPTY_LINE = 4
K_LINE_TOO_LONG = 5

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8).copy()
_SQRT3 = math.sqrt(3.0)
_INV_2_32 = 1.0 / 4294967296.0
_INV_2_53 = 1.0 / 9007199254740992.0


@njit(cache=True, inline="always")
def fmix32(h):
    """murmur3's 32-bit finalizer (a bijection of [0, 2^32)); h is an int64 in that range."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    h ^= h >> 16
    return h


@njit(cache=True, inline="always")
def gauss32(h):
    """A bell-shaped, zero-mean, unit-variance number from a 32-bit hash (Irwin-Hall, 4 bytes)."""
    s = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255) + 2
    return (s / 256.0 - 2.0) * _SQRT3


@njit(cache=True, inline="always")
def int_bucket(v, table):
    """``pipeline.spec.bucket`` (log_squared): v if v <= 2 else floor(ln(v)^2).

    ``table[v]`` holds the bucket of small v (built with ``pipeline.spec.bucket`` itself).
    """
    if v <= 2:
        return v
    if v < table.shape[0]:
        return np.int64(table[v])
    lg = math.log(v)
    return np.int64(math.floor(lg * lg))


@njit(cache=True, inline="always")
def _pow_quarters(w, q):
    """w ** (q / 4) for an integer q >= 0, with multiplications and square roots only."""
    r = 1.0
    for _ in range(q // 4):
        r *= w
    rem = q % 4
    if rem != 0:
        s = math.sqrt(w)
        if rem == 2:
            r *= s
        else:
            ss = math.sqrt(s)
            r *= ss if rem == 1 else s * ss
    return r


@njit(cache=True, inline="always")
def _ipow(b, k):
    """b ** k for an integer k >= 0 (binary exponentiation)."""
    r = 1.0
    while k > 0:
        if k & 1:
            r *= b
        b *= b
        k >>= 1
    return r


@njit(cache=True)
def sample_chunk(
    raw, int_miss_thr, int_neg_thr, int_scale, int_quarters, int_cap, bucket_table,
    cat_miss_thr, cat_vocab, cat_log_v1, cat_pow_a, cat_pow_k, cat_code_salt,
    w_salt, w_sigma, conj_a, conj_b, conj_salt, conj_sigma, intercept,
    ints_out, codes_out, margin_out, prob_out, label_out,
):  # fmt: skip
    """Sample ``n = ints_out.shape[0]`` rows from ``raw`` (int64 view, 40 words per row).

    Field ids: 0..12 are I1..I13, 13..38 are C1..C26. A field's *key* (what its weight hashes)
    is its bucket (integer field, low 32 bits) or its value code (categorical field).

    Integer values: Lomax(scale, alpha = 4 / quarters), i.e. floor(scale * (u^(-1/alpha) - 1)),
    clipped to ``int_cap``; below ``int_neg_thr`` a small negative value instead.
    Categorical ranks 0..V-1: a truncated power law with exponent s = 1 + 1/k (k =
    ``cat_pow_k``, a nonzero integer; k = 0 means s = 1, log-uniform), by inversion:
    x = (1 + u a)^(-k) with a = (V+1)^(-1/k) - 1, or x = (V+1)^u; rank = floor(x) - 1. Both use
    no pow() and no more than one exp: this kernel is the generator's hot loop.
    Outputs: ``ints_out`` (MISSING_INT = missing), ``codes_out`` (-1 = missing), margin,
    click probability and 0/1 label per row.
    """
    n = ints_out.shape[0]
    keys = np.empty(N_INT + N_CAT, dtype=np.int64)
    present = np.empty(N_INT + N_CAT, dtype=np.bool_)
    for i in range(n):
        base = i * WORDS_PER_ROW
        m = intercept
        for j in range(N_INT):
            r = raw[base + j]
            lo = r & MASK32
            hi = (r >> 32) & MASK32
            if lo < int_miss_thr[j]:
                ints_out[i, j] = MISSING_INT
                present[j] = False
                continue
            if hi < int_neg_thr[j]:
                t = hi / int_neg_thr[j]
                v = -1 if t < 0.7 else (-2 if t < 0.9 else -3)
            else:
                u = (hi - int_neg_thr[j] + 0.5) / (4294967296.0 - int_neg_thr[j])
                x = int_scale[j] * (_pow_quarters(1.0 / u, int_quarters[j]) - 1.0)
                v = np.int64(math.floor(min(x, int_cap)))
            ints_out[i, j] = v
            key = int_bucket(v, bucket_table) & MASK32
            keys[j] = key
            present[j] = True
            m += w_sigma[j] * gauss32(fmix32(key ^ w_salt[j]))
        for j in range(N_CAT):
            r = raw[base + N_INT + j]
            lo = r & MASK32
            hi = (r >> 32) & MASK32
            f = N_INT + j
            if lo < cat_miss_thr[j]:
                codes_out[i, j] = MISSING_CODE
                present[f] = False
                continue
            u = (hi + 0.5) * _INV_2_32
            k = cat_pow_k[j]
            if k == 0:
                x = math.exp(u * cat_log_v1[j])
            elif k > 0:
                x = 1.0 / _ipow(1.0 + u * cat_pow_a[j], k)
            else:
                x = _ipow(1.0 + u * cat_pow_a[j], -k)
            vocab = cat_vocab[j]
            rank = min(max(np.int64(x) - 1, 0), vocab - 1)
            code = fmix32((rank + cat_code_salt[j]) & MASK32)
            codes_out[i, j] = code
            keys[f] = code
            present[f] = True
            m += w_sigma[f] * gauss32(fmix32(code ^ w_salt[f]))
        for p in range(conj_a.shape[0]):
            a = conj_a[p]
            b = conj_b[p]
            if present[a] and present[b]:
                h = fmix32(keys[b] ^ fmix32(keys[a] ^ conj_salt[p]))
                m += conj_sigma[p] * gauss32(h)
        margin_out[i] = m
        prob = 1.0 / (1.0 + math.exp(-m))
        prob_out[i] = prob
        u = ((raw[base + WORDS_PER_ROW - 1] >> 11) & 0x1FFFFFFFFFFFFF) * _INV_2_53
        label_out[i] = 1 if u < prob else 0


@njit(cache=True, inline="always")
def _put_hex8(buf, pos, code):
    """Write ``code`` (0 <= code < 2^32) as 8 lowercase hex digits; return the new position."""
    for k in range(8):
        buf[pos + k] = _HEX[(code >> (28 - 4 * k)) & 15]
    return pos + 8


@njit(cache=True)
def format_chunk(labels, ints, codes, kinds, subs, buf):
    """Write one chunk as Criteo TSV lines into ``buf``; return the number of bytes written.

    A row with ``kinds[i] == -1`` becomes a valid 40-field line. Otherwise the line is malformed
    in exactly one way, chosen by ``kinds[i]`` (``K_*`` above); ``subs[i]`` (a random 32-bit
    number) picks the variant: which field is broken, 39 or 41 fields, which bad label.
    The caller sizes ``buf`` with MAX_VALID_LINE per row plus LONG_FIELD_CHARS per
    ``line_too_long`` row; running out of room raises.
    """
    n = labels.shape[0]
    pos = 0
    cap = buf.shape[0]
    for i in range(n):
        kind = kinds[i]
        sub = subs[i]
        if cap - pos < MAX_VALID_LINE + 16:
            raise ValueError("format_chunk: output buffer too small")
        if kind == K_EMPTY_LINE:
            buf[pos] = 10
            pos += 1
            continue
        if kind == K_BAD_LABEL:
            which = sub % 3
            if which == 0:
                buf[pos] = 50  # '2'
                pos += 1
            elif which == 1:
                buf[pos] = 121  # 'yes'
                buf[pos + 1] = 101
                buf[pos + 2] = 115
                pos += 3
            # which == 2: an empty label
        else:
            buf[pos] = 48 + labels[i]
            pos += 1
        bad_int = sub % N_INT if kind == K_BAD_INTEGER else -1
        for j in range(N_INT):
            buf[pos] = 9
            pos += 1
            v = ints[i, j]
            if j == bad_int:
                pos = write_int(3 if v == MISSING_INT else v, buf, pos)
                if (sub >> 8) & 1:
                    buf[pos] = 120  # '12x'
                    pos += 1
                else:
                    buf[pos] = 46  # '3.5'
                    buf[pos + 1] = 53
                    pos += 2
            elif v != MISSING_INT:
                pos = write_int(v, buf, pos)
        bad_cat = sub % N_CAT if (kind == K_INVALID_UTF8 or kind == K_LINE_TOO_LONG) else -1
        last = N_CAT
        if kind == K_WRONG_FIELD_COUNT and (sub >> 8) & 1 == 0:
            last = N_CAT - 1  # 39 fields: drop C26
        for j in range(last):
            buf[pos] = 9
            pos += 1
            c = codes[i, j]
            if j == bad_cat and kind == K_INVALID_UTF8:
                buf[pos] = 0xFF
                buf[pos + 1] = 0xFE
                pos += 2
                if c != MISSING_CODE:
                    pos = _put_hex8(buf, pos, c)
            elif j == bad_cat:  # line_too_long: the field is its value repeated to 70000 chars
                if c == MISSING_CODE:
                    c = 0
                if cap - pos < LONG_FIELD_CHARS + MAX_VALID_LINE:
                    raise ValueError("format_chunk: output buffer too small")
                for _ in range(LONG_FIELD_CHARS // 8):
                    pos = _put_hex8(buf, pos, c)
            elif c != MISSING_CODE:
                pos = _put_hex8(buf, pos, c)
        if kind == K_WRONG_FIELD_COUNT and last == N_CAT:
            buf[pos] = 9  # 41 fields: one extra categorical-looking field
            pos += 1
            pos = _put_hex8(buf, pos, (sub * 2654435761) & MASK32)
        buf[pos] = 10
        pos += 1
    return pos
