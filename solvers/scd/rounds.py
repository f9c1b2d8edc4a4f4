"""The CoCoA round loop over an abstract problem (dual by example, or primal by feature).

Round r+1 on every rank (Smith et al.'s CoCoA / Parnell et al.'s Algorithms 3-4)::

    pieces_r   = gap pieces of the current point r           (local pass over the shard)
    proposal   = H local epochs on the sigma' subproblem     (dalpha_k or dbeta_k, dv_k)
                 (the sequential dual solver takes pieces_r during its first epoch, no extra pass)
    reduced    = allreduce([dv_k | pieces_r | line pieces | K-slot timings])   # ONE allreduce
    gap_r      = P_r - D_r from the reduced pieces           (identical on every rank)
    stop if gap_r <= tol * P_0  or  r == max_rounds          (point r is the answer)
    gamma      = 1/K (avg), 1 (add) or the exact line search (adaptive)
    v += gamma dv;  local += gamma dlocal                    -> point r+1

So the gap of a point travels in the next round's message: each round costs exactly one
vector allreduce (plus, for adaptive logistic, a few scalar allreduces of the line search),
and at convergence one local solve is computed and discarded. When ``max_rounds`` is reached
the last point's gap is reduced by a scalar-only allreduce. The history row of point r is
completed when its gap arrives: round, primal, dual, gap, gamma and elapsed_s of the round that
produced it, and every rank's compute_s / stall_s / transfer_s of that round (the timings ride
in K slots of the message, so each rank's history has every rank's figures).

``tol`` is relative to ``P_0 = P(beta = 0)``, the first history row's primal: log 2 for
logistic, 1 for hinge and squared hinge, (1/N) sum c y^2 / 2 for ridge — scale-free for ridge, and essentially
an absolute gap on the mean-form objective for classification.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.scd.params import CocoaParams, CocoaState
from terascale.solvers.scd.timing import RoundClock


class Problem(Protocol):
    """What the loop needs from a formulation (``DualProblem`` / ``PrimalProblem`` on the CPU,
    ``gpu_problem.GpuDualProblem`` / ``GpuPrimalProblem`` with the local variables on a GPU)."""

    eval_len: int
    line_len: int
    #: set by the loop before ``gamma``: the gamma of the round that produced the current point
    #: (None before the first round), a warm start for a line search
    previous_gamma: float | None

    @property
    def shared_len(self) -> int: ...
    def eval_pieces(self) -> np.ndarray: ...
    def objectives(self, sums: np.ndarray) -> tuple[float, float]: ...
    def propose(self, round_index: int) -> None: ...
    def evaluate_and_propose(self, round_index: int) -> np.ndarray: ...
    def shared_delta(self) -> np.ndarray: ...
    def line_pieces(self) -> np.ndarray: ...
    def gamma(self, delta: np.ndarray, sums: np.ndarray) -> float: ...
    def apply(self, gamma: float, delta: np.ndarray) -> None: ...
    def model(self) -> np.ndarray: ...
    def snapshot(self) -> tuple[np.ndarray, np.ndarray]: ...
    def restore(self, local: np.ndarray, shared: np.ndarray) -> None: ...


class GapThenProposal:
    """``evaluate_and_propose`` as two steps: a pass for the gap pieces, then the proposal. A
    problem that can take the pieces during its local solve overrides it (the CPU dual)."""

    def evaluate_and_propose(self, round_index: int) -> np.ndarray:
        pieces = self.eval_pieces()  # type: ignore[attr-defined]
        self.propose(round_index)  # type: ignore[attr-defined]
        return pieces


class RoundLoop:
    """Runs rounds until the gap test or ``max_rounds``; keeps the history and checkpoints."""

    def __init__(self, problem: Problem, comm: Communicator, params: CocoaParams,
                 clock: RoundClock, t0: float, n_rows: int) -> None:
        self.problem, self.comm, self.p, self.clock = problem, comm, params, clock
        self.t0 = t0
        self.n_rows = n_rows
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.pending = self._pending(None, clock.lap())  # row 0: the set-up
        self.converged = False

    # -- state -------------------------------------------------------------------------------

    def _pending(self, gamma: float | None, lap: tuple[float, float, float]) -> dict[str, Any]:
        compute, stall, transfer = lap
        return {"gamma": gamma, "elapsed_s": time.perf_counter() - self.t0,
                "compute_s": compute, "stall_s": stall, "transfer_s": transfer}

    def state(self) -> CocoaState:
        local, shared = self.problem.snapshot()
        return CocoaState(
            round=self.round, local=local, shared=shared,
            history=[dict(row) for row in self.history], pending=dict(self.pending),
            rank=self.comm.rank, size=self.comm.size, n_rows=self.n_rows,
            params_key=self.p.trajectory_key(),
        )

    def restore(self, s: CocoaState) -> None:
        mine = (self.comm.rank, self.comm.size, self.n_rows, self.p.trajectory_key())
        theirs = (s.rank, s.size, s.n_rows, tuple(s.params_key))
        if mine != theirs:
            raise ValueError(
                "resume state belongs to another run: (rank, size, n_rows, params) "
                f"{theirs!r} != {mine!r}"
            )
        self.problem.restore(s.local, s.shared)
        self.round = s.round
        self.history = [dict(row) for row in s.history]
        self.pending = dict(s.pending)
        self.t0 = time.perf_counter() - float(self.pending["elapsed_s"])

    # -- the loop ----------------------------------------------------------------------------

    def run(self, on_round_end: Callable[[CocoaState], None] | None = None) -> None:
        while True:
            final = self.round >= self.p.max_rounds
            reduced = self._exchange(final)
            row = self._complete_row(reduced, 0 if final else self.problem.shared_len)
            self.history.append(row)
            if row["gap"] <= self.p.tol * self.history[0]["primal"]:
                self.converged = True
                return
            if final:
                return
            self._step(reduced)
            if on_round_end is not None:
                on_round_end(self.state())

    def _exchange(self, final: bool) -> np.ndarray:
        """One allreduce: [dv | gap pieces | line pieces | timings] (only the last two
        groups without a proposal)."""
        pr = self.problem
        slots = np.zeros(3 * self.comm.size)
        r = self.comm.rank
        slots[3 * r:3 * r + 3] = (self.pending["compute_s"], self.pending["stall_s"],
                                  self.pending["transfer_s"])
        if final:
            return self.comm.allreduce(np.concatenate([pr.eval_pieces(), slots]))
        pieces = pr.evaluate_and_propose(self.round + 1)
        return self.comm.allreduce(
            np.concatenate([pr.shared_delta(), pieces, pr.line_pieces(), slots]))

    def _complete_row(self, reduced: np.ndarray, offset: int) -> dict[str, Any]:
        """The history row of the current point; its gap pieces start at ``offset``."""
        pr = self.problem
        k = self.comm.size
        slots = reduced[reduced.shape[0] - 3 * k:]
        primal, dual = (float(v) for v in pr.objectives(reduced[offset:offset + pr.eval_len]))
        if not (math.isfinite(primal) and math.isfinite(dual)):
            raise FloatingPointError(
                f"round {self.round}: non-finite objective (primal {primal}, dual {dual}); "
                "check the data for huge values or a tiny l2")
        return {
            "round": self.round, "primal": primal, "dual": dual, "gap": primal - dual,
            "gamma": self.pending["gamma"], "elapsed_s": self.pending["elapsed_s"],
            "compute_s": [float(slots[3 * i]) for i in range(k)],
            "stall_s": [float(slots[3 * i + 1]) for i in range(k)],
            "transfer_s": [float(slots[3 * i + 2]) for i in range(k)],
        }

    def _step(self, reduced: np.ndarray) -> None:
        pr = self.problem
        n_v = pr.shared_len
        delta = reduced[:n_v]
        line = reduced[n_v + pr.eval_len:n_v + pr.eval_len + pr.line_len]
        pr.previous_gamma = self.pending["gamma"]
        gamma = float(pr.gamma(delta, line))
        if not math.isfinite(gamma):
            raise FloatingPointError(f"round {self.round + 1}: non-finite aggregation gamma")
        pr.apply(gamma, delta)
        self.round += 1
        self.pending = self._pending(gamma, self.clock.lap())
