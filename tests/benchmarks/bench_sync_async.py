"""The sync-versus-async study (docs/pages/explanation/sync-vs-async.md): hardware efficiency (seconds per epoch),
statistical efficiency (epochs to within 1% of the optimal objective) and their product, the
time to within 1%, for terascale's learners on the benchmark data (Ma, Rusu & Torres 2018,
"SGD on highly-parallel architectures", Sec. 2 and 6: the paper's three performance axes).

**The measure.** Every learner is scored after every epoch by one function, :func:`objective_of`:
the catalogue's f(β, b) = (1/Σw)·Σ wᵢ·ℓ(yᵢ, xᵢ·β + b) + (λ/2)·‖β‖² (logistic loss, λ = 1e-6,
b unpenalized) on the training rows, from ``solvers.predict`` (``decision_function``,
``loss_terms``, ``objective``). The optimum f* is the lowest of an L-BFGS reference run to a
tight tolerance (``ref_passes`` iterations, tol 1e-12) and every value any learner reached;
"within 1%" means f ≤ 1.01·f*. As in the paper, the time to evaluate the objective is not
counted: each learner's clock (:class:`Clock`) stops while it is scored, and a learner's time
is its own from the call that starts it (the data already in memory; numba kernels compiled by
a warm-up run on a few rows). The held-out log loss (the dataset's last rows, the same for every
size, never trained on) is recorded beside f, untimed.

**Learners** (:func:`learners`; an epoch is one pass over the data for the online learners and
the mini-batch baseline, one iteration for L-BFGS, one round for CoCoA):

* ``online``: the online AdaGrad pass (``train.solver = online``), 1 thread, 1 rank: Hogwild
  with one thread = synchronous averaging with K = 1.
* ``hogwild-T2``: the same with ``train.threads = 2`` (lock-free threads on shared weights).
* ``hogwild-T2-hot``: the same on data handed over (``consume_data``), as the train job runs it:
  each thread then updates its own replicas of the hot features (``solvers.hot``), merged after
  every pass; likewise ``hybrid-T2-hot`` for ``hybrid-T2``.
* ``avg-K2``: the online solver on K = 2 ranks (real TreeNodes on 127.0.0.1 in one process, one
  thread each): per-coordinate weighted averaging (Eq. 2 of the terascale paper) after each pass.
* ``minibatch-T2-b<b>``: the synchronous mini-batch baseline (:func:`minibatch_epochs`): T = 2
  threads, each with its own copy of the state table, each runs the online kernel over the next
  b rows of its block, then the copies are averaged per coordinate weighted by G (as
  ``solvers.averaging`` does across ranks) and the next b rows start from the average.
* ``lbfgs`` / ``lbfgs-T2``: L-BFGS from zero, 1 and 2 threads (the gradient pass split into
  fixed row blocks: the synchronous parallel batch method).
* ``hybrid`` / ``hybrid-T2`` / ``hybrid-K2``: one online pass (Hogwild with T2; averaged
  across the 2 ranks with K2), then L-BFGS.
* ``cocoa`` / ``cocoa-T2``: CoCoA with K = 1 (SDCA), its local solver on 1 and 2 threads.

**Timing.** The machine is shared: the learners run interleaved, ``repeats`` times, the order
rotated every repeat; the figures are medians over repeats.

Run: ``python -m tests.benchmarks.bench_sync_async [--rows 500000] [--repeats 2] [--smoke]``
(``make bench`` / ``python -m tests.benchmarks sync_async`` run the defaults). Writes
``bench-results/sync_async.json`` (when run alone; the bench runner writes it otherwise),
``bench-results/sync_async.png`` (objective gap against seconds and against epochs) and
``bench-results/sync_async.md`` (the doc's table); ``--out NAME`` names them. ``--plot-from
a.json,b.json`` merges the sizes of earlier runs into one table and one plot without running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.api import SolverParams, train
from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.online import OK, G, W, new_state, online_pass
from terascale.solvers.predict import decision_function, loss_terms, objective
from terascale.solvers.shard import Shard
from terascale.solvers.threads import split_rows
from tests.benchmarks.common import RESULTS, write_result

LAMBDA = 1e-6
TOLERANCE = 0.01  # "within 1% of the optimal loss"
#: the featurized click log to study; '' = the benchmark's own (bench_memory's 2M rows at 2^22,
#: generated and featurized under bench-results/data on first use)
DATASET = os.environ.get("TERASCALE_BENCH_DATASET", "")
NAME = "sync_async"


# ---------------------------------------------------------------------------------------------
# The one measure


def objective_of(data: CSRData, weights: np.ndarray, intercept: float, l2: float = LAMBDA) -> float:
    """f(β, b) of the catalogue (logistic loss) on ``data``: every learner is scored by this."""
    w = np.asarray(weights, dtype=np.float64)
    m = decision_function(data, w, float(intercept))
    loss_sum, weight_sum = loss_terms(m, data.labels, data.weights, "logistic")
    return objective(loss_sum, weight_sum, w, l2)


def mean_logloss(data: CSRData, weights: np.ndarray, intercept: float) -> float:
    """(1/Σw)·Σ wᵢ·ℓ(yᵢ, mᵢ) on ``data`` (the held-out log loss)."""
    return objective_of(data, weights, intercept, 0.0)


def first_within(objectives: list[float], f_star: float, tol: float = TOLERANCE) -> int | None:
    """The first epoch (1-based) whose objective is ≤ (1 + tol)·f*, or None."""
    bound = (1.0 + tol) * f_star
    return next((i + 1 for i, f in enumerate(objectives) if f <= bound), None)


class Clock:
    """A learner's clock: wall time since :meth:`start` minus the time spent in :meth:`paused`
    blocks (scoring)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.off = 0.0

    def start(self) -> None:
        self.t0, self.off = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.off

    def paused(self, fn: Callable[[], Any]) -> Any:
        a = time.perf_counter()
        try:
            return fn()
        finally:
            self.off += time.perf_counter() - a


