"""Tests of the synthetic click-log generator (``pipeline.generate``).

The files are checked from the outside: a small vectorised parser of the TSV bytes, a slow
reference classifier of malformed lines, ``pipeline.spec`` tokens for the planted model, and a
scikit-learn logistic regression on hashed tokens.
"""

from __future__ import annotations

import gzip
import json
import math
import re

import numpy as np
import pytest

from terascale.pipeline import gen_kernels as K
from terascale.pipeline import generate as G
from terascale.pipeline import spec

ROWS = 200_000
BAD_ROWS = 24_000
BAD_RATE = 0.05
INT_RE = re.compile(r"-?[0-9]+")
HEX_RE = re.compile(r"[0-9a-f]{8}")


# ---------------------------------------------------------------------------------------------
# Helpers: a vectorised parser of valid lines and a slow reference classifier.


def read_part(path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()


def lines_of(data: bytes) -> list[bytes]:
    assert data == b"" or data.endswith(b"\n")
    return data.split(b"\n")[:-1]


def head_lines(data: bytes, n: int) -> list[bytes]:
    """The first n lines of ``data`` (without splitting all of it)."""
    end = -1
    for _ in range(n):
        end = data.index(b"\n", end + 1)
    return lines_of(data[: end + 1])


def parse_columns(data: bytes) -> dict:
    """Field starts/lengths of a file of valid lines; labels; categorical codes (-1 missing)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    sep = np.flatnonzero((buf == 9) | (buf == 10))
    n = nl.size
    assert sep.size == 40 * n, "every line must have exactly 40 fields"
    ends = sep.reshape(n, 40)
    assert np.all(buf[ends[:, -1]] == 10) and np.all(buf[ends[:, :-1]] == 9)
    starts = np.empty_like(ends)
    starts[:, 0] = np.r_[0, nl[:-1] + 1]
    starts[:, 1:] = ends[:, :-1] + 1
    lens = ends - starts
    assert np.all(lens[:, 0] == 1)
    labels = buf[starts[:, 0]].astype(np.int64) - 48
    cat_lens = lens[:, 14:]
    assert np.all((cat_lens == 0) | (cat_lens == 8))
    digits = buf[np.minimum(starts[:, 14:, None] + np.arange(8), buf.size - 1)].astype(np.int64)
    nib = np.where(digits >= 97, digits - 87, digits - 48)
    assert np.all((cat_lens[..., None] == 0) | ((nib >= 0) & (nib < 16)))
    codes = (nib << (4 * np.arange(7, -1, -1))).sum(axis=2)
    codes[cat_lens == 0] = -1
    return {"n": n, "starts": starts, "lens": lens, "labels": labels, "codes": codes}


def int_column(data: bytes, cols: dict, j: int) -> np.ndarray:
    """Values of integer field I{j+1} where present."""
    s, ln = cols["starts"][:, 1 + j], cols["lens"][:, 1 + j]
    keep = ln > 0
    return np.array([int(data[a : a + b]) for a, b in zip(s[keep], ln[keep], strict=True)])


def classify(line: bytes, max_line_bytes: int = 65536) -> str | None:
    """Reason a line is malformed (None = valid), in the featurizer's reason codes."""
    if len(line) > max_line_bytes:
        return "line_too_long"
    if line == b"":
        return "empty_line"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    f = text.split("\t")
    if len(f) != 40:
        return "wrong_field_count"
    if f[0] not in ("0", "1"):
        return "bad_label"
    if any(x and not INT_RE.fullmatch(x) for x in f[1:14]):
        return "bad_integer"
    if any(x and not HEX_RE.fullmatch(x) for x in f[14:]):
        return "bad_categorical"
    return None


def record_of(line: bytes) -> dict:
    return dict(zip(G.FIELDS, line.decode().split("\t")[1:], strict=True))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(np.where(y == 1, np.log(p), np.log1p(-p))))


# ---------------------------------------------------------------------------------------------
# Fixtures: one large clean data set, one with malformed lines.


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    summary = G.generate_clicklogs(out, ROWS, files=2, seed=3, with_prob=True, processes=1)
    data = b"".join(read_part(out / f["name"]) for f in summary["files"])
    prob = np.concatenate([np.load(out / f["prob"]) for f in summary["files"]])
    return {"out": out, "summary": summary, "data": data, "cols": parse_columns(data), "prob": prob}


