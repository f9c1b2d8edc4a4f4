"""What a solver gets (:class:`TrainRun`) and returns (:class:`TrainResult`).

A solver function (see :mod:`solvers.catalogue`) receives a :class:`TrainRun` holding this
rank's validated shards (``inputs``), the communicator (whose first collective also runs the
input agreement), the parameters, the distributed objective, the pass tracker and the resume
state, and the rank's threads (``threads``, :mod:`solvers.threads`: every pass over the rows
runs on them); it calls ``report_rows(rows_done)`` (if set) while a pass runs (progress
heartbeats, from the calling thread),
:meth:`TrainRun.checkpoint` after every pass, and ends with :meth:`TrainRun.finish`, which
applies the early-stopping choice and computes the final objective if the solver did not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.errors import InvalidInputError
from terascale.solvers.objective import DistributedObjective
from terascale.solvers.params import SolverParams
from terascale.solvers.setup import Inputs
from terascale.solvers.state import build_state
from terascale.solvers.threads import SERIAL, RowThreads
from terascale.solvers.tracker import PassTracker


def rows_reporter(progress: Callable[[int, int], Any] | None,
                  tracker: PassTracker) -> Callable[[int], None] | None:
    """``rows_done -> progress(pass in progress, rows_done)``, or None without ``progress``."""
    if progress is None:
        return None

    def report(rows_done: int) -> None:
        progress(tracker.passes_done + 1, rows_done)

    return report


@dataclass(frozen=True)
class TrainResult:
    weights: np.ndarray  # float32 (n_features,), bit-identical on every rank
    intercept: float
    history: list[dict]
    objective: float  # mean-form training objective at (weights, intercept) over all ranks
    stop_reason: str = ""  # "max_passes", "converged_grad", "converged_objective", "early_stop", ...
    passes: int = 0  # passes completed (online passes + L-BFGS iterations)
    path: dict | None = None  # a regularization path's record (solvers.regpath), else None


@dataclass
class TrainRun:
    comm: Communicator
    params: SolverParams
    inputs: Inputs
    loss_id: int
    objective: DistributedObjective
    tracker: PassTracker
    on_pass_end: Callable[[dict], Any] | None = None
    resume: dict | None = None
    report_rows: Callable[[int], None] | None = None  # see rows_reporter
    init: np.ndarray | None = None  # float64 [β, b] to start from, or None (zeros)
    groups: np.ndarray | None = None  # uint8 group of each feature (255: none), or None
    threads: RowThreads = SERIAL  # the rank's threads for its passes (solvers.threads)

    @property
    def n_features(self) -> int:
        return self.inputs.n_features

    def initial_theta(self) -> np.ndarray:
        """The starting point [β, b] (float64): ``init`` or zeros."""
        if self.init is not None:
            return self.init.copy()
        return np.zeros(self.n_features + 1, dtype=np.float64)

    def shuffle_order(self, pass_number: int) -> np.ndarray:
        """The example order of an online pass: empty (stored order) unless ``shuffle``; else a
        permutation seeded by (seed, rank, pass), so a resumed run needs no RNG state. A
        file-backed shard (:attr:`~solvers.shard.Shard.release`) refuses a shuffled order."""
        if not self.params.shuffle:
            return np.zeros(0, dtype=np.int64)
        if self.inputs.train.release is not None:  # every rank's shard is file-backed alike
            raise InvalidInputError("train.shuffle = true: a shuffled pass reads rows at random, which a shard "
                                    "streamed from the local cache (train.data_cache = disk) cannot bound in "
                                    "memory; set train.shuffle=false or train.data_cache=memory")
        rng = np.random.default_rng([self.params.seed, self.comm.rank, pass_number])
        return rng.permutation(self.inputs.train.n_rows).astype(np.int64)

    def checkpoint(self, phase: str, theta: np.ndarray, stop_reason: str | None,
                   arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> None:
        """Hand the state after a completed pass to ``on_pass_end`` (if any)."""
        if self.on_pass_end is None:
            return
        self.on_pass_end(
            build_state(self.params, self.n_features, phase, theta, stop_reason,
                        self.tracker.state(), arrays, scalars)
        )

    def finish(self, theta: np.ndarray, objective: float | None, stop_reason: str,
               value_of: Callable[[np.ndarray], float] | None = None) -> TrainResult:
        """The result: the best held-out weights under early stopping, else ``theta``.
        ``value_of(θ)``: the objective at full-length weights when the solver cannot use
        :attr:`objective` for it any more (L-BFGS after renumbering the data in place)."""
        best = self.tracker.best()
        if best is not None:
            theta, objective = best
        if objective is None:
            objective = (value_of or self.objective.value)(theta)
        return TrainResult(
            weights=np.asarray(theta[:-1], dtype=np.float32).copy(),
            intercept=float(theta[-1]),
            history=[dict(e) for e in self.tracker.history],
            objective=float(objective),
            stop_reason=stop_reason,
            passes=self.tracker.passes_done,
        )
