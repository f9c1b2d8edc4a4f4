"""Python functions as Spark tasks, and what a job asks of its session, classic or Spark Connect.

A classic session (``spark.sparkContext`` exists: a local run, ``spark-submit``) and a Spark
Connect session (``SparkSession.builder.remote(...)``, ``SPARK_REMOTE``: a gRPC client with no
SparkContext, RDD, JVM or status tracker) differ in what a job may call; the jobs ask this
module, never the context, so that one job code serves both.

- :func:`run_tasks` runs ``fn(index, iterator)`` (the contract of ``mapPartitionsWithIndex``)
  over ``items`` split into ``n`` tasks (task ``i`` gets ``items[i*len//n : (i+1)*len//n]``, on
  either kind of session) and returns every result, task by task. Classic: an
  RDD (with ``settle``, collected by ``pipeline.spark_settle`` once every attempt has ended).
  Connect: ``spark.range(0, n, 1, n)`` (one row per partition, its value the task's index)
  mapped by ``mapInArrow``; each result travels pickled in a binary column. The items travel in
  the function's closure, as ``parallelize`` ships them in the task.
- :func:`collect` collects a DataFrame the same way (settled on classic).
- Settling on Connect: there is no status tracker, so a job cannot wait for a beaten attempt
  to end. The commit is fenced instead (``pipeline.artifacts.retire_attempts``): attempts write
  only into their own directories, created without parents inside a directory the driver made,
  and the driver moves that directory away before it renames the new output into place, so a
  late attempt can neither create its directory nor reach the committed output.
- :func:`conf`, :func:`master`, :func:`parallelism`, :func:`described`: the session's settings
  (``SparkConf`` on classic, ``spark.conf`` on Connect, where a key the server does not set
  reads as ``None``), its default parallelism (Connect: ``spark.default.parallelism``, else
  ``local[N]``'s N, else executors × cores, else 2), and a job description (classic only: a
  Connect client has no job description; the server names the job by its operation).

It imports no pyspark at module level; the Connect check looks at the session's class.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

TaskFn = Callable[[int, Iterator], Iterator]


def is_connect(spark) -> bool:
    """True for a Spark Connect session (a client with no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def conf(spark, key: str, default: str | None = None) -> str | None:
    """The session's value of ``key`` (a Spark setting), or ``default`` when it has none."""
    if is_connect(spark):
        value = spark.conf.get(key, None)
        return default if value is None else value
    return spark.sparkContext.getConf().get(key, default)


def all_conf(spark, keys: tuple[str, ...] = ()) -> dict[str, str]:
    """Every setting of a classic session; on Connect, those of ``keys`` the server has (a
    client cannot list the server's SparkConf)."""
    if is_connect(spark):
        return {k: v for k in keys if (v := spark.conf.get(k, None)) is not None}
    return dict(spark.sparkContext.getConf().getAll())


def master(spark) -> str:
    """The session's master URL (``local[2]``, ``yarn``, ...; '' when a Connect server hides it)."""
    if is_connect(spark):
        return spark.conf.get("spark.master", None) or ""
    return spark.sparkContext.master


def parallelism(spark) -> int:
    """The session's default parallelism (module docstring)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    value = spark.conf.get("spark.default.parallelism", None)
    if value:
        return max(1, int(value))
    m = re.fullmatch(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?", master(spark))
    if m is not None:
        import os

        return 1 if not m.group(1) else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    executors, cores = spark.conf.get("spark.executor.instances", None), spark.conf.get("spark.executor.cores", None)
    if executors and cores:
        return max(1, int(executors) * int(cores))
    return 2


@contextlib.contextmanager
def described(spark, text: str):
    """Run the block's Spark jobs under the description ``text`` (classic; Connect: unnamed)."""
    if is_connect(spark):
        yield
        return
    sc = spark.sparkContext
    sc.setJobDescription(text)
    try:
        yield
    finally:
        sc.setJobDescription(None)


def slices(items: list, n: int) -> list[list]:
    """``items`` split into ``n`` consecutive slices, the ``i``-th ``items[i*len//n : (i+1)*len//n]``."""
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def run_tasks(spark, items: list, fn: TaskFn, description: str, *, n: int | None = None,
              settle: bool = False) -> list:
    """``fn(i, iter(slice_i))`` for each of ``n`` (default ``len(items)``) tasks; every result,
    in task order (module docstring). ``settle``: on classic, return (or raise) only once every
    attempt of the job's tasks has ended (``pipeline.spark_settle``)."""
    n = len(items) if n is None else n
    if n == 0:
        return []
    if not is_connect(spark):
        sc = spark.sparkContext
        rdd = sc.parallelize(slices(items, n), n).mapPartitionsWithIndex(_of_slice(fn))
        if settle:
            from terascale.pipeline.spark_settle import collect_settled

            return collect_settled(sc, rdd, description)
        with described(spark, description):
            return rdd.collect()
    parts = slices(items, n)

    def run(batches, parts=parts, fn=fn):
        import pickle

        import pyarrow as pa

        for b in batches:
            for i in b.column(0).to_pylist():
                out = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in fn(i, iter(parts[i]))]
                yield pa.RecordBatch.from_arrays([pa.array([i] * len(out), pa.int64()), pa.array(out, pa.binary())],
                                                 names=["task", "result"])

    rows = spark.range(0, n, 1, n).mapInArrow(run, "task long, result binary").collect()
    return unpickled(rows)


def _of_slice(fn: TaskFn) -> TaskFn:
    """``fn`` over a partition that holds one slice: the partition's input read to its end (a
    Python worker that leaves its input unread is not reused, and a new one forks per task)."""

    def run(i, it):
        (part,) = list(it)
        return fn(i, iter(part))

    return run


def unpickled(rows: list) -> list:
    """The results of :func:`run_tasks`' Connect path (rows of ``task``, ``result``), task by task."""
    import pickle

    return [pickle.loads(r["result"]) for r in sorted(rows, key=lambda r: r["task"])]


def collect(spark, df, description: str, *, settle: bool = False) -> list:
    """``df.collect()``; ``settle`` as in :func:`run_tasks` (classic only)."""
    if settle and not is_connect(spark):
        from terascale.pipeline.spark_settle import collect_settled

        return collect_settled(spark.sparkContext, df.rdd, description)
    with described(spark, description):
        return df.collect()

