"""Bulk murmur3 equals mmh3.hash(token, seed, signed=False) for every token, non-ASCII included."""

from __future__ import annotations

import mmh3
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import njit

from terascale.pipeline.hashing import (
    WORDS8_ROWS,
    hash_tokens,
    murmur3_32_prefixed,
    murmur3_32_words8,
)
from terascale.pipeline.spec import hash_index

tokens = st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40), max_size=30)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@settings(max_examples=300, deadline=None)
@given(tokens, seeds)
@example([""], 0)
@example(["a", "ab", "abc", "abcd", "abcde"], 0)  # every tail length
@example(["C7=3f1a9b2c", "I1=12", "C1=05db9164^C2=38a947a1"], 42)
@example(["héllo", "日本語", "\U0001F600", "\x00", "\uffff", "Ω≈ç√"], 2**32 - 1)
@example(["\udbff\udfff".encode("utf-16", "surrogatepass").decode("utf-16")], 7)  # U+10FFFF
def test_bulk_hash_equals_mmh3(toks, seed):
    got = hash_tokens(toks, seed)
    assert [int(x) for x in got] == [mmh3.hash(t, seed, signed=False) for t in toks]


def test_known_vectors():
    # published murmur3_32 x86 test vectors (seed, input) -> hash
    assert hash_tokens([""], 0)[0] == 0
    assert hash_tokens([""], 1)[0] == 0x514E28B7
    assert hash_tokens([""], 0xFFFFFFFF)[0] == 0x81F16F39
    assert hash_tokens(["Hello, world!"], 1234)[0] == 0xFAF6CDB3
    assert hash_tokens(["The quick brown fox jumps over the lazy dog"], 0x9747B28C)[0] == 0x2FA826CD


def test_index_is_low_bits():
    t = "C3=deadbeef"
    h = mmh3.hash(t, 0, signed=False)
    for bits in (1, 18, 24, 31):
        assert hash_index(t, bits, 0) == h % (1 << bits)


@njit(cache=True)
def _prefixed(pw, plen, buf, starts, lens, seed, out):
    for i in range(out.shape[0]):
        out[i] = murmur3_32_prefixed(pw[i], plen[i], buf, starts[i], lens[i], seed, buf.shape[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["C1=", "C9=", "C10=", "C26=", "I1=", "I13="]), st.binary(min_size=1, max_size=21)),
                min_size=1, max_size=40), seeds)
@example([("C1=", b"68fd1e64"), ("C12=", b"68fd1e64"), ("C3=", b"x"), ("C20=", b"0123456789abcdefg")], 0)
def test_prefixed_and_batched_hashes_equal_mmh3(pairs, seed):
    """murmur3_32_prefixed (the value read in place, the last one ending the buffer) and the batched
    murmur3_32_words8 (8-byte values) against mmh3 of prefix + value."""
    buf = np.frombuffer(b"".join(v for _, v in pairs), np.uint8)
    lens = np.array([len(v) for _, v in pairs], np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    pw = np.array([int.from_bytes(p.encode(), "little") for p, _ in pairs], np.int64)
    plen = np.array([len(p) for p, _ in pairs], np.int64)
    out = np.zeros(len(pairs), np.int64)
    _prefixed(pw, plen, buf, starts, lens, seed, out)
    want = [mmh3.hash(p.encode() + v, seed, signed=False) for p, v in pairs]
    assert out.tolist() == want
    eight = [i for i, (_, v) in enumerate(pairs) if len(v) == 8]
    batch = np.zeros((WORDS8_ROWS, len(eight) + 1), np.uint32)
    for b, i in enumerate(eight):
        v = pairs[i][1]
        batch[:4, b] = [int.from_bytes(v[:4], "little"), int.from_bytes(v[4:], "little"), pw[i], plen[i] == 4]
    got = np.zeros(len(eight) + 2, np.int64)
    murmur3_32_words8(batch, len(eight), seed, (1 << 32) - 1, got, 2)
    assert got[2:].tolist() == [want[i] for i in eight]
