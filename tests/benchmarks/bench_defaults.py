"""Default settings against Vowpal Wabbit's plain runs, as a new user meets them (issue 22).

For each size in :data:`ROWS` (200k, 500k and 2M generated training rows) and each ``bits`` in
:data:`BITS` (2^20 and 2^24 buckets), in one run: the logs are featurized by terascale; terascale
trains with every setting at its default (``terascale train`` in a fresh application, local[2],
2 workers: the hybrid with ``train.l2 = auto``) and is evaluated on a test set of
:data:`TEST_ROWS` rows featurized the same way; Vowpal Wabbit reads exactly the same hashed
features (integer feature names, ``-b bits``, :mod:`tests.benchmarks.vw_io`) from its cache and
runs as a user would without tuning:

``one_pass``, ``bfgs`` and ``bfgs_l2`` (:func:`tests.benchmarks.vw_io.vw_plain_runs`; ``--l2`` =
n·1e-6, terascale's former fixed λ in VW's sum form).

Target: terascale's test logloss ≤ the best VW run's + 0.001 at every size and ``bits``. The
figures: every run's test logloss and seconds, terascale's chosen λ, and the margin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.benchmarks.common import RESULTS, ROOT, generated_logs, terascale_cli
from tests.benchmarks.vw_io import vw_plain_runs

ROWS = (200_000, 500_000, 2_000_000)
BITS = (20, 24)
TEST_ROWS = 200_000
LAMBDA_VW = 1e-6
MARGIN = 0.001
if os.environ.get("TERASCALE_BENCH_SMALL"):
    ROWS, TEST_ROWS = (60_000,), 20_000


def _cli(*args: str) -> float:
    """One terascale command in a fresh application; its wall seconds (RuntimeError on failure)."""
    t0 = time.perf_counter()
    r = subprocess.run(terascale_cli() + list(args) + ["--set", "spark.master=local[2]"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"terascale {args[0]} failed: {r.stderr[-3000:]}")
    return time.perf_counter() - t0


def one(rows: int, bits: int, work: Path) -> dict:
    """terascale's defaults against VW's runs on ``rows`` training rows at 2^``bits``."""
    raw = generated_logs(rows, 2, 51)
    raw_test = generated_logs(TEST_ROWS, 1, 52)
    train_dir, test_dir = work / "train", work / "test"
    for src, dst in ((raw, train_dir), (raw_test, test_dir)):
        _cli("featurize", "--input", str(src / "*.tsv"), "--output", str(dst), "--overwrite",
             "--set", f"featurize.bits={bits}")
    out: dict = {"rows": rows, "bits": bits, "test_rows": TEST_ROWS}

    model, metrics = work / "model", work / "metrics.json"
    wall = _cli("train", "--input", str(train_dir), "--model", str(model), "--overwrite")
    _cli("evaluate", "--input", str(test_dir), "--model", str(model), "--out", str(metrics))
    meta = json.loads((model / "metadata.json").read_text())
    m = json.loads(metrics.read_text())
    reg = meta.get("regularization") or {}
    out["terascale"] = {"test_logloss": m["logloss"], "auroc": m["auroc"], "calibration": m["calibration"],
                        "train_seconds": meta["train_seconds"], "end_to_end_s": wall,
                        "passes": len(meta["history"]), "l2_chosen": reg.get("value"),
                        "stop_reason": meta["stop_reason"]}

    vw = vw_plain_runs(str(train_dir), str(test_dir), bits, str(work), rows * LAMBDA_VW)
    out["vw"] = {k: vw[k] for k in ("one_pass", "bfgs", "bfgs_l2")}
    best = min(out["vw"], key=lambda k: out["vw"][k]["test_logloss"])
    out["best_vw"] = best
    out["margin"] = out["terascale"]["test_logloss"] - out["vw"][best]["test_logloss"]
    out["meets_target"] = out["margin"] <= MARGIN
    for p in work.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return out


def main() -> dict:
    work = RESULTS / "defaults-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fig: dict = {"target": f"terascale's test logloss <= the best VW run's + {MARGIN}", "cases": []}
    try:
        for rows in ROWS:
            for bits in BITS:
                case = one(rows, bits, work)
                fig["cases"].append(case)
                t, v = case["terascale"], case["vw"]
                print(f"{rows:>9,} rows, 2^{bits}: terascale {t['test_logloss']:.5f} (l2 {t['l2_chosen']}, "
                      f"{t['passes']} passes, {t['train_seconds']:.1f} s); VW "
                      + ", ".join(f"{k} {x['test_logloss']:.5f}" for k, x in v.items())
                      + f" -> margin {case['margin']:+.5f} ({'met' if case['meets_target'] else 'NOT met'})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fig["all_met"] = all(c["meets_target"] for c in fig["cases"])
    return fig


if __name__ == "__main__":
    from tests.benchmarks.common import write_result

    print(write_result("defaults", main()))
