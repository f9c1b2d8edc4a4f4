"""What one barrier task of the train job does (runs on an executor; no pyspark import here).

read its shard with pyarrow straight into CSR, one row group at a time, splitting off the held-out
rows as it goes (by row identity, ``pipeline.dataset.holdout_mask``: the same rows for any number
of workers) -> resume from the
newest checkpoint it can verify, if there is one -> train (the first collective joins the tree,
i.e. the task registers as its shard's survivor when its first pass is done, and agrees with the
other ranks on the resume pass, :mod:`jobs.resume`; all restart from a common pass if they
started from different ones) -> rank 0 writes a checkpoint after every pass (every rank its own
for per-rank solver state) and, at the end, the weights into the model's staging directory. The driver
gets back only small things: history, counts, timings and where the weights are.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from terascale.allreduce.lazy import LazyCommunicator
from terascale.jobs import checkpoint
from terascale.jobs import progress as progress_file
from terascale.jobs.memory_accounting import READ, SOLVER_PHASES, SPLIT, Plan, Sizes, account
from terascale.jobs.memory_probe import MemoryProbe
from terascale.jobs.resume import ResumeAgreement, ResumeRestart
from terascale.pipeline import fsutil, modeldir
from terascale.pipeline.dataset import ShardPart, read_shard
from terascale.pipeline.groups import load_map
from terascale.pipeline.shard_cache import CacheSpec, ShardCache
from terascale.solvers.api import train
from terascale.solvers.catalogue import solver_spec
from terascale.solvers.params import SolverParams
from terascale.solvers.recalibration import recalibrate
from terascale.solvers.state import Handover, check_resume
from terascale.solvers.warmup import start_warm_up

PROGRESS_EVERY_S = 2.0


class InjectedFailure(RuntimeError):
    """Raised by the train.inject.fail_* chaos drill."""


@dataclass(frozen=True)
class Inject:
    """The train.inject.* chaos drills (all off by default)."""

    slow_shard: int = -1
    slow_factor: float = 1.0
    fail_shard: int = -1
    fail_attempt: int = 0
    fail_pass: int = 1
    fail_mode: str = "raise"
    pass_delay_s: float = 0.0
    corrupt_checkpoint: str = ""
    late_shard: int = -1
    late_pass: int = 2
    late_s: float = 0.0

    def maybe_lag(self, shard: int, pass_no: int) -> None:
        """The late-rank drill: ``late_shard`` pauses ``late_s`` after pass ``late_pass``, alive
        (its heartbeats go on) but far behind the other ranks."""
        if (shard, pass_no) == (self.late_shard, self.late_pass) and self.late_s > 0:
            time.sleep(self.late_s)

    def maybe_fail(self, shard: int, attempt: int, pass_no: int, checkpoint_dir: str = "") -> None:
        if (shard, attempt, pass_no) == (self.fail_shard, self.fail_attempt, self.fail_pass):
            if self.corrupt_checkpoint and checkpoint_dir:
                corrupt_newest(checkpoint_dir, self.corrupt_checkpoint, shard)
            if self.fail_mode == "kill":
                os._exit(17)  # the process dies abruptly, as a lost executor would
            raise InjectedFailure(f"train.inject: shard {shard} fails at pass {pass_no} of attempt {attempt}")


def corrupt_newest(directory: str, mode: str, shard: int) -> None:
    """The train.inject.corrupt_checkpoint drill: damage the newest shared checkpoint (with
    per-rank checkpoints: the failing shard's own) as a bad disk or a torn copy would (truncate /
    flip a byte of its .npz, or delete its .npz / manifest)."""
    found = checkpoint.entries(directory, 1 << 30) or checkpoint.entries(checkpoint.rank_dir(directory, shard), 1 << 30)
    if not found:
        return
    e = found[0]
    fs, npz = fsutil.resolve(e.npz)
    if mode in ("truncate", "flip"):
        with fs.open_input_stream(npz) as f:
            blob = f.read()
        blob = blob[: len(blob) // 2] if mode == "truncate" else blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:]
        with fs.open_output_stream(npz) as out:
            out.write(blob)
    else:
        fsutil.delete(e.npz if mode == "drop_npz" else e.manifest)


@dataclass(frozen=True)
class TaskSpec:
    """Everything a train task needs, as plain picklable values."""

    shards: tuple[tuple[ShardPart, ...], ...]
    n_features: int
    params: SolverParams
    holdout_period: int  # held-out rows: 1/holdout_period by row identity, seeded by params.seed (0: none)
    checkpoint_dir: str
    checkpoint_interval_s: float
    staging_dir: str
    inject: Inject
    init_weights: str = ""  # a model directory to warm-start from ("" = none)
    groups_path: str = ""  # the dataset's group map, for L-BFGS's coarse correction ("" = none)
    cache: CacheSpec = CacheSpec()  # where the shard lives: memory, or the local shard cache (disk)
    recalibrate: bool = False  # fit σ(a·m + c) on the held-out rows after training (solvers.recalibration)
    path_rows: int = 0  # N of the regularization path: the rows the data stands for (pipeline.sampling.population_rows)
    holdout_cut: int | None = None  # held-out rows by time instead: time >= holdout_cut (pipeline.time_split)


def _progress_hook(ctx, spec: TaskSpec):
    """Heartbeats during pass 1 (so spares see stragglers and losers stop early), slow drill."""
    slow = spec.inject.slow_shard == ctx.shard and not ctx.is_spare and spec.inject.slow_factor > 1
    last = [time.perf_counter()]

    def progress(pass_no: int, rows_done: int) -> None:
        if pass_no != 1:
            return
        if slow:
            now = time.perf_counter()
            time.sleep((now - last[0]) * (spec.inject.slow_factor - 1))
            last[0] = time.perf_counter()
        ctx.heartbeat(rows_done)

    return progress


def _read(spec: TaskSpec, ctx, cache: ShardCache | None = None):
    """(training rows, held-out rows or None, bytes of the shard as read). The held-out rows are
    split off while the shard is read (``pipeline.dataset.read_shard``), so a rank holds one CSR;
    with a ``cache`` (train.data_cache = disk) into its files, mapped (``pipeline.shard_cache``)."""
    parts = list(spec.shards[ctx.shard])
    factory = None
    if cache is not None:
        cache.check_space(sum(16 * p.rows + 8 * p.nnz_estimate for p in parts))
        factory = cache.sink_factory()
    train_data, holdout = read_shard(parts, spec.n_features, spec.holdout_period, spec.params.seed,
                                     sink_factory=factory, holdout_cut=spec.holdout_cut)
    if holdout is None or train_data.n_rows + holdout.n_rows == 0:
        return train_data, None, train_data.nbytes
    return train_data, holdout, train_data.nbytes + holdout.nbytes


def run_train_task(ctx, spec: TaskSpec) -> dict:
    """The task (module docstring); with train.data_cache = disk inside its shard cache directory,
    which it removes when it ends, failed or not (and the run's earlier attempts' on the way in)."""
    if spec.cache.mode != "disk":
        return _train(ctx, spec, None)
    cache = ShardCache(spec.cache, ctx.shard, ctx.attempt, ctx.attempt_id).open()
    try:
        return _train(ctx, spec, cache)
    finally:
        cache.close()


def _train(ctx, spec: TaskSpec, cache: ShardCache | None) -> dict:
    t0 = time.perf_counter()
    probe = MemoryProbe()  # the process baseline: before the warm-up and the shard
    # load the solver's compiled kernels while pyarrow reads the shard (solvers.warmup)
    warming = start_warm_up(spec.params, 10 if spec.holdout_cut is not None else spec.holdout_period,
                            bool(spec.groups_path))
    train_data, holdout, csr_bytes = _read(spec, ctx, cache)
    read_s = time.perf_counter() - t0
    if warming is not None:
        warming.join()
    warm_wait_s = time.perf_counter() - t0 - read_s  # the warm-up's time beyond the read
    shard_sizes = _shard_sizes(train_data, holdout, csr_bytes)
    probe.end_phase("read")
    found = _resume(spec, ctx.shard, ctx.attempt)
    resume = None if found is None else found[1]
    resumed_from = None if found is None else found[0].pass_no
    init = None
    if resume is None and spec.init_weights:
        w, b, _ = modeldir.load_model(spec.init_weights)
        init = (w, b)
    groups = load_map(spec.groups_path, spec.n_features) if spec.groups_path else None
    if spec.params.device != "cpu":
        from terascale.solvers.scd.gpu import select_device

        select_device(ctx.gpu_address)
    ctx.heartbeat(0)
    lazy = LazyCommunicator(ctx.shard, ctx.num_shards, ctx.join)
    # the resume agreement rides the first collective (jobs.resume)
    comm = ResumeAgreement(lazy, [] if found is None else found[2]) if spec.checkpoint_dir else lazy

    last_saved = [time.monotonic()]
    last_progress = [float("-inf")]

    def on_pass_end(state: dict) -> None:
        p = int(state["pass"])
        spec.inject.maybe_fail(ctx.shard, ctx.attempt, p, spec.checkpoint_dir)
        spec.inject.maybe_lag(ctx.shard, p)
        save_checkpoint(p, state)
        if spec.inject.pass_delay_s:
            time.sleep(spec.inject.pass_delay_s)

    def save_checkpoint(p: int, state: dict) -> None:
        if not spec.checkpoint_dir:
            return
        due = time.monotonic() - last_saved[0] >= spec.checkpoint_interval_s
        if state.get("per_rank"):
            # every rank saves its own state, on one decision, so a common pass always exists
            if comm.allreduce_scalars([1.0 if due else 0.0])[0] > 0:
                checkpoint.save(checkpoint.rank_dir(spec.checkpoint_dir, comm.rank), p, state,
                                attempt=ctx.attempt, root=spec.checkpoint_dir)
                last_saved[0] = time.monotonic()
        elif comm.rank == 0 and due:
            checkpoint.save(spec.checkpoint_dir, p, state, attempt=ctx.attempt)
            last_saved[0] = time.monotonic()
        # the driver's progress display: at most every PROGRESS_EVERY_S (CoCoA rounds can take
        # milliseconds, and on HDFS / S3 every write is a create and a rename), and the last pass
        now = time.monotonic()
        if comm.rank == 0 and (now - last_progress[0] >= PROGRESS_EVERY_S or state.get("stop_reason")):
            progress_file.write_pass(spec.checkpoint_dir, state, tag=f"a{ctx.attempt}")
            last_progress[0] = now

    progress = _progress_hook(ctx, spec)

    def fit(resume_state):
        return train(train_data, comm, spec.params, holdout=holdout, on_pass_end=on_pass_end,
                     resume=resume_state, progress=progress, init=init, groups=groups, consume_data=True,
                     path_rows=spec.path_rows or sum(part.rows for shard in spec.shards for part in shard))

    with comm:
        try:
            result = fit(resume)
        except ResumeRestart as r:
            # ranks started from different passes: all restart from the one every rank holds,
            # on fresh data (L-BFGS renumbers the consumed shard in place)
            del train_data, holdout, resume
            resume = _load_pass(spec, ctx.shard, ctx.attempt, r.pass_no)
            resumed_from = r.pass_no
            train_data, holdout, _ = _read(spec, ctx, cache)
            result = fit(resume)
        counts = comm.allreduce_scalars([train_data.n_rows, train_data.nnz,
                                         0 if holdout is None else holdout.n_rows, float(csr_bytes)])
        recal = recalibrate(comm, holdout, result.weights, result.intercept) if spec.recalibrate else None
    out = {
        "shard": ctx.shard, "rank": comm.rank, "attempt_id": ctx.attempt_id, "spare": ctx.is_spare,
        "rows": train_data.n_rows, "nnz": train_data.nnz, "holdout_rows": 0 if holdout is None else holdout.n_rows,
        "csr_bytes": csr_bytes, "read_s": read_s, "warm_wait_s": warm_wait_s, "seconds": time.perf_counter() - t0,
        "resumed_from_pass": resumed_from,
        "numpy_madvise_hugepage": os.environ.get("NUMPY_MADVISE_HUGEPAGE"),  # jobs.session.EXECUTOR_ENV
        "data_cache": {"mode": spec.cache.mode, **({} if cache is None else {
            "chunk_rows": int(train_data.chunk_rows), "stale_removed": len(cache.stale_removed)})},
    }
    if comm.rank == 0:
        weights = modeldir.write_weights(spec.staging_dir, result.weights)
        out.update({
            "weights": weights,
            "history": result.history, "intercept": float(result.intercept), "objective": float(result.objective),
            "stop_reason": result.stop_reason, "regularization": result.path,
            "recalibration": None if recal is None else recal.to_json(),
            "totals": {"train_rows": int(counts[0]), "train_nnz": int(counts[1]), "holdout_rows": int(counts[2]),
                       "csr_bytes": int(counts[3])},
        })
    out["memory"] = _memory(probe, spec, ctx, shard_sizes, result.history)
    out["peak_rss_bytes"] = out["memory"]["peak_rss_bytes"]
    return out


def _shard_sizes(train_data, holdout, csr_bytes: int) -> dict:
    """The rank's shard as read (both halves of its held-out split), for the memory accounting."""
    parts = [train_data] if holdout is None else [train_data, holdout]
    return {"rows": sum(p.n_rows for p in parts), "nnz": sum(p.nnz for p in parts),
            "nnz_values": sum(p.values.size for p in parts), "csr_bytes": int(csr_bytes), "holdout": holdout is not None}


