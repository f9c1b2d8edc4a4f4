"""The train job's driver side: validate, plan shards, run the barrier stage, commit the model.

Spark orchestration only: numbers are computed in the tasks (``jobs.train_task``) by the
solvers. The model directory appears only when complete (staging directory + rename); a failed
run leaves none, and removes its staging directory. Before anything starts, ``check_outputs``
refuses a model or checkpoint directory that holds anything else than terascale's own artifact
of that kind (``pipeline.artifacts``); the checkpoint directory gets its marker first and is
removed at the end only when the marker is this run's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from terascale.allreduce.spark import BarrierError, NetConf, local_cores, run_barrier
from terascale.jobs import checkpoint, preflight
from terascale.jobs.config import (
    Config,
    ConfigError,
    recalibration_obstacle,
    solver_params,
    to_dict,
)
from terascale.jobs.memory_accounting import CSR_TERM
from terascale.jobs.progress import ProgressMonitor
from terascale.jobs.run_checkpoints import RunCheckpoints
from terascale.jobs.train_task import Inject, TaskSpec, run_train_task
from terascale.pipeline import artifacts, fsutil, modeldir, shard_cache, spark_tasks, time_split
from terascale.pipeline.dataset import plan_shards
from terascale.pipeline.manifest import MANIFEST, DatasetError, read_manifest
from terascale.pipeline.pointer import resolve_model, served_by
from terascale.pipeline.sampling import dataset_negative_rate, population_rows
from terascale.pipeline.spark_errors import spark_error_summary
from terascale.pipeline.spec import check_bits
from terascale.solvers.catalogue import solver_spec
from terascale.solvers.params import SolverParams
from terascale.solvers.regpath import auto_penalty, path_passes

log = logging.getLogger("terascale.train")

# failures that a new attempt would only repeat: fail the job at once
DETERMINISTIC_ERRORS = ("InvalidInputError", "NonFiniteInputError", "DivergenceError", "ModelError", "CheckpointError",
                        "DataFileError")


class TrainError(RuntimeError):
    """The train job failed; no model was written. ``attempts``: the barrier stage's attempts."""

    def __init__(self, message: str, attempts: list[dict] | None = None):
        super().__init__(message)
        self.attempts = list(attempts or [])


def _progress_tty(cfg: Config) -> bool | None:
    """train.progress: auto (a bar on a terminal, log lines otherwise), bar, log."""
    return {"auto": None, "bar": True, "log": False}[cfg.train.progress]


def checkpoint_dir(cfg: Config, model_dir: str) -> str:
    return cfg.train.checkpoint_dir or fsutil.normalize(model_dir).rstrip("/") + ".checkpoint"


OVERWRITE_FLAG = "--overwrite (or train.overwrite: true)"


def check_outputs(cfg: Config, data_dir: str, model_dir: str) -> None:
    """Refuse, before any Spark work, a model or checkpoint directory this run must not write.

    The model: a missing path, an empty directory or (with ``train.overwrite``) an earlier model.
    The checkpoint directory: missing, empty, or an earlier run's (its marker; cleared at start).
    Neither may equal, contain or lie inside the input dataset or each other.
    """
    artifacts.check_apart(model_dir, "--model", {"the input dataset": data_dir})
    if artifacts.check_target(model_dir, artifacts.MODEL, cfg.train.overwrite, "--model", OVERWRITE_FLAG).kind == artifacts.MODEL:
        serving = served_by(model_dir)
        if serving:
            raise artifacts.OutputError(
                f"--model {model_dir}: is the model served by the pointer {', '.join(serving)}; refusing to replace "
                "it in place: train into a new directory, then gate and publish it")
    ckpt = checkpoint_dir(cfg, model_dir)
    what = "train.checkpoint_dir"
    artifacts.check_apart(ckpt, what, {"the input dataset": data_dir, "the model directory": model_dir})
    artifacts.check_target(ckpt, artifacts.CHECKPOINTS, True, what, "")


