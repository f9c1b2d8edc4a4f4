"""MLflow tracking of train and evaluate (the optional ``mlflow`` extra; the ``tracking`` section).

Tracking is on when ``tracking.mlflow_uri`` is set, or when it is '' and the environment has
``MLFLOW_TRACKING_URI`` (``off``: never). mlflow is imported only here and in
``jobs.mlflow_model``, and only when tracking is on.

The command line (``jobs.cli``: ``terascale train`` / ``evaluate`` and their spark-submit entry
points) calls this module. **train** (``start_train`` before its Spark session starts,
``finish_train`` after the model is committed) creates a run in ``tracking.experiment`` named ``tracking.run_name`` (default: the
model directory's last path element). The model's ``metadata.json`` records it under
``tracking`` (the tracking URI as ``pipeline.redact`` shows it, the experiment id, the run id),
which is how evaluate finds the run. Then the run gets

- params: the configuration as the model's metadata holds it (redacted, as everywhere), flattened
  to dotted keys (``train.l2``, ``spark.conf.spark.executor.memory``); lists and mappings as JSON;
  the model's feature spec (the dataset's, which scoring uses) as ``spec.bits``, ``spec.fields``, ...;
  and (MLflow logs a model's configuration so) the pyfunc model's ``calibration``, ``labeled`` and
  ``skip_bad`` (``jobs.mlflow_model``);
- metrics per pass (MLflow's step = the pass number): every number of the history entry
  (``objective``, ``holdout_loss``, ``grad_norm``, ``elapsed_s``, a path's λ, ...) and each rank's
  seconds of the pass as ``rank<R>/compute_s``, ``rank<R>/stall_s``, ``rank<R>/transfer_s``;
- metrics at step 0: ``chosen_l2`` and ``chosen_l1`` (the λ the returned weights minimise: a
  path's choice or the configured number), ``passes``, ``returned_objective`` (the objective at
  the returned weights, the metadata's ``objective``), ``train_seconds``,
  ``train_rows``, ``holdout_rows``, ``nonzeros``; per rank ``rank<R>/seconds``, ``rank<R>/read_s``,
  ``rank<R>/rows``, ``rank<R>/peak_rss_mb``; the driver's estimate ``memory/estimate_mb`` and what a
  rank may use, ``memory/available_mb``;
- tags ``terascale/model_dir``, ``terascale/dataset``, ``terascale/version``, ``terascale/solver``,
  ``terascale/stop_reason`` and ``terascale/pyfunc_model_uri`` (paths redacted);
- artifacts: ``model_dir/`` (the model directory's files), ``report/`` (``terascale report``'s
  page and plots) and, with ``tracking.log_model``, the pyfunc model ``model``
  (``jobs.mlflow_model``; registered as ``tracking.registered_model`` when that is set).

A train that fails marks its run FAILED. **evaluate** (``log_evaluation``) adds to the run its
model names: every number of the metrics as ``eval/<name>`` (step 0), the metrics as
``evaluation/metrics.json`` and ``report/`` again, with the ROC, precision-recall and
calibration plots.

Never a failed job: mlflow missing, a tracking server that cannot be reached or that fails on
the way is a warning in the job's log and the job goes on; a model whose run was not
created records none. Requests to a server time out after ``tracking.timeout_s`` and are retried
at most twice (the run's creation not at all), unless ``MLFLOW_HTTP_REQUEST_TIMEOUT`` or
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` are set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from terascale.pipeline import fsutil
from terascale.pipeline.manifest import terascale_version
from terascale.pipeline.redact import redact, redact_text

log = logging.getLogger("terascale.tracking")

_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
_CODE = Path(__file__).with_name("mlflow_pyfunc.py")  # the logged model's code (models from code)


def tracking_uri(t) -> str | None:
    """The tracking URI of a ``tracking`` section: its own, else MLFLOW_TRACKING_URI; None: off."""
    if t.mlflow_uri.strip().lower() == "off":
        return None
    return t.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


@dataclass(frozen=True)
class TrackedRun:
    """A run train created: where it lives and how to reach it."""

    uri: str
    experiment_id: str
    run_id: str
    timeout_s: float

    def record(self) -> dict:
        """The model metadata's ``tracking`` entry (the URI as ``pipeline.redact`` shows it)."""
        return {"mlflow": {"tracking_uri": redact_text(self.uri), "experiment_id": self.experiment_id,
                           "run_id": self.run_id}}

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


def _warn(what: str, uri: str, e: BaseException) -> None:
    log.warning("MLflow tracking at %s: %s (%s: %s); the job goes on without it", redact_text(uri), what,
                type(e).__name__, redact_text(str(e)).splitlines()[0] if str(e) else "")


