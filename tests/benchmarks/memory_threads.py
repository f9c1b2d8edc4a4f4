"""Threads per rank (``train.threads``): one worker with 2 threads against 2 workers with 1 thread.

``measure(dataset_dir, workdir)`` on an existing featurized dataset (e.g. the 2M-row, 2^22
benchmark data) measures:

a. the online pass alone (``OnlineLearner._local_pass``, the whole shard in one process, in
   memory, a fresh zero state before every pass, not timed) with 1 and 2 threads (Hogwild; with
   2 the data are handed over, so the hot-feature replicas of :mod:`solvers.hot` are on: the
   relabelling and its undoing are timed apart, ``relabel_seconds`` / ``unlabel_seconds``, and
   ``speedup_median_with_relabel`` charges them to one pass, as a hybrid run's one online pass pays them),
   interleaved 1, 2, 1, 2, … (this machine's speed drifts): non-zeros per second (the CSR's
   non-zeros plus one per row for the intercept, as bench_train counts them), best and median
   of ``repeats`` each, their ratios (target: 2 threads >= 1.7x one), and each pass's
   progressive loss (Hogwild's should stay close to the sequential pass's);
b. the train job through the command line (``terascale train``, a fresh application each,
   local[2]: the 1 x 2 run's session gets spark.task.cpus = 2), 2 workers x 1 thread and
   1 worker x 2 threads, in that order and again ``job_repeats`` times: from each model's
   metadata.json the history (objective, elapsed_s and elapsed_all_s per pass), every rank's peak
   RSS (and their sum: the memory both layouts use), every rank's model state (the memory
   accounting's ``model_state`` at its peak phase, ``per_rank[i].memory``) and their sum, the
   memory preflight's estimate and
   ``train_seconds``, and the end-to-end wall time. The caller compares the times to a target
   objective (e.g. MLlib's, from bench_train) with :func:`time_to_objective`.

Run alone: ``python -m tests.benchmarks.memory_threads DATASET WORKDIR``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tests.benchmarks.common import train_cli

LAMBDA = 1e-6
JOB_SETTINGS = ["spark.master=local[2]", f"train.l2={LAMBDA}", "train.tol=1e-12", "train.holdout_period=0",
                "train.early_stop_passes=0", "train.passes=12"]
LAYOUTS = {"2x1": (2, 1), "1x2": (1, 2)}  # name: (workers, threads)


def _online_run(csr, threads, consume=False):
    """What ``solvers.api.train`` hands the online solver (the input agreement done), on ``threads``."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.catalogue import loss_spec
    from terascale.solvers.objective import DistributedObjective
    from terascale.solvers.params import SolverParams
    from terascale.solvers.run import TrainRun
    from terascale.solvers.setup import AgreeingCommunicator, Inputs
    from terascale.solvers.tracker import PassTracker

    params = SolverParams(solver="online", l2=LAMBDA, passes=1, threads=threads.size)
    comm = LocalCommunicator()
    inputs = Inputs(0, csr, None, params.loss, consume)
    inputs.agree(comm)
    solver_comm = AgreeingCommunicator(comm, inputs)
    loss_id = loss_spec(params.loss).id
    return TrainRun(solver_comm, params, inputs, loss_id,
                    DistributedObjective(inputs, solver_comm, loss_id, params.l2, threads=threads),
                    PassTracker(solver_comm, inputs, loss_id, 0, threads=threads), threads=threads)


