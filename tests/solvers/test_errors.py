"""Bad inputs and divergence stop training with a clear error on every rank, naming what and
where; no NaN model is ever returned."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.api import SolverParams, train
from terascale.solvers.data import CSRData
from terascale.solvers.errors import DivergenceError, InvalidInputError, NonFiniteInputError
from tests.allreduce.harness import run_tree
from tests.solvers.helpers import TREE_NODE_KWARGS, planted_problem, split_rows, train_local


def _with(data: CSRData, **arrays) -> CSRData:
    fields = {k: getattr(data, k).copy() for k in ("indptr", "indices", "values", "labels", "weights")}
    for name, (pos, value) in arrays.items():
        fields[name][pos] = value
    return CSRData(**fields, n_features=data.n_features)


@pytest.mark.parametrize("array,pos,value,match", [
    ("values", 5, np.nan, r"values\[5\] = nan \(row \d+\) is not finite"),
    ("values", 0, np.inf, r"values\[0\] = inf"),
    ("labels", 3, np.nan, r"labels\[3\] = nan is not finite"),
    ("weights", 7, np.nan, r"weights\[7\] = nan is not finite"),
    ("weights", 2, -np.inf, r"weights\[2\] = -inf is not finite"),
])
def test_non_finite_inputs(array, pos, value, match):
    bad = _with(planted_problem(n=50, d=8, seed=41), **{array: (pos, value)})
    with pytest.raises(NonFiniteInputError, match="rank 0 training data: " + match):
        train_local(bad, SolverParams())


@pytest.mark.parametrize("array,pos,value,match", [
    ("labels", 4, 0.5, r"labels\[4\] = 0.5: the logistic loss takes labels 0 or 1"),
    ("weights", 1, -1.0, r"weights\[1\] = -1.0: must be >= 0"),
    ("indices", 2, 8, r"indices\[2\] = 8 is outside \[0, n_features = 8\)"),
    ("indices", 0, -1, r"indices\[0\] = -1"),
])
def test_invalid_inputs(array, pos, value, match):
    bad = _with(planted_problem(n=50, d=8, seed=42), **{array: (pos, value)})
    with pytest.raises(InvalidInputError, match=match):
        train_local(bad, SolverParams())


def test_non_finite_holdout_is_named():
    data = planted_problem(n=50, d=8, seed=43)
    hold = _with(planted_problem(n=20, d=8, seed=44), labels=(0, np.nan))
    with pytest.raises(NonFiniteInputError, match=r"rank 0 held-out data: labels\[0\] = nan"):
        train_local(data, SolverParams(), holdout=hold)


def test_no_training_weight():
    data = planted_problem(n=10, d=4, seed=45)
    zero = CSRData(data.indptr, data.indices, data.values, data.labels, np.zeros(10, np.float32), 4)
    with pytest.raises(InvalidInputError, match="no training data"):
        train_local(zero, SolverParams())


def test_every_rank_raises_when_one_rank_has_bad_data():
    shards = split_rows(planted_problem(n=120, d=8, seed=46), 3)
    shards[1] = _with(shards[1], labels=(2, np.nan))

    def body(node):
        return train(shards[node.rank], node, SolverParams())

    run = run_tree(3, body, node_kwargs=TREE_NODE_KWARGS, check=False)
    assert isinstance(run.errors[1], NonFiniteInputError)
    assert "rank 1 training data: labels[2] = nan" in str(run.errors[1])
    for r in (0, 2):
        assert isinstance(run.errors[r], NonFiniteInputError)
        assert "rank(s) [1]" in str(run.errors[r])


def test_ranks_must_agree_on_the_number_of_features():
    data = planted_problem(n=40, d=8, seed=47)
    shards = split_rows(data, 2)
    shards[1] = CSRData(shards[1].indptr, shards[1].indices, shards[1].values, shards[1].labels,
                        shards[1].weights, 16)
    run = run_tree(2, lambda node: train(shards[node.rank], node, SolverParams()),
                   node_kwargs=TREE_NODE_KWARGS, check=False)
    assert all(isinstance(e, InvalidInputError) and "disagree on n_features" in str(e) for e in run.errors)


def test_absurd_learning_rate_diverges_with_a_clear_error():
    """Plain (non-invariant) steps: an exploding loss at 1e6, an overflowing squared gradient
    at 1e20 (adaptive steps move each weight by at most ~learning_rate per example)."""
    data = planted_problem(n=400, d=20, seed=48, loss="squared")
    params = SolverParams(solver="online", l2=1e-6, loss="squared", learning_rate=1e6, invariant=False, passes=3)
    with pytest.raises(DivergenceError, match=r"diverged in online pass 1 \(learning_rate = 1000000.0\): exploding loss"):
        train_local(data, params)
    params = SolverParams(solver="online", l2=1e-6, loss="squared", learning_rate=1e20, invariant=False, passes=3)
    with pytest.raises(DivergenceError, match=r"diverged in online pass 1 \(learning_rate = 1e\+20\): rank 0: non-finite update at row \d+"):
        train_local(data, params)


def test_divergence_raises_on_every_rank():
    shards = split_rows(planted_problem(n=400, d=20, seed=49, loss="squared"), 2)
    params = SolverParams(solver="hybrid", loss="squared", learning_rate=1e6, invariant=False, passes=3)
    run = run_tree(2, lambda node: train(shards[node.rank], node, params),
                   node_kwargs=TREE_NODE_KWARGS, check=False)
    assert all(isinstance(e, DivergenceError) for e in run.errors), run.errors


def test_invariant_updates_do_not_diverge_with_the_same_learning_rate():
    data = planted_problem(n=400, d=20, seed=48, loss="squared")
    res = train_local(data, SolverParams(solver="online", l2=1e-6, loss="squared", learning_rate=1e6, passes=3))
    assert np.isfinite(res.weights).all() and np.isfinite(res.objective)


@pytest.mark.parametrize("kwargs,match", [
    ({"l2": -1.0}, r"train.l2 = -1.0: must be 'auto' or a finite number in \[0, inf\)"),
    ({"l2": float("nan")}, r"train.l2 = nan"),
    ({"loss": "log"}, r"train.loss = 'log': must be one of 'logistic', 'squared', 'hinge', 'squared_hinge'"),
    ({"passes": 0}, r"train.passes = 0: must be an integer in \[1, 100000\]"),
    ({"online_passes": 5, "passes": 3}, r"train.online_passes = 5: must be <= train.passes \(3\)"),
    ({"learning_rate": 0.0}, r"train.learning_rate = 0.0: must be a finite number in \(0, inf\)"),
    ({"lbfgs_memory": 0}, r"train.lbfgs_memory = 0"),
    ({"shuffle": 1}, r"train.shuffle = 1: must be true or false"),
    ({"solver": "cocoa", "l2": 0.0}, r"train.l2 = 0.0: must be > 0 with train.solver = 'cocoa'"),
    ({"solver": "cocoa", "loss": "squared", "formulation": "primal", "partition": "redeal"},
     r"train.partition = 'redeal': needs train.formulation = 'dual'"),
])
def test_parameter_errors_name_key_value_and_constraint(kwargs, match):
    """One error format (terascale.solvers.constraints), raised at construction: the train job
    builds its SolverParams on the driver, before Spark starts."""
    with pytest.raises(ValueError, match=r"^" + match):
        SolverParams(**kwargs)


def test_unknown_solver():
    with pytest.raises(ValueError, match=r"train.solver = 'nope': must be one of the registered solvers 'hybrid', "):
        SolverParams(solver="nope")
