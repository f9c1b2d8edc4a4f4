"""Held-out loss after every pass and early stopping (stop after k passes without
improvement, return the best weights)."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from tests.solvers.helpers import (
    keep,
    objective_np,
    planted_problem,
    split_rows,
    train_local,
    train_on_tree,
)


def _flipped(data: CSRData) -> CSRData:
    return CSRData(data.indptr, data.indices, data.values, 1 - data.labels, data.weights, data.n_features)


@pytest.mark.parametrize("solver", ["online", "lbfgs", "hybrid"])
def test_holdout_loss_is_the_mean_loss_of_each_pass_weights(solver):
    data = planted_problem(n=300, d=20, seed=61)
    hold = planted_problem(n=150, d=20, seed=62, weighted=True)
    states = []
    res = train_local(data, SolverParams(solver=solver, l2=1e-3, passes=4, early_stop_passes=0),
                      holdout=hold, on_pass_end=keep(states))
    assert len(states) == len(res.history)
    for entry, state in zip(res.history, states, strict=True):
        expected = objective_np(hold, state["weights"], state["intercept"], 0.0)
        assert entry["holdout_loss"] == pytest.approx(expected, rel=1e-9)


def test_early_stopping_returns_the_best_pass():
    data = planted_problem(n=400, d=30, seed=63)
    hold = _flipped(planted_problem(n=200, d=30, seed=63))  # gets worse as training improves
    states = []
    k = 2
    res = train_local(data, SolverParams(solver="hybrid", l2=1e-4, passes=20, early_stop_passes=k),
                      holdout=hold, on_pass_end=keep(states))
    losses = [e["holdout_loss"] for e in res.history]
    best = int(np.argmin(losses))
    assert res.stop_reason == "early_stop"
    assert res.passes == best + 1 + k
    assert all(loss >= losses[best] for loss in losses[best + 1 :])
    np.testing.assert_array_equal(res.weights, np.asarray(states[best]["weights"], dtype=np.float32))
    assert res.intercept == states[best]["intercept"]
    expected = objective_np(data, states[best]["weights"], states[best]["intercept"], 1e-4)
    assert res.objective == pytest.approx(expected, rel=1e-9)


def test_without_early_stopping_the_last_weights_are_returned():
    data = planted_problem(n=300, d=20, seed=64)
    hold = _flipped(planted_problem(n=100, d=20, seed=64))
    params = SolverParams(solver="lbfgs", l2=1e-3, passes=6, early_stop_passes=0)
    with_hold = train_local(data, params, holdout=hold)
    without = train_local(data, params)
    assert with_hold.weights.tobytes() == without.weights.tobytes()
    assert with_hold.stop_reason == without.stop_reason
    assert all("holdout_loss" in e for e in with_hold.history)


def test_holdout_on_some_ranks_only():
    data = planted_problem(n=300, d=20, seed=65)
    hold = planted_problem(n=100, d=20, seed=66)
    params = SolverParams(solver="lbfgs", l2=1e-3, passes=4, early_stop_passes=0)
    results = train_on_tree(split_rows(data, 3), params, holdouts=[None, hold, CSRData.empty(20)])
    single = train_local(data, params, holdout=hold)
    got = [e["holdout_loss"] for e in results[0].history]
    np.testing.assert_allclose(got, [e["holdout_loss"] for e in single.history], rtol=1e-8)
    assert results[0].history == results[2].history