@dataclass
class Trajectory:
    """Per epoch: seconds on the learner's clock at its end, f, held-out log loss, extra counts."""

    seconds: list[float] = field(default_factory=list)
    objective: list[float] = field(default_factory=list)
    holdout_loss: list[float] = field(default_factory=list)
    data_passes: list[float] = field(default_factory=list)  # passes over the data (cumulative)

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "objective": self.objective, "holdout_loss": self.holdout_loss,
                "data_passes": self.data_passes}


class Recorder:
    """Scores the weights after every epoch with the clock paused."""

    def __init__(self, data: CSRData, holdout: CSRData | None, clock: Clock):
        self.data, self.holdout, self.clock = data, holdout, clock
        self.traj = Trajectory()

    def __call__(self, weights: np.ndarray, intercept: float, data_passes: float) -> None:
        t = self.clock.now()

        def score() -> None:
            self.traj.seconds.append(t)
            self.traj.objective.append(objective_of(self.data, weights, intercept))
            self.traj.holdout_loss.append(
                mean_logloss(self.holdout, weights, intercept) if self.holdout is not None and self.holdout.n_rows
                else float("nan"))
            self.traj.data_passes.append(float(data_passes))

        self.clock.paused(score)


# ---------------------------------------------------------------------------------------------
# The synchronous mini-batch baseline


