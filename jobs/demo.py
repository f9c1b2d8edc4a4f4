"""``make demo``: the main pipeline end to end on generated click logs, with the results printed.

generate (200k train rows with 1% malformed lines, 50k test rows) -> featurize both on Spark
in local mode -> train (hybrid solver, 2 barrier workers joined by the AllReduce tree) ->
evaluate on the test set. Everything lands under ``--workdir`` (default demo-output/); a rerun
replaces the demo's own outputs (the generated logs, and the datasets and model through
``featurize.overwrite`` / ``train.overwrite``) and refuses a workdir where those paths hold
anything else.
"""

from __future__ import annotations

import fnmatch
import math
import os
import shutil
import time

from terascale.jobs.config import load_config
from terascale.jobs.steps import (
    check_metrics_out,
    evaluate,
    featurize,
    featurize_summary,
    metrics_summary,
    penalty_text,
    train,
    train_summary,
)

_GENERATED = ("_truth.json", "part-*.tsv", "part-*.tsv.gz", "part-*.prob.npy")


def _remove_generated(path: str) -> None:
    """Remove click logs an earlier demo generated; refuse a directory holding anything else."""
    from terascale.pipeline.artifacts import OutputError

    if not os.path.exists(path):
        return
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [path]
    other = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in _GENERATED)]
    if other:
        raise OutputError(f"demo: {path} holds files the demo did not generate ({', '.join(other[:5])}); "
                          "refusing to replace it: choose another --workdir")
    shutil.rmtree(path)


def run_demo(workdir: str, rows: int) -> int:
    from terascale.pipeline import fsutil
    from terascale.pipeline.generate import generate_clicklogs

    workdir = os.path.abspath(workdir)
    raw, raw_test = os.path.join(workdir, "raw"), os.path.join(workdir, "raw-test")
    data, data_test = os.path.join(workdir, "train"), os.path.join(workdir, "test")
    model = os.path.join(workdir, "model")
    test_rows = max(rows // 4, 1000)
    for d in (raw, raw_test):
        _remove_generated(d)
    cfg = load_config([], ["spark.master=local[2]", "train.workers=2", "featurize.overwrite=true",
                           "train.overwrite=true"])

    print(f"[1/4] generating {rows:,} training rows (1% malformed) and {test_rows:,} test rows into {workdir}")
    t = time.perf_counter()
    g = generate_clicklogs(raw, rows, files=2, seed=1, malformed_rate=0.01)
    gt = generate_clicklogs(raw_test, test_rows, files=1, seed=2, with_prob=True)
    print(f"      positive rate {g['positive_rate']:.3f}, {g['malformed_total']:,} malformed lines, "
          f"Bayes-optimal test logloss {gt['bayes_logloss']:.4f}, {time.perf_counter() - t:.1f} s")

    print(f"[2/4] featurizing on Spark ({cfg.spark.master})")
    m = featurize(cfg, [raw], data)
    featurize(cfg, [os.path.join(raw_test, "part-*.tsv")], data_test)  # not the generator's .prob.npy beside it
    print(featurize_summary(m))
    dropped = (m.get("sampling") or {}).get("negatives_dropped", 0)
    conserved = m["lines"] == m["rows"] + dropped + m["quarantine"]["rows"]
    print(f"  rows in = written + dropped by sampling + quarantined: {'yes' if conserved else 'NO'}")

    print(f"[3/4] training ({cfg.train.solver}, {cfg.train.workers} workers, l2 {penalty_text(cfg.train.l2)})")
    meta = train(cfg, data, model)
    print(train_summary(meta))

    print("[4/4] evaluating on the test set")
    r = evaluate(cfg, data_test, model)
    print(metrics_summary(r))
    print(f"  Bayes-optimal       {gt['bayes_logloss']:.6f} (the generator's true probabilities)")
    metrics_path = os.path.join(workdir, "metrics.json")
    check_metrics_out(metrics_path, overwrite=True)
    fsutil.write_json_atomic(metrics_path, r)
    from terascale.jobs.report import build_report

    report = build_report(model, metrics_path)
    print(f"\nmodel: {model} (weights.npy + metadata.json); metrics: {metrics_path}")
    print(f"report: {report} (convergence, per-rank timings, ROC / precision-recall / calibration)")
    ok = conserved and math.isfinite(r["logloss"]) and r["normalized_entropy"] < 1.0  # better than the base rate
    return 0 if ok else 1
