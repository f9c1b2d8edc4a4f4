"""The pyspark.ml API (jobs.ml): schema-generated params, fit, transform, persistence, example."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, Config, ConfigError, iter_params, load_config
from terascale.jobs.ml import TerascaleClassifier, TerascaleModel
from terascale.jobs.ml_params import PARAM_KEYS, param_name
from terascale.jobs.scoring import evaluate, predict
from terascale.jobs.train_job import run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.modeldir import ModelError, load_model
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec
from tests.frames import frame

ROOT = Path(__file__).resolve().parents[1]
# deterministic L-BFGS to a tight tolerance: any sharding reaches the same optimum
EXACT = {"solver": "lbfgs", "holdoutPeriod": 0, "earlyStopPasses": 0, "passes": 200, "tol": 1e-8,
         "l2": 1e-2, "workers": 2}


def _key_default(key: str):
    v: object = Config()
    for part in key.split("."):
        v = getattr(v, part)
    return v


def test_params_are_generated_from_the_schema():
    clf = TerascaleClassifier()
    keys = [k for k, _ in iter_params() if k.split(".")[0] in ("train", "allreduce")]
    assert sorted(PARAM_KEYS.values()) == sorted(keys)
    for key, f in iter_params():
        if key not in keys:
            continue
        p = clf.getParam(param_name(key))
        assert clf.getOrDefault(p) == _key_default(key), key
        assert f.metadata["help"] in p.doc and key in p.doc
        assert getattr(clf, "get" + p.name[0].upper() + p.name[1:])() == _key_default(key)
    assert [param_name(k) for k in ("train.l2", "train.learning_rate", "train.inject.fail_shard",
                                    "allreduce.io_timeout_s")] == ["l2", "learningRate", "injectFailShard",
                                                                   "allreduceIoTimeoutS"]
    assert TerascaleClassifier(l2=0.5, shuffle=True).config() == load_config(sets=["train.l2=0.5", "train.shuffle=true"])


@pytest.mark.parametrize("name,value,key", [("l2", -1, "train.l2"), ("solver", "sgd", "train.solver"),
                                            ("workers", 2.5, "train.workers"), ("shuffle", "maybe", "train.shuffle"),
                                            ("allreduceIoTimeoutS", 0, "allreduce.io_timeout_s")])
def test_a_bad_value_gets_the_schemas_error_naming_the_key(name, value, key):
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    with pytest.raises(ConfigError) as expected:
        load_config(sets=[f"{key}={text}"])
    with pytest.raises(ConfigError) as got:
        TerascaleClassifier(**{name: value})
    assert str(got.value) == str(expected.value) and str(got.value).startswith(key)
    clf = TerascaleClassifier()
    with pytest.raises(ConfigError, match=key):
        getattr(clf, "set" + name[0].upper() + name[1:])(value)
    with pytest.raises(ValueError, match=key):
        clf.set(clf.getParam(name), value)


def test_l2_auto_is_a_param_value_and_its_cross_checks_run_on_the_whole_configuration():
    assert TerascaleClassifier().getOrDefault("l2") == "auto"
    assert TerascaleClassifier(l2="auto").config().train.l2 == "auto"
    clf = TerascaleClassifier(solver="cocoa", holdoutPeriod=0)  # each fine on its own
    with pytest.raises(ConfigError, match=r"train.l2 = 'auto': must be a number with train.solver = 'cocoa'"):
        clf.config()
    assert TerascaleClassifier(solver="cocoa", holdoutPeriod=0, l2=1e-3).config().train.l2 == 1e-3


def test_cross_key_checks_run_at_fit_and_unknown_params_are_named():
    clf = TerascaleClassifier(injectFailShard=5)  # fine on its own: train.workers could be raised
    with pytest.raises(ConfigError, match=r"train.inject.fail_shard = 5: must be -1 or a shard in \[0, 1\]"):
        clf.fit("/nonexistent/dataset")  # checked before any data is touched
    with pytest.raises(ValueError, match="no param 'learning_rate'"):
        TerascaleClassifier(learning_rate=0.1)


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("ml")
    generate_clicklogs(d / "raw", 6000, files=2, seed=5, processes=1)
    generate_clicklogs(d / "rawt", 1500, files=1, seed=6, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
    for raw, name in (("raw", "tr"), ("rawt", "te")):
        run_featurize(spark, [str(d / raw)], str(d / name), spec, load_config([], ["featurize.partitions=2"]).featurize)
    return d


@pytest.fixture(scope="module")
def reference(spark, data, tmp_path_factory):
    """run_train with the configuration the EXACT params describe."""
    out = tmp_path_factory.mktemp("ref") / "model"
    cfg = TerascaleClassifier(**EXACT).config()
    meta = run_train(spark, cfg, str(data / "tr"), str(out))
    return out, meta


@pytest.mark.spark
def test_fit_on_a_dataframe_or_a_path_equals_run_train(spark, data, reference, tmp_path):
    ref_dir, ref = reference
    w_ref, b_ref, _ = load_model(str(ref_dir))
    clf = TerascaleClassifier(**EXACT)
    for what in (spark.read.parquet(str(data / "tr")), str(data / "tr")):  # trained on in place
        m = clf.fit(what)
        assert np.array_equal(m.weights, w_ref) and m.intercept == b_ref and m.modelDir is None
        assert m.metadata["data"]["dataset"] == str(data / "tr")
    # a transformed DataFrame is written to a temporary dataset under tempDir, then removed
    m = clf.copy().setParams(tempDir=str(tmp_path), modelDir=str(tmp_path / "kept")).fit(
        spark.read.parquet(str(data / "tr")).select("indices", "label", "values"))
    assert m.metadata["objective"] == pytest.approx(ref["objective"], rel=1e-7)
    assert np.max(np.abs(m.weights - w_ref)) < 1e-3 and m.modelDir == str(tmp_path / "kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert m.metadata["data"]["rows"] == 6000 and m.metadata["spec"] == ref["spec"]


@pytest.mark.spark
def test_fit_on_an_in_memory_dataframe_needs_a_feature_spec(spark, data, reference):
    _, ref = reference
    t = pq.read_table(data / "tr", columns=["label", "indices", "values"])  # no lineage, other types
    df = frame(spark, t.rename_columns(["y", "indices", "values"]).cast(pa.schema(
        [("y", pa.float64()), ("indices", pa.list_(pa.int64())), ("values", pa.list_(pa.float64()))])))
    clf = TerascaleClassifier(**EXACT, labelCol="y")
    with pytest.raises(ValueError, match="feature spec is unknown.*set featureSpec"):
        clf.fit(df)
    m = clf.setParams(featureSpec=json.dumps(ref["spec"])).fit(df)
    assert m.metadata["objective"] == pytest.approx(ref["objective"], rel=1e-7)
    assert m.metadata["data"]["rows"] == 6000
    with pytest.raises(ModelError, match="featureSpec differs .* on bits"):
        clf.setParams(featureSpec='{"bits": 17}').fit(spark.read.parquet(str(data / "tr")))


@pytest.fixture(scope="module")
def model(spark, reference):
    return TerascaleModel.from_dir(str(reference[0]))


@pytest.mark.spark
def test_transform_equals_the_scorer_on_the_same_rows(spark, data, model, reference, tmp_path):
    out = model.transform(spark.read.parquet(str(data / "te"))).collect()
    assert len(out) == 1500
    p = predict(spark, str(data / "te"), str(reference[0]), str(tmp_path / "pred"), ("indices", "values"))
    scorer = {}
    for f in p["files"]:
        t = pq.read_table(tmp_path / "pred" / f["path"])
        for idx, vals, prob in zip(t["indices"].to_pylist(), t["values"].to_pylist(), t["probability"].to_pylist(),
                                   strict=True):
            scorer[(tuple(idx), vals and tuple(vals))] = prob
    assert all(r.probability == scorer[(tuple(r.indices), r["values"] and tuple(r["values"]))] for r in out)  # exact
    assert all(r.prediction == float(r.probability > 0.5) for r in out)
    assert sum(r.prediction for r in out) > 0
    high = model.copy({model.threshold: 0.9, model.probabilityCol: "p"}).transform(
        spark.read.parquet(str(data / "te"))).select("p", "prediction").collect()
    assert [r.prediction for r in high] == [float(r.p > 0.9) for r in high]


@pytest.mark.spark
def test_transform_checks_the_feature_spec_and_the_index_range(spark, data, model, tmp_path):
    other = tmp_path / "te17"
    shutil.copytree(data / "te", other)
    m = read_manifest(str(other))
    m["spec"]["bits"] = 17
    (other / "_manifest.json").write_text(json.dumps(m))
    with pytest.raises(ModelError, match=r"featurized differently \(bits\)"):
        model.transform(spark.read.parquet(str(other)))
    bad = spark.createDataFrame([([1, 70000],)], "indices array<int>")
    with pytest.raises(Exception, match=r"is outside \[0, n_features = 65536\)"):
        model.transform(bad).collect()
    ok = model.transform(spark.createDataFrame([([3, 9], [2.0, 1.0]), ([], None)], "indices array<int>, values array<float>"))
    w, b = model.weights, model.intercept
    m0 = b + 2.0 * float(w[3]) + float(w[9])
    got = [r.probability for r in ok.collect()]
    assert got[0] == pytest.approx(1 / (1 + np.exp(-m0)), rel=1e-12) and got[1] == pytest.approx(1 / (1 + np.exp(-b)), rel=1e-12)


@pytest.mark.spark
def test_save_and_load_round_trip(spark, data, model, tmp_path):
    path = str(tmp_path / "saved")
    model.copy({model.threshold: 0.3}).save(path)
    back = TerascaleModel.load(path)
    assert np.array_equal(back.weights, model.weights) and back.intercept == model.intercept
    assert back.getOrDefault(back.threshold) == 0.3 and back.metadata["spec"] == model.spec
    w, b, _ = load_model(path)  # a plain model directory: the jobs read it too
    assert np.array_equal(w, model.weights) and b == model.intercept
    assert evaluate(spark, str(data / "te"), path)["rows"] == 1500
    with pytest.raises(FileExistsError):
        model.save(path)
    model.write().overwrite().save(path)
    assert TerascaleModel.from_dir(path).getOrDefault("threshold") == 0.5
    # the estimator's params persist too, and the model persists inside a PipelineModel
    clf = TerascaleClassifier(l2=0.25, solver="online")
    clf.save(str(tmp_path / "clf"))
    assert TerascaleClassifier.load(str(tmp_path / "clf")).config() == clf.config()
    from pyspark.ml import PipelineModel

    PipelineModel(stages=[model]).save(str(tmp_path / "pipe"))
    stage = PipelineModel.load(str(tmp_path / "pipe")).stages[0]
    assert isinstance(stage, TerascaleModel) and np.array_equal(stage.weights, model.weights)


@pytest.mark.slow
@pytest.mark.spark
def test_the_example_runs(tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "pyspark_api.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "logloss" in r.stdout and "the same scores: True" in r.stdout
    assert any((tmp_path / "saved-model" / f).exists() for f in ("weights.npy", "weights_sparse.npz"))
