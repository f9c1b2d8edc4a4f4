"""The pipeline's steps as functions of a resolved configuration (featurize, train, evaluate)
and the summaries printed after them: what the ``terascale`` command line (``jobs.cli``) and the
demo (``jobs.demo``) both run, so the demo does not import the command line. ``featurize`` and
``train`` check their output paths before their Spark session starts.
"""

from __future__ import annotations

from terascale.jobs.config import feature_spec


def featurize(cfg, inputs: list[str], output: str) -> dict:
    """Run the featurize job with a resolved configuration; returns the manifest."""
    from terascale.jobs.session import get_spark
    from terascale.pipeline.spark_featurize import check_output, run_featurize

    spec = spec_from(cfg.featurize.spec_from) if cfg.featurize.spec_from else feature_spec(cfg)
    check_output(inputs, output, cfg.featurize.overwrite)  # before the session starts
    if spec.format == "table":
        from terascale.pipeline.spark_table import run_table_featurize

        spark = get_spark(cfg.spark)
        f = cfg.featurize
        return run_table_featurize(spark, inputs, output, spec, f, table=f.table, where=f.where)
    spark = get_spark(cfg.spark)
    return run_featurize(spark, inputs, output, spec, cfg.featurize)


def spec_from(path: str):
    """The feature spec a dataset (its manifest) or a model (its metadata) was featurized with."""
    from terascale.pipeline import fsutil, manifest, modeldir
    from terascale.pipeline.pointer import resolve_model
    from terascale.pipeline.spec import FeatureSpec

    if fsutil.exists(fsutil.join(fsutil.normalize(path), manifest.MANIFEST)):
        return FeatureSpec.from_json(manifest.read_manifest(path)["spec"])
    try:
        return FeatureSpec.from_json(modeldir.load_metadata(resolve_model(path))["spec"])
    except modeldir.ModelError as e:
        raise fsutil.InputError(f"featurize.spec_from = {path!r}: neither a terascale dataset nor a model ({e})") from None


def featurize_summary(m: dict) -> str:
    q = m["quarantine"]
    reasons = ", ".join(f"{k}={v}" for k, v in q["by_reason"].items()) or "none"
    distinct = "not counted (bits > 26)" if m["distinct_features"] is None else f"{m['distinct_features']:,}"
    rate = m["lines"] / m["seconds"] if m["seconds"] else float("nan")
    return "\n".join([
        f"  rows in            {m['lines']:,}",
        f"  rows written       {m['rows']:,} in {len(m['files'])} Parquet files",
        f"  rows quarantined   {q['rows']:,} ({reasons})",
        *_sampling_lines(m),
        f"  positive rate      {m['label_mean']:.4f}" if m["label_mean"] is not None else "  positive rate      n/a",
        f"  distinct features  {distinct} of 2^{m['spec']['bits']}",
        f"  non-zeros          {m['nnz']:,} ({m['nnz'] / max(m['rows'], 1):.1f} per row)",
        f"  bytes written      {m['bytes']:,}",
        f"  time               {m['seconds']:.2f} s, {rate:,.0f} rows/s",
    ])


def _sampling_lines(m: dict) -> list[str]:
    s = m.get("sampling") or {}
    if s.get("negative_rate", 1.0) >= 1.0:
        return []
    return [f"  rows dropped       {s['negatives_dropped']:,} negatives (negative_rate {s['negative_rate']:g}; "
            f"kept {s['after']['negatives']:,} of {s['before']['negatives']:,} at weight {s['negative_weight']:g})"]


def train(cfg, data_dir: str, model_dir: str, tracking: dict | None = None) -> dict:
    """Run the train job; ``tracking``: the model metadata's MLflow run entry (``jobs.tracking``)."""
    from terascale.jobs.config import check_listen_address
    from terascale.jobs.session import get_spark
    from terascale.jobs.train_job import check_local_slots, check_outputs, run_train

    check_outputs(cfg, data_dir, model_dir)  # before the session starts
    check_listen_address(cfg.allreduce)
    check_local_slots(cfg)
    return run_train(get_spark(cfg.spark, cfg.train.threads), cfg, data_dir, model_dir, tracking)


def tracking_line(meta: dict) -> str | None:
    """The MLflow run a model was tracked in, for display; None when it was not."""
    m = (meta.get("tracking") or {}).get("mlflow")
    if not m:
        return None
    return f"  mlflow run         {m['run_id']} (experiment {m['experiment_id']}) at {m['tracking_uri']}"


def penalty_text(value) -> str:
    """A penalty (``train.l2``, ``train.l1``) for display: ``auto`` or the number."""
    return value if isinstance(value, str) else f"{value:g}"


def penalties_text(meta: dict) -> str:
    """A model's penalties for display: ``l2 1e-06``, ``l2 auto: 1e-06``, ``l2 0, l1 auto: 1e-05``
    (l1 only when set: a path's choice shown after ``auto:``)."""
    t, reg = meta["config"]["train"], meta.get("regularization") or {}
    parts = []
    for name in ("l2", "l1"):
        value = t.get(name, 0.0)
        if reg.get("penalty") == name:
            parts.append(f"{name} auto: {reg['value']:g}")
        elif name == "l2" or value:
            parts.append(f"{name} {penalty_text(value)}")
    return ", ".join(parts)


