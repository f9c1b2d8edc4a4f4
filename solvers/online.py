"""The ``online`` solver: online passes (Algorithm 1 of the terascale paper, see
:mod:`solvers.kernels.online`) with per-coordinate weighted averaging across ranks after each
pass (:mod:`solvers.averaging`). :class:`OnlineLearner` and :func:`run_online_phase` are
reused by the hybrid solver.

Online passes minimize the loss term only: the L2 penalty is not applied in the updates (with
CTR-scale λ its effect over a pass is negligible; L-BFGS then solves the regularized problem).
The ``objective`` of an online pass is therefore not computed (None); the result's objective
is evaluated once, at the returned weights.

Threads (``threads`` = T > 1, :mod:`solvers.threads`): the pass is Hogwild (Niu, Recht, Ré &
Wright 2011, lock-free SGD): T threads run the kernel over T contiguous blocks of the pass's
rows (of the shuffled order's positions when ``shuffle`` is on), each cut to about the same
number of non-zeros, all updating the one shared state table (w, G, s) without locks, so one
thread's update may overwrite another's concurrent update of the same feature: rare for sparse
rows, and the result is not reproducible bit for bit. Each thread keeps its own copy of the
totals [t, N], starting from the pass's starting totals: it sees its own rows' increments (its
step size η·√(t/N) follows its rows, as one rank's would), not the other threads'. After the
pass the totals are the starting ones plus every block's increment, added in block order; the
progressive loss and weight sums are each block's, added in block order. With T = 1 the pass
is one sequential walk, as before.

Hot features (T > 1 on data handed over, ``Inputs.consume``): the intercept and the most frequent
features are written by every thread on nearly every row, and that contention, not the arithmetic,
held two Hogwild threads to about one thread's speed. Each thread therefore updates its own
replicas of them during a pass, merged into the shared rows after it by a per-coordinate weighted
average (:mod:`solvers.hot`, :mod:`solvers.kernels.hot`); the shard's indices are relabelled for
the online phase and given back by :meth:`OnlineLearner.close`.

L1 (``l1`` = λ₁ > 0): every pass applies truncated-gradient shrinkage, lazily per feature
(:mod:`solvers.kernels.online`, step 6): before the pass every feature's shrink clock is set to
the pass's starting t; the kernel shrinks a feature's weight towards 0 (clipped at 0) whenever it
updates it, for the importance weight seen since its last shrink; after the pass (the threads'
totals merged) :func:`~solvers.kernels.online.l1_catch_up` shrinks every feature for the rest of
the pass at the pass's final step size. The averaged weights are then 0 wherever every rank's
are, so the hybrid's L-BFGS (OWL-QN) phase starts from a sparse point. From the second pass on
K > 1 ranks every rank also shrinks the features only other ranks' rows hold, with the holders'
normalizers agreed at the first averaging (:meth:`OnlineLearner.share_normalizers`), so each
pays its penalty on every rank's examples.

Divergence: a non-finite margin, squared gradient or weight on any rank, or an exploding loss
(the pass's progressive loss above EXPLODING_FACTOR times the loss of the all-zero model),
raises DivergenceError on every rank.
"""

from __future__ import annotations

import numpy as np

from terascale.solvers.active import ActiveFeatures, agree_marks
from terascale.solvers.averaging import average_online_state
from terascale.solvers.errors import DivergenceError
from terascale.solvers.hot import HotReplicas, choose_hot
from terascale.solvers.kernels.features import mark_features
from terascale.solvers.kernels.online import (
    BAD_MARGIN,
    OK,
    G,
    S,
    T,
    W,
    l1_catch_up,
    mark_state,
    new_state,
    online_pass,
    restore_normalizers,
    zero_model_loss_sum,
)
from terascale.solvers.run import TrainResult, TrainRun
from terascale.solvers.state import take
from terascale.solvers.threads import split_positions

EXPLODING_FACTOR = 1e6