def check_local_slots(cfg: Config) -> None:
    """Before a local session starts (terascale's own, not spark-submit's): refuse a run whose
    ``train.workers`` + ``train.spares`` barrier tasks of ``train.threads`` cpus each do not fit
    the master's cores (``local[N]``: N // threads task slots). The barrier stage checks the
    slots again on the real session (``allreduce.spark.preflight``). Not for a Spark Connect
    session, whose master is the server's."""
    from terascale.jobs.session import launched_by_spark_submit, remote_url

    t = cfg.train
    cores = local_cores(cfg.spark.master)
    if cores is None or launched_by_spark_submit() or remote_url(cfg.spark):
        return
    cpus = max(t.threads, int(dict(cfg.spark.conf).get("spark.task.cpus", 1)))
    if cores // cpus < t.workers + t.spares:
        raise ConfigError(
            f"spark.master = {cfg.spark.master!r} runs {cores} task threads: {cores // cpus} barrier task(s) of "
            f"{cpus} cpus (train.threads = {t.threads}), but the barrier stage needs {t.workers + t.spares} at once "
            f"(train.workers = {t.workers} + train.spares = {t.spares}); lower train.workers, train.spares or "
            f"train.threads, or use more cores (local[N])"
        )


def _groups_path(data_dir: str, manifest: dict, params: SolverParams) -> str:
    """The dataset's group map when the L-BFGS phase will use it (``lbfgs_coarse``), else ""."""
    entry = manifest.get("groups")
    if not entry or not params.lbfgs_coarse or "lbfgs" not in solver_spec(params.solver).phases:
        return ""
    return fsutil.join(fsutil.normalize(data_dir), entry["path"])


def _fenced(ckpt: str, attach):
    """Before each attempt starts: its checkpoint fence (jobs.checkpoint.begin_attempt), then ``attach``."""

    def on_attempt(server, attempt: int) -> None:
        checkpoint.begin_attempt(ckpt, attempt)
        attach(server, attempt)

    return on_attempt


def _memory_preflight(spark, cfg: Config, manifest: dict, shards, bits: int, warm_start: bool) -> tuple[dict, dict]:
    """The per-rank memory estimate of the largest shard against what a rank may use
    (``jobs.preflight``); raises PreflightError when it does not fit and train.preflight=fail.
    Also resolves train.data_cache (:func:`_data_cache`): (the estimate, the cache decision)."""
    t = cfg.train
    sizes = preflight.shard_sizes(shards, manifest)
    biggest = max(sizes, key=lambda s: 16 * s.rows + 8 * s.nnz)

    def rank_estimate(cache_budget: int = 0) -> preflight.Estimate:
        return preflight.estimate(t, 1 << bits, biggest, preflight.active_bound(manifest, 1 << bits), t.workers,
                                  cfg.allreduce.chunk_bytes, warm_start, cache_budget)

    est = rank_estimate()
    conf = spark_tasks.all_conf(spark, preflight.CONF_KEYS)
    available = preflight.available(conf, spark_tasks.master(spark), t.workers + t.spares, t.rank_memory_mb)
    est.available, est.source = available
    cache = _data_cache(t, est, conf.get("spark.local.dir", "") or "")
    if cache["mode"] == "disk":  # the shard streams: the estimate counts the blocks a pass holds
        est = rank_estimate(cache["budget_bytes"])
        est.available, est.source = available
    warning = preflight.check(est, t.preflight, t.workers, bits)
    if warning:
        log.warning("%s", warning)
    else:
        log.info("memory preflight: a rank needs about %.0f MiB (%s peak), may use %s (%s)", est.needed / 2**20,
                 est.phase, "?" if est.available is None else f"{est.available / 2**20:.0f} MiB", est.source)
    return est.to_json(), cache


def _data_cache(t, est, spark_local_dir: str) -> dict:
    """train.data_cache resolved on the driver (``pipeline.shard_cache.choose``) from the largest
    shard's CSR bytes and the rest of the estimate (the in-memory one); with disk the caller
    estimates again with the budget as the shard's term (a pass holds that much of it).
    {mode, budget_bytes, why, spark_local_dir}."""
    csr = est.terms.get(CSR_TERM, 0)
    mode, budget, why = shard_cache.choose(t.data_cache, t.memory_budget_mb, t.threads, t.shuffle, csr,
                                           est.available, est.source, est.needed - csr)
    log.info("shard cache: %s", why)
    return {"mode": mode, "budget_bytes": budget, "why": why, "spark_local_dir": spark_local_dir}


def negative_sampling(manifest: dict) -> dict:
    """The dataset's negative downsampling as the model metadata records it (``pipeline.sampling``)."""
    rate = dataset_negative_rate(manifest)
    note = ("negatives kept with probability r and weighted 1/r: the weighted objective estimates the unsampled "
            "population's; the model's probabilities are recalibrated on its held-out rows (train.recalibrate, "
            "see recalibration), as sigma(margin) over-predicts on unsampled rows; sigma(a * margin + c - ln r) "
            "is the click rate among the kept rows") if rate < 1.0 else "every row kept"
    return {"negative_rate": rate, "weighting": note}


