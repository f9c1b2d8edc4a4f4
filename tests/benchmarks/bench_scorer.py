"""The raw-line scorer (``pipeline.scorer``) against the Spark predict job, in one run.

1,000,000 generated Criteo lines, a model at 2^24 buckets (featurized and trained here, one
online pass: the weights do not change the scoring cost). Figures:

- ``scorer.lines_per_s_per_core``: ``Scorer.predict_block`` over the raw bytes in memory, 8 MiB
  blocks, in one single-threaded process (``NUMBA_NUM_THREADS=1``; parse + hash + margins +
  sigmoid), lines per CPU second of the process (best of 3); ``lines_per_s_wall`` beside it.
  Target >= 1M.
- ``cli.lines_per_s_per_core``: ``terascale score < file > /dev/null`` (the same plus reading
  stdin, writing one decimal probability per line, interpreter start-up), lines per CPU second
  of the command.
- ``spark_predict.rows_per_s`` and ``..._per_core``: the predict job (local[2], second of two
  runs, so workers and kernels are warm) on the featurized rows of the same lines, divided by
  the session's default parallelism.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from tests.benchmarks.common import RESULTS, ROOT, generated_logs

ROWS, BITS = 1_000_000, 24
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS = 100_000

_TIMER = r"""
import os, sys, time, json
from terascale.pipeline.scorer import Scorer
model, paths = sys.argv[1], sys.argv[2:]
s = Scorer.from_model_dir(model)
data = b"".join(open(p, "rb").read() for p in paths)
s.predict_block(data[: data.index(b"\n", 1 << 16) + 1], skip_bad=True)  # compile / load the kernels
best, best_cpu = None, None
for _ in range(3):
    t0, c0, pos, n = time.perf_counter(), time.process_time(), 0, 0
    while pos < len(data):
        end = data.rfind(b"\n", pos, pos + (8 << 20)) + 1 or len(data)
        n += s.predict_block(memoryview(data)[pos:end], skip_bad=True).shape[0]
        pos = end
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    best = dt if best is None else min(best, dt)
    best_cpu = dc if best_cpu is None else min(best_cpu, dc)
print(json.dumps({"lines": n, "seconds": best, "cpu_seconds": best_cpu}))
"""


def main() -> dict:
    from terascale.jobs.config import feature_spec, load_config
    from terascale.jobs.scoring import predict
    from terascale.jobs.session import get_spark
    from terascale.jobs.train_job import run_train
    from terascale.pipeline import fsutil
    from terascale.pipeline.spark_featurize import run_featurize

    raw = generated_logs(ROWS, 2, 31)
    files = sorted(str(p) for p in raw.glob("*.tsv"))
    work = RESULTS / "scorer-work"
    cfg = load_config([], [f"featurize.bits={BITS}", "spark.master=local[2]", "train.workers=2", "train.passes=1",
                           "train.holdout_period=0", "train.l2=1e-6"])
    spark = get_spark(cfg.spark)
    run_featurize(spark, files, str(work / "ds"), feature_spec(cfg), cfg.featurize)
    run_train(spark, cfg, str(work / "ds"), str(work / "model"))
    times = []
    for i in range(2):
        t0 = time.perf_counter()
        p = predict(spark, str(work / "ds"), str(work / "model"), str(work / f"pred{i}"), ())
        times.append(time.perf_counter() - t0)
    cores = spark.sparkContext.defaultParallelism
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _TIMER, str(work / "model"), *files], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1800, check=True)
    sc = json.loads(r.stdout.strip().splitlines()[-1])
    stdin = work / "lines.tsv"
    with open(stdin, "wb") as f:
        for p_ in files:
            f.write(open(p_, "rb").read())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(stdin, "rb") as f:
        subprocess.run([sys.executable, "-m", "terascale.jobs.cli", "score", "--model", str(work / "model"), "--skip-bad"],
                       stdin=f, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT, timeout=1800,
                       check=True)
    cli_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cli_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    lines = sc["lines"]
    out = {
        "lines": lines, "bits": BITS,
        "scorer": {"seconds": sc["seconds"], "cpu_seconds": sc["cpu_seconds"],
                   "lines_per_s_per_core": lines / sc["cpu_seconds"], "lines_per_s_wall": lines / sc["seconds"]},
        "cli": {"seconds": cli_s, "cpu_seconds": cli_cpu, "lines_per_s_per_core": lines / cli_cpu,
                "lines_per_s_wall": lines / cli_s},
        "spark_predict": {"rows": p["rows"], "seconds": times, "rows_per_s": p["rows"] / times[-1],
                          "rows_per_s_per_core": p["rows"] / times[-1] / cores, "cores": cores},
    }
    out["scorer_vs_predict_per_core"] = out["scorer"]["lines_per_s_per_core"] / out["spark_predict"]["rows_per_s_per_core"]
    out["target_1M_lines_per_s_per_core"] = out["scorer"]["lines_per_s_per_core"] >= 1e6
    fsutil.delete(str(work))
    print(json.dumps(out, indent=2))
    return out
