"""Bulk murmur3 equals mmh3.hash(token, seed, signed=False) for every token, non-ASCII included."""

from __future__ import annotations

import mmh3
from hypothesis import example, given, settings
from hypothesis import strategies as st

from terascale.pipeline.hashing import hash_tokens
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
