"""Featurize throughput: against the raw-line scorer's parser and Spark MLlib's FeatureHasher.

The same 2,000,000 generated rows (bits 22), as plain TSV (4 files) and gzip'd (4 files of the
same lines). In one run, interleaved (``REPS`` rounds, best of each reported; this machine's
speed drifts and its cores are shared):

- terascale featurize on local[2] from the plain files and from the gzip'd ones: wall seconds
  and rows/s; its tasks' CPU seconds (each task measures its own, ``featurize_task.run_task``,
  and the driver logs their sum with a split by phase) and rows per task-CPU-second, i.e. per
  core; and the CPU seconds of every process of the run (driver, JVM, Python workers, from
  /proc) and rows per CPU second of all of them;
- the raw-line scorer (``Scorer.predict_block``, one thread, a model of zeros: parse + hash +
  margins) on the same lines in memory, lines per CPU second, in a subprocess;
- ``ratio_per_core``: featurize rows per task-CPU-second / scorer lines per CPU second (1.0 =
  featurize at the speed of the scorer's parser), for the plain and the gzip'd input.

Then, once: Spark MLlib (Spark's CSV reader, the same tokens by column expressions, its
FeatureHasher, label + vector to Parquet; one warm-up on a small file first, as for terascale)
on the plain files, and one featurize task outside Spark on one plain and one gzip'd file
(``tests.benchmarks.featurize_phases``: CPU seconds per million rows per phase, and the bare
parser and zlib on the same bytes). Targets (issue 32, 2 cores): >= 1M rows/s from plain
logs, >= 600k from gzip'd logs, >= 8x MLlib's rows/s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

from tests.benchmarks.common import RESULTS, ROOT, PeakMemory, generated_logs
from tests.benchmarks.proc_watch import descendants, scan

ROWS, FILES, BITS, REPS = 2_000_000, 4, 22, 2
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS = 200_000

_SCORER = r"""
import json, sys, time
import numpy as np
from terascale.pipeline.scorer import Scorer
from terascale.pipeline.spec import FeatureSpec
spec, paths = json.loads(sys.argv[1]), sys.argv[2:]
s = Scorer(np.zeros(1 << spec["bits"], np.float32), 0.0,
           {"spec": spec, "config": {"train": {"loss": "logistic"}, "featurize": {}}}, "raw")
data = b"".join(open(p, "rb").read() for p in paths)
s.predict_block(data[: data.index(b"\n", 1 << 16) + 1], skip_bad=True)  # load the kernels
t0, c0, pos, n = time.perf_counter(), time.process_time(), 0, 0
while pos < len(data):
    end = data.rfind(b"\n", pos, pos + (8 << 20)) + 1 or len(data)
    n += s.predict_block(memoryview(data)[pos:end], skip_bad=True).shape[0]
    pos = end
print(json.dumps({"lines": n, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}))
"""


def _pythonpath() -> str:
    """The subprocesses' PYTHONPATH: the caller's first (a run may measure another checkout's
    ``terascale`` package put there), then this repository (for ``tests``)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)


