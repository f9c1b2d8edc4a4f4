"""The solver catalogue: built-ins registered, plugins can register a SolverSpec, names are
unique, and a plugin solver gets the full TrainRun (objective, tracker, checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.api import SOLVERS, SolverParams, SolverSpec, register_solver
from terascale.solvers.catalogue import COMMON
from tests.solvers.helpers import keep, planted_problem, train_local


def test_builtins_are_registered():
    assert {"online", "lbfgs", "hybrid", "cocoa"} <= set(SOLVERS)
    for spec in SOLVERS.values():  # every entry function resolves
        assert callable(spec.function())


def test_a_plugin_solver_registers_and_runs():
    name = "test-gradient-descent"

    def gradient_descent(run):
        theta = np.zeros(run.n_features + 1)
        ev = None
        for _ in range(run.params.passes):
            ev = run.objective.evaluate(theta)
            theta = theta - 1.0 * ev.grad
            run.tracker.finish_pass("gd", theta, objective=ev.value, grad_norm=None, step=1.0)
            run.checkpoint("gd", theta, None, {}, {})
        return run.finish(theta, None, "max_passes")

    register_solver(SolverSpec(name, gradient_descent, "gradient descent", COMMON, ("logistic",)), replace=True)
    try:
        states = []
        data = planted_problem(n=200, d=10, seed=71)
        res = train_local(data, SolverParams(solver=name, passes=5, l2=1e-2), on_pass_end=keep(states))
        assert res.passes == 5 and len(states) == 5 and res.history[0]["phase"] == "gd"
        assert res.history[-1]["objective"] > res.objective  # objective recomputed at the end
    finally:
        SOLVERS.pop(name, None)


def test_names_are_unique():
    with pytest.raises(ValueError, match="already registered"):
        register_solver(SolverSpec("lbfgs", lambda run: None, "", COMMON, ("logistic",)))
    with pytest.raises(ValueError, match="non-empty"):
        register_solver(SolverSpec("", lambda run: None, "", COMMON, ("logistic",)))
    with pytest.raises(ValueError, match="unknown parameters or losses"):
        register_solver(SolverSpec("x", lambda run: None, "", COMMON + ("no_such_key",), ("logistic",)))
