"""The scale benchmark's per-stage figures, read from what each job wrote (manifests, the model's
metadata, the metrics file, the console log), and the merge of runs into one results file.

Nothing here runs a job: :mod:`tests.benchmarks.bench_scale` does, and hands these functions the
paths and the captured stderr.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

_FINISHED = re.compile(r"INFO terascale: (\w+) finished in ([0-9.]+) s")
_PROGRESS = re.compile(r"progress: (.*?)elapsed ([0-9:]+)(?:, ETA [≤≈] ([0-9:]+))?")
_PASS = re.compile(r"pass (\d+)/(\d+)( done)?")


def _seconds(hms: str) -> int:
    s = 0
    for part in hms.split(":"):
        s = s * 60 + int(part)
    return s


def cli_seconds(stderr: str) -> float | None:
    """The CLI's own ``<command> finished in X s`` (the process's time less its start-up)."""
    m = _FINISHED.findall(stderr)
    return float(m[-1][1]) if m else None


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def featurize_figures(dataset: Path) -> dict:
    """Rows in and out of one featurize run, from its ``_manifest.json``: ``lines`` (raw lines
    read), ``rows`` (written), ``quarantined``, ``dropped`` (negative downsampling),
    ``conserved`` (lines = rows + quarantined + dropped, invariant 1), files, bytes, job seconds."""
    m = json.loads((dataset / "_manifest.json").read_text())
    quarantined = int(m["quarantine"]["rows"])
    dropped = int(m["sampling"]["negatives_dropped"])
    return {
        "lines": int(m["lines"]), "rows": int(m["rows"]), "quarantined": quarantined, "dropped": dropped,
        "conserved": int(m["lines"]) == int(m["rows"]) + quarantined + dropped,
        "input_files": len(m["inputs"]), "output_files": len(m["files"]), "nnz": int(m["nnz"]),
        "parquet_bytes": int(m["bytes"]), "job_seconds": float(m["seconds"]),
    }


def eta_figures(stderr: str, actual_s: float) -> dict:
    """The train progress lines' ETAs against the time training really took (``actual_s``, from
    the same clock's start: the model's ``train_seconds``). Each sample: ``elapsed_s``,
    ``eta_s``, ``predicted_total_s`` (= elapsed + ETA), ``ratio`` (predicted / actual); the
    first sample at 20% or more of the actual time is ``at_20_percent`` (the issue's target:
    within 30%). At most 40 samples are kept, spread over the run."""
    samples = []
    for line in stderr.splitlines():
        m = _PROGRESS.search(line)
        if not m or m.group(3) is None:
            continue
        elapsed, eta = _seconds(m.group(2)), _seconds(m.group(3))
        p = _PASS.search(m.group(1))
        samples.append({"pass": int(p.group(1)) if p else None, "pass_budget": int(p.group(2)) if p else None,
                        "pass_done": bool(p and p.group(3)), "elapsed_s": elapsed, "eta_s": eta,
                        "predicted_total_s": elapsed + eta,
                        "ratio": (elapsed + eta) / actual_s if actual_s > 0 else None})
    at20 = next((s for s in samples if s["elapsed_s"] >= 0.2 * actual_s), None)
    if len(samples) > 40:
        step = len(samples) / 40
        samples = [samples[int(i * step)] for i in range(40)] + [samples[-1]]
    return {"actual_s": actual_s, "samples": samples, "at_20_percent": at20}


def train_figures(model: Path, rows: int) -> dict:
    """From the model's ``metadata.json``: passes (its history's entries), the seconds of all
    passes (the history's clock) and per row-pass, the first (online) pass's seconds, the chosen
    λ and the path's steps, the data cache, each rank's peak RSS and shard CSR bytes."""
    meta = json.loads((model / "metadata.json").read_text())
    hist = meta["history"]
    passes = len(hist)
    pass_s = float(hist[-1]["elapsed_s"]) if hist else 0.0
    train_rows = int(meta["data"]["train_rows"])
    reg = meta.get("regularization") or {}
    return {
        "passes": passes,
        "passes_seconds": pass_s,
        "seconds_per_row_pass": pass_s / (passes * train_rows) if passes and train_rows else None,
        "first_pass_seconds": float(hist[0]["elapsed_s"]) if hist else None,
        "train_rows": train_rows, "holdout_rows": int(meta["data"]["holdout_rows"]), "dataset_rows": rows,
        "train_seconds": float(meta["train_seconds"]),
        "stop_reason": meta.get("stop_reason"),
        "objective": meta.get("objective"),
        "l2": reg.get("value", meta["config"]["train"]["l2"] if "config" in meta else None),
        "path_steps": [{k: s.get(k) for k in ("l2", "l1", "holdout_loss", "passes", "seconds", "stop_reason")
                        if k in s} for s in reg.get("steps", [])],
        "data_cache": (meta.get("data_cache") or {}).get("mode"),
        "rank_peak_rss_bytes": [r.get("peak_rss_bytes") for r in meta.get("per_rank", [])],
        "rank_csr_bytes": [r.get("csr_bytes") for r in meta.get("per_rank", [])],
        "estimated_rank_peak_bytes": (meta.get("memory_estimate") or {}).get("needed_bytes"),
        "attempts": len(meta.get("attempts", [])),
    }


def quality_figures(metrics: dict, truth: dict) -> dict:
    """The test metrics (``terascale evaluate --out``) against the generator's Bayes loss on the
    same rows (``_truth.json``: the true probabilities' logloss over its valid rows)."""
    bayes = truth.get("bayes_logloss")
    out = {k: metrics.get(k) for k in ("rows", "logloss", "auroc", "auprc", "normalized_entropy", "calibration",
                                       "mean_prediction", "positive_rate")}
    out["bayes_logloss"] = bayes
    out["excess_logloss"] = metrics["logloss"] - bayes if bayes is not None and metrics.get("logloss") is not None else None
    out["base_rate_logloss"] = truth.get("base_rate_entropy")
    return out


def run_key(run: dict) -> str:
    """``"N"`` for a run of every stage, ``"N:STAGE"`` for one stopped after STAGE."""
    stop = run.get("stop_after", "score")
    return str(run["rows"]) if stop == "score" else f"{run['rows']}:{stop}"


def merge_run(path: Path, run: dict) -> dict:
    """``path``'s results (``{"benchmark": "scale", "runs": {key: run}}``) with ``run`` put under
    its :func:`run_key`: a run of another N (or stopped after another stage) is added, one with
    the same key replaced, so a partial run never replaces a whole one; ordered by N. The caller
    writes it."""
    old: dict = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
    runs = old.get("runs") if isinstance(old.get("runs"), dict) else {}
    runs[run_key(run)] = run

    def order(key: str) -> tuple:
        n, _, stop = key.partition(":")
        return (int(n) if n.isdigit() else math.inf, stop)

    ordered = dict(sorted(runs.items(), key=lambda kv: order(kv[0])))
    return {"benchmark": "scale", "schema": 1, "runs": ordered}


def machine() -> dict:
    """What the figures were measured on."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpus": os.cpu_count(), "memory_bytes": pages, "load_avg_at_start": list(os.getloadavg())}