def _have_mlflow(uri: str) -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError as e:
        _warn("mlflow is not installed (pip install 'terascale[mlflow]')", uri, e)
        return False
    return True


@contextlib.contextmanager
def _requests(timeout_s: float, retries: int):
    """MLflow's HTTP timeout and retries for the requests inside, unless the environment sets them."""
    saved = {k: os.environ.get(k) for k in (_TIMEOUT, _RETRIES)}
    if saved[_TIMEOUT] is None:
        os.environ[_TIMEOUT] = str(max(1, round(timeout_s)))
    if saved[_RETRIES] is None:
        os.environ[_RETRIES] = str(retries)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def start_train(cfg, data_dir: str, model_dir: str) -> TrackedRun | None:
    """Create train's run (see the module docstring); None when tracking is off or unavailable."""
    uri = tracking_uri(cfg.tracking)
    if uri is None or not _have_mlflow(uri):
        return None
    t = cfg.tracking
    name = t.run_name or fsutil.normalize(model_dir).rstrip("/").rsplit("/", 1)[-1]
    try:
        from mlflow.tracking import MlflowClient

        with _requests(t.timeout_s, 0):
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(t.experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(t.experiment)
            run = client.create_run(exp_id, run_name=redact_text(name), tags=_tags(cfg, data_dir, model_dir))
    except Exception as e:  # noqa: BLE001 - tracking never fails the job
        _warn("cannot create a run", uri, e)
        return None
    tracked = TrackedRun(uri, exp_id, run.info.run_id, t.timeout_s)
    log.info("MLflow run %s in experiment %r at %s", tracked.run_id, t.experiment, redact_text(uri))
    return tracked


def _tags(cfg, data_dir: str, model_dir: str) -> dict[str, str]:
    return {"terascale/model_dir": redact_text(fsutil.normalize(model_dir)),
            "terascale/dataset": redact_text(fsutil.normalize(data_dir)),
            "terascale/version": terascale_version(), "terascale/solver": cfg.train.solver}


def fail_train(run: TrackedRun | None) -> None:
    """Mark the run FAILED (train raised)."""
    if run is None:
        return
    try:
        with _requests(run.timeout_s, 2):
            run.client().set_terminated(run.run_id, "FAILED")
    except Exception as e:  # noqa: BLE001 - tracking never fails the job
        _warn(f"cannot mark run {run.run_id} failed", run.uri, e)


def finish_train(run: TrackedRun | None, cfg, meta: dict, model_dir: str) -> None:
    """Log the committed model's run: params, metrics, tags, artifacts, the pyfunc model; FINISHED."""
    if run is None:
        return
    from mlflow.entities import Metric, Param

    try:
        with _requests(run.timeout_s, 2), tempfile.TemporaryDirectory(prefix="terascale-mlflow-") as tmp:
            client = run.client()
            params = [Param(k, v) for k, v in {**flatten_params(meta["config"]),
                                               **flatten_params({"spec": meta["spec"]})}.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(run.run_id, params=params[i:i + 100])
            metrics = [Metric(k, v, 0, step) for k, v, step in train_metrics(meta)]
            for i in range(0, len(metrics), 1000):
                client.log_batch(run.run_id, metrics=metrics[i:i + 1000])
            client.set_tag(run.run_id, "terascale/stop_reason", str(meta.get("stop_reason")))
            local = _local_copy(model_dir, tmp)
            client.log_artifacts(run.run_id, local, "model_dir")
            client.log_artifacts(run.run_id, _report(local, None, tmp), "report")
            if cfg.tracking.log_model:
                _log_pyfunc(run, local, cfg.tracking.registered_model)
            client.set_terminated(run.run_id, "FINISHED")
    except Exception as e:  # noqa: BLE001 - tracking never fails the job
        _warn(f"logging run {run.run_id} failed", run.uri, e)
        fail_train(run)


def flatten_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The (redacted) configuration as MLflow params: dotted keys, lists and mappings as JSON."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_params(v, key + "."))
        elif isinstance(v, (list, tuple, dict)):
            out[key] = json.dumps(v)
        elif isinstance(v, bool):
            out[key] = "true" if v else "false"
        else:
            out[key] = str(v)
    return out


def _number(v) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def train_metrics(meta: dict) -> list[tuple[str, float, int]]:
    """(name, value, step) of a model's metrics (see the module docstring)."""
    from terascale.solvers.regpath import effective_l2, effective_penalty

    out: list[tuple[str, float, int]] = []
    for h in meta["history"]:
        p = int(h["pass"])
        for k, v in h.items():
            if k == "pass":
                continue
            if _number(v):
                out.append((k, float(v), p))
            elif k in ("compute_s", "stall_s", "transfer_s") and isinstance(v, list):
                out += [(f"rank{r}/{k}", float(x), p) for r, x in enumerate(v) if _number(x)]
    summary = {"chosen_l2": effective_l2(meta), "chosen_l1": effective_penalty(meta, "l1"),
               "passes": len(meta["history"]), "returned_objective": meta.get("objective"),
               "train_seconds": meta.get("train_seconds"), "train_rows": meta["data"].get("train_rows"),
               "holdout_rows": meta["data"].get("holdout_rows"), "nonzeros": (meta.get("weights") or {}).get("nonzeros")}
    for r in meta["per_rank"]:
        for k in ("seconds", "read_s", "rows"):
            summary[f"rank{r['rank']}/{k}"] = r.get(k)
        if r.get("peak_rss_bytes") is not None:
            summary[f"rank{r['rank']}/peak_rss_mb"] = r["peak_rss_bytes"] / 2**20
    est = meta.get("memory_estimate") or {}
    if est.get("needed_bytes") is not None:
        summary["memory/estimate_mb"] = est["needed_bytes"] / 2**20
    if est.get("available_bytes") is not None:
        summary["memory/available_mb"] = est["available_bytes"] / 2**20
    out += [(k, float(v), 0) for k, v in summary.items() if _number(v)]
    return out


def _local_copy(model_dir: str, tmp: str) -> str:
    """A local directory with the model's files: the model itself when it is local, else a copy."""
    import pyarrow.fs as pafs

    fs, inner = fsutil.resolve(fsutil.normalize(model_dir))
    if isinstance(fs, pafs.LocalFileSystem):
        return inner
    dst = os.path.join(tmp, "model_dir")
    pafs.copy_files(inner, dst, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return dst


def _report(local_model: str, metrics_json: str | None, tmp: str) -> str:
    from terascale.jobs.report import build_report

    out = os.path.join(tmp, "report")
    build_report(local_model, metrics_json, out)
    return out


def _log_pyfunc(run: TrackedRun, local_model: str, registered: str) -> None:
    import mlflow

    from terascale.jobs.mlflow_model import ARTIFACT, CONFIG_DEFAULTS

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(run.uri)
    try:
        with mlflow.start_run(run_id=run.run_id, experiment_id=run.experiment_id):
            info = mlflow.pyfunc.log_model(
                name="model", python_model=str(_CODE), artifacts={ARTIFACT: local_model}, model_config=CONFIG_DEFAULTS,
                pip_requirements=[f"terascale[mlflow]=={terascale_version()}"],
                registered_model_name=registered or None)
            mlflow.set_tag("terascale/pyfunc_model_uri", info.model_uri)
    finally:
        mlflow.set_tracking_uri(previous)
    log.info("MLflow: logged the pyfunc model %s%s", info.model_uri,
             f", registered as {registered!r}" if registered else "")


def run_of(meta: dict) -> str | None:
    """The MLflow run id a model's metadata records, or None."""
    return ((meta.get("tracking") or {}).get("mlflow") or {}).get("run_id")


def log_evaluation(cfg, model_dir: str, metrics: dict) -> str | None:
    """Add evaluate's metrics (and report) to the run of the model; returns the run id, or None
    when nothing was logged (tracking off, a model without a run, a failure: warned)."""
    from terascale.pipeline import modeldir
    from terascale.pipeline.pointer import resolve_model

    uri = tracking_uri(cfg.tracking)
    if uri is None:
        return None
    model_dir = resolve_model(model_dir)
    meta = modeldir.load_metadata(model_dir)
    run_id = run_of(meta)
    if run_id is None:
        log.warning("MLflow tracking is on, but model %s records no MLflow run (trained without tracking): "
                    "its evaluation is not logged", redact_text(model_dir))
        return None
    if not _have_mlflow(uri):
        return None
    from mlflow.entities import Metric

    try:
        with _requests(cfg.tracking.timeout_s, 2), tempfile.TemporaryDirectory(prefix="terascale-mlflow-") as tmp:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            client.get_run(run_id)  # names a missing run before anything is logged
            client.log_batch(run_id, metrics=[Metric(f"eval/{k}", float(v), 0, 0) for k, v in metrics.items()
                                              if _number(v)])
            shown = redact(metrics)
            path = os.path.join(tmp, "metrics.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(shown, f, indent=2, default=str)
            client.log_artifact(run_id, path, "evaluation")
            local = _local_copy(model_dir, tmp)
            client.log_artifacts(run_id, _report(local, path, tmp), "report")
    except Exception as e:  # noqa: BLE001 - tracking never fails the job
        _warn(f"cannot log the evaluation to run {run_id}", uri, e)
        return None
    log.info("MLflow: evaluation logged to run %s", run_id)
    return run_id