def online_rates(csr, counts: tuple[int, ...], repeats: int) -> dict:
    """The online pass alone on ``csr`` with each thread count in ``counts``, interleaved
    (``counts`` in order, ``repeats`` times, after one untimed warm pass each): per count the
    seconds of every timed pass, their progressive losses, and for T > 1 the relabelling and
    its undoing timed apart (part (a) of the module docstring, for any thread counts)."""
    from terascale.solvers.online import OnlineLearner
    from terascale.solvers.threads import RowThreads

    pools = {t: RowThreads(t) for t in counts}
    # T > 1 on data handed over: the hot-feature replicas (solvers.hot); the relabelling before the
    # first pass and its undoing after the phase are timed apart from the pass
    runs = {t: _online_run(csr, pools[t], consume=t > 1) for t in counts}
    out = {t: {"seconds": [], "progressive_loss": [], "relabel_seconds": [], "unlabel_seconds": [],
               "hot_features": 0} for t in counts}

    def one_pass(t: int, timed: bool) -> None:
        learner = OnlineLearner(runs[t])  # a fresh zero state
        s = runs[t].inputs.train
        rec = out[t]
        if learner.hot is not None:
            rec["hot_features"] = int(learner.hot.hot_ids.shape[0])
            t0 = time.perf_counter()
            learner.hot.relabel(s, pools[t])
            if timed:
                rec["relabel_seconds"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loss_sum, weight_sum, problem = learner._local_pass(1)
        if timed:
            rec["seconds"].append(time.perf_counter() - t0)
            rec["progressive_loss"].append(loss_sum / weight_sum)
        assert problem is None, problem
        t0 = time.perf_counter()
        learner.close()  # the shard's feature ids back
        if timed and learner.hot is not None:
            rec["unlabel_seconds"].append(time.perf_counter() - t0)

    try:
        for t in counts:  # warm: compile / load the kernels, start the pool's threads
            one_pass(t, False)
        for _ in range(repeats):
            for t in counts:
                one_pass(t, True)
    finally:
        for p in pools.values():
            p.close()
    return out


def online_pass_rates(dataset_dir: str, repeats: int = 4) -> dict:
    """Part (a) of the module docstring."""
    from terascale.pipeline.dataset import read_dataset

    csr, _ = read_dataset(dataset_dir)
    work = int(csr.nnz) + int(csr.n_rows)
    rates = online_rates(csr, (1, 2), repeats)
    seconds = {t: rates[t]["seconds"] for t in (1, 2)}
    relabel_s, unlabel_s = rates[2]["relabel_seconds"], rates[2]["unlabel_seconds"]
    out = {"rows": int(csr.n_rows), "nnz": int(csr.nnz), "work_per_pass": work, "repeats": repeats}
    for t in (1, 2):
        out[f"threads_{t}"] = {"seconds": seconds[t], "best_nnz_per_s": work / min(seconds[t]),
                               "median_nnz_per_s": work / statistics.median(seconds[t]),
                               "progressive_loss": rates[t]["progressive_loss"]}
    out["hot_features"] = rates[2]["hot_features"]
    out["relabel_seconds"] = relabel_s
    out["unlabel_seconds"] = unlabel_s
    out["speedup_best"] = min(seconds[1]) / min(seconds[2])
    out["speedup_median"] = statistics.median(seconds[1]) / statistics.median(seconds[2])
    # a hybrid run's single online pass pays the relabelling and its undoing once
    once = statistics.median(relabel_s) + statistics.median(unlabel_s) if relabel_s else 0.0
    out["speedup_median_with_relabel"] = statistics.median(seconds[1]) / (statistics.median(seconds[2]) + once)
    out["meets_target"] = out["speedup_median"] >= 1.7
    return out


def train_job(dataset_dir: str, model_dir: str, workers: int, threads: int, extra: list[str] = ()) -> dict:
    """One ``terascale train`` run (part b): the figures from its metadata.json."""
    sets = [*JOB_SETTINGS, f"train.workers={workers}", f"train.threads={threads}", *extra]
    meta, wall = train_cli(dataset_dir, model_dir, sets, f"{workers} x {threads}")
    peaks = [p["peak_rss_bytes"] for p in meta["per_rank"]]
    mem = [p.get("memory") or {} for p in meta["per_rank"]]
    state = [m.get("breakdown", {}).get("model_state") for m in mem]
    return {
        "workers": workers, "threads": threads, "end_to_end_s": wall, "train_seconds": meta["train_seconds"],
        "objective": meta["objective"], "stop_reason": meta["stop_reason"],
        "history": [{k: e.get(k) for k in ("pass", "phase", "objective", "elapsed_s", "elapsed_all_s", "evaluations",
                                           "progressive_loss")} for e in meta["history"]],
        "per_rank_peak_rss_bytes": peaks, "peak_rss_bytes_sum": int(sum(peaks)),
        "per_rank_csr_bytes": [p["csr_bytes"] for p in meta["per_rank"]],
        "per_rank_phase_peaks": [m.get("phase_peaks") for m in mem],
        "per_rank_model_state_bytes": state,  # the accounting's model_state at the rank's peak phase
        "model_state_bytes_sum": None if None in state else int(sum(state)),
        "memory_estimate_bytes": meta["memory_estimate"]["needed_bytes"],
        "memory_estimate_terms": meta["memory_estimate"]["terms"],
    }


def time_to_objective(history: list[dict], target: float, clock: str = "elapsed_s") -> float | None:
    """The ``clock`` of the first pass whose objective is at or below ``target`` (None: never)."""
    for e in history:
        if e.get("objective") is not None and e["objective"] <= target:
            return e[clock]
    return None


def measure(dataset_dir: str, workdir: str, repeats: int = 4, job_repeats: int = 1) -> dict:
    """Parts (a) and (b) of the module docstring; returns the figures."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    fig: dict = {"dataset": dataset_dir, "online_pass": online_pass_rates(dataset_dir, repeats)}
    jobs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for i in range(job_repeats):
        for name, (workers, threads) in LAYOUTS.items():
            jobs[name].append(train_job(dataset_dir, str(work / f"model-{name}-{i}"), workers, threads))
    fig["train_job"] = jobs
    # the runs' own common target: the worse of the two final objectives, reached by both
    target = max(r["objective"] for runs in jobs.values() for r in runs)
    summary = {}
    for name, runs in jobs.items():
        times = [time_to_objective(r["history"], target) for r in runs]
        summary[name] = {"time_to_common_objective_s": None if None in times else statistics.median(times),
                         "peak_rss_bytes_sum": statistics.median(r["peak_rss_bytes_sum"] for r in runs),
                         "model_state_bytes_sum": runs[0]["model_state_bytes_sum"],
                         "train_seconds": statistics.median(r["train_seconds"] for r in runs)}
    a, b = summary["1x2"], summary["2x1"]
    summary["common_objective"] = target
    summary["time_ratio_1x2_over_2x1"] = (None if None in (a["time_to_common_objective_s"], b["time_to_common_objective_s"])
                                          else a["time_to_common_objective_s"] / b["time_to_common_objective_s"])
    summary["memory_ratio_1x2_over_2x1"] = a["peak_rss_bytes_sum"] / b["peak_rss_bytes_sum"]
    summary["model_state_ratio_1x2_over_2x1"] = (None if None in (a["model_state_bytes_sum"], b["model_state_bytes_sum"])
                                                 else a["model_state_bytes_sum"] / b["model_state_bytes_sum"])
    fig["summary"] = summary
    for i in range(job_repeats):
        for name in LAYOUTS:
            shutil.rmtree(work / f"model-{name}-{i}", ignore_errors=True)
    return fig


def _print(fig: dict) -> None:
    o, s = fig["online_pass"], fig["summary"]
    print(f"online pass: 1 thread {o['threads_1']['median_nnz_per_s'] / 1e6:.1f} M nnz/s, 2 threads "
          f"{o['threads_2']['median_nnz_per_s'] / 1e6:.1f} M nnz/s (median of {o['repeats']}) -> "
          f"{o['speedup_median']:.2f}x (best {o['speedup_best']:.2f}x; target >= 1.7x); progressive loss "
          f"{np.mean(o['threads_1']['progressive_loss']):.6f} vs {np.mean(o['threads_2']['progressive_loss']):.6f}")
    for name in LAYOUTS:
        x = s[name]
        print(f"train {name}: time to objective {s['common_objective']:.6f}: {x['time_to_common_objective_s']} s, "
              f"train_seconds {x['train_seconds']:.1f}, peak RSS over ranks {x['peak_rss_bytes_sum'] / 2**20:.0f} MiB")
    print(f"1x2 / 2x1: time {s['time_ratio_1x2_over_2x1']}, peak RSS {s['memory_ratio_1x2_over_2x1']:.2f}, "
          f"model state {s['model_state_ratio_1x2_over_2x1']}")


if __name__ == "__main__":
    figures = measure(sys.argv[1], sys.argv[2])
    _print(figures)
    print(json.dumps(figures, indent=1, default=float))
