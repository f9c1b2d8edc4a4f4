"""Creating (or joining) the Spark session a job runs in.

Executor environment (:data:`EXECUTOR_ENV`, each variable added unless the job's own Spark
settings name it; measurements: ``docs/pages/explanation/design-notes.md``):

- ``NUMPY_MADVISE_HUGEPAGE=0``. Otherwise numpy advises the kernel to back every array of 4 MiB
  or more with transparent huge pages (``madvise(MADV_HUGEPAGE)``). Where THP's ``defrag``
  setting is ``madvise`` (a common default), the first touch of such memory then compacts memory
  synchronously, and on a node whose free memory is fragmented (a busy page cache) that stalls a
  task on every large array: a fresh Python worker pays it for its shard's CSR, the online
  table, the L-BFGS working table and every new buffer. The kernels prefetch the rows they
  gather, so 4 KiB pages do not slow them down.
- ``MALLOC_MMAP_THRESHOLD_=33554432``, ``MALLOC_TRIM_THRESHOLD_=268435456`` (glibc, numpy's
  arrays) and ``MIMALLOC_PURGE_DELAY=-1`` (mimalloc, pyarrow's default pool on Linux): a worker
  keeps the memory it freed for its next batch instead of handing it back to the kernel and
  faulting it in again, 4 KiB page by page. A featurize batch allocates and frees some hundreds
  of MiB (the read batch, the parts, the rows, the pages); returned and re-faulted each time,
  that was about 40k page faults per million rows and a tenth of the task's time. Arrays over
  32 MiB (a shard's CSR) are still mapped and unmapped whole; the worker's peak memory is
  unchanged, it only stays resident at that peak.

Cpus per task: the train job's barrier tasks each run ``train.threads`` threads. Local mode has no
stage-level scheduling (``allreduce.spark.barrier_profile``), so a local session terascale starts
for a run with T > 1 threads gets ``spark.task.cpus = T`` (unless the config's ``spark.conf`` sets
it); on a cluster the barrier stage asks for T cpus itself.

Redaction: every session terascale starts or joins extends ``spark.redaction.regex`` (Spark's
default, or the submitter's value) with terascale's rule, and ``spark.redaction.string.regex``
with URI user-info (``pipeline.redact.spark_redaction_settings``), so Spark's UI,
event logs and configuration dumps hide the same keys terascale's own logs and files do (Spark's
default misses e.g. ``fs.azure.account.key.*``, which ``spark.logConf`` would print at INFO). The
real values still reach Spark, but never on the command line of the JVM terascale launches
(``_launch_jvm_without_secrets``).

Spark Connect: with ``spark.remote`` (or ``SPARK_REMOTE``) set, and not under ``spark-submit``,
the job is a Connect client of that server (:func:`connect_session`): it starts no JVM, the
master and the server's settings are the server's, and every job runs through the DataFrame API
(``pipeline.spark_tasks``, ``allreduce.spark``).
"""

from __future__ import annotations

import logging
import os
import sys

from terascale.allreduce.spark import is_local
from terascale.pipeline.redact import redact_text, shown, spark_redaction_settings

log = logging.getLogger("terascale")

#: Environment of the executors' Python workers (see the module docstring).
EXECUTOR_ENV = {
    "spark.executorEnv.NUMPY_MADVISE_HUGEPAGE": "0",
    "spark.executorEnv.MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "spark.executorEnv.MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    "spark.executorEnv.MIMALLOC_PURGE_DELAY": "-1",
}