def minibatch_epochs(data: CSRData, threads: int, batch_rows: int, epochs: int,
                 on_epoch: Callable[[np.ndarray, float], None] | None = None,
                 learning_rate: float = 0.5, invariant: bool = True,
                 weighting: str = "G") -> np.ndarray:
    """``epochs`` epochs of the synchronous mini-batch baseline; returns the final state table
    (``solvers.kernels.online`` layout, thread 0's copy) and calls ``on_epoch(weights, intercept)``
    after every epoch.

    The rows are cut into ``threads`` contiguous blocks (``solvers.threads.split_rows``, the
    Hogwild pass's cuts). Thread i keeps its own state table (w, G, s) and its own totals
    [t, N]. A round: every thread runs ``online_pass`` over the next ``batch_rows`` rows of
    its block (in parallel: the kernel releases the GIL), then the copies are averaged over
    the features those rows touched and the intercept: ``weighting = "G"``: w̄ = Σᵢ Gᵢ·wᵢ / Σᵢ Gᵢ
    (0 where Σ G = 0) and Ḡ = Σᵢ Gᵢ / T, float32, summed in thread order (the formula of
    ``solvers.averaging``); ``"plain"``: w̄ = mean wᵢ, Ḡ = mean Gᵢ. A feature no row of the
    round touched has the same w and G in every copy, which both averages leave as they are.
    The normalizers s stay per thread (a function of each thread's rows, as per rank).
    Totals follow the ranks' averaging (``solvers.online``): each thread starts the epoch from
    the epoch's starting totals and adds its own rows' increments; after the epoch the totals
    are the threads' mean (summed in thread order), so with ``batch_rows`` ≥ a block every
    epoch is that of the online solver on T ranks holding the blocks, bit for bit.

    With ``threads = 1`` there is nothing to average: ``batch_rows`` ≥ the rows gives one
    plain ``online_pass`` call per epoch, bit for bit."""
    if threads < 1 or batch_rows < 1:
        raise ValueError(f"threads = {threads}, batch_rows = {batch_rows}: both must be >= 1")
    if weighting not in ("G", "plain"):
        raise ValueError(f"weighting = {weighting!r}: must be 'G' or 'plain'")
    s = Shard.from_csr(data)
    d = s.n_features
    loss_id = loss_spec("logistic").id
    order = np.zeros(0, dtype=np.int64)
    states = [new_state(d) for _ in range(threads)]
    totals = np.zeros(2, dtype=np.float64)
    cuts = split_rows(s.indptr, threads)
    marks = np.zeros(d, dtype=bool)
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None

    def run(i: int, a: int, b: int, tot: np.ndarray) -> None:
        _, _, status, row = online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, order,
                                        states[i], tot, loss_id, learning_rate, invariant, a, b, 0.0, 0.0)
        if status != OK:
            raise FloatingPointError(f"mini-batch baseline diverged at row {row} (thread {i})")

    try:
        for _ in range(epochs):
            if threads == 1:
                for a in range(0, s.n_rows, batch_rows):
                    run(0, a, min(a + batch_rows, s.n_rows), totals)
            else:
                mine = [totals.copy() for _ in range(threads)]
                pos = cuts[:-1].copy()
                while (pos < cuts[1:]).any():
                    ends = np.minimum(pos + batch_rows, cuts[1:])
                    futures = [pool.submit(run, i, int(pos[i]), int(ends[i]), mine[i])
                               for i in range(threads) if ends[i] > pos[i]]
                    for f in futures:
                        f.result()
                    _average(states, s, pos, ends, marks, weighting)
                    pos = ends
                totals[:] = mine[0]
                for t in mine[1:]:
                    totals += t
                totals /= threads
            if on_epoch is not None:
                table = states[0]
                on_epoch(table[:-1, W].astype(np.float64), float(table[-1, W]))
    finally:
        if pool is not None:
            pool.shutdown()
    return states[0]


def _average(states: list[np.ndarray], s: Shard, pos: np.ndarray, ends: np.ndarray, marks: np.ndarray,
             weighting: str) -> None:
    """Average the copies over the features rows pos[i]..ends[i]-1 touched, and the intercept."""
    for a, b in zip(pos, ends, strict=True):
        marks[s.indices[s.indptr[a] : s.indptr[b]]] = True
    ids = np.flatnonzero(marks)
    marks[ids] = False
    rows = np.append(ids, s.n_features)
    ws = [t[rows, W] for t in states]
    gs = [t[rows, G] for t in states]
    k = np.float32(len(states))
    if weighting == "G":
        num, den = gs[0] * ws[0], gs[0].copy()
        for w, g in zip(ws[1:], gs[1:], strict=True):
            num += g * w
            den += g
        safe = np.where(den > 0, den, np.float32(1))
        w_bar = np.where(den > 0, num / safe, np.float32(0)).astype(np.float32)
        g_bar = den / k
    else:
        w_bar, g_bar = ws[0].copy(), gs[0].copy()
        for w, g in zip(ws[1:], gs[1:], strict=True):
            w_bar += w
            g_bar += g
        w_bar /= k
        g_bar /= k
    for t in states:
        t[rows, W] = w_bar
        t[rows, G] = g_bar


