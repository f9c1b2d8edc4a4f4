"""The scale curve's figure: ``bench-results/scale.json`` (runs of ``bench_scale`` at several N)
drawn as ``docs/pages/explanation/scale.png``, and its table as Markdown.

    python -m tests.benchmarks.scale_plot [--results bench-results/scale.json] [--out docs/pages/explanation/scale.png]

Three panels over N (training rows, log-scaled), one point per complete run (runs cut short by
``--stop-after`` are left out):

1. seconds per million rows of every stage (wall time of the stage's command over the rows it
   handled: training rows for generate / featurize / train, test rows for evaluate / predict,
   lines for score): flat lines are cost linear in rows;
2. the peak RSS of each kind of process (the Python driver, the JVM, the largest Python worker,
   over all stages);
3. the test log loss and the generator's Bayes log loss of the same rows.

:func:`table` gives the same figures as a Markdown table (``--table``), for docs/pages/explanation/scaling.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.benchmarks.common import RESULTS, ROOT

STAGES = ("generate", "featurize", "train", "evaluate", "predict", "score")
KINDS = ("python_driver", "jvm", "python_worker")


def complete_runs(results: dict) -> list[dict]:
    """The runs that went through every stage, by N ascending."""
    runs = [r for key, r in results["runs"].items() if key.isdigit() and "failed" not in r
            and set(STAGES) <= set(r.get("stages", {}))]
    return sorted(runs, key=lambda r: r["rows"])


def seconds_per_million(run: dict, stage: str) -> float:
    s = run["stages"][stage]
    rows = s.get("rows") or 0
    return s["wall_s"] / rows * 1e6 if rows else float("nan")


def peak_rss(run: dict, kind: str) -> int:
    """The largest peak RSS of a process of ``kind`` over the run's stages (0: none)."""
    return max((s.get("rss_peak_bytes", {}).get(kind, {}).get("max", 0) for s in run["stages"].values()), default=0)


def table(runs: list[dict]) -> str:
    head = ["N", *(f"{s} s/M rows" for s in STAGES), "train passes", "driver MiB", "JVM MiB", "worker MiB",
            "test logloss", "Bayes", "min free disk GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in runs:
        q = r["quality"]
        cells = [f"{r['rows']:,}", *(f"{seconds_per_million(r, s):.1f}" for s in STAGES),
                 str(r["stages"]["train"].get("passes")),
                 *(f"{peak_rss(r, k) / 2**20:.0f}" for k in KINDS),
                 f"{q['logloss']:.5f}", f"{q['bayes_logloss']:.5f}",
                 f"{min(s.get('min_free_disk_bytes', 0) for s in r['stages'].values()) / 1e9:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["rows"] for r in runs]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    for stage in STAGES:
        ax[0].plot(n, [seconds_per_million(r, stage) for r in runs], marker="o", label=stage)
    ax[0].set(xscale="log", yscale="log", xlabel="training rows N", ylabel="seconds per million rows",
              title="cost per row by stage (flat = linear)")
    for kind in KINDS:
        ax[1].plot(n, [peak_rss(r, kind) / 2**20 for r in runs], marker="o", label=kind.replace("_", " "))
    ax[1].set(xscale="log", xlabel="training rows N", ylabel="peak RSS (MiB)", title="peak memory per process")
    ax[2].plot(n, [r["quality"]["logloss"] for r in runs], marker="o", label="test logloss")
    ax[2].plot(n, [r["quality"]["bayes_logloss"] for r in runs], linestyle="--", label="Bayes (generator)")
    ax[2].set(xscale="log", xlabel="training rows N", ylabel="log loss", title="quality against the Bayes loss")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.benchmarks.scale_plot", description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS / "scale.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "pages" / "explanation" / "scale.png")
    ap.add_argument("--table", action="store_true", help="print the Markdown table too")
    a = ap.parse_args(argv)
    runs = complete_runs(json.loads(a.results.read_text()))
    if not runs:
        raise SystemExit(f"{a.results}: no complete run to draw")
    print(f"{plot(runs, a.out)}: {len(runs)} runs, N = {[r['rows'] for r in runs]}")
    if a.table:
        print(table(runs))


if __name__ == "__main__":
    main()
