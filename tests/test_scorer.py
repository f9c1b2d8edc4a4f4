"""The raw-line scorer (``pipeline.scorer``, ``terascale score``) against the Spark predict job."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.scoring import evaluate, predict
from terascale.jobs.train_job import run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.scorer import MalformedLine, Scorer
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

ROOT = Path(__file__).resolve().parents[1]
RATE = 0.5
SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=7, conjunctions=(("C6", "C9"),))
TRAIN = ["train.workers=1", "train.passes=3", "train.holdout_period=5", "train.early_stop_passes=0", "train.l2=1e-6",
         "spark.master=local[2]"]


@pytest.fixture(scope="module")
def trained(spark, tmp_path_factory):
    """A model trained on negatives kept at rate 0.5 (recalibrated on its held-out rows: train.recalibrate's
    auto), and the same lines featurized whole (r = 1)."""
    d = tmp_path_factory.mktemp("scorer")
    generate_clicklogs(d / "raw", 3000, files=1, seed=21, malformed_rate=0.01, processes=1)
    fc = lambda *s: load_config([], ["featurize.partitions=1", *s]).featurize  # noqa: E731
    run_featurize(spark, [str(d / "raw")], str(d / "sampled"), SPEC, fc(f"featurize.negative_rate={RATE}"))
    m_all = run_featurize(spark, [str(d / "raw")], str(d / "all"), SPEC, fc())
    meta = run_train(spark, load_config([], TRAIN), str(d / "sampled"), str(d / "model"))
    return d, m_all, meta


def _predicted(spark, d: Path, calibration: str) -> np.ndarray:
    out = d / f"pred-{calibration}"
    p = predict(spark, str(d / "all"), str(d / "model"), str(out), (), calibration)
    assert p["calibration"] == calibration
    return pa.concat_tables([pq.read_table(out / f["path"]) for f in p["files"]])["probability"].to_numpy()


@pytest.mark.spark
def test_scorer_equals_predict_bit_for_bit(spark, trained):
    d, m_all, meta = trained
    assert meta["data"]["negative_rate"] == RATE and "recalibrated on its held-out rows" in meta["data"]["weighting"]
    rc = meta["recalibration"]
    assert rc["applied"] and rc["slope"] != 1.0 and rc["shift"] != 0.0 and rc["holdout_rows"] > 0
    lines = (d / "raw" / "part-00000.tsv").read_bytes().split(b"\n")[:-1]
    assert len(lines) == m_all["lines"] == 3000 and m_all["quarantine"]["rows"] > 0
    for calibration in ("population", "sampled", "raw"):
        want = _predicted(spark, d, calibration)  # one file, one task: rows in line order, bad lines left out
        scorer = Scorer.from_model_dir(str(d / "model"), calibration)
        got = scorer.predict_lines(lines, skip_bad=True)
        assert got.shape == (3000,) and int(np.isnan(got).sum()) == m_all["quarantine"]["rows"]
        got = got[~np.isnan(got)]
        assert got.dtype == want.dtype == np.float64
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    # serving lines without the label field score the same
    unlabeled = Scorer.from_model_dir(str(d / "model"), "sampled", labeled=False)
    scorer = Scorer.from_model_dir(str(d / "model"), "sampled")
    bare = [x.split(b"\t", 1)[1] if x.count(b"\t") == 39 else x for x in lines]
    u, lab = unlabeled.predict_lines(bare, skip_bad=True), scorer.predict_lines(lines, skip_bad=True)
    ok = ~np.isnan(lab)  # (a line malformed only in its label is good without it)
    np.testing.assert_array_equal(u[ok].view(np.uint64), lab[ok].view(np.uint64))
    pop = Scorer.from_model_dir(str(d / "model")).predict_lines(lines[:50], skip_bad=True)
    smp = Scorer.from_model_dir(str(d / "model"), "sampled").predict_lines(lines[:50], skip_bad=True)
    ok = ~np.isnan(pop)
    # sampled = sigma(logit(population) - ln r): the kept rows' click rate
    np.testing.assert_allclose(np.log(smp[ok] / (1 - smp[ok])), np.log(pop[ok] / (1 - pop[ok])) - math.log(RATE),
                               rtol=0, atol=1e-9)
    # population = sigma(a * logit(raw) + c): the held-out fit on the model's own margins
    raw = Scorer.from_model_dir(str(d / "model"), "raw").predict_lines(lines[:50], skip_bad=True)
    np.testing.assert_allclose(np.log(pop[ok] / (1 - pop[ok])), rc["slope"] * np.log(raw[ok] / (1 - raw[ok])) + rc["shift"],
                               rtol=0, atol=1e-9)

    r = evaluate(spark, str(d / "all"), str(d / "model"))
    assert r["weighting"]["model_negative_rate"] == RATE and r["weighting"]["dataset_negative_rate"] == 1.0
    assert "recalibrated on its held-out rows" in r["weighting"]["note"]
    assert r["weighting"]["recalibration"] == [rc["slope"], rc["shift"]]


@pytest.mark.spark
def test_malformed_lines_are_named(trained):
    d, _, _ = trained
    good = [x.decode() for x in (d / "raw" / "part-00000.tsv").read_bytes().split(b"\n")[:3]]
    scorer = Scorer.from_model_dir(str(d / "model"))
    scorer.predict_lines(good)
    with pytest.raises(MalformedLine, match=r"line 3: malformed \(wrong_field_count\)"):
        scorer.predict_lines([good[0], good[1], "1\t2\t3"])
    with pytest.raises(MalformedLine, match=r"line 2: malformed \(empty_line\)"):
        scorer.predict_lines([good[0], "", good[1]])
    p = scorer.predict_lines([good[0], "x\tjunk", good[1]], skip_bad=True)
    assert np.isnan(p[1]) and not np.isnan(p[[0, 2]]).any()
    with pytest.raises(ValueError, match="calibration 'bogus'"):
        Scorer.from_model_dir(str(d / "model"), "bogus")


@pytest.mark.spark
def test_score_command_needs_no_spark_and_names_bad_lines(trained, tmp_path):
    d, _, _ = trained
    lines = (d / "raw" / "part-00000.tsv").read_bytes().split(b"\n")[:400]
    want = Scorer.from_model_dir(str(d / "model"), "sampled").predict_lines(lines, skip_bad=True)
    bad = int(np.flatnonzero(np.isnan(want))[0])  # the generator's first malformed line in these 400
    code = ("import sys; from terascale.jobs.cli import main; "
            "rc = main(sys.argv[1:]); print('pyspark' in sys.modules, file=sys.stderr); sys.exit(rc)")
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, "score", "--model", str(d / "model"), "--chunk-mb", "1", *a],
        input=b"\n".join(lines) + b"\n", capture_output=True, timeout=120, cwd=ROOT)
    r = run("--skip-bad", "--set", "predict.calibration=sampled")
    assert r.returncode == 0 and r.stderr.decode().splitlines()[-1] == "False", r.stderr[-2000:]
    got = np.array([float(x) for x in r.stdout.decode().splitlines()])
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))  # nan where malformed
    r = run("--set", "predict.calibration=sampled")
    assert r.returncode == 1 and f"line {bad + 1}: malformed" in r.stderr.decode()
    assert r.stdout.decode().splitlines() == [repr(x) for x in want[:bad].tolist()]  # the lines before it


def test_libsvm_lines_score_as_their_featurized_rows(tmp_path):
    """LibSVM: raw lines through the scorer = their Parquet rows (written by a featurize task) through
    the predict job's numeric path (read_csr + solvers.predict), bit for bit."""
    from terascale.pipeline import modeldir
    from terascale.pipeline.blocks import Piece
    from terascale.pipeline.dataset import tables_to_csr
    from terascale.pipeline.featurize_task import TaskOptions, run_task
    from terascale.solvers.predict import predict_proba

    rng = np.random.default_rng(3)
    lines = []
    for _ in range(2000):
        idx = np.unique(rng.integers(1, 3000, size=rng.integers(1, 30)))
        vals = rng.choice(["1", "0.5", "2.25", "-3e-1"], size=idx.shape[0])
        lines.append(f"{rng.choice(['-1', '+1', '0', '1'])} " + " ".join(f"{a}:{v}" for a, v in zip(idx, vals, strict=True)))
    lines[7] = "1 5:x"  # unparsable
    raw = tmp_path / "a.libsvm"
    raw.write_text("\n".join(lines) + "\n")
    spec = FeatureSpec(format="libsvm", bits=12, seed=0)
    opts = TaskOptions(max_line_bytes=65536, block_bytes=1 << 20, on_error="quarantine", compression="none")
    r = run_task(0, [Piece(str(raw), 0, raw.stat().st_size, 1)], spec, opts, str(tmp_path / "task"))
    csr = tables_to_csr([pq.read_table(r["data_path"])], 1 << 12)
    w = (rng.normal(size=1 << 12) * 0.3).astype(np.float32)
    stage = str(tmp_path / "m.tmp")
    modeldir.write_weights(stage, w)
    cfg = load_config([], ["featurize.format=libsvm", "featurize.bits=12"])
    modeldir.commit(stage, str(tmp_path / "m"), {"spec": spec.to_json(), "intercept": -0.25,
                                                  "config": {"train": {"loss": "logistic"}, "featurize": {
                                                      "max_line_bytes": cfg.featurize.max_line_bytes}}})
    got = Scorer.from_model_dir(str(tmp_path / "m")).predict_lines(lines, skip_bad=True)
    assert np.isnan(got[7]) and int(np.isnan(got).sum()) == 1
    want = predict_proba(csr, w, -0.25)
    np.testing.assert_array_equal(got[~np.isnan(got)].view(np.uint64), want.view(np.uint64))
    with pytest.raises(MalformedLine, match=r"line 8: malformed"):
        Scorer.from_model_dir(str(tmp_path / "m")).predict_lines(lines)


def test_score_refuses_settings_it_would_ignore(tmp_path, capsys):
    from terascale.jobs.cli import main

    assert main(["score", "--model", str(tmp_path / "m"), "--set", "featurize.bits=20"]) == 2
    assert ("--set featurize.bits: terascale score takes only predict.calibration; the feature spec and "
            "everything else come from the model") in capsys.readouterr().err
    assert main(["score", "--model", str(tmp_path / "m"), "--set", "predict.overwrite=true"]) == 2
    assert "--set predict.overwrite: terascale score takes only predict.calibration" in capsys.readouterr().err
