"""The local shard cache (``train.data_cache = disk``) against memory mode.

``measure(dataset_dir, workdir)`` on an existing featurized dataset (e.g. the 2M-row, 2^22
benchmark data) measures:

a. passes over one rank's shard (shard 0 of a 2-worker plan) in this process: the shard read
   into memory (``MemorySink``) and into the cache (``DiskSink``, budget ``budget_mb``), then the
   gradient pass (``solvers.objective.shard_sums``: loss, gradient) and the online pass
   (``OnlineLearner._local_pass``) over each, interleaved memory, disk, memory, disk, …, the disk
   passes from a warm page cache (the cache files were just written or read); then, after
   ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only; skipped with the reason otherwise),
   one gradient pass from a cold cache, as MB/s of the shard's bytes, beside the disk's
   sequential read rate (a plain ``read`` of a 1 GiB file in 8 MiB blocks after dropping the
   caches) and the warm pass's rate (a pass that computes slower than the disk reads is
   compute-bound from a cold cache as well);
b. the train job through the command line (``terascale train``, a fresh application each,
   local[2], 2 workers, the hybrid solver), memory and disk mode (``train.memory_budget_mb``)
   interleaved ``job_repeats`` times: from each model's metadata.json every rank's peak RSS and
   shard bytes (``csr_bytes``), seconds per pass (the differences of the history's
   ``elapsed_s``: pass 1, and the median of the later passes), the objective, and whether the
   two modes' weights and intercepts are equal bit for bit.

Targets (issue 20): the same model bit for bit; every rank's peak RSS at least 0.7 × its shard's
bytes below memory mode's; seconds per pass from a warm page cache at most 1.3 × memory mode's;
the cold-cache rate reported against the disk's sequential read rate.

Run alone: ``python -m tests.benchmarks.memory_modes DATASET WORKDIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tests.benchmarks.common import train_cli

MIB = 1 << 20
JOB_SETTINGS = ["spark.master=local[2]", "train.workers=2", "train.l2=1e-6", "train.holdout_period=0",
                "train.early_stop_passes=0", "train.passes=10", "train.tol=1e-12"]


def drop_caches() -> str | None:
    """Write back dirty pages and drop the page cache; None, or why it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror}): needs root"
    return None