def _memory(probe: MemoryProbe, spec: TaskSpec, ctx, shard: dict, history: list[dict]) -> dict:
    """per_rank[i]["memory"]: the measured peak, baseline and phase peaks ("read": kernels' warm-up,
    the read and the split; "solver": the rest of the task) beside the shared accounting
    (``jobs.memory_accounting``) over this rank's real sizes and its measured baseline. The active
    features: the L-BFGS phase's agreed count, every feature with a warm start, else a bound."""
    probe.end_phase("solver")
    peak = probe.peak
    D = spec.n_features
    agreed = next((h["active_features"] for h in history if "active_features" in h), None)
    if spec.init_weights:
        d, source = D, "warm start: every feature"
    elif agreed is not None:
        d, source = int(agreed), "the L-BFGS phase's active set"
    else:
        d, source = min(D, shard["nnz"]), "bound: min(2^bits, the shard's non-zeros)"
    streamed = spec.cache.budget_bytes if spec.cache.mode == "disk" else 0  # the blocks a pass holds
    plan = Plan.of(spec.params, shard["holdout"], ctx.num_shards, ctx.net.chunk_bytes, streamed)
    acc = account(plan, Sizes(D, shard["rows"], shard["nnz"], shard["nnz_values"], d, csr=shard["csr_bytes"]),
                  probe.baseline)
    totals = acc.phase_totals()
    groups = {"read": [p for p in (READ, SPLIT) if p in acc.phases],
              "solver": [SOLVER_PHASES[p] for p in solver_spec(spec.params.solver).phases]}
    # the breakdown at the accounting's phase of the measured peak: what it leaves out is unaccounted
    measured = max(probe.phase_peaks, key=probe.phase_peaks.get)
    at = max(groups[measured], key=totals.get)
    cats, terms = acc.categories(at), acc.terms_at(at)
    return {
        "peak_rss_bytes": peak, "baseline_rss_bytes": probe.baseline, "phase_peaks": dict(probe.phase_peaks),
        "hwm_reset": probe.hwm_reset, "breakdown_phase": at, "breakdown": cats, "terms": terms,
        "unaccounted_bytes": peak - sum(cats.values()),
        "phase_estimates": {k: max(totals[p] for p in v) for k, v in groups.items()},
        "peak_phase_estimated": acc.peak_phase, "active_features": d, "active_features_from": source,
    }