@pytest.fixture(scope="module")
def dirty(tmp_path_factory):
    out = tmp_path_factory.mktemp("dirty")
    summary = G.generate_clicklogs(
        out, BAD_ROWS, files=3, seed=5, malformed_rate=BAD_RATE, with_prob=True, processes=1
    )
    lines, prob = [], []
    for f in summary["files"]:
        part = lines_of(read_part(out / f["name"]))
        assert len(part) == f["lines"]
        lines += part
        prob.append(np.load(out / f["prob"]))
    return {"out": out, "summary": summary, "lines": lines, "prob": np.concatenate(prob)}


# ---------------------------------------------------------------------------------------------
# Layout and determinism.


def test_constants():
    assert G.MALFORMED_KINDS == (
        "wrong_field_count", "bad_integer", "bad_label", "invalid_utf8", "empty_line", "line_too_long",
    )  # fmt: skip
    assert len(G.VOCAB_SIZES) == 26 and min(G.VOCAB_SIZES.values()) == 10
    assert max(G.VOCAB_SIZES.values()) == 1_000_000
    for a, b in G.PLANTED_CONJUNCTIONS:
        assert G.VOCAB_SIZES[a] <= 1000 and G.VOCAB_SIZES[b] <= 1000


def test_layout_and_summary(clean):
    s, cols = clean["summary"], clean["cols"]
    assert [f["name"] for f in s["files"]] == ["part-00000.tsv", "part-00001.tsv"]
    assert [f["lines"] for f in s["files"]] == [ROWS // 2, ROWS // 2]
    assert s["rows"] == s["valid_rows"] == cols["n"] == ROWS
    assert s["malformed_total"] == 0 and set(s["malformed"]) == set(G.MALFORMED_KINDS)
    assert s["positives"] == int(cols["labels"].sum())
    assert s["bytes"] == sum((clean["out"] / f["name"]).stat().st_size for f in s["files"])
    assert set(np.unique(cols["labels"])) == {0, 1}
    for line in head_lines(clean["data"], 1000):
        assert classify(line) is None, line
    assert not [p for p in clean["out"].iterdir() if p.name.startswith(".")]


def test_uneven_split_and_zero_rows(tmp_path):
    s = G.generate_clicklogs(tmp_path / "a", 10, files=3, seed=1)
    assert [f["lines"] for f in s["files"]] == [4, 3, 3]
    assert [len(lines_of(read_part(tmp_path / "a" / f["name"]))) for f in s["files"]] == [4, 3, 3]
    s = G.generate_clicklogs(tmp_path / "b", 0, with_prob=True)
    assert s["rows"] == 0 and s["positive_rate"] is None and s["bayes_logloss"] is None
    assert (tmp_path / "b" / "part-00000.tsv").read_bytes() == b""
    assert np.load(tmp_path / "b" / "part-00000.prob.npy").shape == (0,)


def _run_bytes(out, processes, seed=11, compress=None) -> dict:
    G.generate_clicklogs(
        out, 30_000, files=3, seed=seed, malformed_rate=0.01, with_prob=True,
        compress=compress, processes=processes,
    )  # fmt: skip
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name.startswith("part-")}


def test_deterministic_for_seed_and_any_process_count(tmp_path):
    one = _run_bytes(tmp_path / "p1", processes=1)
    two = _run_bytes(tmp_path / "p2", processes=2)
    assert len(one) == 6 and one == two
    other = _run_bytes(tmp_path / "s12", processes=1, seed=12)
    assert other.keys() == one.keys()
    assert all(other[k] != one[k] for k in one)


def test_gzip_is_deterministic_and_matches_plain(tmp_path):
    plain = _run_bytes(tmp_path / "plain", processes=1)
    gz1 = _run_bytes(tmp_path / "gz1", processes=1, compress="gzip")
    gz2 = _run_bytes(tmp_path / "gz2", processes=1, compress="gzip")
    assert gz1 == gz2
    for i in range(3):
        assert gzip.decompress(gz1[f"part-{i:05d}.tsv.gz"]) == plain[f"part-{i:05d}.tsv"]


