"""What one barrier task of the train job does (runs on an executor; no pyspark import here).

read its shard with pyarrow straight into CSR -> split the held-out rows -> resume from the
newest checkpoint if there is one -> train (the first collective joins the tree, i.e. the task
registers as its shard's survivor when its first pass is done) -> rank 0 writes a checkpoint
after every pass and, at the end, the weights into the model's staging directory. The driver
gets back only small things: history, counts, timings and where the weights are.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from allreduce.lazy import LazyCommunicator
from jobs import checkpoint
from jobs import progress as progress_file
from pipeline import modeldir
from pipeline.dataset import ShardPart, read_csr
from pipeline.groups import load_map
from solvers.api import train
from solvers.params import SolverParams
from solvers.warmup import start_warm_up

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

    def maybe_fail(self, shard: int, attempt: int, pass_no: int) -> None:
        if (shard, attempt, pass_no) == (self.fail_shard, self.fail_attempt, self.fail_pass):
            if self.fail_mode == "kill":
                os._exit(17)  # the process dies abruptly, as a lost executor would
            raise InjectedFailure(f"train.inject: shard {shard} fails at pass {pass_no} of attempt {attempt}")


@dataclass(frozen=True)
class TaskSpec:
    """Everything a train task needs, as plain picklable values."""

    shards: tuple[tuple[ShardPart, ...], ...]
    n_features: int
    params: SolverParams
    holdout_period: int
    checkpoint_dir: str
    checkpoint_interval_s: float
    staging_dir: str
    inject: Inject
    init_weights: str = ""  # a model directory to warm-start from ("" = none)
    groups_path: str = ""  # the dataset's group map, for L-BFGS's coarse correction ("" = none)


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


def run_train_task(ctx, spec: TaskSpec) -> dict:
    t0 = time.perf_counter()
    # load the solver's compiled kernels while pyarrow reads the shard (solvers.warmup)
    warming = start_warm_up(spec.params, spec.holdout_period, bool(spec.groups_path))
    data = read_csr(list(spec.shards[ctx.shard]), spec.n_features)
    read_s = time.perf_counter() - t0
    if warming is not None:
        warming.join()
    warm_wait_s = time.perf_counter() - t0 - read_s  # the warm-up's time beyond the read
    train_data, holdout = data.split_holdout(spec.holdout_period)
    csr_bytes = data.nbytes
    del data  # with held-out rows, train_data and holdout are copies: keep one CSR, not two
    found = _resume(spec.checkpoint_dir, ctx.shard, ctx.num_shards)
    resume = None if found is None else found[1]
    init = None
    if resume is None and spec.init_weights:
        w, b, _ = modeldir.load_model(spec.init_weights)
        init = (w, b)
    groups = load_map(spec.groups_path, spec.n_features) if spec.groups_path else None
    if spec.params.device != "cpu":
        from solvers.scd.gpu import select_device

        select_device(ctx.gpu_address)
    ctx.heartbeat(0)
    comm = LazyCommunicator(ctx.shard, ctx.num_shards, ctx.join)

    last_saved = [time.monotonic()]
    last_progress = [float("-inf")]

    def on_pass_end(state: dict) -> None:
        p = int(state["pass"])
        spec.inject.maybe_fail(ctx.shard, ctx.attempt, p)
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
                checkpoint.save(checkpoint.rank_dir(spec.checkpoint_dir, comm.rank), p, state, keep=2)
                last_saved[0] = time.monotonic()
        elif comm.rank == 0 and due:
            checkpoint.save(spec.checkpoint_dir, p, state)
            last_saved[0] = time.monotonic()
        # the driver's progress display: at most every PROGRESS_EVERY_S (CoCoA rounds can take
        # milliseconds, and on HDFS / S3 every write is a create and a rename), and the last pass
        now = time.monotonic()
        if comm.rank == 0 and (now - last_progress[0] >= PROGRESS_EVERY_S or state.get("stop_reason")):
            progress_file.write_pass(spec.checkpoint_dir, state)
            last_progress[0] = now

    progress = _progress_hook(ctx, spec)
    with comm:
        result = train(train_data, comm, spec.params, holdout=holdout, on_pass_end=on_pass_end,
                       resume=resume, progress=progress, init=init, groups=groups, consume_data=True)
        counts = comm.allreduce_scalars([train_data.n_rows, train_data.nnz,
                                         0 if holdout is None else holdout.n_rows, float(csr_bytes)])
    out = {
        "shard": ctx.shard, "rank": comm.rank, "attempt_id": ctx.attempt_id, "spare": ctx.is_spare,
        "rows": train_data.n_rows, "nnz": train_data.nnz, "holdout_rows": 0 if holdout is None else holdout.n_rows,
        "csr_bytes": csr_bytes, "read_s": read_s, "warm_wait_s": warm_wait_s, "seconds": time.perf_counter() - t0,
        "resumed_from_pass": None if found is None else found[0],
        "peak_rss_bytes": _peak_rss(),
        "numpy_madvise_hugepage": os.environ.get("NUMPY_MADVISE_HUGEPAGE"),  # jobs.session.EXECUTOR_ENV
    }
    if comm.rank == 0:
        modeldir.write_weights(spec.staging_dir, result.weights)
        out.update({
            "history": result.history, "intercept": float(result.intercept), "objective": float(result.objective),
            "stop_reason": result.stop_reason,
            "totals": {"train_rows": int(counts[0]), "train_nnz": int(counts[1]), "holdout_rows": int(counts[2]),
                       "csr_bytes": int(counts[3])},
        })
    return out


def _resume(directory: str, rank: int, size: int) -> tuple[int, dict] | None:
    """The checkpoint to resume from: the shared one rank 0 wrote, or this rank's own at the
    newest pass every rank checkpointed (solvers with per-rank state)."""
    if not directory:
        return None
    return checkpoint.latest(directory) or checkpoint.common_latest(directory, rank, size)


def _peak_rss() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # noqa: BLE001 - not every platform has it
        return 0

