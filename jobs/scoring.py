"""evaluate and predict on Spark: tasks score row groups of a dataset with a model directory.

Each task reads its row groups with pyarrow into CSR and scores them with the vectorized
predictor (``solvers.predict``); the model's weights are loaded once per Python worker. evaluate
merges small metric states on the driver; a task that meets a bad file reports it as a result (no
Spark retry) and the driver raises its ``DataFileError``; predict writes Parquet into attempt-private files of a
hidden sibling of the output (``.NAME.attempts-RUN``); the driver moves the accepted files into
the staging sibling (``.NAME.tmp-RUN``, its marker ``_terascale_predictions.json`` written
first), retires the attempts' directory (``pipeline.artifacts.retire_attempts``: no attempt
still running can write into the output, on a Spark Connect session too, where no status tracker
tells when they end), writes ``_manifest.json`` and swaps the whole directory in
(``pipeline.artifacts.replace_dir``), so it never deletes a file of the output one by one. Both
run on a classic session and on Spark Connect alike (``pipeline.spark_tasks``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from terascale.pipeline import artifacts, fsutil, modeldir, spark_tasks
from terascale.pipeline.dataset import ShardPart, plan_shards, read_csr
from terascale.pipeline.manifest import MANIFEST, read_manifest
from terascale.pipeline.pointer import resolve_model
from terascale.pipeline.redact import redact_text
from terascale.pipeline.sampling import (
    dataset_negative_rate,
    model_negative_rate,
    model_recalibration,
    score_transform,
)
from terascale.pipeline.verify import catching, raise_bad_files, read_row_groups
from terascale.solvers.catalogue import loss_spec
from terascale.solvers.regpath import effective_l2, effective_penalty

log = logging.getLogger("terascale.scoring")
_MODEL_CACHE: dict[tuple[str, str], tuple[np.ndarray, float, str, dict]] = {}
KEEPABLE = ("label", "weight", "indices", "values")


def _model(model_dir: str) -> tuple[np.ndarray, float, str, dict]:
    """(weights, intercept, loss, metadata) of the model now at ``model_dir``. A process keeps
    the last one it loaded, keyed by the path and the model's metadata.json (read at every call,
    a few kB): a model replaced at the same path (``train --overwrite``) is loaded anew."""
    key = (model_dir, json.dumps(modeldir.load_metadata(model_dir), sort_keys=True, default=str))
    hit = _MODEL_CACHE.get(key)
    if hit is None:
        w, b, meta = modeldir.load_model(model_dir)
        hit = (w, b, meta["config"]["train"]["loss"], meta)
        _MODEL_CACHE.clear()
        _MODEL_CACHE[(model_dir, json.dumps(meta, sort_keys=True, default=str))] = hit
    return hit


def _margins_and_scores(csr, model_dir: str, calibration: str = "population") -> tuple[np.ndarray, np.ndarray]:
    """(margins, scores) of the rows: scores are probabilities for a sigmoid-link loss, else the
    margins themselves (one pass over the rows for both)."""
    from terascale.solvers.predict import decision_function, sigmoid

    w, b, loss, meta = _model(model_dir)
    m = decision_function(csr, w, b)
    if loss_spec(loss).link != "sigmoid":
        return m, m
    slope, shift = score_transform(meta, calibration)
    return m, sigmoid(m, shift, slope)


def _scores(csr, model_dir: str, calibration: str = "population") -> np.ndarray:
    return _margins_and_scores(csr, model_dir, calibration)[1]


def _check(data_dir: str, model_dir: str) -> tuple[dict, dict]:
    m = read_manifest(data_dir)
    meta = modeldir.load_metadata(model_dir)
    diff = modeldir.same_spec(meta["spec"], m["spec"])
    if diff:
        raise modeldir.ModelError(
            f"model {model_dir} and dataset {data_dir} were featurized differently ({', '.join(diff)}); "
            f"re-featurize the data with the model's spec (terascale featurize ... --spec-from {model_dir})"
        )
    return m, meta


def _groups(spark, data_dir: str, manifest: dict) -> list[list[ShardPart]]:
    n = max(1, min(spark_tasks.parallelism(spark) * 2, sum(1 for _ in manifest["files"]) * 64))
    return [g for g in plan_shards(data_dir, n, manifest) if g]


def evaluate(spark, data_dir: str, model_dir: str) -> dict:
    """Metrics of the model (a directory, or a pointer to one) on a featurized dataset
    (models whose loss has the sigmoid link: probabilities), and ``objective``: the catalogue's
    f(β, b) with the model's λ on these rows (``objective_definition`` says which)."""
    from terascale.solvers.metrics import BinaryMetrics
    from terascale.solvers.predict import loss_terms, objective

    model_dir = resolve_model(model_dir)

    t0 = time.perf_counter()
    m, meta = _check(data_dir, model_dir)
    loss = meta["config"]["train"]["loss"]
    if loss_spec(loss).link != "sigmoid":
        raise modeldir.ModelError(f"evaluate needs a model that predicts probabilities (logistic); {model_dir} "
                                  f"was trained with loss {loss!r}")
    model = fsutil.normalize(model_dir)
    n_features = 1 << int(m["spec"]["bits"])
    groups = [[p.to_json() for p in g] for g in _groups(spark, data_dir, m)]

    recalibrated = model_recalibration(meta) != (1.0, 0.0)

    def task(_, items):
        from terascale.solvers.predict import sigmoid

        for parts in items:
            csr = read_csr([ShardPart.from_json(p) for p in parts], n_features)
            acc = BinaryMetrics()
            terms = (0.0, 0.0)
            raw = 0.0  # Σ w·σ(margin): the model's own mean prediction, beside the recalibrated one
            if csr.n_rows:
                margins, probs = _margins_and_scores(csr, model)
                acc.add(probs, csr.labels, csr.weights)
                terms = loss_terms(margins, csr.labels, csr.weights, loss)
                if recalibrated:
                    raw = float(np.dot(sigmoid(margins), csr.weights.astype(np.float64)))
            yield acc.to_state(), terms, raw

    states = raise_bad_files(spark_tasks.run_tasks(spark, groups, catching(task),
                                                   redact_text(f"terascale evaluate: {data_dir}")))
    total = BinaryMetrics()
    loss_sum = weight_sum = raw_sum = 0.0
    for s, (ls, ws), raw in states:
        total.merge(BinaryMetrics.from_state(s))
        loss_sum, weight_sum, raw_sum = loss_sum + ls, weight_sum + ws, raw_sum + raw
    out = total.finalize()
    if recalibrated:  # what σ(margin) alone would have given (train.recalibrate)
        out["raw_calibration"] = raw_sum / total.pos_weight if total.pos_weight > 0 else float("nan")
    l2 = effective_l2(meta)  # a regularization path's choice, or the configured number
    l1 = effective_penalty(meta, "l1")  # the same; models from before train.l1: 0
    w = _model(model)[0]
    out["objective"] = objective(loss_sum, weight_sum, w, l2, l1)
    out["objective_definition"] = (f"(1/sum w) sum w * {loss}(y, x.beta + b) + {l1:g} |beta|_1 + {l2:g}/2 |beta|^2 "
                                   "on this dataset (terascale.solvers.catalogue; b unpenalized)")
    out["nonzeros"] = int(np.count_nonzero(w))
    out["features"] = int(w.shape[0])
    out.update({"dataset": fsutil.normalize(data_dir), "model": model, "seconds": time.perf_counter() - t0})
    out["weighting"] = _weighting(m, meta)
    return out


