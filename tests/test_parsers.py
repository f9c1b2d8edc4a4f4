"""Criteo and LibSVM block parsers against the plain-Python feature spec, and their edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import njit

from terascale.jobs.config import CRITEO_FIELDS, CRITEO_INT_FIELDS
from terascale.pipeline.criteo_kernel import INT_TABLE_HI, INT_TABLE_LO, bucket_of, find_separators
from terascale.pipeline.rowkernels import POW10, parse_float, parse_int, parse_int_swar
from terascale.pipeline.spec import FeatureSpec, bucket, criteo_tokens, indices_values
from tests.parse_helpers import parse_bytes

SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=20, seed=3)


def criteo_line(label="1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [""] * 13
    cats = cats if cats is not None else [""] * 26
    return "\t".join([label, *ints, *cats])


def reference(line: str, spec: FeatureSpec):
    f = line.split("\t")
    rec = dict(zip(CRITEO_FIELDS, f[1:], strict=True))
    idx, val = indices_values(criteo_tokens(rec, spec.fields, spec.int_bucketing, spec.conjunctions), spec.bits, spec.seed)
    return float(f[0]), idx, val


int_text = st.one_of(
    st.just(""),
    st.integers(-3, 70000).map(str),
    st.integers(-(10**18) + 1, 10**18 - 1).map(str),
    st.integers(0, 99).map(lambda v: f"+{v}"),
)
cat_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\t\n\r"), max_size=12)
lines = st.builds(
    criteo_line,
    st.sampled_from(["0", "1"]),
    st.lists(int_text, min_size=13, max_size=13),
    st.lists(cat_text, min_size=26, max_size=26),
)
specs = st.builds(
    FeatureSpec,
    bits=st.integers(1, 31),
    seed=st.integers(0, 2**32 - 1),
    fields=st.just(CRITEO_FIELDS) | st.lists(st.sampled_from(CRITEO_FIELDS), min_size=1, max_size=8, unique=True).map(tuple),
    int_bucketing=st.sampled_from(["log_squared", "identity"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(lines, min_size=1, max_size=8), specs)
@example([criteo_line("1", ["0", "-1", "2", "3", "70000", "-1025", "+5", "-0", "", "", "", "", "1"], ["x"] * 26)], SPEC)
@example([criteo_line("0", cats=["héllo", "日本", "\U0001F600", "a^b", "=", " "] + [""] * 20)], SPEC)
def test_criteo_rows_equal_the_reference(text_lines, spec):
    data = ("\n".join(text_lines) + "\n").encode()
    rows, reasons = parse_bytes(data, spec)
    assert reasons == ["ok"] * len(text_lines)
    assert rows == [reference(line, spec) for line in text_lines]


@settings(max_examples=60, deadline=None)
@given(lines, st.lists(st.tuples(st.sampled_from(CRITEO_FIELDS), st.sampled_from(CRITEO_FIELDS)), min_size=1, max_size=4))
def test_conjunctions_equal_the_reference(line, pairs):
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=24, seed=0, conjunctions=tuple(pairs))
    rows, _ = parse_bytes((line + "\n").encode(), spec)
    assert rows == [reference(line, spec)]


def test_collisions_add_up_and_indices_are_sorted_unique():
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=1, seed=0)  # 2 buckets: everything collides
    line = criteo_line("1", ["1"] * 13, ["v"] * 26)
    rows, _ = parse_bytes((line + "\n").encode(), spec)
    (label, idx, val), = rows
    assert idx == sorted(set(idx)) and sum(val) == 39.0
    assert (idx, val) == reference(line, spec)[1:]


def test_bucketing_matches_python_math_log():
    vs = np.concatenate([np.arange(-5, 200_000), np.array([10**k for k in range(6, 19)]) - 1,
                         np.round(np.exp(np.arange(1, 41))).astype(np.int64)])
    for v in vs.tolist():
        assert bucket_of(v, 0) == bucket(v, "log_squared"), v
    assert bucket(3) == math.floor(math.log(3) ** 2) == 1
    assert INT_TABLE_LO < 0 < INT_TABLE_HI


def test_integer_table_edges_equal_the_slow_path():
    spec = FeatureSpec(fields=CRITEO_INT_FIELDS, bits=24, seed=11)
    for v in (INT_TABLE_LO - 1, INT_TABLE_LO, INT_TABLE_HI - 1, INT_TABLE_HI, 10**17):
        line = criteo_line("0", [str(v)] * 13)
        rows, _ = parse_bytes((line + "\n").encode(), spec)
        assert rows == [reference(line, spec)], v


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"", "empty_line"),
        (b"\r", "empty_line"),
        (criteo_line()[:-1].encode() + b"\t\tx", "wrong_field_count"),  # 41 fields
        ("\t".join(["1"] * 39).encode(), "wrong_field_count"),
        (criteo_line("2").encode(), "bad_label"),
        (criteo_line("").encode(), "bad_label"),
        (criteo_line("1.0").encode(), "bad_label"),
        (criteo_line(" 1").encode(), "bad_label"),
        (criteo_line("1", ["12x"] + [""] * 12).encode(), "bad_integer"),
        (criteo_line("1", ["3.5"] + [""] * 12).encode(), "bad_integer"),
        (criteo_line("1", ["-"] + [""] * 12).encode(), "bad_integer"),
        (criteo_line("1", ["1" * 19] + [""] * 12).encode(), "bad_integer"),
        (criteo_line("1", [" 1"] + [""] * 12).encode(), "bad_integer"),
        (criteo_line("1", cats=["ab"] * 26).encode().replace(b"ab", b"a\xff", 1), "invalid_utf8"),
        (criteo_line("1", cats=["ab"] * 26).encode().replace(b"ab", b"\xc0\xaf", 1), "invalid_utf8"),  # overlong
        (criteo_line("1", cats=["ab"] * 26).encode().replace(b"ab", b"\xed\xa0\x80", 1), "invalid_utf8"),  # surrogate
        (criteo_line("1", cats=["ab"] * 26).encode().replace(b"ab", b"\xe6\x97", 1), "invalid_utf8"),  # truncated
        (criteo_line("1", cats=["x" * 200] + [""] * 25).encode(), "line_too_long"),
    ],
)
def test_criteo_malformed_lines(line, reason):
    good = criteo_line("1", ["1"] * 13, ["a"] * 26).encode()
    data = good + b"\n" + line + b"\n" + good  # last line without a newline
    rows, reasons = parse_bytes(data, SPEC, max_line=200)
    assert reasons == ["ok", reason, "ok"]
    assert len(rows) == 2


def test_crlf_and_max_line_boundary():
    line = criteo_line("0", ["7"] * 13, ["cafe"] * 26)
    rows, reasons = parse_bytes((line + "\r\n" + line + "\n").encode(), SPEC, max_line=len(line))
    assert reasons == ["ok", "ok"] and rows[0] == rows[1] == reference(line, SPEC)
    _, reasons = parse_bytes((line + "x\n").encode(), SPEC, max_line=len(line))
    assert reasons == ["line_too_long"]


# ---------------------------------------------------------------------------------------------
# LibSVM

LIB = FeatureSpec(format="libsvm", bits=10, libsvm_index_base=1)


def test_libsvm_labels_indices_values():
    data = b"+1 3:1 1:0.5 3:2\n-1 7:1e-3\t2:1\n0\n1 \n1.0 1024:1\n"
    rows, reasons = parse_bytes(data, LIB)
    assert reasons == ["ok"] * 5
    assert rows[0] == (1.0, [0, 2], [0.5, 3.0])  # 1-based -> 0-based; duplicates add up
    assert rows[1][0] == 0.0 and rows[1][1] == [1, 6] and rows[1][2] == pytest.approx([1.0, 1e-3])
    assert rows[2] == (0.0, [], []) and rows[3] == (1.0, [], [])
    assert rows[4] == (1.0, [1023], [1.0])


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"2 1:1", "bad_label"),
        (b"x 1:1", "bad_label"),
        (b"0.5 1:1", "bad_label"),
        (b"1 0:1", "index_out_of_range"),  # base 1: index 0 does not exist
        (b"1 1025:1", "index_out_of_range"),  # >= 2^10 after the shift
        (b"1 1:", "unparsable"),
        (b"1 :1", "unparsable"),
        (b"1 a:1", "unparsable"),
        (b"1 -1:1", "unparsable"),
        (b"1 1:x", "unparsable"),
        (b"1 1:nan", "unparsable"),
        (b"1 1:inf", "unparsable"),
        (b"1 1:1e999", "unparsable"),
        (b"1 1:3.5e38", "unparsable"),  # beyond float32
        (b"1 1", "unparsable"),
        (b"1 1:1:1", "unparsable"),
        (b"1 1:1 \xff", "invalid_utf8"),
        (b"   ", "empty_line"),
    ],
)
def test_libsvm_malformed(line, reason):
    rows, reasons = parse_bytes(b"1 1:1\n" + line + b"\n-1 2:2\n", LIB)
    assert reasons == ["ok", reason, "ok"]
    assert rows == [(1.0, [0], [1.0]), (0.0, [1], [2.0])]


def test_libsvm_zero_based():
    rows, reasons = parse_bytes(b"1 0:1 1023:1\n", FeatureSpec(format="libsvm", bits=10, libsvm_index_base=0))
    assert rows == [(1.0, [0, 1023], [1.0, 1.0])]


@settings(max_examples=500, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=64))
@example(0.1)
@example(-0.0)
@example(5e-324)
@example(1.7976931348623157e308)
@example(123456789012345678901234567890.0)
def test_float_parser_matches_python(x):
    for text in {repr(x), f"{x:.6e}", f"{x:.3f}" if abs(x) < 1e15 else repr(x)}:
        b = np.frombuffer(text.encode(), dtype=np.uint8)
        ok, v = parse_float(b, 0, b.shape[0], POW10)
        if abs(float(text)) < 3.4e38:
            assert ok and np.float32(v) == np.float32(float(text)), text
        else:  # beyond float32: the LibSVM parser rejects it either way
            assert not ok or abs(v) > 3.4e38, text


@njit(cache=True)
def _both_int_parsers(buf, start, end):
    a, va = parse_int(buf, start, end)
    b, vb = parse_int_swar(buf, start, end)
    return a, va, b, vb


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.integers(-(10**19), 10**19).map(str), st.text(alphabet="0123456789+-/:a ", max_size=12)),
       st.integers(0, 9))
@example("12345678", 0)
@example("-12345678", 0)
@example("+", 3)
@example("00000000", 8)
@example("9" * 18, 1)
def test_word_at_a_time_int_parser_equals_the_digit_loop(text, pad):
    """parse_int_swar = parse_int (ok and value), the token ending the buffer or followed by pad bytes."""
    raw = text.encode() + b"\t" * pad
    buf = np.frombuffer(raw or b"\t", np.uint8)
    a, va, b, vb = _both_int_parsers(buf, 0, len(text))
    assert (a, va if a else 0) == (b, vb if b else 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300).map(lambda b: bytes(b"\t\n\r0a\xc3"[x % 6] if x % 3 else x for x in b)))
@example(b"\t" * 64 + b"\n" * 64 + b"x")
@example(b"")
def test_separators_are_every_tab_and_newline(raw):
    """find_separators (64 bytes a word-built bit map, then the rest a byte at a time) against a plain scan."""
    buf = np.frombuffer(raw or b"\0", np.uint8)
    n = len(raw)
    seps = np.zeros(n + 1, np.int64)
    k, non_ascii = find_separators(buf, n, seps)
    want = [i for i, c in enumerate(raw) if c in (9, 10)]
    assert seps[:k].tolist() == want and non_ascii == any(c >= 128 for c in raw)
