"""The fused Criteo scoring kernel (``pipeline.score_kernel``) against featurize's parser followed
by the predict job's margins (``blocks.BlockParser`` + ``solvers.predict``), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from terascale.jobs.config import CRITEO_FIELDS
from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.rowkernels import REASONS
from terascale.pipeline.score_kernel import sorted_runs
from terascale.pipeline.scorer import MalformedLine, Scorer
from terascale.pipeline.spec import FeatureSpec
from terascale.solvers.data import CSRData
from terascale.solvers.predict import decision_function, sigmoid


def _scorer(spec: FeatureSpec, seed: int = 0, max_line: int = 65536, loss: str = "logistic", rate: float = 0.5,
            **kw) -> Scorer:
    w = (np.random.default_rng(seed).normal(size=1 << spec.bits) * 0.7).astype(np.float32)
    meta = {"spec": spec.to_json(), "intercept": -0.3, "data": {"negative_rate": rate},
            "config": {"train": {"loss": loss}, "featurize": {"max_line_bytes": max_line}}}
    return Scorer(w, -0.3 + 1e-9 * seed, meta, **kw)


def _reference(s: Scorer, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(status, scores) the pre-fused way: featurize's CSR rows, the predict job's margins and
    sigmoid; NaN for a bad line."""
    pb = BlockParser(s.spec, s._parser.max_line).parse(np.frombuffer(data, np.uint8))
    n = pb.labels.shape[0]
    csr = CSRData(pb.indptr, pb.indices, pb.values, pb.labels, np.ones(n, np.float32), 1 << s.spec.bits)
    m = decision_function(csr, s.weights, s.intercept)
    scores = sigmoid(m, s.logit_shift) if s.column == "probability" else m
    out = np.full(pb.n_lines, np.nan)
    out[pb.status == 0] = scores
    return pb.status.copy(), out


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def line(label="1", ints=None, cats=None) -> str:
    return "\t".join([label, *(ints if ints is not None else [""] * 13), *(cats if cats is not None else [""] * 26)])


NASTY = [
    line("1", ["0", "-1", "2", "3", "70000", "-1025", "+5", "-0", "", "", "", "", "1"], ["x"] * 26),  # out of the int table
    line("0", ["123456789012345678", "-65537", "65535", "65536", "-1024", "", "", "", "", "", "", "", ""],
         ["68fd1e64"] * 26),
    line("0", cats=["héllo", "日本", "\U0001F600", "a^b", "=", " "] + [""] * 20),  # non-ASCII, odd lengths
    line("1", [str(k) for k in range(13)], [("abcdefgh" * 3)[:k] for k in range(26)]),  # values of 0..25 bytes
    line("1"),  # every feature missing: the intercept alone
    line("1", ["7"] * 13, ["a1b2c3d4"] * 13 + [""] * 13),
    line("0", ["1"] * 13, ["0123456789abcdef"] * 26) + "\r",  # CRLF
    "",  # empty
    "1\t2\t3",  # wrong field count
    line("2"),  # bad label
    line("1", ["x"] + [""] * 12),  # bad integer
    line("1", ["1" * 19] + [""] * 12),  # 19 digits: bad integer
    line("0", cats=["\xff"] + [""] * 25),  # valid UTF-8 of U+00FF
]


def _block(lines: list[str], last_newline: bool = True) -> bytes:
    text = "\n".join(lines) + ("\n" if last_newline else "")
    return text.encode("utf-8")


SPECS = [
    FeatureSpec(fields=CRITEO_FIELDS, bits=18, seed=7),
    FeatureSpec(fields=CRITEO_FIELDS, bits=3, seed=1),  # many tokens per index: counts 2, 3, ...
    FeatureSpec(fields=CRITEO_FIELDS, bits=12, seed=5, conjunctions=(("C6", "C9"), ("I1", "C3"), ("I2", "I3"))),
    FeatureSpec(fields=("C3", "I5", "C26", "I1"), bits=10, seed=2, int_bucketing="identity"),
    FeatureSpec(fields=CRITEO_FIELDS, bits=9, seed=11, conjunctions=tuple(("C1", f"C{k}") for k in range(2, 13))),  # 50 tokens
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("gen")
    generate_clicklogs(d, 4000, files=1, seed=9, malformed_rate=0.03, processes=1)
    return (d / "part-00000.tsv").read_bytes()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"bits{s.bits}-f{len(s.fields)}-c{len(s.conjunctions)}")