# ---------------------------------------------------------------------------------------------
# Learners


@dataclass(frozen=True)
class Learner:
    """One configuration of the study. ``kind``: "solver" (``solvers.api.train`` on one rank),
    "ranks" (the same on ``ranks`` TreeNodes) or "minibatch" (:func:`minibatch_epochs`)."""

    name: str
    kind: str
    epochs: int
    params: dict = field(default_factory=dict)  # SolverParams fields (kind solver / ranks)
    ranks: int = 1
    threads: int = 1
    batch_rows: int = 0
    family: str = ""  # async (Hogwild), sync (averaging / mini-batch / batch), dual
    handed_over: bool = False  # train on a copy handed over (consume_data), as the train job does

    def solver_params(self, epochs: int) -> SolverParams:
        return SolverParams(l2=LAMBDA, passes=epochs, tol=1e-12, early_stop_passes=0, threads=self.threads,
                            **self.params)


def learners(epochs: int = 12, lbfgs_epochs: int = 25, cocoa_epochs: int = 15,
             batch_rows: tuple[int, ...] = (1000, 10000)) -> list[Learner]:
    """The study's learners (see the module docstring)."""
    out = [
        Learner("online", "solver", epochs, {"solver": "online"}, family="async"),
        Learner("hogwild-T2", "solver", epochs, {"solver": "online"}, threads=2, family="async"),
        Learner("hogwild-T2-hot", "solver", epochs, {"solver": "online"}, threads=2, family="async",
                handed_over=True),
        Learner("avg-K2", "ranks", epochs, {"solver": "online"}, ranks=2, family="sync"),
    ]
    out += [Learner(f"minibatch-T2-b{b}", "minibatch", epochs, threads=2, batch_rows=b, family="sync")
            for b in batch_rows]
    out += [
        Learner("lbfgs", "solver", lbfgs_epochs, {"solver": "lbfgs"}, family="sync"),
        Learner("lbfgs-T2", "solver", lbfgs_epochs, {"solver": "lbfgs"}, threads=2, family="sync"),
        Learner("hybrid", "solver", lbfgs_epochs, {"solver": "hybrid", "online_passes": 1}, family="sync"),
        Learner("hybrid-T2", "solver", lbfgs_epochs, {"solver": "hybrid", "online_passes": 1}, threads=2,
                family="sync"),
        Learner("hybrid-T2-hot", "solver", lbfgs_epochs, {"solver": "hybrid", "online_passes": 1}, threads=2,
                family="sync", handed_over=True),
        Learner("hybrid-K2", "ranks", lbfgs_epochs, {"solver": "hybrid", "online_passes": 1}, ranks=2,
                family="sync"),
        Learner("cocoa", "solver", cocoa_epochs, {"solver": "cocoa"}, family="dual"),
        Learner("cocoa-T2", "solver", cocoa_epochs, {"solver": "cocoa"}, threads=2, family="dual"),
    ]
    return out


def _passes_of(state: dict, learner: Learner) -> float:
    """Passes over the data an epoch cost: 1 online pass; an L-BFGS iteration's function
    evaluations (the history's ``evaluations``); a CoCoA round's local epochs + 1 (its gap pass)."""
    solver = learner.params.get("solver")
    if solver == "cocoa":
        return float(learner.params.get("local_epochs", 1) + 1)
    entry = state["history"][-1] if state.get("history") else {}
    if entry.get("phase") == "lbfgs":
        return float(entry.get("evaluations") or 1)
    return 1.0


def _weights_of(state: dict, learner: Learner) -> tuple[np.ndarray, float]:
    if learner.params.get("solver") == "cocoa":  # the dual's shared vector: β and the bias coefficient
        shared = np.asarray(state["shared"], dtype=np.float64)
        return shared[:-1], float(shared[-1]) * float(learner.params.get("intercept_scale", 1.0))
    return np.asarray(state["weights"], dtype=np.float64), float(state["intercept"])