def test_rerun_replaces_stale_parts_atomically(tmp_path):
    G.generate_clicklogs(tmp_path, 300, files=3, with_prob=True)
    s = G.generate_clicklogs(tmp_path, 300, files=2)
    assert sorted(s["removed_stale"]) == [
        "part-00000.prob.npy", "part-00001.prob.npy", "part-00002.prob.npy", "part-00002.tsv",
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_truth.json", "part-00000.tsv", "part-00001.tsv",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rows": -1}, "rows"),
        ({"rows": 1.5}, "rows"),
        ({"rows": True}, "rows"),
        ({"files": 0}, "files"),
        ({"seed": -3}, "seed"),
        ({"malformed_rate": 1.5}, "malformed_rate"),
        ({"malformed_rate": float("nan")}, "malformed_rate"),
        ({"malformed_rate": "0.1"}, "malformed_rate"),
        ({"with_prob": "yes"}, "with_prob"),
        ({"compress": "bz2"}, "compress"),
        ({"processes": 0}, "processes"),
        ({"out_dir": None}, "out_dir"),
        ({"positive_rate": 0.0}, "positive_rate"),
        ({"positive_rate": 1.0}, "positive_rate"),
        ({"positive_rate": float("nan")}, "positive_rate"),
        ({"positive_rate": "0.03"}, "positive_rate"),
    ],
)
def test_bad_arguments_name_the_parameter(tmp_path, kwargs, name):
    args = {"out_dir": tmp_path, "rows": 10, **kwargs}
    with pytest.raises((TypeError, ValueError), match=name):
        G.generate_clicklogs(**args)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# Realism.


def test_positive_rate_and_missing_rates(clean):
    cols = clean["cols"]
    assert clean["summary"]["positive_rate"] == pytest.approx(0.25, abs=0.02)
    missing = (cols["lens"] == 0).mean(axis=0)
    int_missing = missing[1:14]
    assert int_missing.mean() == pytest.approx(0.20, abs=0.03)
    assert np.ptp(int_missing) > 0.3  # rates vary per field
    expected = [G.INT_MISSING_RATES[f] for f in G.INT_FIELDS]
    expected += [G.CAT_MISSING_RATES[f] for f in G.CAT_FIELDS]
    np.testing.assert_allclose(missing[1:], expected, atol=0.01)
    assert np.ptp(missing[14:]) > 0.3


def test_another_positive_rate_shifts_only_the_intercept(tmp_path):
    """positive_rate = 0.03 (33 negatives per click, as raw click logs): the same lines' features
    and planted token weights; the true margin moves by the intercept difference, and the rate
    lands on the target."""
    rows = 30_000
    a = G.generate_clicklogs(tmp_path / "a", rows, seed=5, with_prob=True, processes=1)
    b = G.generate_clicklogs(tmp_path / "b", rows, seed=5, with_prob=True, processes=1, positive_rate=0.03)
    assert a["valid_rows"] == b["valid_rows"] == rows
    assert b["positive_rate"] == pytest.approx(0.03, abs=4 * math.sqrt(0.03 * 0.97 / rows))
    lines_a = (tmp_path / "a" / "part-00000.tsv").read_bytes().splitlines()
    lines_b = (tmp_path / "b" / "part-00000.tsv").read_bytes().splitlines()
    assert [x.split(b"\t", 1)[1] for x in lines_a] == [x.split(b"\t", 1)[1] for x in lines_b]  # same features
    pa = np.load(tmp_path / "a" / "part-00000.prob.npy").astype(np.float64)
    pb = np.load(tmp_path / "b" / "part-00000.prob.npy").astype(np.float64)
    shift = G.planted_intercept(0.03) - G.planted_intercept()
    assert shift < -2.0
    logit = lambda p: np.log(p) - np.log1p(-p)  # noqa: E731
    np.testing.assert_allclose(logit(pb) - logit(pa), shift, atol=2e-4)  # float32 probabilities
    truth = json.loads((tmp_path / "b" / "_truth.json").read_text())
    assert truth["target_positive_rate"] == 0.03 and truth["intercept"] == G.planted_intercept(0.03)


def test_integer_fields_heavy_tailed_with_negatives(clean):
    data, cols = clean["data"], clean["cols"]
    i2 = int_column(data, cols, 1)
    neg = i2[i2 < 0]
    assert 0.06 < neg.size / i2.size < 0.10 and set(neg) == {-1, -2, -3}
    i5 = int_column(data, cols, 4)
    assert i5.min() >= 0 and i5.max() > 1000 * max(np.median(i5), 1)
    i1 = int_column(data, cols, 0)
    assert i1.min() >= 0 and (i1 == 0).mean() > 0.2 and i1.max() > 100


