"""The Airflow DAG conf/airflow/terascale_daily.py: it loads, its graph, its rendered spark-submit lines.

Airflow's Spark provider installs `pyspark-client`, a second distribution of the `pyspark` package
that would overwrite terascale's pyspark, so Airflow lives in its own venv: `make test` builds
.venv-airflow (conf/airflow/requirements.txt) and runs this file there. Where Airflow is not
installed (terascale's .venv) the file is skipped. Tests that run terascale's own CLI do it in a
subprocess with terascale's Python ($TERASCALE_PYTHON, else .venv/bin/python). No scheduler, no
metadata database: AIRFLOW_HOME is a temporary directory and spark-submit a stand-in on PATH.
"""

from __future__ import annotations

import atexit
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("airflow") is None:
    pytest.skip("Apache Airflow is not installed in this environment; `make test` runs this file in "
                ".venv-airflow", allow_module_level=True)

_HOME = tempfile.mkdtemp(prefix="terascale-airflow-home-")
atexit.register(shutil.rmtree, _HOME, True)
os.environ["AIRFLOW_HOME"] = _HOME  # before Airflow is imported: it reads its home then
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"

from airflow.dag_processing.dagbag import DagBag  # noqa: E402 - after AIRFLOW_HOME is set

pytest.importorskip("airflow.providers.apache.spark", reason="the apache-spark Airflow provider is not installed")

ROOT = Path(__file__).resolve().parents[1]
DAG_DIR = ROOT / "conf" / "airflow"
DAY = "2026-03-05"
EXPECTED_UPSTREAM = {
    "featurize_train": set(), "featurize_eval": set(), "train": {"featurize_train"},
    "evaluate": {"train", "featurize_eval"}, "gate": {"evaluate"}, "publish": {"gate"},
}


