"""train.threads in the train job: the barrier tasks get that many cpus (local mode: the session's
spark.task.cpus, which terascale's own sessions set), a run with 1 worker x 2 threads writes a
model at the optimum of 1 worker x 1 thread, and runs whose tasks do not fit are refused with the
numbers before any task starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from terascale.jobs.config import CRITEO_FIELDS, ConfigError, load_config
from terascale.jobs.session import local_settings
from terascale.jobs.train_job import TrainError, check_local_slots, run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.spark_featurize import run_featurize
from terascale.pipeline.spec import FeatureSpec

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]
EXACT = ["train.solver=lbfgs", "train.holdout_period=0", "train.early_stop_passes=0", "train.passes=200",
         "train.tol=1e-10", "train.l2=1e-3"]


@pytest.fixture(scope="module")
def data(spark, tmp_path_factory):
    d = tmp_path_factory.mktemp("threads")
    generate_clicklogs(d / "raw", 4000, files=2, seed=5, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=14, seed=0)
    run_featurize(spark, [str(d / "raw")], str(d / "ds"), spec, load_config([], ["featurize.partitions=2"]).featurize)
    return d / "ds"


def test_local_slots_are_checked_before_the_session_starts():
    check_local_slots(load_config([], ["spark.master=local[2]", "train.workers=1", "train.threads=2"]))
    check_local_slots(load_config([], ["spark.master=local[4]", "train.workers=2", "train.threads=2"]))
    with pytest.raises(ConfigError, match=r"runs 2 task threads: 1 barrier task\(s\) of 2 cpus \(train.threads = 2\), "
                                          r"but the barrier stage needs 2 at once \(train.workers = 2 \+ train.spares = 0\)"):
        check_local_slots(load_config([], ["spark.master=local[2]", "train.workers=2", "train.threads=2"]))
    with pytest.raises(ConfigError, match=r"needs 3 at once"):
        check_local_slots(load_config([], ["spark.master=local[5]", "train.workers=2", "train.spares=1",
                                           "train.threads=2"]))
    check_local_slots(load_config([], ["spark.master=yarn", "train.workers=64", "train.threads=8"]))  # not local


def test_terascale_sets_the_task_cpus_of_its_local_sessions():
    cfg = load_config([], ["spark.master=local[4]"])
    assert local_settings(cfg.spark, 2)["spark.task.cpus"] == "2"
    assert "spark.task.cpus" not in local_settings(cfg.spark, 1)
    mine = load_config([], ["spark.master=local[4]", 'spark.conf={"spark.task.cpus": "4"}'])
    assert local_settings(mine.spark, 2)["spark.task.cpus"] == "4"  # the config's own value wins
    assert "spark.task.cpus" not in local_settings(load_config([], ["spark.master=yarn"]).spark, 2)


def test_a_session_with_one_cpu_per_task_refuses_two_threads(spark, data, tmp_path):
    """The shared session is local[2] with spark.task.cpus = 1: a barrier task cannot get 2 cpus."""
    with pytest.raises(TrainError, match=r"train.threads = 2: each barrier task needs 2 cpus, but this local-mode "
                                         r"session gives every task spark.task.cpus = 1"):
        run_train(spark, load_config([], [*EXACT, "train.workers=1", "train.threads=2"]), str(data),
                  str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()


THREADS_APP = """
import json, sys
from terascale.jobs.config import load_config
from terascale.jobs.session import get_spark
from terascale.jobs.train_job import TrainError, run_train

data, out, sets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spark = get_spark(load_config([], ["spark.master=local[2]"]).spark, 2)
res = {"task_cpus": spark.sparkContext.getConf().get("spark.task.cpus")}
for name, extra in (("t2", ["train.threads=2"]), ("t1", ["train.threads=1"])):
    m = run_train(spark, load_config([], [*sets, "train.workers=1", *extra]), data, f"{out}/{name}")
    res[name] = {k: m[k] for k in ("objective", "stop_reason", "history", "per_rank", "config")}
try:
    run_train(spark, load_config([], [*sets, "train.workers=2", "train.threads=2"]), data, f"{out}/w2")
    res["w2"] = "trained"
except TrainError as e:
    res["w2"] = str(e)
print(json.dumps(res))
"""


def test_one_worker_with_two_threads_trains_to_the_single_thread_optimum(data, tmp_path):
    """In a subprocess: its own local[2] session with spark.task.cpus = 2 (terascale's setting for
    train.threads = 2), so one barrier task of 2 cpus fits and two do not."""
    r = subprocess.run([sys.executable, "-c", THREADS_APP, str(data), str(tmp_path), json.dumps(EXACT)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["task_cpus"] == "2"
    t1, t2 = res["t1"], res["t2"]
    assert t2["config"]["train"]["threads"] == 2 and len(t2["per_rank"]) == 1
    assert t2["stop_reason"] in ("converged_grad", "converged_objective")
    assert t2["objective"] == pytest.approx(t1["objective"], rel=1e-8)
    assert (tmp_path / "t2" / "metadata.json").exists()
    assert "needs 2 concurrent task slots (2 workers + 0 spares of 2 cpus each), but the cluster offers 1" in res["w2"]
    assert not (tmp_path / "w2").exists()


PROFILE_APP = """
import json, os, sys
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
from pyspark.sql import SparkSession
from terascale.allreduce.spark import BarrierError, NetConf, run_barrier
from terascale.pipeline.spark_errors import spark_error_summary

spark = (SparkSession.builder.master("local-cluster[2,2,1024]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").getOrCreate())

def task(ctx):
    from pyspark import BarrierTaskContext
    node = ctx.join()
    try:
        return {"rank": node.rank, "cpus": BarrierTaskContext.get().cpus()}
    finally:
        node.close()

net = NetConf(startup_timeout_s=60.0)
res = {"two": [r["cpus"] for r in run_barrier(spark, 2, 0, task, net=net, task_cpus=2,
                                               summarize_error=spark_error_summary).results]}
try:
    run_barrier(spark, 3, 0, task, net=NetConf(startup_timeout_s=3.0), task_cpus=2, summarize_error=spark_error_summary)
    res["three"] = "ran"
except BarrierError as e:
    res["three"] = str(e)
spark.stop()
print(json.dumps(res))
"""


def test_on_a_cluster_the_barrier_stage_asks_for_the_threads_cpus():
    """local-cluster[2,2,1024] (standalone: 2 executors of 2 cores, spark.task.cpus = 1): the
    barrier stage's task resource profile gives each task 2 cpus, so 2 tasks fit and 3 do not."""
    r = subprocess.run([sys.executable, "-c", PROFILE_APP], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["two"] == [2, 2]
    assert ("needs 3 concurrent task slots (3 workers + 0 spares of 2 cpus each), but the cluster offers 2 "
            "(executor cores / 2 cpus per task (train.threads))") in res["three"]