def recalibration_plan(t, manifest: dict) -> tuple[bool, str]:
    """(fit σ(a·m + c) on the held-out rows?, why) for ``train.recalibrate`` on this dataset."""
    if t.recalibrate == "off":
        return False, "train.recalibrate = off"
    if t.recalibrate == "on":
        return True, "train.recalibrate = on"
    rate = dataset_negative_rate(manifest)
    if rate >= 1.0:
        return False, "auto: the dataset keeps every row"
    obstacle = recalibration_obstacle(t)
    if obstacle is not None:
        return False, f"auto: the dataset keeps negatives at rate {rate:g}, but {obstacle}"
    return True, (f"auto: the dataset keeps negatives at rate {rate:g}; the weighted model over-predicts on "
                  "unsampled rows")


def _recalibration_record(planned: bool, why: str, fitted: dict | None) -> dict:
    """The model's ``recalibration`` entry: applied (with the fit, pipeline.sampling reads it) or not, and why."""
    if planned and fitted is None:
        return {"applied": False, "why": f"{why}; nothing to fit: the held-out rows hold one class only or none"}
    return {"applied": planned, "why": why, **(fitted or {})}


def _time_split(t, manifest: dict, data_dir: str) -> dict | None:
    """The held-out split by time (``train.holdout_latest``, ``pipeline.time_split``): the cut and
    what it stands for, or None for the split by row; a dataset without a time column is a
    ConfigError naming it (before any Spark job)."""
    if not t.holdout_latest:
        return None
    entry = manifest.get("time")
    if not entry:
        raise ConfigError(f"train.holdout_latest = {t.holdout_latest}: the dataset {data_dir} has no time column; "
                          "featurize it with featurize.time_column (a table's timestamp, date or integer column)")
    cut = time_split.cut_for_latest(entry["quantiles"], t.holdout_latest)
    log.info("train: holding out the latest %.3g of the rows: %s >= %d (%s)", t.holdout_latest, entry["column"], cut,
             entry["unit"])
    return {"by": "time", "column": entry["column"], "unit": entry["unit"], "fraction": t.holdout_latest, "cut": cut}


