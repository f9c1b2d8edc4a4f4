"""Creating (or joining) the Spark session a job runs in."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("terascale")


def launched_by_spark_submit() -> bool:
    """True inside a driver started by spark-submit (the JVM exported its gateway to Python)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_spark(sconf):
    """The Spark session: spark-submit's own, or a new one from the ``spark`` config section.

    Under spark-submit the master and settings come from spark-submit (the config's
    ``spark.master`` is ignored there, so one job file serves local runs and clusters).
    """
    from pyspark.sql import SparkSession

    if launched_by_spark_submit():
        b = SparkSession.builder.appName(sconf.app_name)
        for k, v in _executor_defaults().items():
            b = b.config(k, v)
        spark = b.getOrCreate()
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        b = SparkSession.builder.master(sconf.master).appName(sconf.app_name)
        extra = dict(sconf.conf)
        if sconf.master.startswith("local"):
            # a laptop or CI run: keep everything on loopback, no UI port to collide on
            extra.setdefault("spark.driver.host", "127.0.0.1")
            extra.setdefault("spark.driver.bindAddress", "127.0.0.1")
            extra.setdefault("spark.ui.enabled", "false")
        if not sys.stderr.isatty():
            extra.setdefault("spark.ui.showConsoleProgress", "false")  # no progress bars in logs
        extra.setdefault("spark.sql.execution.arrow.pyspark.enabled", "true")
        for k, v in extra.items():
            b = b.config(k, v)
        spark = b.getOrCreate()
    spark.sparkContext.setLogLevel(sconf.log_level)
    log.info("spark: master=%s parallelism=%d", spark.sparkContext.master, spark.sparkContext.defaultParallelism)
    return spark


def _executor_defaults() -> dict[str, str]:
    """Settings terascale adds under spark-submit unless the submitter set them: executors
    keep numba's compiled kernels across applications (``pipeline.numba_cache``)."""
    from pyspark import SparkConf, SparkContext

    from pipeline.numba_cache import LOCATORS

    SparkContext._ensure_initialized()  # the gateway spark-submit started: its --conf values
    submitted = SparkConf()
    wanted = {"spark.executorEnv.NUMBA_CACHE_LOCATOR_CLASSES": LOCATORS}
    return {k: v for k, v in wanted.items() if not submitted.contains(k)}

