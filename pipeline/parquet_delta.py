"""Parquet's DELTA_BINARY_PACKED encoding of INT32 values (the rows writer's indices,
``pipeline.parquet_rows``). No pyspark.

The format (Apache Parquet, Encodings.md): a header of four ULEB128 varints — the block size in
values (128 here), the miniblocks in a block (4: 32 values each), the number of values and the
first value zigzag-encoded — then the deltas ``v[i] - v[i-1]`` (wrapping in 32 bits) in blocks:
each block the zigzag varint of its smallest delta, one byte per miniblock with its bit width,
then each miniblock's deltas minus that smallest, bit-packed least significant bit first in
``32 * width`` bits. A block's last miniblocks that hold no value are width 0 and take no bytes;
the last miniblock holding values is padded with zeros to 32 values.

The indices of a row are sorted, so most deltas are small and positive; a row's first delta is
negative (the next row starts low). A block of 128 values spans about four rows of thirty, so
its smallest delta is about ``-2^bits`` and its widths about ``bits + 1``: near 3 bytes a value
at 22 bits, with no codec after it (bit-packed values do not compress).
"""

from __future__ import annotations

import numpy as np
from numba import njit

BLOCK = 128  # values in a block
MINIBLOCKS = 4  # of 32 values


def max_bytes(n: int) -> int:
    """The most bytes :func:`delta_binary_packed32` writes for ``n`` values: a 25-byte header
    (four varints), and per block a 5-byte varint, the width bytes and 32-bit values."""
    blocks = (max(n - 1, 0) + BLOCK - 1) // BLOCK
    return 25 + blocks * (5 + MINIBLOCKS + 4 * BLOCK)


@njit(cache=True, inline="always")
def _uleb(out, w, x):
    while x >= np.uint64(0x80):
        out[w] = np.uint8((x & np.uint64(0x7F)) | np.uint64(0x80))
        x >>= np.uint64(7)
        w += 1
    out[w] = np.uint8(x)
    return w + 1


@njit(cache=True, inline="always")
def _zigzag(x):
    return np.uint64((np.int64(x) << 1) ^ (np.int64(x) >> 63))


@njit(cache=True)
def delta_binary_packed32(vals, out, scratch):
    """``vals`` (int32) encoded into ``out`` (uint8, at least ``max_bytes(len(vals))``); returns
    the bytes written. ``scratch``: uint32, at least ``len(vals) + 128`` entries."""
    n = vals.shape[0]
    w = _uleb(out, 0, np.uint64(BLOCK))
    w = _uleb(out, w, np.uint64(MINIBLOCKS))
    w = _uleb(out, w, np.uint64(n))
    w = _uleb(out, w, _zigzag(vals[0] if n else 0))
    m = max(n - 1, 0)  # deltas
    d = scratch
    for j in range(m):
        d[j] = np.uint32(vals[j + 1]) - np.uint32(vals[j])  # wraps in 32 bits, as the format says
    for j in range(m, (m + BLOCK - 1) // BLOCK * BLOCK):
        d[j] = 0  # the last miniblock's padding
    for a in range(0, m, BLOCK):
        nb = min(BLOCK, m - a)
        lo = np.int32(2**31 - 1)
        for j in range(a, a + nb):
            lo = min(lo, np.int32(d[j]))
        ulo = np.uint32(lo)
        for j in range(a, a + nb):
            d[j] = d[j] - ulo
        w = _uleb(out, w, _zigzag(lo))
        wb = w
        w += MINIBLOCKS
        for k in range(MINIBLOCKS):
            out[wb + k] = 0
        for k in range((nb + 31) // 32):
            b0 = a + 32 * k
            hi = np.uint32(0)
            for j in range(b0, b0 + 32):
                hi |= d[j]
            width = 0
            while hi:
                width += 1
                hi >>= np.uint32(1)
            out[wb + k] = width
            acc = np.uint64(0)
            bits = np.uint64(0)
            for j in range(b0, b0 + 32):
                acc |= np.uint64(d[j]) << bits
                bits += np.uint64(width)
                if bits >= np.uint64(32):
                    x = np.uint32(acc & np.uint64(0xFFFFFFFF))
                    out[w] = np.uint8(x & np.uint32(0xFF))
                    out[w + 1] = np.uint8((x >> np.uint32(8)) & np.uint32(0xFF))
                    out[w + 2] = np.uint8((x >> np.uint32(16)) & np.uint32(0xFF))
                    out[w + 3] = np.uint8(x >> np.uint32(24))
                    w += 4
                    acc >>= np.uint64(32)
                    bits -= np.uint64(32)
    return w
