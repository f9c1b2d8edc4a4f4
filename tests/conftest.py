"""Shared fixtures: one Spark session for the whole run (local[2], UI off, loopback only)."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("PYTHONHASHSEED", "0")
# train and evaluate track to MLflow when MLFLOW_TRACKING_URI is set (jobs.tracking): the suite
# never logs to a developer's tracking server; the MLflow tests name their own store
os.environ.pop("MLFLOW_TRACKING_URI", None)
# numba's default cache is keyed on each kernel's own file and timestamp, but a cached kernel
# contains the code of the njit functions it calls: after an edit to a callee in another file
# (losses.py under dual_kernels.py, say) the tests would run the caller's stale code. The
# project's locator keys every cache on a hash of the whole package instead (set before numba
# is imported; Spark's Python workers inherit it). Must equal pipeline.numba_cache.LOCATORS.
NUMBA_LOCATORS = ("terascale.pipeline.numba_cache.StableLocator,InTreeCacheLocator,UserWideCacheLocator,"
                  "ZipCacheLocator")
os.environ.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", NUMBA_LOCATORS)


def _gpu_available() -> bool:
    """A real CUDA device: numba's simulator (NUMBA_ENABLE_CUDASIM=1, where is_available() is
    True) is not one, and the ``gpu`` tests' sizes are for a device."""
    try:
        from numba import config, cuda

        return bool(cuda.is_available()) and not getattr(config, "ENABLE_CUDASIM", 0)
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return False


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a test on the spark fixture is a Spark test (make test-spark35 selects by marker)
        if "spark" in getattr(item, "fixturenames", ()) and "spark" not in item.keywords:
            item.add_marker(pytest.mark.spark)
    if any("gpu" in item.keywords for item in items) and not _gpu_available():
        skip = pytest.mark.skip(reason="no CUDA device on this machine (numba's simulator is not one)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    items[:] = sorted(items, key=_runs_last)  # stable: the suite's order otherwise


#: modules of whole-pipeline runs in subprocesses (spark-submit, the benchmark harness): they go
#: after the rest of the suite, whose tests have by then compiled the kernels into the user-wide
#: numba cache that these runs' executors load (tests/multihost, tests/test_bench_scale.py; the
#: standalone cluster keeps a cache of its own: a fresh cluster's executors compile, as a user's do)
LAST = ("tests/cluster/", "tests/multihost/", "tests/test_bench_scale.py")


def _runs_last(item) -> bool:
    return item.nodeid.startswith(LAST)


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    from terascale.jobs.session import EXECUTOR_ENV

    s = (
        SparkSession.builder.master("local[2]")
        .appName("terascale-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config(map=EXECUTOR_ENV)  # as the jobs' sessions (jobs.session)
        .getOrCreate()
    )
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()
