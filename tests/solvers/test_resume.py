"""Checkpoint / resume: a run resumed from the state of any pass ends exactly where the
uninterrupted run ends (same weights bit for bit, same objective), for every solver, with
early stopping, across K ranks; and states survive a round trip through npz + JSON."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from terascale.solvers.api import SolverParams
from terascale.solvers.state import copy_state, split_arrays
from tests.solvers.helpers import (
    copy_data,
    keep,
    planted_problem,
    split_rows,
    train_local,
    train_on_tree,
)


def _round_trip(state: dict) -> dict:
    """Store a state the way a job would: arrays in an .npz, the rest as JSON."""
    arrays, rest = split_arrays(state)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf) as z:
        loaded = {k: z[k] for k in z.files}
    return {**loaded, **json.loads(json.dumps(rest))}


def _same(a, b):
    assert a.weights.tobytes() == b.weights.tobytes()
    assert a.intercept == b.intercept
    assert a.objective == b.objective
    assert a.stop_reason == b.stop_reason and a.passes == b.passes
    strip = ("elapsed_s", "elapsed_all_s", "compute_s", "stall_s", "transfer_s", "start_objective_s")
    assert [{k: v for k, v in e.items() if k not in strip} for e in a.history] == \
        [{k: v for k, v in e.items() if k not in strip} for e in b.history]


CASES = {
    "online": SolverParams(solver="online", l2=1e-6, passes=5, shuffle=True, seed=7),
    "lbfgs": SolverParams(solver="lbfgs", l2=1e-3, passes=12),
    "hybrid": SolverParams(solver="hybrid", l2=1e-3, passes=10, online_passes=2),
    "hybrid_squared": SolverParams(solver="hybrid", loss="squared", l2=1e-2, passes=8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_from_every_pass_matches_the_uninterrupted_run(name):
    params = CASES[name]
    data = planted_problem(n=400, d=30, seed=51, loss="squared" if "squared" in name else "logistic")
    states = []
    full = train_local(data, params, on_pass_end=keep(states))
    assert [s["pass"] for s in states] == list(range(1, full.passes + 1))
    for state in states:
        resumed = train_local(data, params, resume=_round_trip(state))
        _same(resumed, full)


def test_resume_with_the_coarse_correction_matches_the_uninterrupted_run():
    """The coarse matrix is computed once, at the L-BFGS start, and restored from the state."""
    data = planted_problem(n=400, d=30, seed=53)
    gmap = (np.arange(30) % 4).astype(np.uint8)
    gmap[::7] = 255
    params = SolverParams(solver="hybrid", l2=1e-3, passes=10)
    states = []
    full = train_local(data, params, on_pass_end=keep(states), groups=gmap)
    assert "lbfgs_coarse_E" in states[-1]
    for state in states:
        _same(train_local(data, params, resume=_round_trip(state), groups=gmap), full)
        # a run that renumbers its data in place for the working table (the train job's)
        _same(train_local(copy_data(data), params, resume=_round_trip(state), groups=gmap, consume_data=True), full)


def test_resume_with_early_stopping_keeps_the_best_weights():
    data = planted_problem(n=400, d=30, seed=52)
    # held-out labels anti-correlated with the training signal: the held-out loss gets worse
    hold = planted_problem(n=200, d=30, seed=52)
    hold = type(hold)(hold.indptr, hold.indices, hold.values, 1 - hold.labels, hold.weights, 30)
    params = SolverParams(solver="hybrid", l2=1e-4, passes=15, early_stop_passes=2)
    states = []
    full = train_local(data, params, holdout=hold, on_pass_end=keep(states))
    assert full.stop_reason == "early_stop"
    for state in states:
        _same(train_local(data, params, holdout=hold, resume=_round_trip(state)), full)


def test_resume_on_k_ranks_recomputes_the_normalizers():
    """Non-binary values: each rank's s_j = max |x_j| is rebuilt from its own data."""
    data = planted_problem(n=300, d=20, seed=53)
    shards = split_rows(data, 2)
    params = SolverParams(solver="online", l2=1e-6, passes=4)
    states = []
    full = train_on_tree(shards, params, on_pass_end=keep(states))
    by_pass = {s["pass"]: s for s in states}  # states are the same on every rank
    for state in (by_pass[1], by_pass[2], by_pass[3]):
        resumed = train_on_tree(shards, params, resume=_round_trip(state))
        for a, b in zip(resumed, full, strict=True):
            _same(a, b)