def run_learner(learner: Learner, data: CSRData, holdout: CSRData | None, epochs: int | None = None) -> Trajectory:
    """Train ``learner`` for its epochs (or ``epochs``) and score every epoch (untimed)."""
    epochs = learner.epochs if epochs is None else epochs
    clock = Clock()
    rec = Recorder(data, holdout, clock)
    passes = [0.0]

    def on_state(state: dict) -> None:
        passes[0] += _passes_of(state, learner)
        w, b = _weights_of(state, learner)
        rec(w, b, passes[0])

    if learner.kind == "solver":
        mine = data.take_rows(np.ones(data.n_rows, dtype=bool)) if learner.handed_over else data  # a copy
        clock.start()
        train(mine, LocalCommunicator(), learner.solver_params(epochs), on_pass_end=on_state,
              consume_data=learner.handed_over)
    elif learner.kind == "minibatch":
        clock.start()
        minibatch_epochs(data, learner.threads, learner.batch_rows, epochs,
                         on_epoch=lambda w, b: (passes.__setitem__(0, passes[0] + 1.0), rec(w, b, passes[0])),
                         learning_rate=float(learner.params.get("learning_rate", 0.5)))
    elif learner.kind == "ranks":
        _run_ranks(learner, data, epochs, clock, on_state)
    else:
        raise ValueError(f"learner {learner.name}: unknown kind {learner.kind!r}")
    return rec.traj


def shards_of(data: CSRData, k: int) -> list[CSRData]:
    """``k`` contiguous row blocks of about equal work (the Hogwild pass's cuts)."""
    cuts = split_rows(np.asarray(data.indptr, dtype=np.int64), k)
    out = []
    for i in range(k):
        mask = np.zeros(data.n_rows, dtype=bool)
        mask[cuts[i] : cuts[i + 1]] = True
        out.append(data.take_rows(mask))
    return out


def _run_ranks(learner: Learner, data: CSRData, epochs: int, clock: Clock, on_state) -> None:
    """K TreeNodes on 127.0.0.1 in threads; rank 0 scores while every rank waits at a barrier."""
    from tests.allreduce.harness import run_tree

    k = learner.ranks
    shards = shards_of(data, k)
    params = learner.solver_params(epochs)
    barrier = threading.Barrier(k)
    started = threading.Barrier(k)
    slow = {"handshake_timeout_s": 60.0, "io_timeout_s": 900.0, "startup_timeout_s": 120.0}

    def body(node):
        started.wait()
        if node.rank == 0:
            clock.start()

        def cb(state: dict) -> None:
            if node.rank == 0:
                on_state(state)
            barrier.wait()

        return train(shards[node.rank], node, params, on_pass_end=cb)

    run_tree(k, body, server_kwargs=slow, node_kwargs={"chunk_bytes": 1 << 20, "connect_timeout_s": 60.0, **slow},
             timeout=3600.0)


# ---------------------------------------------------------------------------------------------
# The study


def summarize(traj: Trajectory, f_star: float, tol: float = TOLERANCE) -> dict:
    """Seconds per epoch (mean over the epochs run), epochs and seconds to within ``tol``."""
    n = len(traj.seconds)
    e = first_within(traj.objective, f_star, tol)
    return {
        "epochs_run": n,
        "seconds_per_epoch": traj.seconds[-1] / n if n else float("nan"),
        "epochs_to_target": e,
        "seconds_to_target": traj.seconds[e - 1] if e else None,
        "data_passes_to_target": traj.data_passes[e - 1] if e else None,
        "final_gap": traj.objective[-1] / f_star - 1.0 if n else float("nan"),
        "final_holdout_loss": traj.holdout_loss[-1] if n else float("nan"),
    }


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if len(vals) == len(values) and vals else None