def run_train(spark, cfg: Config, data_dir: str, model_dir: str, tracking: dict | None = None) -> dict:
    """Train on the featurized dataset ``data_dir`` and write ``model_dir``; returns its metadata.
    ``tracking``: the metadata's ``tracking`` entry (the MLflow run, ``jobs.tracking``), if any."""
    t0 = time.perf_counter()
    check_outputs(cfg, data_dir, model_dir)
    manifest = read_manifest(data_dir)
    spec = manifest["spec"]
    check_bits(spec["bits"], f"{fsutil.join(fsutil.normalize(data_dir), MANIFEST)}: spec.bits")
    if not manifest["rows"]:  # featurize.allow_empty: nothing to train on
        raise DatasetError(f"{data_dir}: the dataset has no rows (featurized from {manifest.get('lines', 0)} lines); "
                           "nothing to train on")
    t = cfg.train
    init_model = resolve_model(t.init_model) if t.init_model else ""  # once: a pointer may move
    if init_model:
        init_meta = modeldir.load_metadata(init_model)
        diff = modeldir.same_spec(init_meta["spec"], spec)
        if diff:
            detail = ", ".join(f"{k}: model {init_meta['spec'].get(k)!r} vs data {spec.get(k)!r}" for k in diff)
            raise modeldir.ModelError(f"train.init_model {t.init_model}: its feature spec differs from the data's ({detail})")
    params = solver_params(cfg.train)
    split = _time_split(t, manifest, data_dir) if solver_spec(params.solver).holdout else None
    shards = plan_shards(data_dir, t.workers, manifest)
    memory, cache = _memory_preflight(spark, cfg, manifest, shards, int(spec["bits"]), bool(init_model))
    ckpt = checkpoint_dir(cfg, model_dir)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_ckpt = RunCheckpoints(ckpt, run_id)  # this run's subdirectory (jobs.run_checkpoints)
    staging = modeldir.staging_dir(model_dir, run_id)
    recal_on, recal_why = recalibration_plan(t, manifest)
    task = TaskSpec(
        shards=tuple(tuple(s) for s in shards), n_features=1 << int(spec["bits"]), params=params,
        # a solver without a held-out split (CoCoA stops on the duality gap) trains on all rows
        holdout_period=t.holdout_period if solver_spec(params.solver).holdout and split is None else 0,
        holdout_cut=None if split is None else split["cut"],
        checkpoint_dir=run_ckpt.dir, checkpoint_interval_s=t.checkpoint_interval_s,
        staging_dir=staging,
        inject=Inject(**dataclasses.asdict(t.inject)), init_weights=init_model,
        groups_path=_groups_path(data_dir, manifest, params),
        cache=shard_cache.CacheSpec(cache["mode"], cache["budget_bytes"], t.threads, t.memory_budget_mb, t.cache_dir,
                                    cache["spark_local_dir"], run_id),
        recalibrate=recal_on,
        path_rows=population_rows(manifest),
    )
    log.info("train: %s solver, %d workers + %d spares, %d rows in %d files, 2^%d features",
             params.solver, t.workers, t.spares, manifest["rows"], len(manifest["files"]), spec["bits"])
    # rows per pass, for the progress display: the expected count, as each row is held out with
    # probability 1/holdout_period (by its identity, solvers.holdout); the tasks report the exact one
    period = task.holdout_period
    train_rows = manifest["rows"] - (round(manifest["rows"] / period) if period else 0)
    if split is not None:
        train_rows = round(manifest["rows"] * (1.0 - t.holdout_latest))
    try:
        with run_ckpt, ProgressMonitor(run_ckpt.dir, path_passes(params), train_rows, tty=_progress_tty(cfg),
                                             step_passes=params.passes if auto_penalty(params) else 0,
                                             phases=solver_spec(params.solver).phases) as monitor:
            res = run_barrier(spark, t.workers, t.spares, lambda ctx: run_train_task(ctx, task),
                              net=NetConf.from_conf(cfg.allreduce), max_attempts=t.max_attempts, task_cpus=t.threads,
                              server_host=cfg.allreduce.host, job_name="terascale train", summarize_error=spark_error_summary,
                              no_retry=DETERMINISTIC_ERRORS, on_attempt=_fenced(run_ckpt.dir, monitor.attach))
    except BarrierError as e:
        fsutil.delete(staging)
        raise TrainError(str(e), e.attempts) from None
    rank0 = next(r for r in res.results if r["rank"] == 0)
    per_rank = [{k: r[k] for k in ("rank", "shard", "attempt_id", "spare", "rows", "nnz", "holdout_rows",
                                   "csr_bytes", "read_s", "warm_wait_s", "seconds", "resumed_from_pass", "peak_rss_bytes",
                                   "numpy_madvise_hugepage", "memory", "data_cache")}
                for r in res.results]
    metadata = {
        "spec": spec,
        "config": to_dict(cfg),
        "intercept": rank0["intercept"],
        "objective": rank0["objective"],
        "weights": rank0["weights"],  # storage, nonzeros, length (pipeline.modeldir)
        "stop_reason": rank0["stop_reason"],
        "history": rank0["history"],
        **({"regularization": rank0["regularization"]} if rank0.get("regularization") else {}),
        "recalibration": _recalibration_record(recal_on, recal_why, rank0.get("recalibration")),
        "holdout": split or {"by": "row", "period": task.holdout_period, "seed": params.seed},
        "per_rank": per_rank,
        "data": {"dataset": fsutil.normalize(data_dir), "rows": manifest["rows"], **rank0["totals"],
                 **negative_sampling(manifest)},
        "memory_estimate": memory,
        "data_cache": {k: cache[k] for k in ("mode", "budget_bytes", "why")},
        "attempts": res.attempts,
        "tasks": [{k: v for k, v in x.items() if k != "result"} for x in res.tasks],
        "train_seconds": time.perf_counter() - t0,
        **({"tracking": tracking} if tracking else {}),
    }
    try:
        tokens = modeldir.copy_token_dictionary(data_dir, manifest, staging)
        if tokens:
            metadata["dictionary"] = tokens
        modeldir.commit(staging, model_dir, metadata, overwrite=t.overwrite, run=run_id, flag=OVERWRITE_FLAG)
    except Exception:
        fsutil.delete(staging)
        raise
    run_ckpt.finish()
    log.info("train: peak RSS per rank %s MiB (estimate %.0f MiB)",
             ", ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in sorted(per_rank, key=lambda r: r["rank"])),
             memory["needed_bytes"] / 2**20)
    log.info("train: objective %.6g after %d passes -> %s", rank0["objective"], len(rank0["history"]), model_dir)
    return metadata