def test_generated_and_nasty_lines_score_as_featurize_then_predict(spec, generated):
    s = _scorer(spec, max_line=400)
    data = generated + _block(NASTY) + b"\n".join(generated.split(b"\n")[:50])  # ends without a newline
    status, want = _reference(s, data)
    assert (status != 0).sum() > 100 and {REASONS[c] for c in status} >= {"ok", "line_too_long", "empty_line"}
    _same(s.predict_block(data, skip_bad=True), want)
    for k in (0, 1, 17, 12345, len(data) - 600):  # blocks cut at other line starts
        cut = data.index(b"\n", k) + 1
        _same(s.predict_block(data[cut:], skip_bad=True), _reference(s, data[cut:])[1])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(NASTY), min_size=1, max_size=12), st.sampled_from(SPECS), st.booleans(),
       st.sampled_from(["population", "sampled"]))
@example([NASTY[6]], SPECS[1], False, "population")
@example([NASTY[3]], SPECS[4], False, "sampled")
def test_any_mix_of_lines_scores_as_featurize_then_predict(lines, spec, last_newline, calibration):
    s = _scorer(spec, seed=len(lines), calibration=calibration)
    assert s.logit_shift == (0.0 if calibration == "population" else 0.6931471805599453)
    data = _block(lines, last_newline)
    _same(s.predict_block(data, skip_bad=True), _reference(s, data)[1])


def test_a_block_of_short_lines_beyond_the_first_guess_of_its_line_count(generated):
    """Many more lines than bytes / 64: the kernel fills its buffers, the scorer calls it again."""
    s = _scorer(SPECS[0])
    good = generated.split(b"\n")[:3]
    data = b"\n".join(good) + b"\n" + b"\n" * 5000 + b"\n".join(good) + b"\n1\t2\n" * 3000 + b"\n".join(good)
    status, want = _reference(s, data)
    assert status.shape[0] > len(data) // 64 + 16 and int((status == 0).sum()) == 9
    _same(s.predict_block(data, skip_bad=True), want)


def test_the_first_malformed_line_is_named_and_scores_without_skip_bad(generated):
    s = _scorer(SPECS[0])
    good = [x.decode() for x in generated.split(b"\n")[:40] if x.count(b"\t") == 39 and 0 < len(x) < 300][:5]
    _same(s.predict_lines(good), _reference(s, _block(good))[1])
    for bad, reason in ((NASTY[8], "wrong_field_count"), (NASTY[9], "bad_label"), (NASTY[10], "bad_integer"),
                        ("", "empty_line"), ("1" * 500 + line("1")[1:], "line_too_long")):
        lines = [*good[:3], bad, *good[3:], bad]
        with pytest.raises(MalformedLine, match=rf"line 4: malformed \({reason}\)") as e:
            _scorer(SPECS[0], max_line=300).predict_lines(lines)
        assert e.value.line == 4 and e.value.reason == reason
        with pytest.raises(MalformedLine, match=rf"line 104: malformed \({reason}\)"):
            _scorer(SPECS[0], max_line=300).predict_block(_block(lines), first_line=101)
    invalid = b"\n".join([good[0].encode(), line("1", cats=["ok"] * 25 + ["x"]).encode()[:-1] + b"\xc3\x28"])
    with pytest.raises(MalformedLine, match=r"line 2: malformed \(invalid_utf8\)"):
        s.predict_block(invalid)


def test_unlabeled_lines_and_a_linear_loss():
    spec = SPECS[2]
    lines = [x for x in NASTY[:7] if x]
    labeled = _scorer(spec, loss="squared")
    assert labeled.column == "score"
    want = _reference(labeled, _block(lines))[1]
    _same(labeled.predict_lines(lines), want)
    bare = _scorer(spec, loss="squared", labeled=False)
    _same(bare.predict_lines([x.split("\t", 1)[1] for x in lines]), want)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, (1 << 31) - 1), min_size=0, max_size=80), st.integers(0, 6))
@example([5, 5, 5, 1, 1, 0], 0)
@example(list(range(48, 0, -1)), 3)
def test_sorted_runs_are_the_distinct_values_and_their_counts(keys, dups):
    keys = keys + keys[:dups]
    n = len(keys)
    buf = np.zeros(max(n, 64), np.int64)
    buf[:n] = keys
    narrow = all(k < 1 << 25 for k in keys)
    tmp, t32 = np.zeros(128 + max(n, 64), np.int64), np.zeros(128 + max(n, 64), np.int32)
    idx, cnt = np.zeros(n + 3, np.int64), np.zeros(n + 3, np.float32)
    u = sorted_runs(buf, n, narrow, tmp, t32, idx, cnt, 3)
    want, counts = np.unique(np.array(keys, np.int64), return_counts=True)
    assert u == want.shape[0]
    np.testing.assert_array_equal(idx[3:3 + u], want)
    np.testing.assert_array_equal(cnt[3:3 + u], counts.astype(np.float32))
