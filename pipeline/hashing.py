"""murmur3_32 (x86 variant) as a numba kernel, bit-compatible with ``mmh3.hash(..., signed=False)``.

The kernel hashes a byte range of a uint8 array, so tokens never become Python strings on the
hot path. ``hash_tokens`` is the bulk entry point used by tests and small callers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# All arithmetic is int64 on values below 2^32: a product of two such values may wrap in int64,
# but its low 32 bits (kept by the mask) are exact, and right shifts only see masked values.


@njit(cache=True, inline="always")
def _rotl32(x, r):
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


@njit(cache=True, inline="always")
def _fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


@njit(cache=True, inline="always")
def _mix_k1(k):
    k = (k * 0xCC9E2D51) & 0xFFFFFFFF
    k = _rotl32(k, 15)
    return (k * 0x1B873593) & 0xFFFFFFFF


@njit(cache=True, inline="always")
def _mix_h1(h, k):
    """The state after one 4-byte block k."""
    h ^= _mix_k1(k)
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & 0xFFFFFFFF


@njit(cache=True, inline="always")
def murmur3_32(buf, start, n, seed):
    """murmur3_32 of buf[start:start+n] (uint8 array), seed < 2^32; returns an int64 < 2^32."""
    h = np.int64(seed) & 0xFFFFFFFF
    p = np.int64(start)
    for _ in range(n // 4):
        k = (
            np.int64(buf[p])
            | (np.int64(buf[p + 1]) << 8)
            | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24)
        )
        h = _mix_h1(h, k)
        p += 4
    tail = n & 3
    k = np.int64(0)
    if tail == 3:
        k ^= np.int64(buf[p + 2]) << 16
    if tail >= 2:
        k ^= np.int64(buf[p + 1]) << 8
    if tail >= 1:
        k ^= np.int64(buf[p])
        h ^= _mix_k1(k)
    h ^= np.int64(n)
    return _fmix32(h)


def is_byte_index(arr, i) -> bool:
    """The argument types of an unaligned load: a 1-D array and an integer position."""
    return isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(i, types.Integer)


def unaligned_load(width: int, widen: bool):
    """The codegen of an intrinsic ``(arr, i)`` that reads ``width`` bits at the byte address
    of arr[i] in one unaligned load, zero-extended to 64 bits when ``widen``."""

    def codegen(context, builder, signature, args):
        aryty, ity = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = builder.gep(ary.data, [context.cast(builder, args[1], ity, types.intp)])
        v = builder.load(builder.bitcast(ptr, ir.IntType(width).as_pointer()), align=1)
        return builder.zext(v, ir.IntType(64)) if widen else v

    return codegen


@intrinsic
def load_u32(typingctx, arr, i):
    """The 4 bytes arr[i:i+4] of a 1-D uint8 array as a little-endian unsigned int64 (one
    unaligned load; no bounds check: the caller guarantees i + 4 <= len(arr))."""
    if not is_byte_index(arr, i):
        return None
    return types.int64(arr, i), unaligned_load(32, widen=True)


@njit(cache=True, inline="always")
def murmur3_32_prefixed(pword, plen, buf, start, n, seed, limit):
    """murmur3_32 of the token prefix + buf[start:start+n], without copying it: ``pword`` holds
    the prefix's plen = 3 or 4 bytes (little-endian), n >= 1. Reads whole 4-byte words of buf
    (the last one may reach up to 3 bytes past the token, never past ``limit`` <= len(buf))."""
    h = np.int64(seed) & 0xFFFFFFFF
    if n == 8:  # the usual Criteo value (8 hex digits): straight-line code
        lo = load_u32(buf, start)
        hi = load_u32(buf, start + 4)
        if plen == 4:
            h = _mix_h1(_mix_h1(_mix_h1(h, pword), lo), hi)
        else:
            h = _mix_h1(_mix_h1(h, pword | ((lo & 0xFF) << 24)), (lo >> 8) | ((hi & 0xFF) << 24))
            h ^= _mix_k1(hi >> 8)
        return _fmix32(h ^ (plen + 8))
    if plen == 4:
        h = _mix_h1(h, pword)
        p = np.int64(start)
        m = n
    else:  # the first block is the 3 prefix bytes and the token's first byte
        h = _mix_h1(h, pword | (np.int64(buf[start]) << 24))
        p = np.int64(start) + 1
        m = n - 1
    for _ in range(m >> 2):
        h = _mix_h1(h, load_u32(buf, p))
        p += 4
    tail = m & 3
    if tail > 0:
        if p + 4 <= limit:
            k = load_u32(buf, p) & ((np.int64(1) << (8 * tail)) - 1)
        else:
            k = np.int64(0)
            for q in range(tail):
                k |= np.int64(buf[p + q]) << (8 * q)
        h ^= _mix_k1(k)
    h ^= np.int64(plen + n)
    return _fmix32(h)


_U32 = np.uint32
_C1, _C2, _C5, _CE = _U32(0xCC9E2D51), _U32(0x1B873593), _U32(5), _U32(0xE6546B64)
_F1, _F2 = _U32(0x85EBCA6B), _U32(0xC2B2AE35)


@njit(cache=True, inline="always")
def _rotl_u32(x, r):
    return _U32((x << _U32(r)) | (x >> _U32(32 - r)))


@njit(cache=True, inline="always")
def _mix_k1_u32(k):
    return _U32(_rotl_u32(_U32(k * _C1), 15) * _C2)


@njit(cache=True, inline="always")
def _mix_h1_u32(h, k):
    return _U32(_U32(_rotl_u32(_U32(h ^ _mix_k1_u32(k)), 13) * _C5) + _CE)


WORDS8_ROWS = 5  # the rows of a batch of murmur3_32_words8


@njit(cache=True)  # not inlined: LLVM vectorizes its loop (8 tokens a vector) only in its own function
def murmur3_32_words8(batch, nb, seed, mask, out, o):
    """out[o + i] = murmur3_32(prefix_i + value_i, seed) & mask for the nb tokens of a batch of
    8-byte values, several tokens at once (branch-free 32-bit lanes). ``batch`` is uint32 of
    shape (WORDS8_ROWS, >= nb): row 0 and 1 the value's bytes 0-3 and 4-7 (little-endian),
    row 2 the prefix's bytes (3 or 4, little-endian), row 3 1 for a 4-byte prefix, 0 for 3,
    row 4 free for the caller. Same function as ``murmur3_32_prefixed`` with n = 8."""
    for i in range(nb):
        lo = batch[0, i]
        hi = batch[1, i]
        four = batch[3, i] != 0
        # prefix + 8 bytes = 3 whole blocks (4-byte prefix) or 2 blocks and a 3-byte tail
        b1 = batch[2, i] if four else _U32(batch[2, i] | (lo << _U32(24)))
        b2 = lo if four else _U32((lo >> _U32(8)) | (hi << _U32(24)))
        b3 = hi if four else _U32(hi >> _U32(8))
        h = _mix_h1_u32(_mix_h1_u32(_U32(seed), b1), b2)
        t = _U32(h ^ _mix_k1_u32(b3))
        h = _U32(_U32(_rotl_u32(t, 13) * _C5) + _CE) if four else t
        h = _U32(h ^ (_U32(12) if four else _U32(11)))
        h = _U32(h ^ (h >> _U32(16)))
        h = _U32(h * _F1)
        h = _U32(h ^ (h >> _U32(13)))
        h = _U32(h * _F2)
        h = _U32(h ^ (h >> _U32(16)))
        out[o + i] = np.int64(h) & mask


@njit(cache=True)
def _hash_many(data, offsets, seed, out):
    for i in range(offsets.shape[0] - 1):
        out[i] = murmur3_32(data, offsets[i], offsets[i + 1] - offsets[i], seed)


def hash_tokens(tokens: list[str] | list[bytes], seed: int = 0) -> np.ndarray:
    """Unsigned murmur3_32 of each token (str is UTF-8 encoded), as uint32."""
    encoded = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in tokens]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)
    if data.size == 0:
        data = np.zeros(1, np.uint8)
    out = np.zeros(len(encoded), dtype=np.int64)
    _hash_many(data, offsets, int(seed), out)
    return out.astype(np.uint32)


def hash_buffers(data: np.ndarray, offsets: np.ndarray, seed: int = 0) -> np.ndarray:
    """Unsigned murmur3_32 of the strings data[offsets[i]:offsets[i+1]] (uint8 data, int64
    offsets: an Arrow string array's buffers), as int64."""
    out = np.zeros(offsets.shape[0] - 1, dtype=np.int64)
    if data.size == 0:
        data = np.zeros(1, np.uint8)
    _hash_many(data, np.ascontiguousarray(offsets, dtype=np.int64), int(seed), out)
    return out
