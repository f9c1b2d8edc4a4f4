"""Spark Connect against a classic session: the same jobs on the same data, interleaved, in one run.

1,000,000 generated rows (TERASCALE_BENCH_SMALL: 100,000), featurized at bits 20 into 4 files,
then trained (hybrid, 2 workers, 8 passes) and evaluated, ROUNDS times each way, alternating:
``terascale featurize / train / evaluate`` with ``--set spark.master=local[2]`` (each command
starts its own Spark) and with ``--remote`` on one Spark Connect server (pyspark's own
``SparkConnectServer``, local[2], started once; tests/connect_server.py). Recorded per step and
way: the median wall time of the command, the job's own time (its "finished in" line: for the
classic session this includes starting Spark, for Connect the connection) and, for train, the
barrier stage's (the successful attempt's seconds), and the ratios Connect / classic. The two ways' models are checked equal, bit for bit, and their metrics too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from tests.benchmarks.common import RESULTS, generated_logs, terascale_cli, write_result
from tests.connect_server import ConnectServer

ROWS, ROUNDS = 1_000_000, 3
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS = 100_000
STEPS = ("featurize", "train", "evaluate")
TRAIN = ["--set", "train.workers=2", "--set", "train.passes=8", "--set", "train.l2=1e-6",
         "--set", "train.checkpoint_interval_s=0"]
_FINISHED = re.compile(r"(\w+) finished in ([0-9.]+) s")


def _run(step: str, args: list[str], way: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([*terascale_cli(), step, *args, *way], env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"terascale {step} {' '.join(way)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    job = [float(m.group(2)) for m in _FINISHED.finditer(r.stderr) if m.group(1) == step]
    return {"wall_s": wall, "job_s": job[-1] if job else None}


def main() -> dict:
    raw = generated_logs(ROWS, 4, 11)
    work = RESULTS / "connect-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop("SPARK_REMOTE", None)
    times: dict[str, dict[str, list]] = {w: {s: [] for s in STEPS} for w in ("classic", "connect")}
    weights: dict[str, set] = {"classic": set(), "connect": set()}
    metrics: dict[str, set] = {"classic": set(), "connect": set()}
    try:
        with ConnectServer(work / "server.log", master="local[2]") as server:
            ways = {"classic": ["--set", "spark.master=local[2]"], "connect": ["--remote", server.url]}
            for r in range(ROUNDS):
                for name in (("classic", "connect") if r % 2 == 0 else ("connect", "classic")):
                    d = work / f"{name}-{r}"
                    steps = {
                        "featurize": ["--input", str(raw), "--output", str(d / "data"), "--set", "featurize.bits=20",
                                      "--set", "featurize.partitions=4"],
                        "train": ["--input", str(d / "data"), "--model", str(d / "model"), *TRAIN],
                        "evaluate": ["--input", str(d / "data"), "--model", str(d / "model"), "--out",
                                     str(d / "metrics.json")],
                    }
                    for step in STEPS:
                        times[name][step].append(_run(step, steps[step], ways[name], env))
                    meta = json.loads((d / "model" / "metadata.json").read_text())
                    times[name]["train"][-1]["stage_s"] = meta["attempts"][-1]["seconds"]
                    weights[name].add(hashlib.sha256((d / "model" / "weights.npy").read_bytes()).hexdigest())
                    m = json.loads((d / "metrics.json").read_text())
                    metrics[name].add(json.dumps({k: m[k] for k in ("logloss", "auroc")}, sort_keys=True))
                    shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = weights["classic"] == weights["connect"] and len(weights["classic"]) == 1 and metrics["classic"] == metrics["connect"]
    out: dict = {"rows": ROWS, "rounds": ROUNDS, "same_model_and_metrics": same, "steps": {}}
    for step in STEPS:
        row = {}
        for name in ("classic", "connect"):
            row[f"{name}_wall_s"] = statistics.median(t["wall_s"] for t in times[name][step])
            row[f"{name}_job_s"] = statistics.median(t["job_s"] for t in times[name][step])
        if step == "train":  # the barrier stage alone (its attempt's seconds): no session start in it
            for name in ("classic", "connect"):
                row[f"{name}_stage_s"] = statistics.median(t["stage_s"] for t in times[name][step])
            row["connect_over_classic_stage"] = row["connect_stage_s"] / row["classic_stage_s"]
        row["connect_over_classic_wall"] = row["connect_wall_s"] / row["classic_wall_s"]
        row["connect_over_classic_job"] = row["connect_job_s"] / row["classic_job_s"]
        out["steps"][step] = row
    if not same:
        raise RuntimeError(f"Spark Connect and a classic session gave different models or metrics: {out}")
    write_result("connect", out)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