class OnlineLearner:
    """This rank's online state: the float32 table (w, G, s per feature) and totals [t, N]."""

    def __init__(self, run: TrainRun):
        self.run = run
        self.space: ActiveFeatures | None = None  # the features averaged, see agree_features
        s = run.inputs.train
        self.hot: HotReplicas | None = None  # T > 1 on data handed over: per-thread hot replicas
        if run.threads.size > 1 and run.inputs.consume:
            ids = choose_hot(s)
            if ids.shape[0]:
                self.hot = HotReplicas(ids, run.n_features, run.threads.size)
        # the kernel's table: with replicas, the canonical rows then the threads' blocks
        self.state = self.hot.extended_table() if self.hot else new_state(run.n_features)
        self.table = self.state[: run.n_features + 1]  # weights 0
        if run.init is not None:
            self.table[:, W] = run.init
        self.totals = np.zeros(2, dtype=np.float64)
        # L1: (ids, s) the normalizers agreed at the first averaging (share_normalizers)
        self.shared_scale: tuple[np.ndarray, np.ndarray] | None = None
        self.zero_loss = zero_model_loss_sum(s.labels, s.weights, run.loss_id)
        s.release_all()  # a file-backed shard: the two columns leave memory again

    def close(self) -> None:
        """Give the shard back its feature ids if the hot replicas relabelled them (solvers.hot);
        the learner's state stays usable."""
        if self.hot is not None:
            self.hot.unlabel(self.run.inputs.train, self.run.threads)

    def theta(self) -> np.ndarray:
        """Current weights as float64 [β, b]."""
        return self.table[:, W].astype(np.float64)

    def restore(self, saved: dict) -> np.ndarray:
        """Load an online checkpoint; recompute this rank's normalizers from its data."""
        self.table[:-1, W] = take(saved, "weights")
        self.table[-1, W] = saved["intercept"]
        self.table[:, G] = take(saved, "G")
        self.totals[:] = (saved["online_t"], saved["online_N"])
        if saved["pass"] > 0:
            shard = self.run.inputs.train
            for a, b in shard.chunks():  # a maximum: the same whatever the ranges
                part = shard.rows(a, b)
                restore_normalizers(part.indptr, part.indices, part.values, part.vpos, part.weights, self.table)
        if "online_scale_ids" in saved:
            self.shared_scale = (np.asarray(saved["online_scale_ids"], dtype=np.int64),
                                 np.asarray(saved["online_scale"], dtype=np.float32))
            self._fill_normalizers()
        return self.theta()

    def share_normalizers(self, ids: np.ndarray) -> None:
        """L1 on several ranks: give every rank a normalizer s_j for every averaged feature, so
        that its catch-up shrink pays the penalty of its own examples for the features only other
        ranks' rows hold (:func:`~solvers.kernels.online.l1_catch_up`). One AllReduce, at the
        first averaging, of [s_j | 1 if s_j > 0] over ``ids``: a rank without feature j takes the
        mean of the holders' s_j (1 for hashed tokens); the holders keep their own. The result is
        the same bits on every rank and is kept in the checkpoint (``online_scale_ids``,
        ``online_scale``): a resumed run does not average before its next pass's catch-up."""
        n = ids.shape[0]
        own = self.table[ids, S]
        buf = np.empty(2 * n, dtype=np.float32)
        buf[:n] = own
        buf[n:] = own > 0.0
        tot = self.run.comm.allreduce(buf)
        held = tot[n:] > 0.0
        self.shared_scale = (ids[held].astype(np.int64), tot[:n][held] / tot[n:][held])
        self._fill_normalizers()

    def _fill_normalizers(self) -> None:
        ids, scale = self.shared_scale
        col = self.table[ids, S]
        self.table[ids, S] = np.where(col > 0.0, col, scale)

    def _local_pass(self, pass_number: int) -> tuple[float, float, str | None]:
        """The kernel over this rank's shard in chunks (:meth:`~solvers.shard.Shard.chunks`,
        progress between them), on the rank's threads (see the module docstring: Hogwild with
        T > 1)."""
        run, s = self.run, self.run.inputs.train
        order = run.shuffle_order(pass_number)
        threads = run.threads
        if threads.size == 1 or order.shape[0] == 0:
            cuts = threads.blocks(s.indptr)
        else:
            cuts = split_positions(s.indptr, order, threads.size)
        single = cuts.shape[0] == 2
        l1 = run.params.l1
        if l1 > 0.0:  # every feature's shrink clock starts at the pass's t (module docstring)
            self.table[:, T] = self.totals[0]
        start = self.totals.copy()
        hot = None if single else self.hot
        if hot is not None:
            hot.relabel(s, threads)  # once: the shard keeps the relabelled ids until close()
            hot.seed(self.state)

        def work(i: int, lo: int, hi: int, tick):
            totals = self.totals if single else start.copy()  # a thread's own [t, N]
            loss_sum = weight_sum = 0.0
            status, row = OK, -1
            top, offset, bias = hot.kernel_args(i) if hot is not None else (-1, 0, -1)
            for a, b in s.chunks(lo, hi):
                loss_sum, weight_sum, status, row = online_pass(
                    s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, order, self.state, totals,
                    run.loss_id, run.params.learning_rate, run.params.invariant, a, b,
                    loss_sum, weight_sum, l1, top, offset, bias,
                )
                if status != OK:
                    break
                tick(b - lo)
            return loss_sum, weight_sum, status, row, totals

        try:
            parts = threads.run(work, cuts, run.report_rows)
        finally:
            if hot is not None:
                hot.merge(self.state)
        loss_sum, weight_sum = parts[0][0], parts[0][1]
        if not single:
            self.totals[:] = start
            for p in parts:  # the blocks' increments, in block order
                self.totals += p[4] - start
            for p in parts[1:]:
                loss_sum += p[0]
                weight_sum += p[1]
        status, row = next(((p[2], p[3]) for p in parts if p[2] != OK), (OK, -1))
        t, n_norm = self.totals
        if l1 > 0.0 and status == OK and n_norm > 0.0:
            l1_catch_up(self.table, t, run.params.learning_rate * np.sqrt(t / n_norm), l1)
        problem = None
        if status == BAD_MARGIN:
            problem = f"rank {run.comm.rank}: non-finite margin at row {row}"
        elif status != OK:
            problem = f"rank {run.comm.rank}: non-finite update at row {row}"
        elif not np.isfinite(self.table[:, W]).all():
            problem = f"rank {run.comm.rank}: non-finite weights after the pass"
        return loss_sum, weight_sum, problem

    def agree_features(self) -> ActiveFeatures:
        """The features the averaging covers (:mod:`solvers.averaging`), agreed at the first
        averaging of the run with one AllReduce of packed marks (:func:`solvers.active.agree_marks`):
        those some rank holds in its data, or has a non-zero w or G for (a warm start, a resumed
        state). The set cannot grow later: the data stay the same and a feature outside them gets
        no gradient."""
        if self.space is None:
            run = self.run
            s = run.inputs.train
            if self.hot is not None and self.hot.relabelled:
                marks = self.hot.take_marks()  # made while relabelling, on the rank's threads
            else:
                marks = np.zeros(run.n_features, dtype=np.uint8)
                for a, b in s.chunks():
                    mark_features(s.indices[s.indptr[a] : s.indptr[b]], marks)
            mark_state(self.table, marks)
            self.space = ActiveFeatures(agree_marks(run.comm, marks), run.n_features)
        return self.space

    def run_pass(self, pass_number: int) -> np.ndarray:
        """One pass + averaging + the tracker's pass record; returns the averaged θ."""
        run = self.run
        loss_sum, weight_sum, problem = self._local_pass(pass_number)
        space = self.agree_features()
        n_bad = average_online_state(run.comm, self.table, space.ids, problem is not None)
        where = f"in online pass {pass_number} (learning_rate = {run.params.learning_rate})"
        if n_bad:
            raise DivergenceError(
                f"diverged {where}: " + (problem or f"{n_bad} rank(s) reported non-finite values")
            )
        if run.params.l1 > 0.0 and self.shared_scale is None:
            self.share_normalizers(space.ids)
        if not np.isfinite(self.table[:, W]).all():
            raise DivergenceError(f"diverged {where}: the averaged weights are not finite")
        theta = self.theta()
        entry, sums = run.tracker.finish_pass(
            "online", theta, objective=None, grad_norm=None, step=None,
            sums=[self.totals[0], self.totals[1], loss_sum, weight_sum, self.zero_loss],
        )
        k = float(run.comm.size)
        self.totals[:] = (sums[0] / k, sums[1] / k)
        progressive = float(sums[2] / sums[3]) if sums[3] > 0 else None
        entry["progressive_loss"] = progressive
        zero = float(sums[4] / sums[3]) if sums[3] > 0 else 0.0
        if progressive is not None and progressive > EXPLODING_FACTOR * max(zero, 1e-12):
            raise DivergenceError(
                f"diverged {where}: exploding loss, the progressive loss {progressive:.6g} is "
                f"more than {EXPLODING_FACTOR:g} times the all-zero model's {zero:.6g}"
            )
        return theta

    def checkpoint(self, theta: np.ndarray, stop_reason: str | None) -> None:
        self.run.checkpoint(
            "online", theta, stop_reason,
            arrays={"weights": self.table[:-1, W], "G": self.table[:, G],
                    **({"online_scale_ids": self.shared_scale[0], "online_scale": self.shared_scale[1]}
                       if self.shared_scale is not None else {})},
            scalars={"online_t": float(self.totals[0]), "online_N": float(self.totals[1])},
        )


