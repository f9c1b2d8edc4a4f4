"""DELTA_BINARY_PACKED (``pipeline.parquet_delta``) against a plain-Python decoder written from
the format's description, on the nasty cases: no value, one, a partial miniblock and block,
deltas that wrap in 32 bits, all-equal runs (width 0); and its size on sorted rows of hashed
indices. pyarrow and Spark decode it in tests/test_parquet_rows.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from terascale.pipeline.parquet_delta import delta_binary_packed32, max_bytes

I32 = st.integers(-(2**31), 2**31 - 1)


def _uleb(buf: bytes, pos: int) -> tuple[int, int]:
    x = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        x |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return x, pos


def _unzigzag(z: int) -> int:
    return (z >> 1) ^ -(z & 1)


def _wrap32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def decode(buf: bytes) -> tuple[list[int], int]:
    """(values, bytes read) of one DELTA_BINARY_PACKED stream of INT32."""
    block, pos = _uleb(buf, 0)
    minis, pos = _uleb(buf, pos)
    n, pos = _uleb(buf, pos)
    z, pos = _uleb(buf, pos)
    per = block // minis
    out = [_unzigzag(z)] if n else []
    while len(out) < n:
        z, pos = _uleb(buf, pos)
        lo = _unzigzag(z)
        widths = list(buf[pos : pos + minis])
        pos += minis
        for wd in widths:
            if len(out) >= n:
                break  # a miniblock past the last value: no bytes
            bits = int.from_bytes(buf[pos : pos + per * wd // 8], "little")
            pos += per * wd // 8
            for j in range(per):
                if len(out) < n:
                    out.append(_wrap32(out[-1] + lo + ((bits >> (j * wd)) & ((1 << wd) - 1))))
    return out, pos


def encode(vals) -> bytes:
    v = np.asarray(vals, np.int32)
    out = np.empty(max_bytes(v.shape[0]), np.uint8)
    size = delta_binary_packed32(v, out, np.empty(v.shape[0] + 128, np.uint32))
    return out[:size].tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(I32, max_size=700))
@example([])
@example([7])
@example([2**31 - 1, -(2**31), 2**31 - 1, 0])  # deltas that wrap, both ways
@example([5] * 300)  # width 0 everywhere
@example(list(range(129)))  # one delta past a block
@example(list(range(0, 33 * 1000, 1000)))  # one delta past a miniblock
def test_decodes_to_the_values_and_fills_its_bound(vals):
    buf = encode(vals)
    got, used = decode(buf)
    assert got == vals and used == len(buf) <= max_bytes(len(vals))


def test_a_full_block_of_full_width_values_fits_the_bound():
    rng = np.random.default_rng(0)
    vals = np.where(np.arange(1000) % 2 == 0, 2**31 - 1, -(2**31)).astype(np.int32)  # every delta +-(2^32 - 1)
    buf = encode(vals)
    assert decode(buf)[0] == vals.tolist()
    assert buf[:4] == bytes([0x80, 0x01, 0x04, 0xE8])  # 128, 4, 1000 (0xE8 0x07): the header's varints
    noise = rng.integers(-(2**31), 2**31, 4096).astype(np.int32)
    assert decode(encode(noise))[0] == noise.tolist()


@pytest.mark.parametrize("bits", [16, 22, 24])
def test_sorted_rows_of_hashed_indices_take_about_bits_plus_one_bits(bits):
    """Rows of thirty sorted indices below 2^bits: about (bits + 1) / 8 bytes a value."""
    rng = np.random.default_rng(bits)
    rows = [np.sort(rng.integers(0, 1 << bits, 30)) for _ in range(3000)]
    vals = np.concatenate(rows).astype(np.int32)
    size = len(encode(vals)) / vals.shape[0]
    assert (bits - 1) / 8 < size < (bits + 2) / 8, size