def _weighting(manifest: dict, meta: dict) -> dict:
    """How evaluate's weighted metrics relate to negative downsampling (``pipeline.sampling``)."""
    d_rate = dataset_negative_rate(manifest)
    m_rate = model_negative_rate(meta)
    parts = []
    slope, shift = model_recalibration(meta)
    if m_rate < 1.0:
        parts.append(f"the model was trained on negatives kept at rate {m_rate:g} and weighted 1/{m_rate:g}, "
                     "which estimates the unsampled data's loss")
    if (slope, shift) != (1.0, 0.0):
        parts.append(f"its probabilities are recalibrated on its held-out rows: sigma({slope:.6g} * margin "
                     f"{'+' if shift >= 0 else '-'} {abs(shift):.6g})")
    elif m_rate < 1.0:
        parts.append("its probabilities are sigma(margin), not recalibrated")
    if d_rate < 1.0:
        parts.append(f"this dataset keeps negatives at rate {d_rate:g}; metrics weight them 1/{d_rate:g}, "
                     "estimating the unsampled data's")
    return {"model_negative_rate": m_rate, "dataset_negative_rate": d_rate, "recalibration": [slope, shift],
            "note": "; ".join(parts) or "no downsampling: every row weighs 1"}


OVERWRITE_FLAG = "--overwrite (or predict.overwrite: true)"


