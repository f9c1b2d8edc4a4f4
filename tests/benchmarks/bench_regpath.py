"""``train.l2 = auto`` (the regularization path, solvers.regpath) against a grid of fixed λ, in one run.

The same generated click logs (featurized once at bits 22; the test logs never sampled) are
trained with every other setting at its default: once with ``train.l2 = auto`` and once for
each of the path's 8 values for these rows (``PATHS["l2"].values(ROWS)``: 100/N down to 0.01/N,
log-spaced), each a separate job, and once with the former default λ = 1e-6. All models are evaluated on the same test set.

Target: auto's test logloss within 0.001 of the best grid point's. Also reported: the time auto
costs (``train_seconds``, the job's own clock) against a single fixed-λ run (the run at the λ
auto chose, the grid's median, and the former default), and whether the held-out split
chose the grid's test-best λ. A short run first fills the executors' numba cache, so no
measured run pays for compilation.

``ROWS`` is 500,000 so that the eleven jobs fit a few minutes on a small machine; set
TERASCALE_BENCH_REGPATH_ROWS to change it (TERASCALE_BENCH_SMALL: 100,000).
"""

from __future__ import annotations

import json
import os
import statistics

from terascale.solvers.regpath import PATHS
from tests.benchmarks.common import RESULTS, generated_logs

ROWS = int(os.environ.get("TERASCALE_BENCH_REGPATH_ROWS", 500_000))
TEST_ROWS, BITS = 200_000, 22
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS, TEST_ROWS = 100_000, 20_000
GRID = sorted(PATHS["l2"].values(ROWS))  # the path's own values at these rows, increasing


def main() -> dict:
    from terascale.jobs.config import feature_spec, load_config
    from terascale.jobs.scoring import evaluate
    from terascale.jobs.session import get_spark
    from terascale.jobs.train_job import run_train
    from terascale.pipeline import fsutil
    from terascale.pipeline.spark_featurize import run_featurize

    train_raw = generated_logs(ROWS, 2, 51)
    test_raw = generated_logs(TEST_ROWS, 1, 52)
    work = RESULTS / "regpath-work"
    base = [f"featurize.bits={BITS}", "spark.master=local[2]", "train.overwrite=true"]
    cfg = load_config([], base)
    spark = get_spark(cfg.spark)
    spec = feature_spec(cfg)
    tsv = lambda d: [str(p) for p in sorted(d.glob("*.tsv"))]  # noqa: E731
    run_featurize(spark, tsv(train_raw), str(work / "train"), spec, cfg.featurize)
    run_featurize(spark, tsv(test_raw), str(work / "test"), spec, cfg.featurize)
    run_train(spark, load_config([], [*base, "train.l2=1e-6", "train.passes=2"]), str(work / "train"), str(work / "warm"))

    def fit(l2) -> dict:
        # a directory per model: the scoring tasks' Python workers cache a model by its path
        model = str(work / f"model-{l2}")
        meta = run_train(spark, load_config([], [*base, f"train.l2={l2}"]), str(work / "train"), model)
        r = evaluate(spark, str(work / "test"), model)
        held = [h["holdout_loss"] for h in meta["history"] if h.get("holdout_loss") is not None]
        return {"l2": l2, "train_seconds": meta["train_seconds"], "passes": len(meta["history"]),
                "stop_reason": meta["stop_reason"], "best_holdout_loss": min(held),
                **{k: r[k] for k in ("logloss", "auroc", "calibration")},
                **({"regularization": meta["regularization"]} if meta.get("regularization") else {})}

    grid = [fit(lam) for lam in GRID]
    auto = fit("auto")
    old_default = fit(1e-6)  # the default before auto
    best = min(grid, key=lambda g: g["logloss"])
    chosen = auto["regularization"]["value"]
    at_chosen = next(g for g in grid if g["l2"] == chosen)
    out = {
        "rows": ROWS, "test_rows": TEST_ROWS, "bits": BITS, "grid": grid, "auto": auto,
        "best_grid_l2": best["l2"], "best_grid_logloss": best["logloss"], "auto_chose": chosen,
        "chose_the_test_best": chosen == best["l2"],
        "logloss_delta": auto["logloss"] - best["logloss"],
        "auto_vs_chosen_fixed_logloss": auto["logloss"] - at_chosen["logloss"],
        "time_ratio_vs_chosen_fixed": auto["train_seconds"] / at_chosen["train_seconds"],
        "time_ratio_vs_grid_median": auto["train_seconds"] / statistics.median(g["train_seconds"] for g in grid),
        "grid_total_over_auto": sum(g["train_seconds"] for g in grid) / auto["train_seconds"],
    }
    out["old_default_1e-6"] = old_default
    out["time_ratio_vs_1e-6"] = auto["train_seconds"] / old_default["train_seconds"]
    out["targets"] = {"logloss_within_0.001_of_best_grid": out["logloss_delta"] <= 0.001}
    fsutil.delete(str(work))
    print(json.dumps(out, indent=2))
    return out
