"""Checkpoint / resume: a run resumed from any round's state ends exactly where the
uninterrupted run ends (same bytes), on one rank and on K ranks."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.scd import CocoaParams, train_cocoa
from tests.scd.helpers import make_data, run_and_resume, split_rows

_TRACE = ("round", "primal", "dual", "gap", "gamma")


def _trace(result):
    return [tuple(h[k] for k in _TRACE) for h in result.history]


@pytest.mark.parametrize(
    "loss, formulation, threads",
    [("logistic", "dual", 1), ("hinge", "dual", 2), ("squared", "primal", 1)],
)
def test_resume_on_one_rank(loss, formulation, threads):
    data = make_data(loss, n=200, seed=41)
    params = CocoaParams(loss=loss, formulation=formulation, l2=1e-2, tol=1e-7, max_rounds=2000,
                         threads=threads, bucket_size=4)
    states = []
    full = train_cocoa(data, LocalCommunicator(), params, on_round_end=states.append)
    assert full.converged and full.rounds > 6
    mid = states[4]
    assert mid.round == 5 and len(mid.history) == 5  # rows 0..4; row 5 is pending
    mid.local[:] = np.nan  # the state holds copies: scribbling on them must not matter...
    resumed = train_cocoa(data, LocalCommunicator(), params, resume=states[5])
    assert resumed.weights.tobytes() == full.weights.tobytes()
    assert resumed.intercept == full.intercept and resumed.rounds == full.rounds
    assert _trace(resumed) == _trace(full)


def test_resume_on_two_ranks():
    data = make_data("logistic", n=200, seed=42)
    params = CocoaParams(loss="logistic", l2=1e-2, tol=1e-9, max_rounds=400)
    full, resumed, _ = run_and_resume(split_rows(data, 2), params, at_round=3)
    for a, b in zip(full, resumed, strict=True):
        assert a.weights.tobytes() == b.weights.tobytes() and _trace(a) == _trace(b)


def test_resume_with_a_larger_round_budget():
    """max_rounds may change on resume (the budget is not part of the trajectory)."""
    data = make_data("squared", n=200, seed=43)
    short = CocoaParams(loss="squared", l2=1e-2, tol=1e-12, max_rounds=3)
    states = []
    cut = train_cocoa(data, LocalCommunicator(), short, on_round_end=states.append)
    assert cut.rounds == 3 and not cut.converged
    longer = CocoaParams(loss="squared", l2=1e-2, tol=1e-12, max_rounds=8)
    resumed = train_cocoa(data, LocalCommunicator(), longer, resume=states[-1])
    straight = train_cocoa(data, LocalCommunicator(), longer)
    assert resumed.weights.tobytes() == straight.weights.tobytes()


def test_resume_rejects_another_run():
    data = make_data("logistic", n=100, seed=44)
    states = []
    params = CocoaParams(loss="logistic", l2=1e-2, max_rounds=2)
    train_cocoa(data, LocalCommunicator(), params, on_round_end=states.append)
    with pytest.raises(ValueError, match="another run"):
        train_cocoa(data, LocalCommunicator(), CocoaParams(loss="logistic", l2=2e-2),
                    resume=states[-1])
    other = make_data("logistic", n=90, seed=44)
    with pytest.raises(ValueError, match="another run"):
        train_cocoa(other, LocalCommunicator(), params, resume=states[-1])
