"""terascale_daily: featurize the day's click logs, train, evaluate, gate, publish.

    featurize_train ──> train ──┐
    featurize_eval ─────────────┴─> evaluate ──> gate ──> publish

Every task is a SparkSubmitOperator running one of terascale's jobs/*.py from the release that
`make dist` builds (dist/jobs/*.py, the py-files zip, the packed env.tar.gz):

Every task is idempotent and retried: featurize, train and evaluate pass ``--overwrite`` so that a
retry (or a re-run of the day) replaces the outputs of the attempt before it, atomically. They
still refuse a path that holds anything else (a user's files, another kind of artifact, the
pointer), so a wrong path in the configuration fails the task instead of destroying data.

- featurize_train / featurize_eval: the day's training logs and held-out logs -> hashed Parquet.
- train: warm-starts from the published model (`--init-model-if-exists POINTER`); the first day,
  before anything is published, it trains from scratch and says so. It starts from the model in
  service rather than the previous day's, so a day whose model failed the gate does not pass its
  regression on.
- evaluate: the new model on the day's held-out data -> metrics JSON.
- gate: `terascale gate` fails the run (exit 1) when the metric regresses beyond the configured
  margin against the metrics the published model was published with; nothing published yet: pass.
- publish: `terascale publish` atomically points the pointer file at the new model and records
  its metrics there for the next day's gate.

Paths, job settings and Spark settings come from terascale_daily.yaml beside this file (or the
file TERASCALE_DAG_CONFIG names), read at parse time; its strings are Jinja templates rendered
per run ({{ ds }}). The file needs only Airflow, its Spark provider and PyYAML, not terascale.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pendulum
import yaml
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG

CONFIG = os.environ.get("TERASCALE_DAG_CONFIG") or str(Path(__file__).with_name("terascale_daily.yaml"))
REQUIRED = {
    "dag": ("dag_id", "schedule", "start_date"),
    "paths": ("train_logs", "eval_logs", "train_data", "eval_data", "model", "metrics", "pointer"),
    "gate": ("metric", "max_regression", "margin"),
    "spark_submit": ("jobs_dir",),
}


def load_config(path: str = CONFIG) -> dict:
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    missing = [f"{s}.{k}" for s, keys in REQUIRED.items() for k in keys if k not in (cfg.get(s) or {})]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return cfg


def _value(v) -> str:
    """A --set value as terascale reads it (YAML): lists as JSON flow, booleans lower-case."""
    return json.dumps(v) if isinstance(v, list | dict | bool) else str(v)


def _sets(overrides: dict | None) -> list[str]:
    return [a for k, v in (overrides or {}).items() if v is not None for a in ("--set", f"{k}={_value(v)}")]


def _inputs(paths) -> list[str]:
    return [str(p) for p in paths] if isinstance(paths, list) else [str(paths)]


def job_args(cfg: dict) -> dict[str, tuple[str, list[str]]]:
    """task id -> (terascale job, application arguments as templates)."""
    p, g, ts = cfg["paths"], cfg["gate"], cfg.get("terascale") or {}
    feat = _sets(ts.get("featurize"))
    return {
        "featurize_train": ("featurize", ["--input", *_inputs(p["train_logs"]), "--output", p["train_data"],
                                          "--overwrite", *feat]),
        "featurize_eval": ("featurize", ["--input", *_inputs(p["eval_logs"]), "--output", p["eval_data"],
                                         "--overwrite", *feat]),
        "train": ("train", ["--input", p["train_data"], "--model", p["model"], "--overwrite",
                            "--init-model-if-exists", p["pointer"], *_sets(ts.get("train"))]),
        "evaluate": ("evaluate", ["--input", p["eval_data"], "--model", p["model"], "--overwrite", "--out", p["metrics"],
                                  *_sets(ts.get("evaluate"))]),
        "gate": ("gate", ["--metrics", p["metrics"], "--baseline", p["pointer"], "--metric", str(g["metric"]),
                          "--max-regression", str(g["max_regression"]), "--margin", str(g["margin"])]),
        "publish": ("publish", ["--model", p["model"], "--pointer", p["pointer"], "--metrics", p["metrics"]]),
    }


def submit_kwargs(cfg: dict, task_id: str) -> dict:
    """SparkSubmitOperator arguments of one task: spark_submit, then tasks.<task_id> over it."""
    kw = dict(cfg["spark_submit"])
    over = dict((cfg.get("tasks") or {}).get(task_id) or {})
    conf = {**(kw.pop("conf", None) or {}), **(over.pop("conf", None) or {})}
    kw.update(over)
    kw["conf"] = {k: _value(v) for k, v in conf.items() if v is not None}  # null: leave unset
    return kw


def build_dag(cfg: dict) -> DAG:
    d = cfg["dag"]
    default_args = {"owner": d.get("owner", "airflow"), "retries": int(d.get("retries", 0)),
                    "retry_delay": dt.timedelta(minutes=float(d.get("retry_delay_minutes", 5)))}
    with DAG(dag_id=d["dag_id"], schedule=d["schedule"], start_date=pendulum.parse(str(d["start_date"]), tz="UTC"),
             catchup=bool(d.get("catchup", False)), max_active_runs=int(d.get("max_active_runs", 1)),
             default_args=default_args, tags=list(d.get("tags") or []), doc_md=__doc__) as dag:
        ops = {}
        for task_id, (job, args) in job_args(cfg).items():
            kw = submit_kwargs(cfg, task_id)
            application = f"{str(kw.pop('jobs_dir')).rstrip('/')}/{job}.py"
            ops[task_id] = SparkSubmitOperator(task_id=task_id, application=application, application_args=args,
                                               name=f"terascale-{task_id}-{{{{ ds }}}}", **kw)
        ops["featurize_train"] >> ops["train"]
        [ops["train"], ops["featurize_eval"]] >> ops["evaluate"]
        ops["evaluate"] >> ops["gate"] >> ops["publish"]
    return dag


dag = build_dag(load_config())