def terascale_python() -> str:
    py = os.environ.get("TERASCALE_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py).exists():
        pytest.skip(f"terascale's Python {py} not found (set TERASCALE_PYTHON)")
    return py


def load_dag(monkeypatch, config: Path | None = None):
    if config is not None:
        monkeypatch.setenv("TERASCALE_DAG_CONFIG", str(config))
    else:
        monkeypatch.delenv("TERASCALE_DAG_CONFIG", raising=False)
    bag = DagBag(dag_folder=str(DAG_DIR))
    assert bag.import_errors == {}
    return bag.dags["terascale_daily"]


def rendered(dag, task_id: str, day: str = DAY):
    """A copy of the task with its templates rendered for the logical date ``day``."""
    task = copy.copy(dag.get_task(task_id))
    task.render_template_fields({"ds": day, "ds_nodash": day.replace("-", "")})
    return task


def local_config(tmp_path: Path) -> Path:
    """The shipped configuration with every path on the local filesystem under tmp_path."""
    import yaml

    cfg = yaml.safe_load((DAG_DIR / "terascale_daily.yaml").read_text())
    cfg["paths"] = {
        "train_logs": [f"{tmp_path}/logs/{{{{ ds }}}}/a.tsv", f"{tmp_path}/logs/{{{{ ds }}}}/b.tsv"],
        "eval_logs": f"{tmp_path}/logs/{{{{ ds }}}}/eval.tsv",
        "train_data": f"{tmp_path}/data/{{{{ ds }}}}/train", "eval_data": f"{tmp_path}/data/{{{{ ds }}}}/eval",
        "model": f"{tmp_path}/models/{{{{ ds }}}}", "metrics": f"{tmp_path}/metrics/{{{{ ds_nodash }}}}.json",
        "pointer": f"{tmp_path}/models/current",
    }
    cfg["terascale"]["featurize"] = {"featurize.bits": 18, "featurize.conjunctions": [["C6", "C9"]]}
    cfg["terascale"]["train"]["train.shuffle"] = True
    cfg["spark_submit"]["jobs_dir"] = str(ROOT / "jobs" / "submit")
    path = tmp_path / "dag.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fake_spark_submit(tmp_path: Path, monkeypatch, rc: int = 0, run: bool = False) -> Path:
    """spark-submit on PATH: records its argv; with run=True runs the application like client mode."""
    bin_dir, record = tmp_path / "bin", tmp_path / "spark-submit-argv.json"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "spark-submit"
    script.write_text(f"""#!{sys.executable}
import json, subprocess, sys
argv = sys.argv[1:]
with open({str(record)!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
i = 0
while argv[i].startswith("--"):
    i += 1 if argv[i] == "--verbose" else 2
if {run!r}:
    sys.exit(subprocess.run([{terascale_python() if run else ""!r}, *argv[i:]]).returncode)
sys.exit({rc})
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    return record


def recorded(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


# --------------------------------------------------------------------------------------------


def test_dag_loads_with_the_expected_graph(monkeypatch):
    dag = load_dag(monkeypatch)
    assert {t.task_id: set(t.upstream_task_ids) for t in dag.tasks} == EXPECTED_UPSTREAM
    assert {type(t).__name__ for t in dag.tasks} == {"SparkSubmitOperator"}
    assert (dag.max_active_runs, dag.catchup) == (1, False)


def test_rendered_arguments_carry_the_days_paths_and_the_config(monkeypatch):
    dag = load_dag(monkeypatch)
    release = "hdfs:///apps/terascale/0.1.0"
    expected = {
        "featurize_train": ["--input", f"hdfs:///data/clicks/raw/dt={DAY}/train/",
                            "--output", f"hdfs:///data/clicks/featurized/dt={DAY}/train", "--overwrite",
                            "--set", "featurize.bits=24"],
        "featurize_eval": ["--input", f"hdfs:///data/clicks/raw/dt={DAY}/eval/",
                           "--output", f"hdfs:///data/clicks/featurized/dt={DAY}/eval", "--overwrite",
                           "--set", "featurize.bits=24"],
        "train": ["--input", f"hdfs:///data/clicks/featurized/dt={DAY}/train", "--model", f"hdfs:///models/ctr/dt={DAY}",
                  "--overwrite", "--init-model-if-exists", "hdfs:///models/ctr/current", "--set", "train.workers=8", "--set", "train.spares=1"],
        "evaluate": ["--input", f"hdfs:///data/clicks/featurized/dt={DAY}/eval", "--model", f"hdfs:///models/ctr/dt={DAY}",
                     "--overwrite", "--out", f"hdfs:///models/ctr/metrics/dt={DAY}.json"],
        "gate": ["--metrics", f"hdfs:///models/ctr/metrics/dt={DAY}.json", "--baseline", "hdfs:///models/ctr/current",
                 "--metric", "logloss", "--max-regression", "0.01", "--margin", "relative"],
        "publish": ["--model", f"hdfs:///models/ctr/dt={DAY}", "--pointer", "hdfs:///models/ctr/current",
                    "--metrics", f"hdfs:///models/ctr/metrics/dt={DAY}.json"],
    }
    for task_id, args in expected.items():
        t = rendered(dag, task_id)
        job = task_id.split("_")[0]
        assert (t.application, t.application_args) == (f"{release}/jobs/{job}.py", args)
        assert t.name == f"terascale-{task_id}-{DAY}"
        assert (t.py_files, t._archives) == (f"{release}/terascale-pyfiles.zip", f"{release}/env.tar.gz#env")
        assert t.conf["spark.pyspark.python"] == "./env/bin/python"
        no_spark = task_id in ("gate", "publish")  # YARN fails cluster-mode apps without a SparkContext
        assert t._deploy_mode == ("client" if no_spark else "cluster")
        assert ("spark.pyspark.driver.python" in t.conf) == no_spark
    train, evaluate = rendered(dag, "train"), rendered(dag, "evaluate")
    assert (train._num_executors, train._executor_cores, evaluate._num_executors, evaluate._executor_cores) == (9, 1, 8, 4)
    assert train.conf["spark.dynamicAllocation.enabled"] == "false" and "spark.dynamicAllocation.enabled" not in evaluate.conf


def test_another_config_file_and_a_spark_submit_line(tmp_path, monkeypatch):
    dag = load_dag(monkeypatch, local_config(tmp_path))
    record = fake_spark_submit(tmp_path, monkeypatch)
    t = rendered(dag, "featurize_train")
    t.execute({})
    assert recorded(record) == [[
        "--master", "local[2]", "--conf", "spark.pyspark.python=./env/bin/python",
        "--conf", "spark.yarn.appMasterEnv.PYSPARK_PYTHON=./env/bin/python", "--conf", "spark.yarn.maxAppAttempts=1",
        "--py-files", "hdfs:///apps/terascale/0.1.0/terascale-pyfiles.zip",
        "--archives", "hdfs:///apps/terascale/0.1.0/env.tar.gz#env", "--num-executors", "8",
        "--executor-cores", "4", "--executor-memory", "8g", "--driver-memory", "4g",
        "--name", f"terascale-featurize_train-{DAY}", "--deploy-mode", "cluster", str(ROOT / "jobs" / "submit" / "featurize.py"),
        "--input", f"{tmp_path}/logs/{DAY}/a.tsv", f"{tmp_path}/logs/{DAY}/b.tsv", "--output", f"{tmp_path}/data/{DAY}/train",
        "--overwrite", "--set", "featurize.bits=18", "--set", 'featurize.conjunctions=[["C6", "C9"]]',
    ]]
    assert rendered(dag, "evaluate").application_args[-1] == f"{tmp_path}/metrics/{DAY.replace('-', '')}.json"


def test_a_failing_job_fails_its_task(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowException

    dag = load_dag(monkeypatch, local_config(tmp_path))
    fake_spark_submit(tmp_path, monkeypatch, rc=1)
    with pytest.raises(AirflowException, match="Error code is: 1"):
        rendered(dag, "gate").execute({})


def test_rendered_arguments_are_valid_terascale_commands(tmp_path, monkeypatch):
    """terascale's own parser and configuration schema accept what every task passes."""
    commands = []
    for config in (None, local_config(tmp_path)):
        dag = load_dag(monkeypatch, config)
        commands += [[Path(t.application).stem, *rendered(dag, t.task_id).application_args] for t in dag.tasks]
    code = ("import json, sys\nfrom terascale.jobs.cli import build_parser\nfrom terascale.jobs.config import load_config\n"
            "for argv in json.load(sys.stdin):\n"
            "    a = build_parser().parse_args(argv)\n"
            "    if hasattr(a, 'sets'):\n        load_config(a.conf, a.sets)\n"
            "print('ok', len(json.load(open(sys.argv[1]))))\n")
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    r = subprocess.run([terascale_python(), "-c", code, str(tmp_path / "commands.json")], input=json.dumps(commands),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", "12"]


def test_gate_and_publish_tasks_run_terascale(tmp_path, monkeypatch):
    """Day 1 publishes (no baseline yet); day 2 regresses: its gate task fails and the pointer stays."""
    from airflow.sdk.exceptions import AirflowException

    dag = load_dag(monkeypatch, local_config(tmp_path))
    fake_spark_submit(tmp_path, monkeypatch, run=True)
    days = {"2026-03-05": 0.45, "2026-03-06": 0.47, "2026-03-07": 0.44}
    make = ("import sys, numpy as np\nfrom terascale.pipeline import modeldir\nfor d in sys.argv[1:]:\n"
            "    s = modeldir.staging_dir(d)\n    modeldir.write_weights(s, np.zeros(16, np.float32))\n"
            "    modeldir.commit(s, d, {'spec': {'bits': 4}, 'intercept': 0.0})\n")
    r = subprocess.run([terascale_python(), "-c", make, *(f"{tmp_path}/models/{d}" for d in days)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "metrics").mkdir()
    for d, logloss in days.items():
        (tmp_path / "metrics" / f"{d.replace('-', '')}.json").write_text(json.dumps({"logloss": logloss}))
    pointer = tmp_path / "models" / "current"

    rendered(dag, "gate", "2026-03-05").execute({})
    rendered(dag, "publish", "2026-03-05").execute({})
    assert json.loads(pointer.read_text())["model"] == f"{tmp_path}/models/2026-03-05"
    with pytest.raises(AirflowException):
        rendered(dag, "gate", "2026-03-06").execute({})  # 0.47 > 0.45 * 1.01: exit 1, no publish
    assert json.loads(pointer.read_text())["model"] == f"{tmp_path}/models/2026-03-05"
    rendered(dag, "gate", "2026-03-07").execute({})
    rendered(dag, "publish", "2026-03-07").execute({})
    p = json.loads(pointer.read_text())
    assert (p["model"], p["previous"], p["metrics"]) == (
        f"{tmp_path}/models/2026-03-07", f"{tmp_path}/models/2026-03-05", {"logloss": 0.44})
