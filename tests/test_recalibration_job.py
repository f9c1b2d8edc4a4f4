"""``train.recalibrate`` through the jobs: a model trained on negative-downsampled rows fits
σ(a·m + c) on its held-out rows, records it, and predict / evaluate / the scorer use it; when it
applies (auto, on, off), K = 1 and 2 agreeing, and the configuration errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, ConfigError, load_config
from terascale.jobs.scoring import evaluate, predict
from terascale.jobs.train_job import run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

pytestmark = pytest.mark.spark

SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=18, seed=5)
#: a fixed small lambda: the weighted model then over-predicts clearly on unsampled rows
TRAIN = ["spark.master=local[2]", "train.l2=1e-6", "train.passes=6", "train.holdout_period=5"]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    """Click logs at 1 click in 12 featurized twice: negatives kept at rate 0.1, and every row. (Which
    negatives are kept depends on the files' paths, pipeline.sampling, so every run of the test draws
    another sample: the assertions hold for any.)"""
    d = tmp_path_factory.mktemp("recal")
    generate_clicklogs(d / "raw", 60_000, files=2, seed=31, positive_rate=0.08, processes=1)
    fc = lambda *s: load_config([], ["featurize.partitions=2", *s]).featurize  # noqa: E731
    run_featurize(spark, [str(d / "raw")], str(d / "sampled"), SPEC, fc("featurize.negative_rate=0.1"))
    run_featurize(spark, [str(d / "raw")], str(d / "all"), SPEC, fc())
    return d


def _train(spark, d, name, *sets, dataset="sampled"):
    return run_train(spark, load_config([], [*TRAIN, *sets]), str(d / dataset), str(d / name))


def _probabilities(spark, d, model, calibration):
    out = d / f"pred-{model}-{calibration}"
    p = predict(spark, str(d / "all"), str(d / model), str(out), ("label",), calibration)
    t = pa.concat_tables([pq.read_table(out / f["path"]) for f in p["files"]])
    return t["probability"].to_numpy(), t["label"].to_numpy().astype(np.float64)


def test_a_downsampled_model_is_recalibrated_on_its_held_out_rows(spark, data):
    meta = _train(spark, data, "m-auto")
    rc = meta["recalibration"]
    assert rc["applied"] and rc["why"].startswith("auto: the dataset keeps negatives at rate 0.1")
    assert rc["holdout_rows"] == meta["data"]["holdout_rows"] > 0
    assert rc["holdout_loss_after"] < rc["holdout_loss_before"]
    # on rows it did not train on the weighted model over-predicts (σ(margin)'s calibration 1.48-1.56
    # over six samples (six paths), the recalibrated one 0.96-1.05)
    assert rc["slope"] > 0 and rc["iterations"] >= 1
    pop, y = _probabilities(spark, data, "m-auto", "population")
    raw, _ = _probabilities(spark, data, "m-auto", "raw")
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    np.testing.assert_allclose(logit(pop), rc["slope"] * logit(raw) + rc["shift"], rtol=0, atol=1e-8)
    # on the unsampled rows the recalibrated probabilities are the better calibrated, and the better loss
    cal = lambda p: p.mean() / y.mean()  # noqa: E731
    ll = lambda p: -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))  # noqa: E731
    assert abs(cal(pop) - 1) < 0.15 < 0.3 < abs(cal(raw) - 1), (cal(pop), cal(raw))
    assert ll(pop) < ll(raw)
    r = evaluate(spark, str(data / "all"), str(data / "m-auto"))
    assert r["calibration"] == pytest.approx(cal(pop), rel=1e-9) and r["logloss"] == pytest.approx(ll(pop), rel=1e-9)
    assert r["weighting"]["recalibration"] == [rc["slope"], rc["shift"]]
    assert r["raw_calibration"] == pytest.approx(cal(raw), rel=1e-9)


def test_when_recalibration_applies(spark, data):
    off = _train(spark, data, "m-off", "train.recalibrate=off")
    assert off["recalibration"] == {"applied": False, "why": "train.recalibrate = off"}
    raw, _ = _probabilities(spark, data, "m-off", "raw")
    pop, _ = _probabilities(spark, data, "m-off", "population")
    np.testing.assert_array_equal(raw, pop)  # nothing fitted: population is sigma(margin), bit for bit
    assert "raw_calibration" not in evaluate(spark, str(data / "all"), str(data / "m-off"))
    full = _train(spark, data, "m-full", dataset="all")
    assert full["recalibration"] == {"applied": False, "why": "auto: the dataset keeps every row"}
    on = _train(spark, data, "m-on", "train.recalibrate=on", dataset="all")
    assert on["recalibration"]["applied"] and on["recalibration"]["why"] == "train.recalibrate = on"
    # auto without held-out rows: not applied, and the reason says so
    none = _train(spark, data, "m-none", "train.holdout_period=0")
    assert not none["recalibration"]["applied"] and "holds no rows out" in none["recalibration"]["why"]


def test_one_and_two_workers_fit_the_same_recalibration(spark, data):
    one = _train(spark, data, "m-k1", "train.workers=1", "train.solver=lbfgs", "train.passes=30", "train.tol=1e-10")
    two = _train(spark, data, "m-k2", "train.workers=2", "train.solver=lbfgs", "train.passes=30", "train.tol=1e-10")
    a, b = one["recalibration"], two["recalibration"]
    assert a["holdout_rows"] == b["holdout_rows"]
    np.testing.assert_allclose([a["slope"], a["shift"]], [b["slope"], b["shift"]], rtol=1e-5)


@pytest.mark.parametrize("sets,match", [
    (["train.recalibrate=on", "train.holdout_period=0", "train.l2=1e-6"], r"train\.recalibrate = .on..*holdout_period = 0"),
    (["train.recalibrate=on", "train.loss=squared", "train.l2=1e-6"], r"train\.recalibrate = 'on'.*'squared'"),
    (["train.recalibrate=on", "train.solver=cocoa", "train.l2=1e-6"], r"train\.recalibrate = 'on'.*'cocoa' trains on every row"),
    (["train.recalibrate=maybe"], r"train\.recalibrate"),
])
def test_impossible_recalibration_is_refused_naming_the_key(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], sets)