def test_more_passes_continue_a_finished_run():
    data = planted_problem(n=300, d=20, seed=54)
    states = []
    short = train_local(data, SolverParams(solver="lbfgs", l2=1e-3, passes=3), on_pass_end=keep(states))
    assert short.stop_reason == "max_passes"
    longer = SolverParams(solver="lbfgs", l2=1e-3, passes=8)
    assert train_local(data, longer, resume=states[-1]).passes == 8
    _same(train_local(data, longer, resume=states[-1]), train_local(data, longer))


def test_resume_rejects_an_incompatible_state():
    data = planted_problem(n=100, d=10, seed=55)
    states = []
    train_local(data, SolverParams(l2=1e-3, passes=2), on_pass_end=keep(states))
    with pytest.raises(ValueError, match=r"resume state: params.l2 = 0.001 differs from this run's 0.01"):
        train_local(data, SolverParams(l2=1e-2, passes=2), resume=states[-1])
    with pytest.raises(ValueError, match=r"resume state: n_features = 10: the data has 12"):
        train_local(planted_problem(n=100, d=12), SolverParams(l2=1e-3, passes=2), resume=states[-1])


def test_states_are_live_views_and_copy_state_keeps_them():
    data = planted_problem(n=100, d=10, seed=56)
    raw, kept = [], []

    def both(state):
        raw.append(state)
        kept.append(copy_state(state))

    train_local(data, SolverParams(solver="online", l2=1e-6, passes=3), on_pass_end=both)
    assert kept[0]["weights"].tobytes() != kept[-1]["weights"].tobytes()
    assert kept[0]["G"].tobytes() != kept[-1]["G"].tobytes()
    assert raw[0]["G"].tobytes() == raw[-1]["G"].tobytes()  # views of the final live state


def test_a_handed_over_state_is_taken_not_copied_and_resumes_to_the_same_bits():
    """A job hands the solver the state it loaded (``Handover``): the arrays it restores from
    leave the dict (a resumed rank holds one copy of its state, not two); the bits are those of
    the uninterrupted run, from the online phase, from L-BFGS and inside a path's later step."""
    from terascale.solvers.state import Handover

    data = planted_problem(n=400, d=30, seed=51)
    params = CASES["hybrid"]
    states = []
    full = train_local(data, params, on_pass_end=keep(states))
    for state in (states[0], states[4]):  # online (pass 1 of 2), then L-BFGS
        given = Handover(_round_trip(state))
        _same(train_local(data, params, resume=given), full)
        big = {"online": ("weights", "G"), "lbfgs": ("weights", "lbfgs_S", "lbfgs_Y", "lbfgs_grad", "lbfgs_inv_diag")}
        assert not set(big[state["phase"]]) & set(given), state["phase"]
    auto = SolverParams(solver="lbfgs", l2="auto", passes=6)
    train_rows, hold = split_rows(data, 2)
    states = []
    full = train_local(train_rows, auto, holdout=hold, path_rows=400, on_pass_end=keep(states))
    mid = next(s for s in states if s["path_step"] == 1 and s["path_step_stop"] is None)
    given = Handover(_round_trip(mid))
    resumed = train_local(train_rows, auto, holdout=hold, path_rows=400, resume=given)
    assert resumed.weights.tobytes() == full.weights.tobytes() and resumed.intercept == full.intercept
    assert resumed.objective == full.objective and resumed.passes == full.passes
    assert not {"weights", "lbfgs_S", "lbfgs_Y", "path_best_weights"} & set(given)