def reference_optimum(data: CSRData, passes: int) -> dict:
    """f* from L-BFGS to a tight tolerance (1 thread, ``passes`` iterations at most)."""
    t = time.perf_counter()
    res = train(data, LocalCommunicator(), SolverParams(solver="lbfgs", l2=LAMBDA, passes=passes, tol=1e-12,
                                                        early_stop_passes=0))
    return {"objective": objective_of(data, res.weights, res.intercept), "passes": res.passes,
            "stop_reason": res.stop_reason, "seconds": time.perf_counter() - t}


def study(data: CSRData, holdout: CSRData | None, chosen: list[Learner], repeats: int = 1,
          ref_passes: int = 100, log: Callable[[str], None] = print) -> dict:
    """Run every learner ``repeats`` times (interleaved, order rotated), find f*, summarize."""
    ref = reference_optimum(data, ref_passes)
    log(f"   reference L-BFGS: f = {ref['objective']:.8f} after {ref['passes']} passes ({ref['seconds']:.1f} s)")
    runs: dict[str, list[Trajectory]] = {ln.name: [] for ln in chosen}
    for r in range(repeats):
        shift = r % len(chosen)
        for ln in chosen[shift:] + chosen[:shift]:
            traj = run_learner(ln, data, holdout)
            runs[ln.name].append(traj)
            log(f"   repeat {r + 1} {ln.name:>20}: {traj.seconds[-1]:7.2f} s, {len(traj.seconds)} epochs, "
                f"f = {traj.objective[-1]:.6f}")
    lowest = min(min(t.objective) for ts in runs.values() for t in ts)
    f_star = min(ref["objective"], lowest)
    table = {}
    for ln in chosen:
        per = [summarize(t, f_star) for t in runs[ln.name]]
        row = {
            "family": ln.family, "threads": ln.threads, "ranks": ln.ranks, "batch_rows": ln.batch_rows,
            "epochs_run": per[0]["epochs_run"],
            "seconds_per_epoch": _median([p["seconds_per_epoch"] for p in per]),
            "epochs_to_target": _median([p["epochs_to_target"] for p in per]),
            "seconds_to_target": _median([p["seconds_to_target"] for p in per]),
            "data_passes_to_target": _median([p["data_passes_to_target"] for p in per]),
            "reached": [p["epochs_to_target"] is not None for p in per],
            "final_gap": _median([p["final_gap"] for p in per]),
            "final_holdout_loss": _median([p["final_holdout_loss"] for p in per]),
            "repeats": per,
            "trajectories": [t.to_json() for t in runs[ln.name]],
        }
        table[ln.name] = row
    return {"f_star": f_star, "f_star_source": "reference" if ref["objective"] <= lowest else "a learner",
            "reference": ref, "tolerance": TOLERANCE, "target": (1.0 + TOLERANCE) * f_star,
            "n_rows": data.n_rows, "nnz": data.nnz, "n_features": data.n_features,
            "holdout_rows": holdout.n_rows if holdout is not None else 0, "repeats": repeats, "learners": table}


# ---------------------------------------------------------------------------------------------
# Data, plot, entry point


def load_rows(dataset: Path, rows: int, holdout_rows: int) -> tuple[CSRData, CSRData]:
    """The first ``rows`` rows of the featurized dataset (training) and its last ``holdout_rows``
    rows (held out: the same rows for every size; training stops before them)."""
    from terascale.pipeline.dataset import read_dataset

    csr, _ = read_dataset(str(dataset))
    held = min(holdout_rows, csr.n_rows)
    rows = min(rows, csr.n_rows - held)
    head = np.zeros(csr.n_rows, dtype=bool)
    head[:rows] = True
    tail = np.zeros(csr.n_rows, dtype=bool)
    tail[csr.n_rows - held :] = True
    return csr.take_rows(head), csr.take_rows(tail)


