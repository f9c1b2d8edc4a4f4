"""Serving parity for a table model: the Spark predict job, ``terascale score`` on JSON lines and
the MLflow pyfunc on a pandas DataFrame give the same probabilities, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import feature_spec, load_config
from terascale.jobs.scoring import predict
from terascale.jobs.train_job import run_train
from terascale.pipeline.scorer import MalformedLine, Scorer
from terascale.pipeline.spark_table import run_table_featurize

pytestmark = pytest.mark.spark

SETS = ["featurize.format=table", "featurize.bits=14", "featurize.seed=2", "featurize.label=clicked",
        "featurize.partitions=1",
        "featurize.columns=[{name: site, missing: token}, app, {name: price, kind: numeric, bucketing: log}, "
        "{name: score, kind: numeric}, {name: segs, kind: multi}, {name: kv, kind: map}]",
        "featurize.crosses=[[site, app]]"]
TRAIN = ["train.workers=1", "train.passes=3", "train.holdout_period=5", "train.early_stop_passes=0", "train.l2=1e-5",
         "spark.master=local[2]"]


def _table(n: int) -> pa.Table:
    rng = np.random.default_rng(8)
    site = np.array(["a", "b", "ç", None, ""], dtype=object)[rng.integers(0, 5, n)]
    segs = [None if k == 0 else [f"s{x}" for x in rng.integers(0, 6, k)] for k in rng.integers(0, 4, n)]
    kv = [{f"k{x}": float(rng.normal()) for x in range(rng.integers(0, 3))} for _ in range(n)]
    return pa.table({
        "clicked": pa.array(rng.random(n) < 0.3), "site": pa.array(site, pa.string()),
        "app": pa.array(rng.integers(0, 9, n), pa.int64()), "price": pa.array(rng.lognormal(0, 1.5, n)),
        "score": pa.array(rng.normal(size=n)), "segs": pa.array(segs, pa.list_(pa.string())),
        "kv": pa.array([list(d.items()) for d in kv], pa.map_(pa.string(), pa.float64())),
    })


@pytest.fixture(scope="module")
def served(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("serving")
    (d / "raw").mkdir()
    t = _table(1500)
    pq.write_table(t, d / "raw" / "part-0.parquet")
    cfg = load_config([], SETS)
    run_table_featurize(spark, [str(d / "raw")], str(d / "ds"), feature_spec(cfg), cfg.featurize)
    run_train(spark, load_config([], TRAIN), str(d / "ds"), str(d / "model"))
    p = predict(spark, str(d / "ds"), str(d / "model"), str(d / "pred"), (), "population")
    want = pa.concat_tables([pq.read_table(d / "pred" / f["path"]) for f in p["files"]])["probability"].to_numpy()
    records = t.to_pylist()
    for r in records:
        r["kv"] = dict(r["kv"])
    return d, records, want


def test_score_on_json_lines_equals_predict(served):
    d, records, want = served
    lines = "".join(json.dumps({k: v for k, v in r.items() if k != "clicked"}, ensure_ascii=False) + "\n"
                    for r in records).encode("utf-8")
    got = Scorer.from_model_dir(str(d / "model")).predict_block(lines)
    assert got.tobytes() == want.tobytes()
    out = subprocess.run([sys.executable, "-m", "terascale.jobs.cli", "score", "--model", str(d / "model")],
                         input=lines, capture_output=True, check=True)
    assert np.array([float(x) for x in out.stdout.split()]).tobytes() == want.tobytes()


def test_pyfunc_on_a_dataframe_equals_predict(served):
    from terascale.jobs.mlflow_model import ARTIFACT, RawLineModel

    d, records, want = served
    model = RawLineModel()
    model.load_context(SimpleNamespace(artifacts={ARTIFACT: str(d / "model")}, model_config={}))
    df = pa.Table.from_pylist(records).to_pandas()  # maps become lists of pairs, missing values NaN/None
    df["kv"] = [dict(r["kv"]) for r in records]
    assert model.predict(None, df).tobytes() == want.tobytes()


def test_a_bad_record_names_its_line(served):
    d, records, _ = served
    scorer = Scorer.from_model_dir(str(d / "model"))
    lines = b'{"site": "a", "app": 1}\n{"site": "a", "price": "cheap"}\nnot json\n'
    with pytest.raises(MalformedLine, match="line 2: malformed \\(unparsable\\)"):
        scorer.predict_block(lines)
    got = scorer.predict_block(lines, skip_bad=True)
    assert np.isfinite(got[0]) and np.isnan(got[1:]).all()
