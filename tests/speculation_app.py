"""Featurize under Spark's speculation, in its own Spark application (one master per process).

    python -m tests.speculation_app MASTER RAW_DIR WORK_DIR  -> prints the manifest as JSON

Featurizes RAW_DIR into ``WORK/spec`` in 4 tasks with ``spark.speculation=true`` and task 1's
first attempt held back after its output is complete (featurize.inject_slow_task), so that Spark
runs a speculative copy of it. The event log (``WORK/events``) records every task attempt.
Used by tests/test_featurize_speculation.py.
"""

from __future__ import annotations

import json
import os
import sys

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.pipeline.numba_cache import LOCATORS
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

SLOW_S = 120.0  # the straggler's wait: the job ends long before unless a copy overtakes it
SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=18, seed=5)


def main(master: str, raw: str, work: str) -> None:
    from pyspark.sql import SparkSession

    os.makedirs(f"{work}/events", exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    b = (SparkSession.builder.master(master).appName("terascale-speculation-test")
         .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.pyspark.python", sys.executable)
         .config("spark.executorEnv.PYTHONPATH", root).config("spark.executorEnv.PYTHONHASHSEED", "0")
         .config("spark.executor.memory", "512m")
         .config("spark.executorEnv.NUMBA_CACHE_LOCATOR_CLASSES", LOCATORS)  # compiled kernels from earlier runs
         .config("spark.speculation", "true").config("spark.speculation.interval", "100ms")
         .config("spark.speculation.multiplier", "2").config("spark.speculation.quantile", "0.5")
         .config("spark.speculation.minTaskRuntime", "500ms")
         .config("spark.eventLog.enabled", "true").config("spark.eventLog.dir", f"file://{work}/events")
         .config("spark.eventLog.rolling.enabled", "false").config("spark.eventLog.compress", "false"))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    fconf = load_config([], ["featurize.partitions=4", "featurize.inject_slow_task=1",
                             f"featurize.inject_slow_s={SLOW_S}"]).featurize
    try:
        manifest = run_featurize(spark, [raw], f"{work}/spec", SPEC, fconf)
    finally:
        spark.stop()
    print(json.dumps(manifest))


if __name__ == "__main__":
    main(*sys.argv[1:4])
