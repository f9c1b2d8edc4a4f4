"""The ``hybrid`` solver (default; Algorithm 2 of the terascale paper): ``online_passes``
online passes with per-coordinate weighted averaging, then L-BFGS warm-started from the
average, up to ``passes`` passes in all. The online phase's first averaging agrees on the
features once (:meth:`~solvers.online.OnlineLearner.agree_features`); L-BFGS then works on that
set without a collective of its own.
"""

from __future__ import annotations

import numpy as np

from terascale.solvers.lbfgs import LBFGSPhase, lbfgs_resume
from terascale.solvers.online import OnlineLearner, resumed_stop, run_online_phase
from terascale.solvers.run import TrainResult, TrainRun


def train_hybrid(run: TrainRun) -> TrainResult:
    saved = run.resume
    if saved is not None and saved["phase"] == "lbfgs":
        return lbfgs_resume(run)
    learner = OnlineLearner(run)
    try:
        theta, stop = _online_phase(run, learner, saved)
    finally:
        learner.close()  # the shard's feature ids back (solvers.hot) before anything else reads them
    if stop:
        return run.finish(theta, None, stop)
    if theta is None:  # online_passes = 0: L-BFGS from the initial weights
        theta = learner.theta()
    space = learner.space  # the features averaged: a superset of L-BFGS's (solvers.lbfgs)
    del learner  # the online table is not needed by L-BFGS
    phase = LBFGSPhase.start(run, theta, space)
    del theta  # the phase keeps θ over the active features only: the full-length start goes
    return phase.run_until(run.params.passes)


def _online_phase(run: TrainRun, learner: OnlineLearner, saved: dict | None) -> tuple[np.ndarray | None, str | None]:
    """(θ after the online passes or the resumed state, None if neither; the stop reason or None)."""
    theta = None  # the weights as float64 (a copy of the table's column): made when needed
    first = 1
    if saved is not None:
        theta = learner.restore(saved)
        first = saved["pass"] + 1
        stop = resumed_stop(run)
        if stop:
            return theta, stop
    if first <= run.params.online_passes:
        return run_online_phase(run, learner, first, run.params.online_passes)
    return theta, None