def test_categorical_vocabularies_and_zipf_skew(clean):
    codes = clean["cols"]["codes"]
    vocab = np.array([G.VOCAB_SIZES[f] for f in G.CAT_FIELDS])
    distinct = np.array([np.unique(c[c >= 0]).size for c in codes.T])
    assert np.all(distinct <= vocab)
    small = vocab <= 30
    np.testing.assert_array_equal(distinct[small], vocab[small])  # small fields saturate
    assert np.all(distinct[vocab >= 100_000] > 10_000)
    # ordered like the vocabulary sizes: rank correlation close to 1
    rv, rd = np.argsort(np.argsort(vocab)), np.argsort(np.argsort(distinct))
    assert np.corrcoef(rv, rd)[0, 1] > 0.95
    c3 = codes[:, G.CAT_FIELDS.index("C3")]
    _, counts = np.unique(c3[c3 >= 0], return_counts=True)
    assert counts.max() > 1000 * np.median(counts)
    # the most frequent value is rank 0's text
    c9 = codes[:, G.CAT_FIELDS.index("C9")]
    vals, counts = np.unique(c9[c9 >= 0], return_counts=True)
    assert f"{vals[counts.argmax()]:08x}" == G.value_text("C9", 0)


# ---------------------------------------------------------------------------------------------
# Malformed lines.