def launched_by_spark_submit() -> bool:
    """True inside a driver started by spark-submit (the JVM exported its gateway to Python)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_spark(sconf, task_cpus: int = 1):
    """The Spark session: spark-submit's own, or a new one from the ``spark`` config section.

    Under spark-submit the master and settings come from spark-submit (the config's
    ``spark.master`` is ignored there, so one job file serves local runs and clusters).
    ``task_cpus``: the cpus a barrier task needs (``train.threads``; see the module docstring).
    """
    from pyspark.sql import SparkSession

    from terascale.pipeline import spark_compat

    line = spark_compat.check_pyspark()  # before any JVM or job starts
    remote = remote_url(sconf)
    if remote and not launched_by_spark_submit():
        return connect_session(sconf, remote)
    if launched_by_spark_submit():
        b = SparkSession.builder.appName(sconf.app_name)
        for k, v in _executor_defaults().items():
            b = b.config(k, v)
        spark = b.getOrCreate()
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        settings = local_settings(sconf, task_cpus)
        from pyspark import SparkContext

        if SparkContext._gateway is None:
            spark_compat.check_java(line, spark_compat.java_command())
        _launch_jvm_without_secrets({"spark.master": sconf.master, "spark.app.name": sconf.app_name, **settings})
        b = SparkSession.builder.master(sconf.master).appName(sconf.app_name)
        for k, v in settings.items():
            b = b.config(k, v)
        spark = b.getOrCreate()
    spark_compat.check_session(spark)
    spark.sparkContext.setLogLevel(sconf.log_level)
    log.info("spark: master=%s parallelism=%d", spark.sparkContext.master, spark.sparkContext.defaultParallelism)
    return spark


def remote_url(sconf) -> str:
    """The Spark Connect URL a job runs on: ``spark.remote``, else ``SPARK_REMOTE``, else ''."""
    return sconf.remote or os.environ.get("SPARK_REMOTE", "")


def connect_session(sconf, remote: str):
    """A Spark Connect session on the server at ``remote`` (``sc://host:port``), with the
    config's ``spark.conf`` as its session settings; its client gives up on a server it cannot
    reach after ``spark.remote_retry_s``. No JVM starts here; the URL is logged with
    its parameters' secrets redacted (a ``;token=``)."""
    from terascale.pipeline import spark_compat

    spark_compat.require_connect(remote)
    from pyspark.sql import SparkSession

    b = SparkSession.builder.remote(remote).appName(sconf.app_name)
    for k, v in dict(sconf.conf).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark_compat.limit_connect_retries(spark, sconf.remote_retry_s)
    spark_compat.check_session(spark)
    log.info("spark: Spark Connect %s (Spark %s)", redact_text(remote), spark.version)
    return spark


def _launch_jvm_without_secrets(settings: dict) -> None:
    """Start pyspark's JVM (when this process has none yet) with the settings that are not secret.

    pyspark hands the settings of the first session to the JVM it launches as command-line
    arguments (``spark-submit --conf key=value``), which every local user can read (``ps``,
    ``/proc/PID/cmdline``). Launched here first, the JVM gets only what ``pipeline.redact`` shows
    unchanged; the session's builder then passes every setting, secrets included, to the new
    SparkContext over Py4J.
    """
    from pyspark import SparkConf, SparkContext

    if SparkContext._gateway is not None:
        return
    plain = [(k, v) for k, v in settings.items() if shown(k, v) == v]
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).setAll(plain))


def local_settings(sconf, task_cpus: int = 1) -> dict:
    """The Spark settings of a session terascale starts itself: the config's ``spark.conf``,
    plus defaults it does not set (``spark.task.cpus = task_cpus`` in local mode when > 1)."""
    extra = dict(sconf.conf)
    if sconf.master.startswith("local"):
        # a laptop or CI run: keep everything on loopback, no UI port to collide on
        extra.setdefault("spark.driver.host", "127.0.0.1")
        extra.setdefault("spark.driver.bindAddress", "127.0.0.1")
        extra.setdefault("spark.ui.enabled", "false")
    if task_cpus > 1 and is_local(sconf.master):
        extra.setdefault("spark.task.cpus", str(task_cpus))
    if not sys.stderr.isatty():
        extra.setdefault("spark.ui.showConsoleProgress", "false")  # no progress bars in logs
    extra.setdefault("spark.sql.execution.arrow.pyspark.enabled", "true")
    for k, v in EXECUTOR_ENV.items():
        extra.setdefault(k, v)
    extra.update(spark_redaction_settings(extra.get))
    return extra


def _executor_defaults() -> dict[str, str]:
    """Settings terascale adds under spark-submit unless the submitter set them: executors
    keep numba's compiled kernels across applications (``pipeline.numba_cache``), and
    :data:`EXECUTOR_ENV`; and ``spark.redaction.regex``, the submitter's extended."""
    from pyspark import SparkConf, SparkContext

    from terascale.pipeline.numba_cache import LOCATORS

    SparkContext._ensure_initialized()  # the gateway spark-submit started: its --conf values
    submitted = SparkConf()
    wanted = {"spark.executorEnv.NUMBA_CACHE_LOCATOR_CLASSES": LOCATORS, **EXECUTOR_ENV}
    out = {k: v for k, v in wanted.items() if not submitted.contains(k)}
    out.update(spark_redaction_settings(lambda k: submitted.get(k, None)))
    return out