def run_online_phase(run: TrainRun, learner: OnlineLearner, first: int, last: int) -> tuple[np.ndarray, str | None]:
    """Online passes ``first..last`` (1-based, inclusive); returns (θ, stop reason or None)."""
    if first > last:
        return learner.theta(), None
    for p in range(first, last + 1):
        theta = learner.run_pass(p)
        stop = None
        if run.tracker.should_stop:
            stop = "early_stop"
        elif p >= run.params.passes:
            stop = "max_passes"
        learner.checkpoint(theta, stop)
        if stop:
            return theta, stop
    return theta, None


def resumed_stop(run: TrainRun) -> str | None:
    """The stop reason of the resume state if the run is over (a "max_passes" stop is not
    final when this run allows more passes)."""
    saved = run.resume
    if saved is None or saved["stop_reason"] is None:
        return None
    if saved["stop_reason"] == "max_passes" and saved["pass"] < run.params.passes:
        return None
    return saved["stop_reason"]


def train_online(run: TrainRun) -> TrainResult:
    learner = OnlineLearner(run)
    try:
        first = 1
        theta, stop = None, None
        if run.resume is not None:
            theta = learner.restore(run.resume)
            first = run.resume["pass"] + 1
            stop = resumed_stop(run)
        if not stop:
            theta, stop = run_online_phase(run, learner, first, run.params.passes)
            stop = stop or "max_passes"
    finally:
        learner.close()  # the shard's feature ids back (solvers.hot) before the objective reads them
    return run.finish(theta, None, stop)