def path_lines(meta: dict) -> list[str]:
    """A regularization path (``train.l2`` or ``train.l1 = auto``, solvers.regpath): one line per step, the chosen
    one marked."""
    reg = meta.get("regularization")
    if not reg:
        return []
    name = reg["penalty"]
    out = [f"  {name} path            chose {reg['value']:g} (step {reg['chosen_step'] + 1} of {len(reg['steps'])}"
           f"{', stopped: ' + reg['stop'] if reg['stop'] != 'end' else ''}) by held-out loss:"]
    for st in reg["steps"]:
        h = "n/a" if st["holdout_loss"] is None else f"{st['holdout_loss']:.6f}"
        mark = " <-" if st["step"] == reg["chosen_step"] else ""
        nz = f", {st['nonzeros']:,} non-zero" if "nonzeros" in st else ""  # paths from before the count: none
        out.append(f"    {name} {st[name]:<9.3g} held-out {h}, objective {st['objective']:.6f}, {st['passes']} passes, "
                   f"{st['seconds']:.2f} s{nz}{mark}")
    return out


def recalibration_text(meta: dict) -> str | None:
    """The held-out recalibration of a model (``train.recalibrate``), or None when it has none."""
    r = meta.get("recalibration") or {}
    if not r.get("applied"):
        return None
    return (f"sigma({r['slope']:.4g} * margin {'+' if r['shift'] >= 0 else '-'} {abs(r['shift']):.4g}), fitted on "
            f"{r['holdout_rows']:,} held-out rows (held-out loss {r['holdout_loss_before']:.6f} -> "
            f"{r['holdout_loss_after']:.6f})")


def train_summary(meta: dict) -> str:
    h = meta["history"]
    ranks = meta["per_rank"]
    held = [x for x in h if x.get("holdout_loss") is not None]
    best = min(held, key=lambda x: x["holdout_loss"]) if held else None
    held_text = f"; best held-out loss {best['holdout_loss']:.6f} (pass {best['pass']})" if best else ""
    if (reg := meta.get("regularization")) and reg.get("steps"):  # a path: the chosen step's last pass
        st = reg["steps"][reg["chosen_step"]]
        if st.get("holdout_loss") is not None:
            held_text = f"; held-out loss {st['holdout_loss']:.6f} there (pass {st['best_pass']})"
    return "\n".join([
        f"  solver             {meta['config']['train']['solver']} ({len(ranks)} workers), loss "
        f"{meta['config']['train']['loss']}, {penalties_text(meta)}",
        *path_lines(meta),
        f"  rows               {meta['data']['train_rows']:,} train + {meta['data']['holdout_rows']:,} held out"
        + (f" (negatives kept at rate {r:g}, weighted 1/{r:g})" if (r := meta["data"].get("negative_rate", 1.0)) < 1 else ""),
        f"  passes             {len(h)} (stopped: {meta.get('stop_reason') or 'n/a'}); objective {meta['objective']:.6f} at the returned weights"
        + held_text,
        *([f"  recalibrated       {c}"] if (c := recalibration_text(meta)) else []),
        f"  time in job        {meta['train_seconds']:.2f} s (attempts: {len(meta['attempts'])})",
    ] + ([f"  weights            {w['nonzeros']:,} non-zero of {w['length']:,} (stored {w['storage']})"]
         if (w := meta.get("weights")) else []))


def metrics_summary(r: dict) -> str:
    return "\n".join([
        f"  rows                {r['rows']:,}",
        f"  logloss             {r['logloss']:.6f}",
        f"  normalized entropy  {r['normalized_entropy']:.6f}",
        f"  auROC               {r['auroc']:.6f}",
        f"  auPRC               {r['auprc']:.6f}",
        *([f"  non-zero weights    {r['nonzeros']:,} of {r['features']:,}"] if "nonzeros" in r else []),
        f"  calibration         {r['calibration']:.4f} (mean prediction {r['mean_prediction']:.4f} / positive rate {r['positive_rate']:.4f})"
        + (f"; recalibrated, sigma(margin) alone {r['raw_calibration']:.4f}" if "raw_calibration" in r else ""),
    ] + ([f"  weighting           {w['note']}"] if (w := r.get("weighting"))
         and min(w["model_negative_rate"], w["dataset_negative_rate"]) < 1 else []))


def evaluate(cfg, data_dir: str, model_dir: str) -> dict:
    from terascale.jobs.scoring import evaluate as run
    from terascale.jobs.session import get_spark

    return run(get_spark(cfg.spark), data_dir, model_dir)


def check_metrics_out(path: str, overwrite: bool) -> None:
    """evaluate --out: a new file, or (with --overwrite) a metrics file evaluate wrote before."""
    from terascale.pipeline import artifacts

    found = artifacts.inspect(path)
    if found.kind == "missing":
        return
    if found.kind != "metrics":
        what = {"file": "a file that evaluate did not write", "empty": "an empty directory",
                "foreign": "a directory"}.get(found.kind, found.detail)
        raise artifacts.OutputError(f"--out {path}: exists and is {what}, not a metrics file; refusing to replace it")
    if not overwrite:
        raise artifacts.OutputError(f"--out {path}: exists and is {found.detail}; pass --overwrite to replace it")
