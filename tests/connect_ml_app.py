"""The PySpark API through Spark Connect, in a process of its own (a Connect session cannot live
beside tests' classic one): ``SPARK_REMOTE`` names the server.

    SPARK_REMOTE=sc://... python -m tests.connect_ml_app WORKDIR OUT_JSON

A ``Pipeline`` of ``TerascaleFeaturizer`` and ``TerascaleClassifier`` fits on a DataFrame of raw
columns (tests/test_ml_featurize.py's table) and its model scores new rows; a classifier fits on a
featurized dataset's path and transforms it. Writes the probabilities, for
tests/test_spark_connect.py to compare with ``terascale score`` and a classic session.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(work: Path) -> dict:
    from pyspark.ml import Pipeline
    from pyspark.sql import SparkSession

    from terascale.jobs.ml import TerascaleClassifier
    from terascale.jobs.ml_featurize import TerascaleFeaturizer
    from tests.frames import frame
    from tests.test_ml_featurize import CONF, _table

    spark = SparkSession.builder.getOrCreate()
    assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
    feat = TerascaleFeaturizer(conf=CONF)
    clf = TerascaleClassifier(featureSpec=feat.featureSpecJson(), workers=1, passes=3, holdoutPeriod=5,
                              earlyStopPasses=0, l2=1e-4, modelDir=str(work / "m"))
    model = Pipeline(stages=[feat, clf]).fit(frame(spark, _table(3000, 2)))
    new = _table(200, 3).drop_columns(["clicks"])
    raw = [r["probability"] for r in model.stages[1].transform(frame(spark, new)).orderBy("other").collect()]
    data = str(work / "data")
    path_model = TerascaleClassifier(workers=2, passes=4, l2=1e-5, modelDir=str(work / "m2")).fit(data)
    featurized = [r["probability"] for r in path_model.transform(spark.read.parquet(data)).collect()]
    return {"raw": raw, "featurized": featurized}


if __name__ == "__main__":
    work = Path(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(main(work)))
