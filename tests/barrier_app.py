"""Barrier-stage scenarios run in their own Spark application (one master per process).

    python -m tests.barrier_app SCENARIO MASTER  -> prints one JSON line with the outcome

Used by tests/test_barrier_spark.py; each scenario exercises allreduce.spark.run_barrier.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np

from terascale.allreduce.spark import NetConf, run_barrier
from terascale.pipeline.spark_errors import spark_error_summary

STEPS = 20  # a fake first pass: STEPS steps with a heartbeat after each


def _spark(master: str):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    s = (SparkSession.builder.master(master).appName("terascale-barrier-test")
         .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    return s


def allreduce_fn(ctx):
    with ctx.join() as node:
        got = node.allreduce(np.arange(5, dtype=np.float64) + 10.0 * ctx.shard)
        scal = node.allreduce_scalars([1.0, float(ctx.shard)])
        return {"sum": got.tolist(), "scalars": scal, "rank": node.rank, "size": node.size,
                "stats": node.stats()["totals"]}


def straggler_fn(ctx, slow_shard=1, step_s=0.05, factor=5):
    slow = ctx.shard == slow_shard and not ctx.is_spare
    rows = 0
    for _ in range(STEPS):
        time.sleep(step_s * (factor if slow else 1))
        rows += 1000
        ctx.heartbeat(rows)
    with ctx.join() as node:
        total = node.allreduce_scalars([float(rows)])
        return {"rows": rows, "total": total, "spare": ctx.is_spare, "rank": node.rank}


def slow_fn(ctx, delay_s=1.5):
    """Two AllReduces; between them shard 1 falls ``delay_s`` behind (3 x io_timeout_s in the
    test that uses it): it is waited for, kept alive by its heartbeats."""
    with ctx.join() as node:
        first = node.allreduce(np.arange(5.0) + ctx.shard)
        if ctx.shard == 1:
            time.sleep(delay_s)
        second = node.allreduce(np.arange(5.0) * (ctx.shard + 1))
        return {"rank": node.rank, "first": first.tolist(), "second": second.tolist(),
                "second_wall_s": node.stats()["calls"][1]["wall_s"]}


def kill_fn(ctx):
    if ctx.shard == 0 and ctx.attempt == 0:
        os._exit(3)  # the executor's Python worker dies abruptly mid-stage
    return allreduce_fn(ctx)


SCENARIOS = {
    "allreduce": (3, 0, allreduce_fn),
    "allreduce2": (2, 0, allreduce_fn),
    "straggler": (3, 1, straggler_fn),
    "kill": (2, 0, kill_fn),
}


def main(argv):
    scenario, master = argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    k, s, fn = SCENARIOS[scenario]
    spark = _spark(master)
    try:
        t0 = time.perf_counter()
        res = run_barrier(spark, k, s, fn, net=NetConf(startup_timeout_s=60, io_timeout_s=30), max_attempts=2,
                          job_name=f"test {scenario}", summarize_error=spark_error_summary)
        out = {"results": res.results, "tasks": res.tasks, "attempts": res.attempts,
               "seconds": time.perf_counter() - t0}
    finally:
        spark.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
