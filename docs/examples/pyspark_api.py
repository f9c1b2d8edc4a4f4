"""terascale from your own PySpark code: the pyspark.ml Estimator and Model (``jobs.ml``).

Generates small click logs, featurizes them, fits a TerascaleClassifier on a DataFrame,
scores a test DataFrame with the model, evaluates it, saves it and loads it back.

    python docs/examples/pyspark_api.py [WORKDIR]            # local[2]
    spark-submit docs/examples/pyspark_api.py [WORKDIR]      # spark-submit's master

Needs terascale installed (``make`` creates .venv with it; ``pip install -e .`` elsewhere).
WORKDIR defaults to a fresh temporary directory.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

from pyspark.sql import functions as F

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.ml import TerascaleClassifier, TerascaleModel
from terascale.jobs.scoring import evaluate
from terascale.jobs.session import get_spark
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec


def main(argv: list[str]) -> int:
    work = os.path.abspath(argv[0] if argv else tempfile.mkdtemp(prefix="terascale-example-"))
    cfg = load_config(sets=["spark.master=local[2]", "featurize.partitions=2"])
    spark = get_spark(cfg.spark)  # spark-submit's session when run by spark-submit

    # 1. small click logs and their featurized datasets (Parquet + _manifest.json)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=18, seed=0)
    for name, rows, seed in (("train", 20_000, 1), ("test", 5_000, 2)):
        generate_clicklogs(os.path.join(work, f"raw-{name}"), rows, files=2, seed=seed, processes=1)
        run_featurize(spark, [os.path.join(work, f"raw-{name}")], os.path.join(work, name), spec, cfg.featurize)
    train = spark.read.parquet(os.path.join(work, "train"))
    test = spark.read.parquet(os.path.join(work, "test"))

    # 2. fit: the params are the schema's train.* / allreduce.* keys in camelCase
    clf = TerascaleClassifier(workers=2, l2=1e-5, passes=10, modelDir=os.path.join(work, "model"))
    print(clf.explainParam("l2"))
    model = clf.fit(train)  # a plain read of a dataset: trained on in place
    print(f"trained: objective {model.metadata['objective']:.6f} after {len(model.metadata['history'])} passes, "
          f"intercept {model.intercept:.4f}")

    # 3. transform: + probability (float64) and prediction (probability > threshold)
    scored = model.transform(test)
    scored.select("label", "probability", "prediction").show(5)
    p = F.greatest(F.least(F.col("probability"), F.lit(1 - 1e-15)), F.lit(1e-15))
    mine = scored.select(F.avg(-(F.col("label") * F.log(p) + (1 - F.col("label")) * F.log(1 - p)))).first()[0]

    # 4. evaluate with terascale's evaluator on the model directory fit wrote
    r = evaluate(spark, os.path.join(work, "test"), os.path.join(work, "model"))
    print(f"logloss {r['logloss']:.6f} (from transform: {mine:.6f}), auROC {r['auroc']:.4f}")

    # 5. save and load (a model directory: weights.npy + metadata.json + pyspark params)
    saved = os.path.join(work, "saved-model")
    model.write().overwrite().save(saved)
    loaded = TerascaleModel.load(saved)
    same = loaded.transform(test).select("probability").collect() == scored.select("probability").collect()
    print(f"saved to {saved} and loaded back: the same scores: {same}")
    ok = math.isfinite(r["logloss"]) and abs(mine - r["logloss"]) < 1e-9 and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
