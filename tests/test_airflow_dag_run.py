"""The Airflow DAG conf/airflow/terascale_daily.py run by Airflow, two days in a row, with the real
``spark-submit`` and the ``make dist`` artifacts.

Airflow's own runner (``airflow dags test``, the command line of ``DAG.test()``) runs every task
of a day in order against a SQLite metadata database in a temporary AIRFLOW_HOME; each task is
the provider's SparkSubmitOperator calling pyspark's ``spark-submit`` (terascale's .venv) in local
mode with dist/jobs/*.py, the py-files zip, and a driver Python unpacked from env.tar.gz, as an
Airflow worker runs it. The configuration is the shipped terascale_daily.yaml with local paths
and local-mode Spark settings (``dag_config``).

- Day 1 (generated logs) featurizes, trains from scratch, evaluates, passes the gate (nothing
  published yet) and publishes.
- Day 2's logs carry label noise on purpose (a third of the labels flipped): it warm-starts from
  day 1's model, its gate fails, the run fails at the gate and the pointer still serves day 1's
  model, unchanged.
- Then day 1's featurize_eval is cleared (``airflow tasks clear``) and run again in its run
  (``airflow tasks test``): its dataset is replaced as a whole, every other file is untouched.

Runs in .venv-airflow (``make test-airflow``), like test_airflow_dag.py; needs TERASCALE_DIST (or
dist/ beside this checkout) and terascale's Python ($TERASCALE_PYTHON, else .venv/bin/python).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

if shutil.which("airflow", path=str(Path(sys.executable).parent)) is None:
    pytest.skip("Apache Airflow is not installed in this environment; `make test` runs this file in .venv-airflow",
                allow_module_level=True)

import yaml  # noqa: E402 - Airflow's venv has it (conf/airflow/requirements.txt)

ROOT = Path(__file__).resolve().parents[1]
DAG_DIR = ROOT / "conf" / "airflow"
AIRFLOW = str(Path(sys.executable).parent / "airflow")
DAY1, DAY2 = "2026-03-05", "2026-03-06"
TASKS = ("featurize_train", "featurize_eval", "train", "evaluate", "gate", "publish")
NOISE = 1 / 3  # day 2: this fraction of the labels flipped


def terascale_python() -> Path:
    py = Path(os.environ.get("TERASCALE_PYTHON") or ROOT / ".venv" / "bin" / "python")
    if not py.exists():
        pytest.skip(f"terascale's Python {py} not found (set TERASCALE_PYTHON)")
    return py


def dist_dir() -> Path:
    d = Path(os.environ.get("TERASCALE_DIST") or ROOT / "dist")
    need = [d / "env.tar.gz", d / "terascale-pyfiles.zip", *(d / "jobs" / f"{j}.py" for j in
                                                            ("featurize", "train", "evaluate", "gate", "publish"))]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        pytest.skip(f"missing dist artifacts {missing}: run `make dist` (make test-airflow does)")
    return d


def dag_config(work: Path, dist: Path, driver_python: Path) -> dict:
    """The shipped terascale_daily.yaml with local paths, local-mode Spark and small jobs."""
    cfg = yaml.safe_load((DAG_DIR / "terascale_daily.yaml").read_text())
    cfg["dag"]["retry_delay_minutes"] = 0.05  # a retry (none is expected) would wait 3 s, not 15 min
    cfg["paths"] = {
        "train_logs": f"{work}/logs/{{{{ ds }}}}/train", "eval_logs": f"{work}/logs/{{{{ ds }}}}/eval",
        "train_data": f"{work}/data/{{{{ ds }}}}/train", "eval_data": f"{work}/data/{{{{ ds }}}}/eval",
        "model": f"{work}/models/{{{{ ds }}}}", "metrics": f"{work}/metrics/{{{{ ds }}}}.json",
        "pointer": f"{work}/models/current",
    }
    cfg["terascale"]["featurize"] = {"featurize.bits": 16, "featurize.partitions": 2}
    cfg["terascale"]["train"] = {"train.workers": 2, "train.spares": 0, "train.l2": 1e-4, "train.passes": 10}
    py = str(driver_python)
    cfg["spark_submit"] = {
        "jobs_dir": str(dist / "jobs"), "py_files": str(dist / "terascale-pyfiles.zip"), "archives": None,
        "conn_id": "spark_default", "deploy_mode": "client", "driver_memory": "1g",
        "conf": {"spark.pyspark.python": py, "spark.pyspark.driver.python": py, "spark.ui.enabled": False,
                 "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                 "spark.sql.shuffle.partitions": 2, "spark.ui.showConsoleProgress": False},
    }
    no_spark = {"conf": {"spark.pyspark.driver.python": py}}
    cfg["tasks"] = {"gate": {**cfg["tasks"]["gate"], **no_spark, "deploy_mode": "client"},
                    "publish": {**cfg["tasks"]["publish"], **no_spark, "deploy_mode": "client"}}
    return cfg


def flip_labels(directory: Path, fraction: float, seed: int) -> int:
    """Flip the label (first field) of about ``fraction`` of the lines of every part file."""
    rng, flipped = random.Random(seed), 0
    for f in sorted(directory.glob("part-*.tsv")):
        out = []
        for line in f.read_text().splitlines():
            if rng.random() < fraction:
                label, rest = line.split("\t", 1)
                line, flipped = f"{1 - int(label)}\t{rest}", flipped + 1
            out.append(line)
        f.write_text("\n".join(out) + "\n")
    return flipped


def snapshot(work: Path) -> dict[str, tuple[str, int, int]]:
    """Every file the DAG wrote: path -> (sha256, inode, mtime_ns)."""
    out = {}
    for p in sorted(work.rglob("*")):
        if p.is_file() and "logs" not in p.relative_to(work).parts[:1]:
            st = p.stat()
            out[str(p.relative_to(work))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns)
    return out


class Scenario:
    """The environment of the Airflow commands, and what they printed."""

    def __init__(self, tmp: Path):
        self.tmp, self.work = tmp, tmp / "work"
        self.dist = dist_dir()
        tpy = terascale_python()
        spark_home = subprocess.run([str(tpy), "-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        self.driver_env = tmp / "driver-env"  # as a worker unpacks the release's env.tar.gz
        self.driver_env.mkdir()
        with tarfile.open(self.dist / "env.tar.gz") as t:
            t.extractall(self.driver_env, filter="tar")
        bin_dir = tmp / "bin"  # the real spark-submit, first on PATH (the provider runs `spark-submit`)
        bin_dir.mkdir()
        (bin_dir / "spark-submit").symlink_to(tpy.parent / "spark-submit")
        cfg = tmp / "dag.yaml"
        cfg.write_text(yaml.safe_dump(dag_config(self.work, self.dist, self.driver_env / "bin" / "python")))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYSPARK_", "SPARK_"))}
        self.env.update({
            "AIRFLOW_HOME": str(tmp / "airflow-home"), "AIRFLOW__CORE__DAGS_FOLDER": str(DAG_DIR),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "TERASCALE_DAG_CONFIG": str(cfg),
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SPARK_HOME": spark_home,
            "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONHASHSEED": "0",
        })
        self.terascale = str(tpy.parent / "terascale")
        self.seconds: dict[str, float] = {}

    def airflow(self, name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        t0 = time.perf_counter()
        r = subprocess.run([AIRFLOW, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.tmp)
        self.seconds[name] = time.perf_counter() - t0
        (self.tmp / f"{name}.log").write_text(r.stdout + r.stderr)
        return r

    def states(self, day: str) -> dict[str, tuple[str | None, int]]:
        """task id -> (state, try number) of the day's run, from Airflow's metadata database."""
        with contextlib.closing(sqlite3.connect(self.tmp / "airflow-home" / "airflow.db")) as db:
            rows = db.execute("SELECT ti.task_id, ti.state, ti.try_number FROM task_instance ti JOIN dag_run dr "
                              "ON ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id "
                              "WHERE dr.dag_id = 'terascale_daily' AND substr(dr.logical_date, 1, 10) = ?", (day,))
            return {task: (state, tries) for task, state, tries in rows}

    def generate(self, day: str, seed: int) -> None:
        for part, rows in (("train", 6000), ("eval", 3000)):
            out = self.work / "logs" / day / part
            r = subprocess.run([self.terascale, "generate", "--rows", str(rows), "--out", str(out), "--seed",
                                str(seed + (part == "eval"))], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            (out / "_truth.json").unlink()  # featurize takes every visible file of the directory


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    s = Scenario(tmp_path_factory.mktemp("airflow-run"))
    s.generate(DAY1, seed=31)
    s.generate(DAY2, seed=41)
    s.flipped = {p: flip_labels(s.work / "logs" / DAY2 / p, NOISE, seed=7) for p in ("train", "eval")}
    t0 = time.perf_counter()
    r = s.airflow("db-migrate", "db", "migrate")
    assert r.returncode == 0, r.stderr[-3000:]
    s.day1 = s.airflow("day1", "dags", "test", "terascale_daily", DAY1)
    s.states1 = s.states(DAY1)
    s.pointer1 = (s.work / "models" / "current").read_bytes() if (s.work / "models" / "current").exists() else b""
    s.before2 = snapshot(s.work)
    s.day2 = s.airflow("day2", "dags", "test", "terascale_daily", DAY2)
    s.states2 = s.states(DAY2)
    s.before_rerun = snapshot(s.work)
    s.clear = s.airflow("clear", "tasks", "clear", "terascale_daily", "-t", "featurize_eval", "-s", DAY1, "-e", DAY1,
                        "-y")
    s.cleared = s.states(DAY1)
    s.rerun = s.airflow("rerun", "tasks", "test", "terascale_daily", "featurize_eval", DAY1)
    s.rerun_states = s.states(DAY1)
    s.after_rerun = snapshot(s.work)
    s.total_s = time.perf_counter() - t0
    (s.tmp / "seconds.json").write_text(json.dumps({**s.seconds, "total": s.total_s}, indent=1))
    print(f"airflow scenario seconds: {json.dumps({k: round(v, 1) for k, v in s.seconds.items()})}, "
          f"total {s.total_s:.1f}")
    return s


def test_day_one_runs_every_task_and_publishes(run):
    assert run.day1.returncode == 0, (run.day1.stdout + run.day1.stderr)[-6000:]
    assert run.states1 == dict.fromkeys(TASKS, ("success", 1))  # each once: no retry
    pointer = json.loads(run.pointer1)
    metrics = json.loads((run.work / "metrics" / f"{DAY1}.json").read_text())
    assert pointer["model"] == str(run.work / "models" / DAY1) and pointer["previous"] is None
    assert pointer["metrics"]["logloss"] == metrics["logloss"] and 0.3 < metrics["logloss"] < 0.65
    meta = json.loads((run.work / "models" / DAY1 / "metadata.json").read_text())
    assert meta["data"]["rows"] == 6000 and meta["config"]["train"]["init_model"] == ""  # from scratch
    log = run.day1.stdout + run.day1.stderr
    assert "no model at" in log and "training from scratch" in log  # train's own line, through the task log
    assert "gate passed: no baseline at" in log


def test_day_two_fails_its_gate_and_the_pointer_keeps_day_one(run):
    assert run.day2.returncode != 0 and "DagRun failed" in run.day2.stderr
    # the gate ran once: tasks.gate.retries = 0 in the shipped configuration (a verdict, not a glitch)
    assert run.states2 == {**dict.fromkeys(TASKS[:4], ("success", 1)), "gate": ("failed", 1),
                           "publish": ("upstream_failed", 0)}
    assert run.flipped["train"] > 1500 and run.flipped["eval"] > 700
    day1 = json.loads((run.work / "metrics" / f"{DAY1}.json").read_text())["logloss"]
    day2 = json.loads((run.work / "metrics" / f"{DAY2}.json").read_text())["logloss"]
    assert day2 > day1 * 1.01  # the noise made it worse than the gate allows
    log = run.day2.stdout + run.day2.stderr
    assert f"logloss regressed: {day2:.6f} > " in log
    meta = json.loads((run.work / "models" / DAY2 / "metadata.json").read_text())
    assert meta["config"]["train"]["init_model"] == str(run.work / "models" / DAY1)  # warm start: the served model
    # the pointer and day 1's files are as day 1 left them: same bytes, same files (inode, mtime)
    assert (run.work / "models" / "current").read_bytes() == run.pointer1
    assert {k: v for k, v in run.before_rerun.items() if DAY2 not in k} == run.before2


def test_a_cleared_task_reruns_and_replaces_only_its_output(run):
    assert run.clear.returncode == 0, run.clear.stderr[-3000:]
    assert run.cleared == {**dict.fromkeys(TASKS, ("success", 1)), "featurize_eval": (None, 1)}
    assert run.rerun.returncode == 0, (run.rerun.stdout + run.rerun.stderr)[-6000:]
    assert run.rerun_states["featurize_eval"][0] == "success"
    assert {k: v for k, v in run.rerun_states.items() if k != "featurize_eval"} == \
        {k: v for k, v in run.cleared.items() if k != "featurize_eval"}
    ours = f"data/{DAY1}/eval/"
    before = {k: v for k, v in run.before_rerun.items() if k.startswith(ours)}
    after = {k: v for k, v in run.after_rerun.items() if k.startswith(ours)}
    # every other file is untouched: bytes, inode and modification time
    assert {k: v for k, v in run.after_rerun.items() if not k.startswith(ours)} == \
        {k: v for k, v in run.before_rerun.items() if not k.startswith(ours)}
    # the dataset was replaced as a whole (new files), with the same rows; no staging left behind
    assert sorted(before) == sorted(after) and all(before[k][1:] != after[k][1:] for k in before)
    manifest = json.loads((run.work / ours / "_manifest.json").read_text())
    assert manifest["rows"] == 3000
    assert sorted(p.name for p in (run.work / "data" / DAY1).iterdir()) == ["eval", "train"]
    parts = [k for k in before if k.endswith(".parquet")]
    assert parts and all(before[k][0] == after[k][0] for k in parts)  # the same bytes: featurize is deterministic