def _where(spec: TaskSpec, rank: int) -> str:
    """The directory of this rank's checkpoints: the shared one rank 0 writes if it holds any,
    else this rank's own (solvers with per-rank state)."""
    shared = spec.checkpoint_dir
    if any(True for _ in checkpoint.entries(shared, 1 << 30)):
        return shared
    return checkpoint.rank_dir(shared, rank)


def _fits(spec: TaskSpec, entry, state: dict) -> dict:
    try:
        (solver_spec(spec.params.solver).check_resume or check_resume)(state, spec.params, spec.n_features)
    except ValueError as e:
        raise checkpoint.CheckpointError(f"checkpoint {entry.manifest} does not fit this run: {e}") from None
    return state


def _resume(spec: TaskSpec, rank: int, attempt: int):
    """(entry, state, passes held) of the newest verified checkpoint this rank may resume from
    (jobs.checkpoint.newest), or None; raises CheckpointError if it does not fit the run."""
    if not spec.checkpoint_dir:
        return None
    found = checkpoint.newest(_where(spec, rank), attempt, root=spec.checkpoint_dir)
    if found is None:
        return None
    entry, state, held = found
    return entry, Handover(_fits(spec, entry, state)), held  # the rank's own: the solver takes its arrays


def _load_pass(spec: TaskSpec, rank: int, attempt: int, pass_no: int) -> dict:
    """The verified state of pass ``pass_no`` that the ranks agreed on (CheckpointError if gone)."""
    entry = checkpoint.find(_where(spec, rank), attempt, pass_no, root=spec.checkpoint_dir)
    try:
        return Handover(_fits(spec, entry, checkpoint.load(entry)))
    except checkpoint.CorruptCheckpoint as e:
        raise checkpoint.CheckpointError(f"the agreed resume pass {pass_no} is unusable on rank {rank}: {e}") from None
