"""``terascale report MODEL_DIR [--eval METRICS_JSON] [--out DIR]``: what happened in a run.

Writes ``report.html`` (self-contained: the PNG plots are embedded) plus the PNG files into
``DIR`` (default: the model directory):

- the training objective and the held-out loss per pass, and against elapsed time;
- each rank's compute / stall / transfer seconds per pass (the terascale paper's Table 2 view);
- each rank's memory: its measured peak RSS, baseline and phase peaks, and the breakdown of the
  shared accounting (``jobs.memory_accounting``: process baseline, shard, model state, L-BFGS
  memory, buffers, and what it leaves unaccounted) beside the driver's preflight estimate, as a
  table and a stacked bar per rank;
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

from terascale.jobs.memory_accounting import CATEGORIES, fmt_bytes  # noqa: E402
from terascale.jobs.steps import penalties_text, recalibration_text  # noqa: E402
from terascale.pipeline import artifacts, modeldir  # noqa: E402
from terascale.pipeline.redact import redact  # noqa: E402

PLOTS = artifacts.REPORT_PLOTS  # the files a model directory may hold besides the model (pipeline.artifacts)


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


_COLORS = dict(zip((*CATEGORIES, "unaccounted"), ("#8c8c8c", "#4c72b0", "#55a868", "#c44e52", "#dd8452", "#ccb974"),
                   strict=True))


def _label(category: str) -> str:
    return category.replace("_", " ").replace("lbfgs", "L-BFGS")


def _memory_plot(ranks: list[dict], estimate: dict) -> bytes:
    """One stacked bar per rank (its accounting's categories + what they leave unaccounted, so the
    bar's top is the measured peak) and one for the driver's estimate; a tick at each measured peak."""
    bars = [(f"rank {r['rank']}", r["memory"]["breakdown"], r["memory"]["unaccounted_bytes"], r["memory"]["peak_rss_bytes"])
            for r in ranks]
    if estimate.get("categories"):
        bars.append(("estimate", estimate["categories"], 0, None))
    fig, ax = plt.subplots(figsize=(min(1.6 * len(bars) + 3.0, 12), 3.8))
    mib = float(1 << 20)
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for cat in (*CATEGORIES, "unaccounted"):
        vals = [(max(u, 0) if cat == "unaccounted" else b.get(cat, 0)) / mib for _, b, u, _ in bars]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=_COLORS[cat], label=_label(cat))
            bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    peaks = [(i, p / mib) for i, (_, _, _, p) in enumerate(bars) if p is not None]
    ax.scatter([i for i, _ in peaks], [p for _, p in peaks], marker="_", s=900, color="black", label="measured peak RSS", zorder=3)
    ax.set_xticks(list(x), [name for name, *_ in bars])
    ax.set_ylim(0, 1.05 * max([*bottom, *(p for _, p in peaks)]))
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


def _path_plot(reg: dict) -> bytes:
    """Held-out loss and training objective of every step of a regularization path against its
    λ (log axis), the chosen step marked; an L1 path also its non-zero counts (right axis)."""
    name, steps = reg["penalty"], reg["steps"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    lam = [st[name] for st in steps]
    for key, label in (("holdout_loss", "held-out loss"), ("objective", "training objective")):
        pts = [(x, st[key]) for x, st in zip(lam, steps, strict=True) if st.get(key) is not None]
        if pts:
            ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", ms=4, label=label)
    chosen = steps[reg["chosen_step"]]
    if chosen.get("holdout_loss") is not None:
        ax.scatter([chosen[name]], [chosen["holdout_loss"]], s=120, facecolors="none", edgecolors="black",
                   label=f"chosen {name} = {reg['value']:g}", zorder=3)
    ax.set_xscale("log")
    ax.invert_xaxis()  # the path runs from the largest value down
    ax.set_xlabel(f"{name} (path order: left to right)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if name == "l1" and all("nonzeros" in st for st in steps):  # the sparsity side of an L1 path
        nz = ax.twinx()
        nz.plot(lam, [max(st["nonzeros"], 1) for st in steps], color="grey", ls="--", marker=".", label="non-zeros")
        nz.set_yscale("log")
        nz.set_ylabel("non-zero weights")
        nz.legend(loc="upper right")
    return _png(fig)


def _path_section(meta: dict, images: dict[str, bytes]) -> list[str]:
    """The regularization path (``train.l2`` or ``train.l1 = auto``): the plot and one row per step."""
    reg = meta.get("regularization")
    if not reg:
        return []
    name = reg["penalty"]
    rows = [[str(st["step"] + 1), f"{st[name]:.3g}", "n/a" if st["holdout_loss"] is None else f"{st['holdout_loss']:.6f}",
             f"{st['objective']:.6f}", f"{st['nonzeros']:,}" if "nonzeros" in st else "n/a", str(st["passes"]),
             f"{st['seconds']:.2f}", str(st["stop_reason"]), "yes" if st["step"] == reg["chosen_step"] else ""]
            for st in reg["steps"]]
    return ["<h2>Regularization path</h2>", "<p>" + html.escape(f"{name} = auto: {reg['rule']}. Chosen: {reg['value']:g}"
            + (f" (the path stopped early: {reg['stop']})." if reg["stop"] != "end" else ".")) + "</p>",
            _img("regularization_path", images["regularization_path"], f"held-out loss and objective against {name}"),
            _grid(["step", name, "held-out loss", "objective", "non-zeros", "passes", "seconds", "stopped", "chosen"], rows)]


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
    if meta.get("regularization"):
        images["regularization_path"] = _path_plot(meta["regularization"])
    measured = [r for r in meta["per_rank"] if r.get("memory")]
    if measured:
        images["memory"] = _memory_plot(sorted(measured, key=lambda r: r["rank"]), meta.get("memory_estimate") or {})
    if metrics and metrics.get("curves"):
        c = metrics["curves"]
        images["roc"] = _roc_plot(c["roc"], metrics["auroc"])
        images["precision_recall"] = _pr_plot(c["pr"], metrics["auprc"], metrics["positive_rate"])
        images["calibration"] = _calibration_plot(c["calibration"], metrics["calibration"])
    for name, data in images.items():
        assert name in PLOTS, name  # a plot not listed there would make the model directory foreign
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


def _grid(head: list[str], rows: list[list[str]]) -> str:
    return ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows) + "</table>")


def _memory_section(meta: dict, images: dict[str, bytes]) -> list[str]:
    """Memory per rank: measured peak, baseline and phase peaks; the accounting's breakdown by
    category beside the driver's estimate (``memory_estimate``)."""
    ranks = sorted(meta["per_rank"], key=lambda r: r["rank"])
    est = meta.get("memory_estimate") or {}
    if not any("peak_rss_bytes" in r for r in ranks):
        return []
    out = ["<h2>Memory per rank</h2>"]
    if est.get("needed_bytes"):
        out.append("<p>" + html.escape(
            f"The driver's preflight estimated {fmt_bytes(est['needed_bytes'])} for the largest shard at its "
            f"{est.get('peak_phase', '?')} peak; a rank may use "
            + (fmt_bytes(est["available_bytes"]) if est.get("available_bytes") else "an unknown amount")
            + f" ({est.get('available_from', '?')}).") + "</p>")
    measured = [r for r in ranks if r.get("memory")]
    if "memory" in images:
        out.append(_img("memory", images["memory"], "each rank's accounting by category up to its measured peak RSS "
                        "(the rest unaccounted), and the driver's estimate"))
    if not measured:  # a model trained before per-rank accounting: the peaks only
        out.append(_grid(["rank", "peak RSS", "estimate"],
                         [[str(r["rank"]), fmt_bytes(r["peak_rss_bytes"]), fmt_bytes(est.get("needed_bytes", 0))] for r in ranks]))
        return out
    phases = sorted({p for r in measured for p in r["memory"]["phase_peaks"]}, key=lambda p: (p != "read", p))
    out.append(_grid(
        ["rank", "peak RSS", "baseline RSS", *[f"peak while {p}" for p in phases], "accounted", "unaccounted",
         "estimate", "measured / estimate"],
        [[str(r["rank"]), fmt_bytes(m["peak_rss_bytes"]), fmt_bytes(m["baseline_rss_bytes"]),
          *[fmt_bytes(m["phase_peaks"].get(p, 0)) for p in phases],
          fmt_bytes(sum(m["breakdown"].values())), fmt_bytes(m["unaccounted_bytes"]),
          fmt_bytes(est.get("needed_bytes", 0)),
          f"{m['peak_rss_bytes'] / est['needed_bytes']:.2f}" if est.get("needed_bytes") else "n/a"]
         for r in measured for m in [r["memory"]]]))
    cats = [c for c in CATEGORIES if any(r["memory"]["breakdown"].get(c) for r in measured) or (est.get("categories") or {}).get(c)]
    head = ["category", *[f"rank {r['rank']}" for r in measured], *(["estimate"] if est.get("categories") else [])]
    rows = [[_label(c), *[fmt_bytes(r["memory"]["breakdown"].get(c, 0)) for r in measured],
             *([fmt_bytes(est["categories"].get(c, 0))] if est.get("categories") else [])] for c in cats]
    rows.append(["unaccounted (peak − accounted)", *[fmt_bytes(r["memory"]["unaccounted_bytes"]) for r in measured],
                 *(["—"] if est.get("categories") else [])])
    out.append("<h3>Breakdown</h3>" + _grid(head, rows))
    return out


def _html(meta: dict, metrics: dict | None, images: dict[str, bytes]) -> str:
    t = meta["config"]["train"]
    d = meta["data"]
    summary = [
        ("solver", f"{t['solver']} ({len(meta['per_rank'])} workers), loss {t['loss']}, {penalties_text(meta)}"),
        *([("weights", f"{w['nonzeros']:,} non-zero of {w['length']:,} (stored {w['storage']})")]
          if (w := meta.get("weights")) else []),
        ("data", f"{d.get('train_rows', 0):,} training rows, {d.get('holdout_rows', 0):,} held out, 2^{meta['spec']['bits']} features"),
        ("passes", f"{len(meta['history'])} (stopped: {meta.get('stop_reason') or 'n/a'})"),
        ("training objective", f"{meta['objective']:.6f} at the returned weights"),
        ("time in job", f"{meta['train_seconds']:.2f} s, {len(meta['attempts'])} attempt(s)"),
        *([("negative downsampling", f"rate {d['negative_rate']:g}: {d['weighting']}")]
          if d.get("negative_rate", 1.0) < 1 else []),
        *([("recalibrated", c)] if (c := recalibration_text(meta)) else []),
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
        *_path_section(meta, images),
        "<h2>Per-rank time per pass</h2>",
        _img("rank_timings", images["rank_timings"], "compute, stall (waiting for the slowest rank) and transfer seconds"),
        _table(ranks),
        *_memory_section(meta, images),
    ]
    if metrics is not None:
        parts += ["<h2>Evaluation</h2>", _table([
            ("dataset", str(metrics.get("dataset", ""))), ("rows", f"{metrics['rows']:,}"),
            ("logloss", f"{metrics['logloss']:.6f}"), ("normalized entropy", f"{metrics['normalized_entropy']:.6f}"),
            ("auROC", f"{metrics['auroc']:.6f}"),
            *([("non-zero weights", f"{metrics['nonzeros']:,} of {metrics['features']:,}")] if "nonzeros" in metrics else []), ("auPRC", f"{metrics['auprc']:.6f}"),
            ("calibration", f"{metrics['calibration']:.4f}" + (f" (recalibrated; sigma(margin) alone "
                                                                 f"{metrics['raw_calibration']:.4f})"
                                                                 if "raw_calibration" in metrics else "")),
            *([("weighting", metrics["weighting"]["note"])] if "weighting" in metrics else []),
        ])]
        for name, cap in (("roc", "ROC curve"), ("precision_recall", "precision-recall curve"), ("calibration", "calibration")):
            if name in images:
                parts.append(_img(name, images[name], cap))
    parts.append("</body></html>\n")
    return "\n".join(parts)
