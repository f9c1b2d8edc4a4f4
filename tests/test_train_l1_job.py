"""``train.l1`` through the train / evaluate jobs on a real Spark session: two ranks and one
reach the same L1 optimum; the model directory stores the sparse model as indices + values and
records its non-zero count, which evaluate, the summaries and the report give; evaluate's
objective includes the L1 term; a killed attempt resumes OWL-QN from its checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.scoring import evaluate
from terascale.jobs.steps import metrics_summary, train_summary
from terascale.jobs.train_job import run_train
from terascale.pipeline import modeldir
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

pytestmark = pytest.mark.spark
L1 = ["train.solver=lbfgs", "train.l1=2e-3", "train.l2=1e-4", "train.holdout_period=0", "train.early_stop_passes=0",
      "train.passes=200", "train.tol=1e-10", "spark.master=local[2]"]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("l1")
    generate_clicklogs(d / "raw", 4000, files=2, seed=13, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=14, seed=0)
    run_featurize(spark, [str(d / "raw")], str(d / "tr"), spec, load_config([], ["featurize.partitions=2"]).featurize)
    return d


def test_l1_model_through_the_jobs(spark, data, tmp_path):
    m1 = run_train(spark, load_config([], [*L1, "train.workers=1"]), str(data / "tr"), str(tmp_path / "m1"))
    m2 = run_train(spark, load_config([], [*L1, "train.workers=2"]), str(data / "tr"), str(tmp_path / "m2"))
    assert m2["objective"] == pytest.approx(m1["objective"], rel=1e-7), (m1["stop_reason"], m2["stop_reason"])
    w1, _, _ = modeldir.load_model(str(tmp_path / "m1"))
    w2, _, meta = modeldir.load_model(str(tmp_path / "m2"))
    nnz = int(np.count_nonzero(w2))
    assert meta["weights"] == {"storage": "sparse", "nonzeros": nnz, "length": 1 << 14}
    assert (tmp_path / "m2" / modeldir.WEIGHTS_SPARSE).exists() and not (tmp_path / "m2" / modeldir.WEIGHTS).exists()
    assert 0 < nnz < (1 << 13)  # stored sparse: fewer than half the weights are non-zero
    assert np.array_equal(w1 != 0, w2 != 0) or np.count_nonzero((w1 != 0) != (w2 != 0)) <= 2
    r = evaluate(spark, str(data / "tr"), str(tmp_path / "m2"))
    assert r["nonzeros"] == nnz and r["features"] == 1 << 14
    # evaluate's objective is f with the model's l1 and l2: on the training rows, the train job's
    assert r["objective"] == pytest.approx(m2["objective"], rel=1e-6)
    assert "0.002 |beta|_1" in r["objective_definition"]
    assert f"{nnz:,} non-zero of 16,384 (stored sparse)" in train_summary(meta)
    assert f"non-zero weights    {nnz:,} of 16,384" in metrics_summary(r)
    assert "l1 0.002" in train_summary(meta)


def test_a_killed_l1_attempt_resumes_from_its_checkpoint(spark, data, tmp_path):
    base = [*L1, "train.solver=hybrid", "train.workers=2", "train.passes=8", "train.checkpoint_interval_s=0"]
    clean = run_train(spark, load_config([], base), str(data / "tr"), str(tmp_path / "clean"))
    hurt = run_train(spark, load_config([], [*base, "train.inject.fail_shard=1", "train.inject.fail_pass=4",
                                             "train.inject.fail_mode=kill"]), str(data / "tr"), str(tmp_path / "hurt"))
    assert [a["outcome"] for a in hurt["attempts"]] == ["failed", "succeeded"]
    assert {r["resumed_from_pass"] for r in hurt["per_rank"]} in ({3}, {4})
    assert hurt["objective"] == clean["objective"]
    a, _, _ = modeldir.load_model(str(tmp_path / "clean"))
    b, _, _ = modeldir.load_model(str(tmp_path / "hurt"))
    assert a.tobytes() == b.tobytes()