class _TaskTimes(logging.Handler):
    """Keeps the ``task_times`` of the featurize driver's log record (``spark_featurize``)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.last: dict | None = None

    def emit(self, record):
        if hasattr(record, "task_times"):
            self.last = record.task_times


def _tree_cpu() -> float:
    """CPU seconds so far of this process and every process below it (the JVM, its workers)."""
    table = scan()
    pids = descendants(os.getpid(), {p: v[0] for p, v in table.items()})
    return sum(table[p][1] for p in pids if p in table)


def _gzipped(plain) -> str:
    """The plain files' lines, gzip'd file by file (made once, beside them)."""
    import gzip

    d = plain.with_name(plain.name + "-gz")
    if not (d / "_done").exists():
        d.mkdir(parents=True, exist_ok=True)
        for f in sorted(plain.glob("*.tsv")):
            with open(f, "rb") as src, gzip.open(d / (f.name + ".gz"), "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        (d / "_done").write_text("")
    return str(d / "*.tsv.gz")


def _mllib(spark, inputs: str, out: str, bits: int) -> None:
    from pyspark.ml.feature import FeatureHasher
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    ints = [f"I{k}" for k in range(1, 14)]
    cats = [f"C{k}" for k in range(1, 27)]
    schema = StructType([StructField(c, StringType()) for c in ["label", *ints, *cats]])
    df = spark.read.csv(inputs, sep="\t", schema=schema, mode="DROPMALFORMED")
    cols = [F.col("label").cast("float").alias("label")]
    for c in ints:
        v = F.col(c).cast("long")
        b = F.when(v <= 2, v).otherwise(F.floor(F.log(v) * F.log(v)))
        cols.append(b.cast("string").alias(c))  # null when missing: FeatureHasher skips it
    cols += [F.col(c) for c in cats]
    tokens = df.select(*cols)
    hasher = FeatureHasher(inputCols=ints + cats, outputCol="features", numFeatures=1 << bits, categoricalCols=ints + cats)
    hasher.transform(tokens).select("label", "features").write.mode("overwrite").parquet(out)


def _featurize(spark, run_featurize, spec, fconf, inputs: str, out, handler: _TaskTimes) -> dict:
    handler.last = None
    cpu0, t = _tree_cpu(), time.perf_counter()
    m = run_featurize(spark, [inputs], str(out), spec, fconf)
    wall, cpu = time.perf_counter() - t, _tree_cpu() - cpu0
    shutil.rmtree(out, ignore_errors=True)
    tt = handler.last
    assert m["rows"] == ROWS and tt is not None
    return {"seconds": wall, "rows_per_s": ROWS / wall, "all_cpu_seconds": cpu, "rows_per_cpu_s_all": ROWS / cpu,
            "task_cpu_seconds": tt["cpu_seconds"], "rows_per_s_per_core": ROWS / tt["cpu_seconds"],
            "task_cpu_s_per_m_rows": tt["phases_cpu_s_per_m_rows"], "files": len(m["files"]), "bytes": m["bytes"]}


def _scorer(spec_json: dict, files: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _SCORER, json.dumps(spec_json), *files], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1800, check=True)
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["lines"] == ROWS
    return {**s, "lines_per_s_per_core": s["lines"] / s["cpu_seconds"]}


def _best(runs: list[dict], key: str) -> dict:
    return max(runs, key=lambda r: r[key])


def main() -> dict:
    from pyspark.sql import SparkSession

    from terascale.jobs.config import feature_spec, load_config
    from terascale.jobs.session import EXECUTOR_ENV
    from terascale.pipeline.spark_featurize import run_featurize

    data = generated_logs(ROWS, FILES, seed=11)
    plain, gz = str(data / "*.tsv"), _gzipped(data)
    warm = generated_logs(20_000, 1, seed=12)
    work = RESULTS / "work-featurize"
    shutil.rmtree(work, ignore_errors=True)
    spark = (SparkSession.builder.master("local[2]").appName("bench-featurize")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.memory", "4g")
             .config(map=EXECUTOR_ENV).getOrCreate())  # the executor environment of terascale's jobs
    spark.sparkContext.setLogLevel("ERROR")
    cfg = load_config([], [f"featurize.bits={BITS}"])
    spec = feature_spec(cfg)
    handler = _TaskTimes()
    logger = logging.getLogger("terascale.featurize")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    figures: dict = {"rows": ROWS, "bits": BITS, "master": "local[2]", "reps": REPS}
    files = sorted(str(p) for p in data.glob("*.tsv"))
    runs: dict[str, list] = {"plain": [], "gzip": [], "scorer": []}
    try:
        run_featurize(spark, [str(warm / "*.tsv")], str(work / "warm-ts"), spec, cfg.featurize)
        for _ in range(REPS):  # interleaved: featurize plain, the scorer, featurize gzip'd
            runs["plain"].append(_featurize(spark, run_featurize, spec, cfg.featurize, plain, work / "ts", handler))
            runs["scorer"].append(_scorer(spec.to_json(), files))
            runs["gzip"].append(_featurize(spark, run_featurize, spec, cfg.featurize, gz, work / "tz", handler))
        sc = _best(runs["scorer"], "lines_per_s_per_core")
        figures["scorer"] = {**sc, "all_runs_lines_per_s_per_core": [r["lines_per_s_per_core"] for r in runs["scorer"]]}
        for k in ("plain", "gzip"):
            b = _best(runs[k], "rows_per_s_per_core")
            figures[f"terascale_{k}"] = {
                **b, "best_rows_per_s": max(r["rows_per_s"] for r in runs[k]),
                "all_runs_rows_per_s_per_core": [r["rows_per_s_per_core"] for r in runs[k]],
                "all_runs_rows_per_s": [r["rows_per_s"] for r in runs[k]]}
            figures[f"ratio_per_core_{k}"] = b["rows_per_s_per_core"] / sc["lines_per_s_per_core"]

        _mllib(spark, str(warm / "*.tsv"), str(work / "warm-ml"), BITS)
        with PeakMemory() as mem:
            cpu0, t = _tree_cpu(), time.perf_counter()
            _mllib(spark, plain, str(work / "mllib"), BITS)
            ml, ml_cpu = time.perf_counter() - t, _tree_cpu() - cpu0
        assert spark.read.parquet(str(work / "mllib")).count() == ROWS
        figures["mllib"] = {"seconds": ml, "rows_per_s": ROWS / ml, "all_cpu_seconds": ml_cpu,
                            "rows_per_cpu_s_all": ROWS / ml_cpu, "peak_rss_bytes": mem.peak}
        figures["ratio_rows_per_s_vs_mllib"] = figures["terascale_plain"]["best_rows_per_s"] / figures["mllib"]["rows_per_s"]
        figures["ratio_cpu_vs_mllib"] = (figures["terascale_plain"]["rows_per_cpu_s_all"]
                                         / figures["mllib"]["rows_per_cpu_s_all"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "NUMBA_NUM_THREADS": "1"}
    one = [files[0], sorted(str(p) for p in data.with_name(data.name + "-gz").glob("*.gz"))[0]]
    r = subprocess.run([sys.executable, "-m", "tests.benchmarks.featurize_phases", *one], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=1800, check=True)
    figures["one_task_outside_spark"] = json.loads(r.stdout.strip().splitlines()[-1])
    figures["targets"] = {
        "plain_1M_rows_per_s": figures["terascale_plain"]["best_rows_per_s"] >= 1e6,
        "gzip_600k_rows_per_s": figures["terascale_gzip"]["best_rows_per_s"] >= 6e5,
        "8x_mllib": figures["ratio_rows_per_s_vs_mllib"] >= 8.0,
    }
    print(f"featurize {ROWS:,} rows, bits {BITS}, local[2], best of {REPS} interleaved rounds:")
    for k in ("terascale_plain", "terascale_gzip"):
        f = figures[k]
        print(f"  {k:16s} {f['seconds']:6.2f} s  {f['rows_per_s']:>10,.0f} rows/s  {f['rows_per_s_per_core']:>10,.0f} "
              f"rows per task-CPU-s  {f['rows_per_cpu_s_all']:>10,.0f} rows per CPU-s (all processes)")
        print("  " + " " * 16 + " task CPU s per M rows: "
              + ", ".join(f"{p} {v:.3f}" for p, v in f["task_cpu_s_per_m_rows"].items()))
    print(f"  scorer           {figures['scorer']['lines_per_s_per_core']:>10,.0f} lines per CPU-s (one thread)")
    print(f"  ratio per core (featurize / scorer): plain {figures['ratio_per_core_plain']:.2f}, "
          f"gzip {figures['ratio_per_core_gzip']:.2f}")
    m = figures["mllib"]
    print(f"  mllib            {m['seconds']:6.2f} s  {m['rows_per_s']:>10,.0f} rows/s  {m['rows_per_cpu_s_all']:>10,.0f} "
          f"rows per CPU-s (all processes); terascale/mllib {figures['ratio_rows_per_s_vs_mllib']:.2f}x wall, "
          f"{figures['ratio_cpu_vs_mllib']:.2f}x CPU")
    for o in figures["one_task_outside_spark"]:
        print(f"  one task outside Spark, {os.path.basename(o['file'])}: {o['task']['cpu_s_per_m_rows']:.3f} CPU s per M rows ("
              + ", ".join(f"{p} {v:.3f}" for p, v in o["task"]["phases_cpu_s_per_m_rows"].items())
              + f"); scorer {o['scorer_cpu_s_per_m_lines']:.3f}, parse kernel {o['parse_kernel_cpu_s_per_m_rows']:.3f}"
              + (f", zlib {o['zlib_inflate_cpu_s_per_m_rows']:.3f}" if "zlib_inflate_cpu_s_per_m_rows" in o else ""))
    return figures
