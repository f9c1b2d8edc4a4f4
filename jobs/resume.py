"""Every rank resumes from one pass: the agreement that rides a resumed attempt's first collective.

Each rank of a new attempt picks, on its own, the newest checkpoint it can read and verify
(:func:`jobs.checkpoint.newest`) and starts its first pass from it. It cannot ask the others
first: a task joins the tree only at its first collective, after its first pass, so that spares
can race a slow shard (:mod:`allreduce.spark`); a collective before that pass would register
every worker at once and leave the spares nothing to race.

So the agreement is the first collective itself (:class:`ResumeAgreement` wraps the task's
communicator; it runs before the solvers' own input agreement): one float64 AllReduce of a
vector with one block of :data:`SLOTS` per rank, each slot ``pass + 1`` of a pass that rank holds
(0: empty), i.e. an all-gather of what every rank holds. Every rank then knows every rank's
start (the newest pass it holds) and the newest pass all ranks hold, and decides the same:

- all ranks started from the same pass (the usual case): go on, nothing lost;
- they did not, but a pass held by all exists: every rank raises :class:`ResumeRestart` with it,
  and the task reloads that checkpoint and trains again over the same, already joined tree;
  the first pass's work is lost, nothing else;
- no pass is held by all while some rank holds one: every rank raises
  :class:`jobs.checkpoint.CheckpointError` (not retried).

A spare that wins a shard holds what the worker it replaces would have held (the same files);
one that stands down never reaches the collective.
"""

from __future__ import annotations

import numpy as np

from terascale.allreduce.communicator import Communicator, WrappedCommunicator
from terascale.jobs.checkpoint import CheckpointError

SLOTS = 4  # passes reported per rank, newest first (a writer keeps two)


class ResumeRestart(Exception):
    """Ranks started from different passes: every rank restarts from ``pass_no``."""

    def __init__(self, pass_no: int, starts: list[int | None]) -> None:
        super().__init__(f"ranks resumed from passes {starts}: every rank restarts from pass {pass_no}")
        self.pass_no = pass_no


def decide(held: list[list[int]]) -> int | None:
    """The pass every rank resumes from, given what each rank holds (its start: the newest);
    raises ResumeRestart or CheckpointError as the module docstring says."""
    starts = [max(h) if h else None for h in held]
    if len(set(starts)) == 1:
        return starts[0]
    common = set(held[0]).intersection(*map(set, held[1:]))
    if not common:
        raise CheckpointError(
            "no checkpointed pass is held by every rank: " + ", ".join(f"rank {r} holds {sorted(h)}" for r, h in enumerate(held))
            + " (rerun the job to start over)"
        )
    raise ResumeRestart(max(common), starts)


class ResumeAgreement(WrappedCommunicator):
    """``inner`` whose first collective is preceded by the resume agreement (module docstring).

    ``held``: the passes this rank can resume from, newest first (empty: none).
    """

    def __init__(self, inner: Communicator, held: list[int]) -> None:
        super().__init__(inner)
        self.held = sorted(set(held), reverse=True)[:SLOTS]
        self.agreed = False
        self.pass_no: int | None = None

    def _ready(self) -> Communicator:
        if not self.agreed:
            self.agreed = True
            vec = np.zeros(SLOTS * self.size, dtype=np.float64)
            vec[SLOTS * self.rank:SLOTS * self.rank + len(self.held)] = [p + 1 for p in self.held]
            blocks = self.inner.allreduce(vec).reshape(self.size, SLOTS)
            self.pass_no = decide([[int(v) - 1 for v in row if v > 0] for row in blocks.tolist()])
        return self.inner
