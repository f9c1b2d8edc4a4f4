"""Per-pass bookkeeping shared by every solver: history, per-rank timings, held-out loss and
early stopping, with ONE small AllReduce per pass.

At the end of a pass, each rank measures since the previous pass ended (the previous pass's
own gather included): ``compute_s`` = wall time − time inside collectives, ``stall_s`` = the
collectives' wait (for the slowest rank), ``transfer_s`` = the rest of the collectives' time
(from the communicator's stats), and scores the held-out shard with the current weights. One
float64 AllReduce of ``[held-out loss, held-out problems, solver sums…, compute·e_r, stall·e_r,
transfer·e_r, elapsed·e_r]`` (e_r: one slot per rank) then gives every rank every rank's
timings, so the history is the same on every rank.

Two clocks: ``elapsed_s`` is the largest rank's time since its own start of training, i.e. since
the FIRST rank started (the history's clock, the one checkpoints carry); ``elapsed_all_s`` is the
smallest, since the LAST rank started, i.e. since every shard was in memory. Ranks read their
shards before training and start when their own read is done (no collective before the first
pass: speculative execution), so the difference is the spread of the reads' ends, which the
early ranks spend waiting at the first collective. Every rank takes its time right after the
pass's last collective, which they leave together, so no clocks need to agree.

A solver may also record a value known inside a pass (:meth:`PassTracker.note`: L-BFGS's
objective at its starting point, known after the phase's first evaluation, before its first
pass ends): the pass's entry gets ``key`` and ``key_s``, the seconds from the previous pass's end
(the previous entry's clocks; 0 before the first pass) to when it was known, the largest over
ranks, taken in the same AllReduce.

Early stopping (Vowpal Wabbit's holdout rule): with held-out data and ``early_stop_passes``
k > 0, stop after k consecutive passes without a strictly lower held-out loss, and return the
weights of the best pass.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.errors import DivergenceError
from terascale.solvers.objective import shard_sums
from terascale.solvers.setup import Inputs
from terascale.solvers.state import own
from terascale.solvers.threads import SERIAL, RowThreads


def _json_float(v: Any) -> float | None:
    return None if v is None else float(v)


class PassTracker:
    def __init__(self, comm: Communicator, inputs: Inputs, loss_id: int, early_stop_passes: int,
                 resume: dict | None = None, threads: RowThreads = SERIAL):
        self.comm = comm
        self.threads = threads  # the held-out scoring pass runs on the rank's threads
        self.inputs = inputs
        self.loss_id = loss_id
        self.early_stop_passes = int(early_stop_passes)
        self.history: list[dict] = [dict(e) for e in resume["history"]] if resume else []
        self._elapsed_offset = float(resume["elapsed_s"]) if resume else 0.0
        self.best_theta: np.ndarray | None = None
        self.best_loss: float | None = None
        self.best_objective: float | None = None
        self.best_pass = 0
        self.stale = 0
        if resume and resume.get("best_theta") is not None:
            self.best_theta = own(resume, "best_theta", np.float64)
            self.best_loss = float(resume["best_holdout_loss"])
            self.best_objective = _json_float(resume["best_objective"])
            self.best_pass = int(resume["best_pass"])
        if resume:
            self.stale = int(resume.get("stale_passes", 0))
        self._t0 = time.perf_counter()
        self._mark_time = self._t0
        self._mark_stats = self._totals()
        self._notes: list[tuple[str, float, float]] = []  # (key, value, rank's seconds into the pass)

    @property
    def holdout_weight(self) -> float:
        """Σ held-out weights over all ranks (known once the inputs are agreed; 0: none)."""
        return self.inputs.holdout_weight

    @property
    def passes_done(self) -> int:
        return len(self.history)

    @property
    def early_stopping(self) -> bool:
        return self.early_stop_passes > 0 and self.holdout_weight > 0.0

    @property
    def should_stop(self) -> bool:
        return self.early_stopping and self.stale >= self.early_stop_passes

    def _totals(self) -> dict[str, float]:
        return self.comm.totals()

    def _holdout_sums(self, theta: np.ndarray) -> tuple[float, str | None]:
        hold = self.inputs.holdout
        if hold is None or hold.n_rows == 0:
            return 0.0, None
        loss, problem = shard_sums(hold, theta, self.loss_id, threads=self.threads)
        return loss, None if problem is None else f"rank {self.comm.rank}: {problem}"

    def note(self, key: str, value: float) -> None:
        """Record ``value`` for the pass in progress, known now (every rank notes the same keys
        in the same order: their times travel in the pass's AllReduce)."""
        self._notes.append((key, float(value), time.perf_counter() - self._mark_time))

    def finish_pass(self, phase: str, theta: np.ndarray, *, objective: float | None,
                    grad_norm: float | None, step: float | None, sums=(),
                    **extra: Any) -> tuple[dict, np.ndarray]:
        """Record a completed pass whose current weights are ``theta`` (float64, intercept
        last). ``sums`` are extra float64 values the solver wants summed over ranks in the same
        AllReduce; returns (the history entry, their sums). ``extra`` goes into the entry."""
        hold_loss, hold_problem = self._holdout_sums(theta)
        now = time.perf_counter()
        stats = self._totals()
        k, r = self.comm.size, self.comm.rank
        sums = np.asarray(sums, dtype=np.float64).reshape(-1)
        head = 2 + sums.shape[0]
        notes, self._notes = self._notes, []
        vec = np.zeros(head + (4 + len(notes)) * k, dtype=np.float64)
        vec[0] = hold_loss
        vec[1] = 0.0 if hold_problem is None else 1.0
        vec[2:head] = sums
        wall = stats["wall_s"] - self._mark_stats["wall_s"]
        vec[head + r] = max((now - self._mark_time) - wall, 0.0)
        vec[head + k + r] = stats["wait_s"] - self._mark_stats["wait_s"]
        vec[head + 2 * k + r] = stats["transfer_s"] - self._mark_stats["transfer_s"]
        vec[head + 3 * k + r] = self._elapsed_offset + (now - self._t0)
        for i, (_, _, seconds) in enumerate(notes):
            vec[head + (4 + i) * k + r] = seconds
        tot = self.comm.allreduce(vec)
        self._mark_time, self._mark_stats = now, stats
        if tot[1] != 0.0:
            raise DivergenceError(
                f"non-finite held-out loss after pass {self.passes_done + 1}: "
                + (hold_problem or "reported by another rank (see its error)")
            )
        timing = tot[head:].reshape(4 + len(notes), k)
        entry: dict[str, Any] = {
            "pass": self.passes_done + 1,
            "phase": phase,
            "objective": _json_float(objective),
            "grad_norm": _json_float(grad_norm),
            "step": _json_float(step),
            "elapsed_s": float(timing[3].max()),
            "elapsed_all_s": float(timing[3].min()),
        }
        if self.holdout_weight > 0.0:
            entry["holdout_loss"] = float(tot[0]) / self.holdout_weight
            self._update_best(entry, theta)
        for i, (key, value, _) in enumerate(notes):
            entry[key] = value
            entry[f"{key}_s"] = float(timing[4 + i].max())
        entry["compute_s"] = timing[0].tolist()
        entry["stall_s"] = timing[1].tolist()
        entry["transfer_s"] = timing[2].tolist()
        entry.update(extra)
        self.history.append(entry)
        return entry, tot[2:head].copy()

    def _update_best(self, entry: dict, theta: np.ndarray) -> None:
        loss = entry["holdout_loss"]
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss = loss
            self.best_pass = entry["pass"]
            self.best_objective = entry["objective"]
            self.best_theta = np.array(theta, dtype=np.float64, copy=True) if self.early_stopping else None
            self.stale = 0
        else:
            self.stale += 1

    def best(self) -> tuple[np.ndarray, float | None] | None:
        """(θ, objective or None) of the best held-out pass, when early stopping is on (the
        weights are kept only then)."""
        if self.best_theta is None:
            return None
        return self.best_theta, self.best_objective

    def state(self) -> dict[str, Any]:
        """The tracker's part of a checkpoint (copies)."""
        return {
            "history": [dict(e) for e in self.history],
            # the last pass's (rank-independent) elapsed time: checkpoints are equal on all ranks
            "elapsed_s": self.history[-1]["elapsed_s"] if self.history else 0.0,
            "best_theta": self.best_theta,  # replaced, never modified in place
            "best_holdout_loss": self.best_loss,
            "best_objective": self.best_objective,
            "best_pass": self.best_pass,
            "stale_passes": self.stale,
        }
