"""The defaults' quality at scale (issue 32, "Quality at scale"): ``train.l2 = auto`` against a grid
of 8 fixed λ on the datasets of one scale-benchmark run.

    python -m tests.benchmarks scale_quality --workdir bench-results/scale-work-N [--grid λN ...]

The work folder is one that ``scale --rows N --keep`` left (``data/train``, ``data/test``: the
featurized logs of every size on the curve). Every model trains through the CLI with the scale
benchmark's settings (``TRAIN_SETS``: the disk cache where the shard exceeds the rank's memory)
and the defaults otherwise, each in a fresh application: once with ``train.l2 = auto`` and once
for each λ = λN / N of the grid (λN = 1, 3.2, 10, …, 3162 by default: half decades around the
path's values 100/N, 27/N, … and its values above, 373/N, 1389/N; N the dataset's rows). Each is
scored on the test set by ``terascale evaluate``. Up to 30M rows Vowpal Wabbit's plain runs
follow, from the same hashed features (:func:`tests.benchmarks.vw_io.vw_plain_runs`: one pass,
then BFGS with and without ``--l2``). Targets: auto's test logloss within 0.001 of the best grid
point's and at most the best VW run's + 0.001. Written to bench-results/scale_quality.json, one entry per N (a run at
another N adds its entry; a rerun at the same N replaces it).

Models go to ``<workdir>/quality/`` and are removed after the run unless ``--keep``. auto's
entry also holds its progress lines' ETA against the time it took (``eta``, as the scale run's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from tests.benchmarks.bench_scale import TRAIN_SETS
from tests.benchmarks.common import RESULTS, ROOT, terascale_cli, train_cli
from tests.benchmarks.scale_figures import eta_figures
from tests.benchmarks.vw_io import vw_plain_runs

EXPLICIT_ONLY = True  # minutes to hours: nine training runs at the curve's sizes
GRID_TIMES_ROWS = tuple(10 ** (k / 2) for k in range(8))  # λN = 1 … 3162, half decades
TARGET = 0.001
VW_ROWS = 30_000_000  # VW's runs (text, cache, 20 BFGS passes, single-threaded) up to here
LAMBDA_VW = 1e-6  # bfgs_l2's λ, as tests.benchmarks.bench_defaults runs it (VW's sum form: n·λ)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks scale_quality", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True, help="a scale run's work folder, kept with --keep")
    p.add_argument("--grid", type=float, nargs="*", default=list(GRID_TIMES_ROWS),
                   help="the fixed values as λN (λ times the dataset's rows); none: auto (and VW) only")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--keep", action="store_true", help="keep the models in <workdir>/quality")
    p.add_argument("--vw", choices=("auto", "on", "off"), default="auto",
                   help="also Vowpal Wabbit's plain runs (auto: at N <= 30M, as the issue asks)")
    return p.parse_args(argv)


def _evaluate(test: Path, model: Path, out: Path, master: str) -> dict:
    r = subprocess.run(terascale_cli() + ["evaluate", "--input", str(test), "--model", str(model), "--out", str(out),
                              "--overwrite", "--set", f"spark.master={master}"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"terascale evaluate ({model.name}) failed: {r.stderr[-3000:]}")
    m = json.loads(out.read_text())
    return {k: m[k] for k in ("logloss", "auroc", "calibration") if k in m}


def _fit(a: argparse.Namespace, name: str, l2: str) -> dict:
    work = a.workdir / "quality"
    model = work / f"model-{name}"
    sets = [f"spark.master={a.master}", *TRAIN_SETS, f"train.l2={l2}"]
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"train-{name}.err"
    meta, wall = train_cli(str(a.workdir / "data" / "train"), str(model), sets, name, log)
    reg = meta.get("regularization") or {}
    rec = {"name": name, "l2": float(reg.get("value", meta["config"]["train"]["l2"])), "wall_s": wall,
           "train_seconds": meta.get("train_seconds"), "passes": len(meta.get("history", [])),
           "stop_reason": meta.get("stop_reason")}
    rec.update(_evaluate(a.workdir / "data" / "test", model, work / f"metrics-{name}.json", a.master))
    if reg:
        rec["path"] = {"chosen_step": reg.get("chosen_step"), "stop": reg.get("stop"),
                       "steps": [{k: s.get(k) for k in ("l2", "holdout_loss", "passes", "stop_reason")}
                                 for s in reg.get("steps", [])]}
    if l2 == "auto":  # the progress line's ETA against the time it took, as the scale run records it
        rec["eta"] = eta_figures(log.read_text(), float(meta["train_seconds"]))
    print(f"scale_quality: {name:>10}  λ {rec['l2']:.3g}  test logloss {rec.get('logloss', float('nan')):.6f}  "
          f"{rec['passes']} passes  {wall:.0f} s", flush=True)
    return rec


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(list(argv or []))
    manifest = json.loads((a.workdir / "data" / "train" / "_manifest.json").read_text())
    rows = int(manifest["rows"])
    started = time.time()
    auto = _fit(a, "auto", "auto")
    grid = [_fit(a, f"{g:g}N", repr(g / rows)) for g in a.grid]
    best = min(grid, key=lambda r: r["logloss"]) if grid else {"l2": float("nan"), "logloss": float("nan")}
    vw = None
    if a.vw == "on" or (a.vw == "auto" and rows <= VW_ROWS):
        work = a.workdir / "quality" / "vw"
        work.mkdir(parents=True, exist_ok=True)
        bits = int(manifest["spec"]["bits"])
        vw = vw_plain_runs(str(a.workdir / "data" / "train"), str(a.workdir / "data" / "test"), bits, str(work),
                           rows * LAMBDA_VW)
        shutil.rmtree(work, ignore_errors=True)
        print("scale_quality: VW " + ", ".join(f"{k} {vw[k]['test_logloss']:.6f} ({vw[k]['seconds']:.0f} s)"
                                               for k in ("one_pass", "bfgs", "bfgs_l2")), flush=True)
    entry = {"rows": rows, "workdir": str(a.workdir), "train_sets": list(TRAIN_SETS), "started": started,
             "auto": auto, "grid_times_rows": a.grid, "grid": grid,
             "best_fixed": {"l2": best["l2"], "logloss": best["logloss"]},
             "auto_minus_best": auto["logloss"] - best["logloss"], "target": TARGET,
             "met": auto["logloss"] - best["logloss"] <= TARGET if grid else None, "vw": vw}
    if vw is not None:
        entry["auto_minus_best_vw"] = auto["logloss"] - vw[vw["best"]]["test_logloss"]
        entry["met_vw"] = entry["auto_minus_best_vw"] <= TARGET
    entry["wall_s"] = time.time() - started
    path = RESULTS / "scale_quality.json"
    merged = json.loads(path.read_text()) if path.exists() else {"benchmark": "scale_quality", "runs": {}}
    old = merged["runs"].get(str(rows), {})
    if not grid and old.get("grid"):  # a run without a grid keeps the grid of the run before it
        entry.update({k: old[k] for k in ("grid_times_rows", "grid", "best_fixed", "auto_minus_best", "met")})
    merged["runs"][str(rows)] = entry
    if not a.keep:
        shutil.rmtree(a.workdir / "quality", ignore_errors=True)
    best = entry["best_fixed"]
    print(f"scale_quality: N = {rows:,}: auto {auto['logloss']:.6f}, best fixed {best['logloss']:.6f} at "
          f"λ {best['l2']:.3g}: {entry['auto_minus_best']:+.6f}"
          + (f"; best VW ({vw['best']}) {vw[vw['best']]['test_logloss']:.6f}: {entry['auto_minus_best_vw']:+.6f}"
             if vw else "") + f" (targets ≤ {TARGET})", flush=True)
    return merged  # written by tests.benchmarks.__main__ to bench-results/scale_quality.json
