"""allreduce.spark.run_barrier on real Spark masters: local[4], local-cluster, spares, retries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from terascale.allreduce.spark import BarrierError, NetConf, preflight, run_barrier
from terascale.pipeline.spark_errors import spark_error_summary

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]


def _app(scenario: str, master: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-m", "tests.barrier_app", scenario, master], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _check_allreduce(out, k):
    want = [sum(i + 10.0 * s for s in range(k)) for i in range(5)]
    assert [r["rank"] for r in out["results"]] == list(range(k))
    for r in out["results"]:
        assert r["sum"] == want and r["size"] == k
        assert r["scalars"] == [float(k), float(sum(range(k)))]
        assert r["stats"]["calls"] == 2


def test_barrier_allreduce_local4():
    out, log = _app("allreduce", "local[4]")
    _check_allreduce(out, 3)
    assert "tree server on 127.0.0.1:" in log and [a["outcome"] for a in out["attempts"]] == ["succeeded"]


@pytest.mark.slow
def test_barrier_allreduce_local_cluster():
    out, _ = _app("allreduce2", "local-cluster[2,1,1024]")
    _check_allreduce(out, 2)


def test_spare_wins_the_straggler_shard():
    out, log = _app("straggler", "local[4]")
    by_shard = {r["rank"]: r for r in out["results"]}
    assert by_shard[1]["spare"] is True  # the spare's attempt survived for the 5x slow shard
    assert not by_shard[0]["spare"] and not by_shard[2]["spare"]
    assert all(r["total"] == [3 * 20_000.0] for r in out["results"])
    outcomes = {(t["role"], t["shard"]): t["outcome"] for t in out["tasks"]}
    assert outcomes[("worker", 1)] == "stood_down"  # the straggler stopped mid-pass and exited cleanly
    assert "spare 0 races shard 1" in log and "told to stand down" in log


def test_killed_task_is_retried_by_the_adapter():
    out, log = _app("kill", "local[2]")
    _check_allreduce(out, 2)
    assert [a["outcome"] for a in out["attempts"]] == ["failed", "succeeded"]
    assert out["attempts"][0]["error"]
    assert "attempt 1 failed" in log


def test_slow_rank_under_a_connection_flood_in_a_real_barrier_job(spark):
    """Shard 1 falls 3 x io_timeout_s behind between two AllReduces while another process
    holds 1000 idle connections to the tree server: one attempt, the exact sums."""
    import multiprocessing as mp

    from tests.allreduce.test_allreduce_flood import _flood
    from tests.barrier_app import slow_fn

    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    flooders = []

    def on_attempt(server, attempt):
        p = ctx.Process(target=_flood, args=([(*server.address, 1000)], ready, stop, out, 20), daemon=True)
        p.start()
        flooders.append(p)
        assert ready.wait(30)

    net = NetConf(io_timeout_s=0.5, heartbeat_timeout_s=5.0, connect_timeout_s=20, startup_timeout_s=60)
    try:
        res = run_barrier(spark, 2, 0, slow_fn, net=net, max_attempts=1, on_attempt=on_attempt,
                          job_name="test slow rank", summarize_error=spark_error_summary)
    finally:
        stop.set()
        flood = out.get(timeout=30) if flooders else None
        for p in flooders:
            p.join(10)
    print(f"rank 0 waited {res.results[0]['second_wall_s']:.2f} s for rank 1; flood: {flood['opened']} "
          f"connections opened, {flood['closed_by_peer'][0]} closed by the tree server")
    assert [a["outcome"] for a in res.attempts] == ["succeeded"]
    assert [r["first"] for r in res.results] == [[1.0, 3.0, 5.0, 7.0, 9.0]] * 2
    assert [r["second"] for r in res.results] == [[0.0, 3.0, 6.0, 9.0, 12.0]] * 2
    assert res.results[0]["second_wall_s"] > 1.0  # rank 0 waited for rank 1, past io_timeout_s
    assert flood["opened"] >= 1000 and flood["closed_by_peer"][0] >= 1000 - 64


def test_preflight_refuses_too_few_slots(spark):
    with pytest.raises(BarrierError, match=r"needs 3 concurrent task slots \(2 workers \+ 1 spares\), but the cluster offers 2"):
        run_barrier(spark, 2, 1, lambda ctx: {}, net=NetConf(), summarize_error=spark_error_summary)
    preflight(spark, 2, "ok")


def test_spark_error_summary_names_task_and_cause():
    crash = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
             ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed "
             "barrier ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(0, 1) "
             "finished unsuccessfully.\norg.apache.spark.SparkException: Python worker exited unexpectedly (crashed). "
             "Consider setting 'spark.python.worker.faulthandler.enabled'\n\tat org.apache.spark.x(y.scala:1)")
    assert spark_error_summary(RuntimeError(crash)) == "task 1: Python worker exited unexpectedly (crashed)"
    raised = crash.replace("org.apache.spark.SparkException: Python worker exited unexpectedly (crashed). Consider",
                           "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] Traceback:\n"
                           "  File \"x.py\", line 1, in f\nValueError: boom in shard 1\n Consider")
    assert spark_error_summary(RuntimeError(raised)) == "task 1: ValueError: boom in shard 1"
    assert spark_error_summary(ValueError("plain")) == "plain"
    peer = raised.replace("ValueError: boom in shard 1", "allreduce.errors.PeerLost: rank 1 closed the connection\n SQLSTATE: 38000")
    assert spark_error_summary(RuntimeError(peer)) == "task 1: allreduce.errors.PeerLost: rank 1 closed the connection"