def test_malformed_lines_by_kind(dirty):
    s, lines, prob = dirty["summary"], dirty["lines"], dirty["prob"]
    total = round(BAD_RATE * BAD_ROWS)
    assert s["malformed_total"] == total and s["valid_rows"] == BAD_ROWS - total
    assert sum(f["malformed"] for f in s["files"]) == total
    assert set(s["malformed"].values()) == {total // 6}
    found = {k: 0 for k in G.MALFORMED_KINDS}
    for line, p in zip(lines, prob, strict=True):
        kind = classify(line)
        assert (kind is None) == (not math.isnan(p)), (kind, line[:100])
        if kind is not None:
            found[kind] += 1
    assert found == s["malformed"]


def test_each_malformed_line_is_broken_in_one_way_only(dirty):
    variants = {k: set() for k in G.MALFORMED_KINDS}
    for line in dirty["lines"]:
        kind = classify(line)
        if kind == "wrong_field_count":
            f = line.split(b"\t")
            variants[kind].add(len(f))
            assert classify(b"\t".join(f[:40]) if len(f) == 41 else line + b"\tabcdef01") is None
        elif kind == "bad_integer":
            f = line.decode().split("\t")
            bad = [x for x in f[1:14] if x and not INT_RE.fullmatch(x)]
            assert len(bad) == 1 and re.fullmatch(r"-?[0-9]+(x|\.5)", bad[0])
            variants[kind].add(bad[0][-1])
        elif kind == "bad_label":
            label = line.split(b"\t")[0]
            variants[kind].add(label)
            assert classify(b"0" + line[len(label) :]) is None
        elif kind == "invalid_utf8":
            assert line.count(b"\xff\xfe") == 1
            assert classify(line.replace(b"\xff\xfe", b"")) is None
            variants[kind].add(1)
        elif kind == "line_too_long":
            f = line.split(b"\t")
            long_fields = [x for x in f if len(x) > 8]
            assert len(f) == 40 and len(long_fields) == 1 and len(long_fields[0]) == 70000
            assert re.fullmatch(rb"[0-9a-f]+", long_fields[0])
            assert classify(line.replace(long_fields[0], long_fields[0][:8])) is None
            variants[kind].add(1)
        elif kind == "empty_line":
            variants[kind].add(1)
    assert variants["wrong_field_count"] == {39, 41}
    assert variants["bad_integer"] == {"x", "5"}
    assert variants["bad_label"] == {b"2", b"yes", b""}
    assert all(variants.values())


def test_malformed_rate_keeps_the_valid_rows(tmp_path):
    """Malformed lines replace rows; every other line is the same as without them."""
    a = _run_bytes(tmp_path / "a", processes=1)
    G.generate_clicklogs(tmp_path / "b", 30_000, files=3, seed=11, with_prob=True)
    for i in range(3):
        bad = lines_of(a[f"part-{i:05d}.tsv"])
        good = lines_of((tmp_path / "b" / f"part-{i:05d}.tsv").read_bytes())
        assert len(bad) == len(good) == 10_000
        same = sum(x == y for x, y in zip(bad, good, strict=True))
        assert same == 10_000 - 100


# ---------------------------------------------------------------------------------------------
# The planted model.


def test_prob_sidecar_and_bayes_logloss(clean):
    s, prob, y = clean["summary"], clean["prob"], clean["cols"]["labels"]
    assert prob.dtype == np.float32 and prob.shape == (ROWS,) and not np.isnan(prob).any()
    assert prob.mean() == pytest.approx(s["positive_rate"], abs=0.01)
    bayes, base = logloss(y, prob), G.base_rate_entropy(y.mean())
    assert bayes == pytest.approx(s["bayes_logloss"], abs=1e-4)
    assert 0.40 < bayes < base - 0.07
    truth = json.loads((clean["out"] / "_truth.json").read_text())
    assert truth["seed"] == 3 and truth["rows"] == ROWS and truth["intercept"] == G.planted_intercept()
    assert truth["vocab_sizes"] == G.VOCAB_SIZES
    assert truth["planted_conjunctions"] == [list(p) for p in G.PLANTED_CONJUNCTIONS]
    assert truth["bayes_logloss"] == pytest.approx(bayes, abs=1e-4)
    assert (clean["out"] / "_truth.json").stat().st_size < 10_000


def test_planted_model_is_over_the_featurizer_tokens(clean):
    """sigmoid(intercept + sum of token weights) of spec's tokens = the line's true probability."""
    lines = head_lines(clean["data"], 2000)
    for line, p in zip(lines, clean["prob"], strict=False):
        tokens = spec.criteo_tokens(record_of(line), G.FIELDS, "log_squared", G.PLANTED_CONJUNCTIONS)
        q = 1.0 / (1.0 + math.exp(-G.planted_margin(tokens)))
        assert q == pytest.approx(float(p), rel=1e-5, abs=1e-7)


def test_hashed_logistic_regression_learns_the_signal(clean):
    scipy_sparse = pytest.importorskip("scipy.sparse")
    linear_model = pytest.importorskip("sklearn.linear_model")
    bits, n_train, n_test = 18, 40_000, 10_000
    lines = head_lines(clean["data"], n_train + n_test)
    indptr, indices = [0], []
    for line in lines:
        tokens = spec.criteo_tokens(record_of(line), G.FIELDS, "log_squared")
        idx, _ = spec.indices_values(tokens, bits, 0)
        indices += idx
        indptr.append(len(indices))
    x = scipy_sparse.csr_matrix(
        (np.ones(len(indices)), indices, indptr), shape=(len(lines), 1 << bits)
    )
    y = clean["cols"]["labels"][: len(lines)]
    model = linear_model.LogisticRegression(C=0.1, max_iter=200).fit(x[:n_train], y[:n_train])
    held_out = logloss(y[n_train:], model.predict_proba(x[n_train:])[:, 1])
    base = logloss(y[n_train:], np.full(n_test, y[:n_train].mean()))
    assert held_out < base - 0.03, (held_out, base)


def test_kernel_hashes_match_the_python_reference():
    rng = np.random.default_rng(0)
    for x in [0, 1, 2**32 - 1, *rng.integers(0, 2**32, size=200).tolist()]:
        assert K.fmix32(np.int64(x)) == G._fmix32(x)
        assert K.gauss32(np.int64(x)) == pytest.approx(G._gauss32(x), abs=1e-12)
    table = G._model_arrays()["bucket_table"]
    for v in [-3, -1, 0, 1, 2, 3, 7, 65535, 65536, 10**6, 2**31 - 1, *rng.integers(3, 10**9, 200).tolist()]:
        assert K.int_bucket(np.int64(v), table) == spec.bucket(v)
    gauss = np.array([G._gauss32(int(h)) for h in rng.integers(0, 2**32, size=20_000)])
    assert abs(gauss.mean()) < 0.03 and gauss.std() == pytest.approx(1.0, abs=0.03)
