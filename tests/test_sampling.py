"""Negative downsampling at featurize (``featurize.negative_rate``): exact, deterministic, counted."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, ConfigError, load_config
from terascale.pipeline import sampling
from terascale.pipeline.blocks import Piece
from terascale.pipeline.featurize_task import InjectedFailure, TaskOptions, run_task
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

RATE = 0.3


def test_keep_decision_is_a_fixed_function_of_file_line_and_seed():
    lines = np.arange(1, 1_000_001)
    labels = np.zeros(lines.shape[0], np.float32)
    labels[::7] = 1.0
    k = sampling.file_key("/data/day=1/part-0.tsv", 0)
    keep = sampling.keep_mask(k, 0, lines, labels, RATE)
    # any sub-range of lines gets the same decisions (a task sees a slice of the file)
    np.testing.assert_array_equal(sampling.keep_mask(k, 0, lines[4321:9876], labels[4321:9876], RATE), keep[4321:9876])
    assert keep[labels == 1].all()  # every positive kept
    neg = labels == 0
    n, kept = int(neg.sum()), int(keep[neg].sum())
    assert abs(kept - RATE * n) <= 5 * math.sqrt(n * RATE * (1 - RATE))  # binomial, 5 standard deviations
    # another file, another seed: other (independent) decisions
    other = sampling.keep_mask(sampling.file_key("/data/day=2/part-0.tsv", 0), 0, lines, labels, RATE)
    reseeded = sampling.keep_mask(sampling.file_key("/data/day=1/part-0.tsv", 1), 1, lines, labels, RATE)
    for o in (other, reseeded):
        both = int((keep & o)[neg].sum())
        assert abs(both - RATE * RATE * n) <= 5 * math.sqrt(n * RATE * RATE)
    assert sampling.keep_mask(k, 0, lines, labels, 1.0).all()
    assert sampling.negative_weight(RATE) == np.float32(1 / RATE)
    assert sampling.sampled_logit_shift(RATE) == -math.log(RATE) and sampling.sampled_logit_shift(1.0) == 0.0


def test_take_rows_keeps_whole_rows():
    indptr = np.array([0, 2, 2, 5, 6], np.int64)
    indices = np.arange(6, dtype=np.int32)
    values = np.arange(6, dtype=np.float32) / 2
    p, i, v = sampling.take_rows(indptr, indices, values, np.array([True, True, False, True]))
    assert p.tolist() == [0, 2, 2, 3] and i.tolist() == [0, 1, 5] and v.tolist() == [0.0, 0.5, 2.5]


@pytest.mark.parametrize("bad", ["0", "0.0", "1.5", "-0.1", "nan"])
def test_rate_outside_0_1_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"featurize\.negative_rate.*\(0, 1\]"):
        load_config([], [f"featurize.negative_rate={bad}"])


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    generate_clicklogs(d, 6000, files=2, seed=11, malformed_rate=0.02, processes=1)
    return d


SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=3)


def _fconf(*sets):
    return load_config([], list(sets)).featurize


def _rows(out: Path, m: dict):
    t = pa.concat_tables([pq.read_table(out / f["path"]) for f in m["files"]])
    return t["label"].to_numpy(), t["weight"].to_numpy(), t["indices"].to_pylist()


def _good_lines(m_all: dict, out_all: Path) -> list[tuple[str, int]]:
    """(file, line) of every row of a one-task, r = 1 run, in its row order: all lines but the quarantined."""
    bad = set()
    for f in m_all["quarantine"]["files"]:
        q = pq.read_table(out_all / f)
        bad |= set(zip(q["source"].to_pylist(), q["line"].to_pylist(), strict=True))
    return [(p["path"], ln) for p in m_all["per_input"] for ln in range(1, p["lines"] + 1) if (p["path"], ln) not in bad]


@pytest.mark.spark
def test_downsampled_rows_weights_and_counts_are_exact_for_any_split(spark, logs, tmp_path):
    full, one, many = tmp_path / "full", tmp_path / "one", tmp_path / "many"
    m_all = run_featurize(spark, [str(logs)], str(full), SPEC, _fconf("featurize.partitions=1"))
    m1 = run_featurize(spark, [str(logs)], str(one), SPEC,
                       _fconf("featurize.partitions=1", f"featurize.negative_rate={RATE}", "featurize.sample_seed=9"))
    m5 = run_featurize(spark, [str(logs)], str(many), SPEC,
                       _fconf("featurize.partitions=5", f"featurize.negative_rate={RATE}", "featurize.sample_seed=9"))
    assert len(m5["files"]) == 5 and all(p["path"].endswith(".tsv") for p in m5["per_input"])

    # the expected rows: the unsampled rows filtered by the keep rule at their (file, line)
    y, w, idx = _rows(full, m_all)
    where = _good_lines(m_all, full)
    assert len(where) == len(y) == m_all["rows"] and (w == 1).all()
    keep = np.zeros(len(y), bool)
    for path in {p for p, _ in where}:
        sel = np.array([p == path for p, _ in where])
        lines = np.array([ln for p, ln in where if p == path])
        keep[sel] = sampling.keep_mask(sampling.file_key(path, 9), 9, lines, y[sel], RATE)
    y1, w1, idx1 = _rows(one, m1)
    np.testing.assert_array_equal(y1, y[keep])
    assert idx1 == [idx[i] for i in np.flatnonzero(keep)]
    np.testing.assert_array_equal(w1, np.where(y1 == 1, np.float32(1), np.float32(1 / RATE)))  # exact weights

    # the five-task split keeps the same rows (as a multiset: row order follows the tasks)
    y5, w5, idx5 = _rows(many, m5)
    key = lambda ys, ws, ii: sorted(zip(ys.tolist(), ws.tolist(), map(tuple, ii), strict=True))  # noqa: E731
    assert key(y5, w5, idx5) == key(y1, w1, idx1)

    # counts: recounted from the Parquet, per file and in total
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    s = m1["sampling"]
    assert s["negative_rate"] == RATE and s["negative_weight"] == float(np.float32(1 / RATE))
    assert s["before"] == {"rows": len(y), "positives": n_pos, "negatives": n_neg}
    assert s["after"] == {"rows": len(y1), "positives": n_pos, "negatives": int((y1 == 0).sum())}
    assert s["negatives_dropped"] == n_neg - int((y1 == 0).sum()) == m1["lines"] - m1["rows"] - m1["quarantine"]["rows"]
    assert abs(s["after"]["negatives"] - RATE * n_neg) <= 5 * math.sqrt(n_neg * RATE * (1 - RATE))
    assert m1["weight_sum"] == pytest.approx(float(w1.sum(dtype=np.float64)), rel=1e-12)
    start = 0
    for p, p_all in zip(m1["per_input"], m_all["per_input"], strict=True):
        rows = slice(start, start + p["rows"])
        start += p["rows"]
        assert p["positives"] == int((y1[rows] == 1).sum()) == p_all["rows"] - int((y[[q == p["path"] for q, _ in where]] == 0).sum())
        assert p["negatives_kept"] == int((y1[rows] == 0).sum())
        # row conservation: lines in = rows written + rows dropped by sampling + rows quarantined
        assert p["lines"] == p["rows"] + p["dropped"] + p["quarantined"] == p_all["lines"]
        assert p["dropped"] == p_all["rows"] - p["rows"] > 0
    assert start == len(y1)
    assert [{k: p[k] for k in ("rows", "dropped", "positives", "negatives_kept")} for p in m5["per_input"]] == \
           [{k: p[k] for k in ("rows", "dropped", "positives", "negatives_kept")} for p in m1["per_input"]]
    assert m_all["sampling"]["negatives_dropped"] == 0 and m_all["sampling"]["negative_rate"] == 1.0


def test_a_retried_or_speculative_attempt_keeps_the_same_rows(logs, tmp_path):
    """Attempts of one task (the first dies mid-write, a retry, a speculative copy reading in other
    block sizes) keep the same rows: Spark's retry and commit are tested in test_featurize_spark."""
    files = sorted(logs.glob("*.tsv"))
    size = files[0].stat().st_size
    pieces = [Piece(str(files[0]), 0, size, 1), Piece(str(files[1]), 0, files[1].stat().st_size, 1)]
    opts = TaskOptions(max_line_bytes=65536, block_bytes=1 << 20, on_error="quarantine", compression="none",
                       negative_rate=RATE, sample_seed=2, row_group_rows=500)
    with pytest.raises(InjectedFailure):
        run_task(0, pieces, SPEC, replace(opts, inject_fail=True), str(tmp_path / "a0"))
    r1 = run_task(0, pieces, SPEC, opts, str(tmp_path / "a1"))
    r2 = run_task(0, pieces, SPEC, replace(opts, block_bytes=4096), str(tmp_path / "a2"))
    assert pq.read_table(r1["data_path"]).equals(pq.read_table(r2["data_path"]))
    assert r1["inputs"] == r2["inputs"] and r1["rows"] == r2["rows"] > 0
    assert all(s["dropped"] > 0 for s in r1["inputs"].values())
