"""Every job through a real Spark Connect server (issue 44): ``tests/connect_server.py`` starts
pyspark's own ``SparkConnectServer`` (local mode, 3 task slots) on a free loopback port.

- The whole pipeline of ``tests/spark_lines_app.py`` (featurize -> train with 2 workers, a spare
  and shard 1 failing in pass 2 of the first attempt, resumed -> evaluate -> predict -> score; the
  ad-log table through Spark -> train -> evaluate), run with ``--remote`` against the server and
  with a classic local session, gives the same bits: decoded datasets, weight files, metrics,
  predictions, scores, and the same attempts.
- ``pipeline.spark_tasks.run_tasks`` gives a classic session's results on a Connect session.
- A server that goes away in the middle of a featurize job: a clear error, a non-zero exit, and
  no output nor anything of the run left beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.connect_server import ConnectServer

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ConnectServer(tmp_path_factory.mktemp("connect") / "server.log", master="local[3]") as s:
        yield s


def _app(work: Path, *remote: str) -> dict:
    out = work / "summary.json"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, PYTHONHASHSEED="0")
    env.pop("SPARK_REMOTE", None)
    r = subprocess.run([sys.executable, "-m", "tests.spark_lines_app", str(work / "w"), str(out), *remote], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(out.read_text())["summary"]


def test_the_pipeline_through_spark_connect_gives_the_classic_sessions_bits(server, tmp_path):
    remote = _app(tmp_path / "connect", server.url)
    classic = _app(tmp_path / "classic")
    assert remote.keys() == classic.keys()
    for what in classic:
        assert remote[what] == classic[what], f"{what}: Spark Connect and a classic session differ"
    assert remote["criteo model"]["attempts"] == ["failed", "succeeded"]  # the injected fault, resumed


def test_run_tasks_on_connect_equals_a_classic_session(server, spark):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from terascale.pipeline import spark_tasks

    remote = ConnectSession.builder.remote(server.url).getOrCreate()  # beside the classic one, in this process
    try:
        assert spark_tasks.is_connect(remote) and not spark_tasks.is_connect(spark)
        assert spark_tasks.master(remote) == "local[3]" and spark_tasks.parallelism(remote) == 3
        assert spark_tasks.conf(remote, "spark.no.such.key", "d") == "d"

        def fn(i, it):
            for x in it:
                yield (i, x * x)
            yield (i, "end")

        items = list(range(11))
        for n in (1, 3, 11):
            got = spark_tasks.run_tasks(remote, items, fn, "squares", n=n)
            assert got == spark_tasks.run_tasks(spark, items, fn, "squares", n=n)
            assert [x for _, x in got if x != "end"] == [x * x for x in items]
        assert spark_tasks.run_tasks(remote, [], fn, "nothing") == []
    finally:
        remote.stop()


def test_a_server_that_goes_away_mid_job_fails_clearly_and_leaves_nothing(tmp_path):
    from terascale.jobs.cli import main as cli

    raw, out = tmp_path / "raw", tmp_path / "out"
    assert cli(["generate", "--rows", "6000", "--out", str(raw), "--files", "2", "--seed", "1"]) == 0
    with ConnectServer(tmp_path / "server.log", master="local[2]") as s:
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_REMOTE=s.url)
        proc = subprocess.Popen(
            [sys.executable, "-m", "terascale.jobs.cli", "featurize", "--input", str(raw), "--output", str(out),
             "--set", "featurize.partitions=2", "--set", "featurize.inject_slow_task=0",
             "--set", "featurize.inject_slow_s=120", "--set", "spark.remote_retry_s=3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not any(p.is_dir() and any(p.iterdir()) for p in tmp_path.glob(".out.attempts-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(2.0)  # the slow task has written its file and sleeps: the job is under way
        killer = threading.Thread(target=s.stop)
        killer.start()
        killer.join(60)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("terascale featurize: ") and "Spark Connect" in last, stderr[-1500:]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "server.log"], list(tmp_path.iterdir())


def test_the_pyspark_api_through_spark_connect(server, spark, tmp_path):
    from terascale.jobs.cli import main as cli
    from terascale.jobs.ml import TerascaleClassifier, TerascaleModel
    from terascale.pipeline.scorer import Scorer
    from tests.test_ml_featurize import _table

    work = tmp_path / "w"
    assert cli(["generate", "--rows", "4000", "--out", str(tmp_path / "raw"), "--seed", "2"]) == 0
    assert cli(["featurize", "--input", str(tmp_path / "raw"), "--output", str(work / "data"),
                "--set", "featurize.bits=16", "--set", "featurize.partitions=2"]) == 0
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_REMOTE=server.url)
    r = subprocess.run([sys.executable, "-m", "tests.connect_ml_app", str(work), str(tmp_path / "out.json")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-5000:]}"
    got = json.loads((tmp_path / "out.json").read_text())
    new = _table(200, 3).drop_columns(["clicks"])
    want = Scorer.from_model_dir(str(work / "m")).predict_records(new.to_pylist())
    assert got["raw"] == want.tolist()  # the Pipeline's model scores raw rows as terascale score does
    classic = TerascaleClassifier(workers=2, passes=4, l2=1e-5, modelDir=str(tmp_path / "classic")).fit(str(work / "data"))
    assert TerascaleModel.from_dir(str(work / "m2")).weights.tobytes() == classic.weights.tobytes()
    scored = classic.transform(spark.read.parquet(str(work / "data"))).collect()
    assert got["featurized"] == [row["probability"] for row in scored]