def smoke_data(rows: int = 3000, d: int = 200, seed: int = 0) -> tuple[CSRData, CSRData]:
    """A small generated problem: sparse binary rows, labels from a planted logistic model."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    n = rows + rows // 4
    x = sp.random(n, d, density=0.05, random_state=rng, format="csr", data_rvs=lambda k: np.ones(k))
    beta = rng.normal(0.0, 1.0, d)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ beta - 1.0)))).astype(np.float32)
    data = CSRData.from_scipy(x, y, n_features=d)
    head = np.arange(n) < rows
    return data.take_rows(head), data.take_rows(~head)


def warm_up(chosen: list[Learner], data: CSRData) -> None:
    """Compile the kernels (numba, cached) on a few rows, untimed."""
    mask = np.zeros(data.n_rows, dtype=bool)
    mask[: min(2000, data.n_rows)] = True
    small = data.take_rows(mask)
    for ln in chosen:
        run_learner(ln, small, None, epochs=2)


def plot(result: dict, path: Path) -> Path:
    """Gap (f − f*)/f* against seconds and against epochs, log scale, one row per data size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.6 * len(sizes)), squeeze=False)
    styles = {"async": "-", "sync": "--", "dual": ":"}
    names = list(dict.fromkeys(n for res in sizes.values() for n in res["learners"]))  # one colour per learner
    for row, (size, res) in zip(axes, sizes.items(), strict=True):
        f_star = res["f_star"]
        for name, ln in res["learners"].items():
            traj = ln["trajectories"][0]
            gap = [max(f / f_star - 1.0, 1e-7) for f in traj["objective"]]
            kw = {"label": name, "linestyle": styles.get(ln["family"], "-"), "color": plt.get_cmap("tab20")(names.index(name) % 20),
                  "marker": ".", "markersize": 3, "linewidth": 1.2}
            row[0].plot(traj["seconds"], gap, **kw)
            row[1].plot(range(1, len(gap) + 1), gap, **kw)
        for ax, xlabel in zip(row, ("seconds (scoring excluded)", "epochs"), strict=True):
            ax.set_yscale("log")
            ax.axhline(TOLERANCE, color="k", linewidth=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("(f - f*) / f*")
            ax.grid(True, which="both", alpha=0.3)
            rows = f"{int(size):,}" if size.isdigit() else size
            ax.set_title(f"{rows} rows: gap vs {xlabel.split()[0]}", fontsize=10)
        row[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def _table_lines(res: dict) -> list[str]:
    lines = [f"{'learner':>20} {'s/epoch':>8} {'epochs':>7} {'s to 1%':>8} {'gap end':>9} {'held-out':>9}"]
    for name, ln in res["learners"].items():
        e = ln["epochs_to_target"]
        s = ln["seconds_to_target"]
        lines.append(f"{name:>20} {ln['seconds_per_epoch']:8.3f} {e if e is not None else '-':>7} "
                     f"{f'{s:.2f}' if s is not None else '-':>8} {ln['final_gap']:9.4f} {ln['final_holdout_loss']:9.5f}")
    return lines


def merged(paths: list[str], name: str) -> dict:
    """One result with the sizes of several result files (in order), and its plot and table. A
    size that is in several files must have the same f* in each; a later file's learners then
    replace the earlier file's of the same name (a rerun of some learners, ``--only``)."""
    import json

    out: dict[str, Any] = {"name": name, "sizes": {}, "runs": []}
    for path in paths:
        part = json.loads(Path(path).read_text())
        for size, res in part["sizes"].items():
            have = out["sizes"].get(size)
            if have is None:
                out["sizes"][size] = res
            elif have["f_star"] == res["f_star"]:  # a rerun of some learners: they replace the earlier rows
                have["learners"].update(res["learners"])
            else:
                raise ValueError(f"{path}: {size} rows has f* = {res['f_star']}, an earlier file {have['f_star']}")
        out["runs"].append({k: v for k, v in part.items() if k != "sizes"})
    out["plot"] = str(plot(out, RESULTS / f"{name}.png"))
    (RESULTS / f"{name}.md").write_text(markdown(out))
    return out


def markdown(result: dict) -> str:
    """The doc's table: per size and learner, the medians over repeats."""
    lines = ["| rows | learner | s / epoch | epochs to 1% | data passes to 1% | s to 1% | gap after last epoch | "
             "held-out log loss, last epoch (best epoch) |", "|---|---|---|---|---|---|---|---|"]
    for size, res in result["sizes"].items():
        for name, ln in res["learners"].items():
            e, s = ln["epochs_to_target"], ln["seconds_to_target"]
            p = ln["data_passes_to_target"]
            n = ln["epochs_run"]
            ho = ln["trajectories"][0]["holdout_loss"]
            best = int(np.argmin(ho)) + 1
            reach = f"{e:g}" if e is not None else f"not in {n}"
            lines.append(f"| {f'{int(size):,}' if size.isdigit() else size} | `{name}` | {ln['seconds_per_epoch']:.3f} | {reach} | "
                         f"{f'{p:g}' if p is not None else '–'} | {f'{s:.2f}' if s is not None else '–'} | "
                         f"{ln['final_gap']:.2%} | {ho[-1]:.4f} ({min(ho):.4f} at {best}) |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_sync_async", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default=DATASET, help="a featurized dataset (default: the benchmark's 2M-row click log)")
    p.add_argument("--rows", default="500000", help="training rows, or several sizes comma-separated")
    p.add_argument("--holdout-rows", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=12, help="epochs of the online learners")
    p.add_argument("--lbfgs-epochs", type=int, default=25)
    p.add_argument("--cocoa-epochs", type=int, default=15)
    p.add_argument("--ref-passes", type=int, default=100)
    p.add_argument("--batch-rows", default="1000,10000", help="mini-batch b values, comma-separated")
    p.add_argument("--only", default="", help="learners to run, comma-separated (default all)")
    p.add_argument("--smoke", action="store_true", help="a tiny generated problem, 1 repeat, few epochs")
    p.add_argument("--out", default=NAME, help="name of the JSON and PNG under bench-results/")
    p.add_argument("--plot-from", default="", help="no run: merge the sizes of these result JSONs "
                   "(comma-separated) into one result and one plot")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the study (``argv``: the command-line flags; None = the defaults) and write the plot."""
    args = parse_args([] if argv is None else argv)
    if args.plot_from:
        return merged(args.plot_from.split(","), args.out)
    batch = tuple(int(b) for b in args.batch_rows.split(",") if b)
    if args.smoke:
        chosen = learners(epochs=3, lbfgs_epochs=6, cocoa_epochs=3, batch_rows=(100,))
        sizes = {"smoke": smoke_data()}
        repeats, ref_passes = 1, 200
    else:
        chosen = learners(args.epochs, args.lbfgs_epochs, args.cocoa_epochs, batch)
        sizes = {}
        for rows in (int(r) for r in args.rows.split(",")):
            sizes[str(rows)] = None
        repeats, ref_passes = args.repeats, args.ref_passes
    if args.only:
        keep = set(args.only.split(","))
        chosen = [ln for ln in chosen if ln.name in keep]
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                           "lambda": LAMBDA, "learners": [ln.name for ln in chosen], "sizes": {}}
    if not args.dataset and any(v is None for v in sizes.values()):
        from tests.benchmarks.bench_memory import _dataset

        args.dataset = str(_dataset())
    t0 = time.perf_counter()
    for size in sizes:
        data, holdout = sizes[size] if sizes[size] is not None else load_rows(Path(args.dataset), int(size),
                                                                              args.holdout_rows)
        print(f"== {size}: {data.n_rows} rows, {data.nnz} non-zeros, held-out {holdout.n_rows}", flush=True)
        warm_up(chosen, data)
        out["sizes"][size] = study(data, holdout, chosen, repeats, ref_passes,
                                   log=lambda s: print(s, flush=True))
        for line in _table_lines(out["sizes"][size]):
            print("   " + line, flush=True)
        del data, holdout
    out["total_seconds"] = time.perf_counter() - t0
    out["name"], out["argv"] = args.out, list(argv or [])
    out["plot"] = str(plot(out, RESULTS / f"{args.out}.png"))
    (RESULTS / f"{args.out}.md").write_text(markdown(out))
    return out


if __name__ == "__main__":
    figures = main(sys.argv[1:])
    print(write_result(figures["name"], figures))