def sequential_read_rate(workdir: Path, size: int = 1 << 30, block: int = 8 * MIB) -> dict:
    """MB/s of a plain sequential read of a ``size``-byte file from a cold page cache."""
    path = workdir / "seqread.bin"
    if not path.exists() or path.stat().st_size != size:
        chunk = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            for _ in range(size // block):
                f.write(chunk)
    why = drop_caches()
    if why:
        return {"mb_per_s": None, "why": why}
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        while f.readinto(buf):
            pass
    s = time.perf_counter() - t0
    path.unlink()
    return {"mb_per_s": size / s / 1e6, "seconds": s, "bytes": size}


def _run(csr):
    """What ``solvers.api.train`` hands a solver (the input agreement done)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.catalogue import loss_spec
    from terascale.solvers.objective import DistributedObjective
    from terascale.solvers.params import SolverParams
    from terascale.solvers.run import TrainRun
    from terascale.solvers.setup import AgreeingCommunicator, Inputs
    from terascale.solvers.tracker import PassTracker

    params = SolverParams(solver="online", l2=1e-6, passes=1)
    comm = LocalCommunicator()
    inputs = Inputs(0, csr, None, params.loss)
    inputs.agree(comm)
    solver_comm = AgreeingCommunicator(comm, inputs)
    loss_id = loss_spec(params.loss).id
    return TrainRun(solver_comm, params, inputs, loss_id, DistributedObjective(inputs, solver_comm, loss_id, params.l2),
                    PassTracker(solver_comm, inputs, loss_id, 0))


def _gradient_pass(run) -> float:
    from terascale.solvers.objective import shard_sums

    shard = run.inputs.train
    grad = np.zeros(shard.n_features + 1)
    t0 = time.perf_counter()
    loss, problem = shard_sums(shard, np.zeros(shard.n_features + 1), run.loss_id, grad)
    assert problem is None, problem
    return time.perf_counter() - t0


def _online_pass(run) -> float:
    from terascale.solvers.online import OnlineLearner

    learner = OnlineLearner(run)  # a fresh zero state, not timed
    t0 = time.perf_counter()
    _, _, problem = learner._local_pass(1)
    assert problem is None, problem
    return time.perf_counter() - t0


def pass_rates(dataset_dir: str, workdir: Path, budget_mb: int, repeats: int = 3) -> dict:
    """Part (a) of the module docstring."""
    from terascale.pipeline.dataset import plan_shards, read_shard
    from terascale.pipeline.manifest import read_manifest
    from terascale.pipeline.shard_cache import CacheSpec, ShardCache

    m = read_manifest(dataset_dir)
    parts = plan_shards(dataset_dir, 2, m)[0]
    n_features = 1 << int(m["spec"]["bits"])
    cache = ShardCache(CacheSpec("disk", budget_mb * MIB, cache_dir=str(workdir / "local"), run_id="bench"),
                       0, 0, "w0-a0").open()
    try:
        mem = read_shard(parts, n_features)[0]
        disk = read_shard(parts, n_features, sink_factory=cache.sink_factory())[0]
        runs = {"memory": _run(mem), "disk": _run(disk)}
        shard_bytes = int(mem.nbytes)
        seconds: dict[str, dict[str, list[float]]] = {k: {"gradient": [], "online": []} for k in runs}
        for mode in runs:  # warm: the kernels loaded, the cache files' pages in the page cache
            _gradient_pass(runs[mode])
        for _ in range(repeats):
            for mode, run in runs.items():
                seconds[mode]["gradient"].append(_gradient_pass(run))
                seconds[mode]["online"].append(_online_pass(run))
        why = drop_caches()
        cold = None if why else _gradient_pass(runs["disk"])
        out = {"rows": int(mem.n_rows), "nnz": int(mem.nnz), "shard_bytes": shard_bytes,
               "chunk_rows": int(disk.chunk_rows), "budget_mb": budget_mb, "repeats": repeats, "seconds": seconds}
        for kind in ("gradient", "online"):
            med = {mode: statistics.median(seconds[mode][kind]) for mode in runs}
            out[f"{kind}_warm_ratio_disk_over_memory"] = med["disk"] / med["memory"]
            out[f"{kind}_memory_mb_per_s"] = shard_bytes / med["memory"] / 1e6
            out[f"{kind}_disk_warm_mb_per_s"] = shard_bytes / med["disk"] / 1e6
        out["cold_gradient_pass"] = ({"seconds": cold, "mb_per_s": shard_bytes / cold / 1e6} if cold
                                     else {"seconds": None, "why": why})
        return out
    finally:
        cache.close()



def train_job(dataset_dir: str, model_dir: str, mode: str, budget_mb: int, cache_dir: str) -> dict:
    """One ``terascale train`` run (part b): the figures from its metadata.json."""
    sets = [*JOB_SETTINGS, f"train.data_cache={mode}", f"train.memory_budget_mb={budget_mb}",
            f"train.cache_dir={cache_dir}"]
    meta, wall = train_cli(dataset_dir, model_dir, sets, mode)
    elapsed = [e["elapsed_s"] for e in meta["history"]]
    per_pass = np.diff([0.0, *elapsed])
    ranks = sorted(meta["per_rank"], key=lambda p: p["shard"])
    return {
        "mode": mode, "end_to_end_s": wall, "train_seconds": meta["train_seconds"], "objective": meta["objective"],
        "passes": len(elapsed), "pass_1_s": float(per_pass[0]),
        "later_pass_median_s": float(np.median(per_pass[1:])) if len(per_pass) > 1 else None,
        "per_pass_s": per_pass.tolist(), "phases": [e["phase"] for e in meta["history"]],
        "history": [{k: e.get(k) for k in ("pass", "phase", "objective", "elapsed_s")} for e in meta["history"]],
        "per_rank_peak_rss_bytes": [p["peak_rss_bytes"] for p in ranks],
        "per_rank_csr_bytes": [p["csr_bytes"] for p in ranks],
        "per_rank_read_s": [p["read_s"] for p in ranks],
        "per_rank_data_cache": [p.get("data_cache") for p in ranks],
        "data_cache": meta.get("data_cache"),
        "memory_estimate_bytes": meta["memory_estimate"]["needed_bytes"],
    }


def _same_bits(a: str, b: str) -> bool:
    from terascale.pipeline.modeldir import load_model

    wa, ba, _ = load_model(a)
    wb, bb, _ = load_model(b)
    return bool(np.array_equal(wa.view(np.uint32), wb.view(np.uint32)) and ba == bb)


def measure(dataset_dir: str, workdir: str, budget_mb: int = 64, repeats: int = 3, job_repeats: int = 2) -> dict:
    """Parts (a) and (b) of the module docstring; returns the figures."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    fig: dict = {"dataset": dataset_dir, "budget_mb": budget_mb}
    fig["disk_sequential_read"] = sequential_read_rate(work)
    fig["passes"] = pass_rates(dataset_dir, work, budget_mb, repeats)
    cold = fig["passes"]["cold_gradient_pass"].get("mb_per_s")
    seq = fig["disk_sequential_read"].get("mb_per_s")
    fig["passes"]["cold_over_sequential_read"] = cold / seq if cold and seq else None
    # a pass is compute-bound once the disk keeps up: the cold rate against the warm one too
    fig["passes"]["cold_over_warm"] = cold / fig["passes"]["gradient_disk_warm_mb_per_s"] if cold else None
    jobs: dict[str, list[dict]] = {"memory": [], "disk": []}
    models: dict[str, list[str]] = {"memory": [], "disk": []}
    for i in range(job_repeats):
        for mode in ("memory", "disk"):
            model = str(work / f"model-{mode}-{i}")
            jobs[mode].append(train_job(dataset_dir, model, mode, budget_mb, str(work / "local")))
            models[mode].append(model)
    fig["train_job"] = jobs
    mem, disk = jobs["memory"], jobs["disk"]
    saved = [[m - d for m, d in zip(a["per_rank_peak_rss_bytes"], b["per_rank_peak_rss_bytes"], strict=True)]
             for a, b in zip(mem, disk, strict=True)]
    shard = mem[0]["per_rank_csr_bytes"]
    fig["summary"] = {
        "same_model_bit_for_bit": all(_same_bits(a, b) for a, b in zip(models["memory"], models["disk"], strict=True)),
        "same_objective": all(a["objective"] == b["objective"] for a, b in zip(mem, disk, strict=True)),
        "per_rank_shard_bytes": shard,
        "per_rank_peak_rss_saved_bytes": saved,
        "per_rank_saved_over_shard": [[s / c for s, c in zip(run, shard, strict=True)] for run in saved],
        "rss_target_met": all(s >= 0.7 * c for run in saved for s, c in zip(run, shard, strict=True)),
        "later_pass_s": {mode: statistics.median(r["later_pass_median_s"] for r in runs) for mode, runs in jobs.items()},
        "pass_1_s": {mode: statistics.median(r["pass_1_s"] for r in runs) for mode, runs in jobs.items()},
    }
    s = fig["summary"]
    s["later_pass_ratio_disk_over_memory"] = s["later_pass_s"]["disk"] / s["later_pass_s"]["memory"]
    s["pass_time_target_met"] = s["later_pass_ratio_disk_over_memory"] <= 1.3
    for paths in models.values():
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    return fig


def _print(fig: dict) -> None:
    p, s, seq = fig["passes"], fig["summary"], fig["disk_sequential_read"]
    print(f"shard 0 of 2: {p['rows']} rows, {p['nnz']} nnz, {p['shard_bytes'] / MIB:.0f} MiB; "
          f"blocks of {p['chunk_rows']} rows (budget {p['budget_mb']} MiB)")
    for kind in ("gradient", "online"):
        print(f"{kind} pass: memory {p[f'{kind}_memory_mb_per_s']:.0f} MB/s, disk warm "
              f"{p[f'{kind}_disk_warm_mb_per_s']:.0f} MB/s: disk/memory time {p[f'{kind}_warm_ratio_disk_over_memory']:.2f}")
    cold = p["cold_gradient_pass"]
    print(f"cold gradient pass: {cold.get('mb_per_s') or cold.get('why')} MB/s; disk sequential read "
          f"{seq.get('mb_per_s') or seq.get('why')} MB/s; ratio {p.get('cold_over_sequential_read')}; "
          f"cold / warm {p.get('cold_over_warm')}")
    print(f"train job: same bits {s['same_model_bit_for_bit']}, same objective {s['same_objective']}; peak RSS saved / "
          f"shard bytes per rank {s['per_rank_saved_over_shard']} (target >= 0.7: {s['rss_target_met']}); later passes "
          f"{s['later_pass_s']} s: disk/memory {s['later_pass_ratio_disk_over_memory']:.2f} (target <= 1.3: "
          f"{s['pass_time_target_met']})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.benchmarks.memory_modes DATASET WORKDIR")
    figures = measure(sys.argv[1], sys.argv[2])
    print(json.dumps(figures, indent=2, default=float))
    _print(figures)
