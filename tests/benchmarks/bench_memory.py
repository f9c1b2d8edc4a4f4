"""Memory and threads (issue 20): compact shards, the local shard cache, threads per rank.

The click-log benchmark of bench_train (2,000,000 generated rows, bits 22, λ = 1e-6), in one run:

1. Memory mode: every worker's peak RSS (2 workers, hybrid, the train job through the CLI)
   against the figure before compact shards (:data:`RSS_BEFORE_MIB`, measured on this machine
   at commit 4076228: the old code cannot run in the same process tree), target ≤ 0.6×; and the
   time to Spark MLlib's objective (MLlib's LogisticRegression, 20 iterations, regParam = λ,
   standardization off, fitted in this run as bench_train does) as a ratio against MLlib's fit
   time, beside bench_train's time before (:data:`TIME_TO_MLLIB_BEFORE_S`, not the same run).
2. Disk mode (``train.memory_budget_mb=64``) against memory mode: :mod:`tests.benchmarks.memory_modes`.
3. Threads: 1 worker × 2 threads against 2 workers × 1 thread: :mod:`tests.benchmarks.memory_threads`,
   and each layout's time to MLlib's objective.

bench-results/memory.json holds ``rss_mib`` per mode and worker, ``shard_bytes``,
``pass_seconds`` per mode, ``objective`` per mode and the thread figures.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.benchmarks import memory_modes, memory_threads
from tests.benchmarks.common import RESULTS, ROOT, generated_logs

ROWS, BITS, LAMBDA = 2_000_000, 22, 1e-6
#: peak RSS per worker (MiB) of the same job before compact shards (commit 4076228, this machine)
RSS_BEFORE_MIB = (1193, 1158)
#: bench_train's time to MLlib's objective (s, fresh applications) before (docs/pages/explanation/design-notes.md,
#: jobs.session): the same job on this machine, three runs
TIME_TO_MLLIB_BEFORE_S = (2.72, 2.97, 2.89)


def _dataset() -> Path:
    """The benchmark's training rows featurized at BITS (made once under bench-results/data)."""
    raw = generated_logs(ROWS, files=8, seed=7)
    out = RESULTS / "data" / f"memory-{ROWS}-bits{BITS}"
    if not (out / "_manifest.json").exists():
        exe = Path(sys.executable).with_name("terascale")
        subprocess.run([str(exe), "featurize", "--input", str(raw / "*.tsv"), "--output", str(out), "--overwrite",
                        "--set", f"featurize.bits={BITS}"], check=True, cwd=ROOT)
    return out


def _mllib(dataset: Path) -> dict:
    """MLlib's fit on the same rows (bench_train's function) and its objective by one formula."""
    from terascale.pipeline.dataset import read_dataset
    from tests.benchmarks.bench_train import _mllib as fit
    from tests.benchmarks.bench_train import _session, objective

    spark = _session("bench-memory-mllib")
    try:
        secs, w, b = fit(spark, dataset, LAMBDA)
    finally:
        spark.stop()
    csr, _ = read_dataset(str(dataset))
    x = csr.to_scipy()
    return {"fit_s": secs, "objective": objective(x, csr.labels.astype(np.float64), w, b, LAMBDA)}


def main() -> dict:
    dataset = _dataset()
    work = RESULTS / "memory-work"
    ml = _mllib(dataset)
    modes = memory_modes.measure(str(dataset), str(work / "modes"), budget_mb=64)
    threads = memory_threads.measure(str(dataset), str(work / "threads"), job_repeats=3)
    fig: dict = {"dataset": str(dataset), "rows": ROWS, "bits": BITS, "lambda": LAMBDA, "mllib": ml,
                 "modes": modes, "threads": threads}

    jobs = modes["train_job"]
    fig["rss_mib"] = {m: [statistics.median(r["per_rank_peak_rss_bytes"][k] for r in jobs[m]) / 2**20
                          for k in range(len(jobs[m][0]["per_rank_peak_rss_bytes"]))] for m in jobs}
    fig["rss_mib"]["before_compact_shards"] = list(RSS_BEFORE_MIB)
    fig["shard_bytes"] = jobs["memory"][0]["per_rank_csr_bytes"]
    fig["pass_seconds"] = modes["summary"]["later_pass_s"]
    fig["objective"] = {m: jobs[m][0]["objective"] for m in jobs}
    fig["memory_mode_rss_ratio_to_before"] = max(fig["rss_mib"]["memory"]) / max(RSS_BEFORE_MIB)
    ttm = {m: [memory_threads.time_to_objective(r["history"], ml["objective"]) for r in jobs[m]] for m in jobs}
    for name, runs in threads["train_job"].items():
        ttm[f"threads_{name}"] = [memory_threads.time_to_objective(r["history"], ml["objective"]) for r in runs]
    fig["time_to_mllib_objective_s"] = ttm
    fig["speedup_vs_mllib"] = {k: (None if None in v else ml["fit_s"] / statistics.median(v)) for k, v in ttm.items()}
    fig["time_to_mllib_objective_before_s"] = list(TIME_TO_MLLIB_BEFORE_S)
    print(f"memory mode: peak RSS per worker {fig['rss_mib']['memory']} MiB (before {list(RSS_BEFORE_MIB)}) -> "
          f"{fig['memory_mode_rss_ratio_to_before']:.2f}x (target <= 0.6x); disk mode {fig['rss_mib'].get('disk')} MiB, "
          f"shard {[b / 2**20 for b in fig['shard_bytes']]} MiB")
    print(f"MLlib objective {ml['objective']:.6f} in {ml['fit_s']:.1f} s; speedups {fig['speedup_vs_mllib']}")
    memory_modes._print(modes)
    memory_threads._print(threads)
    return fig
