"""TerascaleFeaturizer (jobs.ml_featurize): a pyspark.ml Pipeline on a DataFrame of raw columns
featurizes as the featurize job does, trains, and scores raw rows as terascale score does."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from terascale.jobs.ml import TerascaleClassifier
from terascale.jobs.ml_featurize import TerascaleFeaturizer
from terascale.pipeline.scorer import Scorer
from terascale.pipeline.table_spec import BadRow, record_label, record_row
from terascale.solvers.constraints import ConfigError
from tests.frames import frame

pytestmark = pytest.mark.spark

CONF = """
featurize:
  format: table
  bits: 14
  seed: 4
  label: clicks
  columns:
    - {name: site, missing: token}
    - app
    - {name: price, kind: numeric, bucketing: log}
    - {name: segs, kind: multi}
  crosses: [[site, app]]
"""


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    segs = [[f"s{x}" for x in rng.integers(0, 5, k)] for k in rng.integers(0, 3, n)]
    return pa.table({
        "clicks": pa.array(rng.integers(-2, 3, n), pa.int64()),  # -2: bad_label
        "site": pa.array(np.array(["a", "b", "é", None], dtype=object)[rng.integers(0, 4, n)], pa.string()),
        "app": pa.array(rng.integers(0, 7, n), pa.int64()),
        "price": pa.array(rng.lognormal(0, 1, n)),
        "segs": pa.array(segs, pa.list_(pa.string())),
        "other": pa.array(np.arange(n)),  # a column the spec does not use: kept
    })


def test_the_featurizer_gives_the_references_rows_and_keeps_every_row(spark):
    t = _table(400, 1)
    feat = TerascaleFeaturizer(conf=CONF)
    spec = feat.spec()
    out = feat.transform(frame(spark, t)).orderBy("other").collect()
    assert len(out) == t.num_rows
    for rec, row in zip(t.to_pylist(), out, strict=True):
        assert row["other"] == rec["other"]
        try:
            y = record_label(rec["clicks"])
            idx, vals = record_row(spec.table, spec.bits, spec.seed, rec)
        except BadRow as e:
            assert row["reason"] == e.reason and row["indices"] is None and row["label"] is None
            continue
        assert row["reason"] is None and row["label"] == y and row["indices"] == idx
        assert (row["values"] or [1.0] * len(idx)) == vals


def test_a_pipeline_on_raw_columns_trains_and_scores_as_terascale_score(spark, tmp_path):
    from pyspark.ml import Pipeline

    train = frame(spark, _table(3000, 2))
    feat = TerascaleFeaturizer(conf=CONF)
    clf = TerascaleClassifier(featureSpec=feat.featureSpecJson(), workers=1, passes=3, holdoutPeriod=5,
                              earlyStopPasses=0, l2=1e-4, modelDir=str(tmp_path / "m"))
    model = Pipeline(stages=[feat, clf]).fit(train)
    new = _table(200, 3).drop_columns(["clicks"])  # serving rows: no label
    scored = model.stages[1].transform(frame(spark, new)).orderBy("other").collect()
    want = Scorer.from_model_dir(str(tmp_path / "m")).predict_records(new.to_pylist())
    assert np.array([r["probability"] for r in scored]).tobytes() == want.tobytes()


def test_quantile_fields_need_learned_boundaries():
    conf = CONF.replace("bucketing: log", "bucketing: quantile, quantiles: 4")
    with pytest.raises(ConfigError, match="price: quantile boundaries are learned by terascale featurize"):
        TerascaleFeaturizer(conf=conf).spec()