def check_output(data_dir: str, model_dir: str, output: str, overwrite: bool) -> None:
    """Refuse, before any Spark work, an output that overlaps the input dataset or the model, or
    that holds anything but (with ``overwrite``) earlier predictions."""
    artifacts.check_apart(output, "--output", {"the input dataset": data_dir, "the model": resolve_model(model_dir)})
    artifacts.check_target(output, artifacts.PREDICTIONS, overwrite, "--output", OVERWRITE_FLAG)


def predict(spark, data_dir: str, model_dir: str, output: str, keep: tuple[str, ...],
            calibration: str = "population", overwrite: bool = False) -> dict:
    """Write Parquet with ``probability`` (logistic) or ``score`` plus the ``keep`` columns
    (the model: a directory, or a pointer to one) to ``output``: a new path, an empty directory
    or, with ``overwrite``, earlier predictions (replaced atomically). ``calibration``
    (``predict.calibration``, :data:`pipeline.sampling.CALIBRATIONS`): population = σ(a·m + c),
    with the slope and shift the model fitted on its held-out rows (1 and 0 when it fitted none);
    sampled = σ(a·m + c − ln r) for a model trained on negatives kept at rate r; raw = σ(m)."""
    t0 = time.perf_counter()
    model_dir = resolve_model(model_dir)
    check_output(data_dir, model_dir, output, overwrite)
    bad = [c for c in keep if c not in KEEPABLE]
    if bad:
        raise ValueError(f"predict.keep_columns: {bad} are not columns of a dataset; allowed: {list(KEEPABLE)}")
    m, meta = _check(data_dir, model_dir)
    col = "probability" if loss_spec(meta["config"]["train"]["loss"]).link == "sigmoid" else "score"
    model = fsutil.normalize(model_dir)
    out = fsutil.normalize(output)
    n_features = 1 << int(m["spec"]["bits"])
    groups = [[p.to_json() for p in g] for g in _groups(spark, data_dir, m)]
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    root = artifacts.staging_path(out, run_id)
    artifacts.write_marker(root, artifacts.PREDICTIONS, run_id, model=model, dataset=fsutil.normalize(data_dir))
    staging = artifacts.open_attempts(out, run_id)

    def task(i, items):
        from pyspark import TaskContext

        tag = f"{i:05d}-t{TaskContext.get().taskAttemptId()}"
        for parts_json in items:
            parts = [ShardPart.from_json(p) for p in parts_json]
            csr = read_csr(parts, n_features)
            cols = {col: pa.array(_scores(csr, model, calibration))}
            if keep:
                kept = pa.concat_tables([_kept(p, keep) for p in parts]) if parts else None
                for c in keep:
                    cols[c] = kept.column(c)
            path = fsutil.join(staging, f"part-{tag}.parquet")  # into the open attempts' directory only
            fs, inner = fsutil.resolve(path)
            pq.write_table(pa.table(cols), inner, filesystem=fs)
            yield {"task": i, "path": path, "rows": csr.n_rows}

    try:  # classic: every attempt has ended when it returns; Connect: retire_attempts fences them
        results = raise_bad_files(spark_tasks.run_tasks(
            spark, groups, catching(task), redact_text(f"terascale predict: {data_dir} -> {out}"), settle=True))
    except Exception:
        fsutil.delete(root)
        artifacts.retire_attempts(out, run_id)
        raise
    try:
        files = []
        for r in sorted(results, key=lambda r: r["task"]):
            name = f"part-{r['task']:05d}.parquet"
            fsutil.move(r["path"], fsutil.join(root, name))
            files.append({"path": name, "rows": r["rows"]})
        artifacts.retire_attempts(out, run_id)  # rejected and speculative attempts
        manifest = {"kind": "predictions", "column": col, "calibration": calibration, "kept": list(keep), "model": model,
                    "dataset": fsutil.normalize(data_dir), "rows": sum(f["rows"] for f in files), "files": files,
                    "seconds": time.perf_counter() - t0}
        fsutil.write_json_atomic(fsutil.join(root, MANIFEST), manifest)
        artifacts.check_target(out, artifacts.PREDICTIONS, overwrite, "--output", OVERWRITE_FLAG)  # changed meanwhile?
        artifacts.replace_dir(root, out, run_id)
    except Exception:
        fsutil.delete(root)
        artifacts.retire_attempts(out, run_id)
        raise
    return manifest


def _kept(part: ShardPart, keep: tuple[str, ...]) -> pa.Table:
    return read_row_groups(part.path, part.row_groups, list(keep))
