"""``terascale report MODEL_DIR [--eval METRICS_JSON] [--out DIR]``: what happened in a run.

Writes ``report.html`` (self-contained: the PNG plots are embedded) plus the PNG files into
``DIR`` (default: the model directory):

- the training objective and the held-out loss per pass, and against elapsed time;
- each rank's compute / stall / transfer seconds per pass (the terascale paper's Table 2 view);
- with ``--eval`` (the JSON that ``terascale evaluate --out`` writes): ROC and precision-recall
  curves and a calibration plot, with the metrics.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from terascale.pipeline import modeldir  # noqa: E402
from terascale.pipeline.redact import redact  # noqa: E402

PLOTS = ("objective_by_pass", "objective_by_time", "rank_timings", "roc", "precision_recall", "calibration")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _series(history: list[dict], key: str) -> tuple[list, list, list]:
    rows = [h for h in history if h.get(key) is not None]
    return [h["pass"] for h in rows], [h["elapsed_s"] for h in rows], [h[key] for h in rows]


def _curve_plot(history: list[dict], by: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, label in (("objective", "training objective"), ("holdout_loss", "held-out loss"),
                       ("progressive_loss", "progressive loss (online)")):
        p, t, v = _series(history, key)
        if v:
            ax.plot(p if by == "pass" else t, v, marker="o", ms=3, label=label)
    ax.set_xlabel("pass" if by == "pass" else "seconds since training started")
    if by == "pass":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def _timings_plot(history: list[dict]) -> bytes:
    ranks = max((len(h.get("compute_s") or []) for h in history), default=0)
    fig, axes = plt.subplots(1, max(ranks, 1), figsize=(min(3.2 * max(ranks, 1), 16), 3.4), sharey=True, squeeze=False)
    for r in range(ranks):
        ax = axes[0][r]
        passes = [h["pass"] for h in history]
        bottom = [0.0] * len(history)
        for key, color in (("compute_s", "#4c72b0"), ("stall_s", "#dd8452"), ("transfer_s", "#55a868")):
            vals = [(h.get(key) or [0.0] * ranks)[r] for h in history]
            ax.bar(passes, vals, bottom=bottom, color=color, label=key[:-2])
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(f"rank {r}")
        ax.set_xlabel("pass")
    axes[0][0].set_ylabel("seconds")
    axes[0][0].legend(fontsize=8)
    return _png(fig)


def _roc_plot(c: dict, auroc: float) -> bytes:
    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot(c["fpr"], c["tpr"], label=f"auROC {auroc:.4f}")
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=0.8)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(loc="lower right")
    return _png(fig)


def _pr_plot(c: dict, auprc: float, base: float) -> bytes:
    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot(c["recall"], c["precision"], label=f"auPRC {auprc:.4f}")
    ax.axhline(base, ls="--", color="grey", lw=0.8, label=f"positive rate {base:.3f}")
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper right")
    return _png(fig)


def _calibration_plot(c: dict, ratio: float) -> bytes:
    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot(c["mean_prediction"], c["positive_rate"], marker="o", ms=4, label=f"calibration {ratio:.3f}")
    hi = max(max(c["mean_prediction"]), max(c["positive_rate"]))
    ax.plot([0, hi], [0, hi], ls="--", color="grey", lw=0.8)
    ax.set_xlabel("mean prediction (equal-weight groups)")
    ax.set_ylabel("observed positive rate")
    ax.legend(loc="upper left")
    return _png(fig)


def build_report(model_dir: str, eval_json: str | None = None, out_dir: str | None = None) -> str:
    """Write the report; returns the path of report.html."""
    meta = redact(modeldir.load_metadata(model_dir))  # files written before redaction existed, too
    metrics = None
    if eval_json:
        with open(eval_json) as f:
            metrics = redact(json.load(f))
    out = out_dir or model_dir
    os.makedirs(out, exist_ok=True)
    h = meta["history"]
    images: dict[str, bytes] = {
        "objective_by_pass": _curve_plot(h, "pass"),
        "objective_by_time": _curve_plot(h, "time"),
        "rank_timings": _timings_plot(h),
    }
    if metrics and metrics.get("curves"):
        c = metrics["curves"]
        images["roc"] = _roc_plot(c["roc"], metrics["auroc"])
        images["precision_recall"] = _pr_plot(c["pr"], metrics["auprc"], metrics["positive_rate"])
        images["calibration"] = _calibration_plot(c["calibration"], metrics["calibration"])
    for name, data in images.items():
        with open(os.path.join(out, f"{name}.png"), "wb") as f:
            f.write(data)
    path = os.path.join(out, "report.html")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(_html(meta, metrics, images))
    os.replace(tmp, path)
    return path


def _img(name: str, data: bytes, caption: str) -> str:
    b64 = base64.b64encode(data).decode("ascii")
    return f'<figure><img alt="{name}" src="data:image/png;base64,{b64}"><figcaption>{html.escape(caption)}</figcaption></figure>'


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows) + "</table>"


def _html(meta: dict, metrics: dict | None, images: dict[str, bytes]) -> str:
    t = meta["config"]["train"]
    d = meta["data"]
    summary = [
        ("solver", f"{t['solver']} ({len(meta['per_rank'])} workers), loss {t['loss']}, l2 {t['l2']:g}"),
        ("data", f"{d.get('train_rows', 0):,} training rows, {d.get('holdout_rows', 0):,} held out, 2^{meta['spec']['bits']} features"),
        ("passes", f"{len(meta['history'])} (stopped: {meta.get('stop_reason') or 'n/a'})"),
        ("training objective", f"{meta['objective']:.6f} at the returned weights"),
        ("time in job", f"{meta['train_seconds']:.2f} s, {len(meta['attempts'])} attempt(s)"),
        *([("negative downsampling", f"rate {d['negative_rate']:g}: {d['weighting']}")]
          if d.get("negative_rate", 1.0) < 1 else []),
    ]
    ranks = [(f"rank {r['rank']}", f"shard {r['shard']} ({r['attempt_id']}), {r['rows']:,} rows, {r['nnz']:,} non-zeros, "
              f"read {r['read_s']:.2f} s, total {r['seconds']:.2f} s") for r in meta["per_rank"]]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>terascale training report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}"
        "figure{display:inline-block;margin:0.5em}img{max-width:100%}figcaption{font-size:0.9em;color:#555}</style>",
        "</head><body><h1>terascale training report</h1>",
        _table(summary), "<h2>Convergence</h2>",
        _img("objective_by_pass", images["objective_by_pass"], "objective and held-out loss per pass"),
        _img("objective_by_time", images["objective_by_time"], "the same against elapsed time"),
        "<h2>Per-rank time per pass</h2>",
        _img("rank_timings", images["rank_timings"], "compute, stall (waiting for the slowest rank) and transfer seconds"),
        _table(ranks),
    ]
    if metrics is not None:
        parts += ["<h2>Evaluation</h2>", _table([
            ("dataset", str(metrics.get("dataset", ""))), ("rows", f"{metrics['rows']:,}"),
            ("logloss", f"{metrics['logloss']:.6f}"), ("normalized entropy", f"{metrics['normalized_entropy']:.6f}"),
            ("auROC", f"{metrics['auroc']:.6f}"), ("auPRC", f"{metrics['auprc']:.6f}"),
            ("calibration", f"{metrics['calibration']:.4f}"),
            *([("weighting", metrics["weighting"]["note"])] if "weighting" in metrics else []),
        ])]
        for name, cap in (("roc", "ROC curve"), ("precision_recall", "precision-recall curve"), ("calibration", "calibration")):
            if name in images:
                parts.append(_img(name, images[name], cap))
    parts.append("</body></html>\n")
    return "\n".join(parts)
