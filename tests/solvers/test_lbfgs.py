"""L-BFGS (and the hybrid) reach the optimum of the mean-form objective: scikit-learn's
LogisticRegression on generated data and on the bundled breast-cancer data read through the
project's LibSVM parser, and the closed-form ridge solution for the squared loss."""

from __future__ import annotations

import io

import numpy as np
import pytest

from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.spec import FeatureSpec
from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.linesearch import strong_wolfe
from tests.solvers.helpers import (
    objective_np,
    planted_problem,
    ridge_closed_form,
    sklearn_logistic,
    train_local,
)

TIGHT = {"tol": 1e-12, "passes": 200}


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_reaches_sklearn_optimum_on_generated_data(solver):
    data = planted_problem(n=800, d=60, seed=21)
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    res = train_local(data, SolverParams(solver=solver, l2=l2, **TIGHT))
    assert res.objective == pytest.approx(f_sk, rel=1e-6)
    assert res.objective <= f_sk * (1 + 1e-9)  # not worse than sklearn beyond rounding
    # the returned float32 weights have (nearly) the reported objective
    assert objective_np(data, res.weights, res.intercept, l2) == pytest.approx(res.objective, rel=1e-6)
    np.testing.assert_allclose(res.weights, coef, atol=2e-3 * max(1.0, np.abs(coef).max()))
    assert res.intercept == pytest.approx(b, abs=2e-3)


def _breast_cancer_via_libsvm() -> CSRData:
    """sklearn's bundled breast-cancer data, standardized, written as LibSVM text and parsed
    back with the project's own parser."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    out = io.StringIO()
    for row, label in zip(x, y, strict=True):
        out.write(f"{int(label)} " + " ".join(f"{j + 1}:{v:.9g}" for j, v in enumerate(row) if v != 0) + "\n")
    text = out.getvalue().encode()
    spec = FeatureSpec(format="libsvm", bits=5, libsvm_index_base=1)  # 2^5 = 32 >= 30 columns
    pb = BlockParser(spec, 65536).parse(np.frombuffer(text, dtype=np.uint8))
    n = pb.labels.shape[0]
    assert n == x.shape[0]
    return CSRData(pb.indptr.astype(np.int64).copy(), pb.indices.copy(), pb.values.copy(),
                   pb.labels.copy(), np.ones(n, np.float32), 1 << spec.bits)


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_reaches_sklearn_optimum_on_breast_cancer(solver):
    data = _breast_cancer_via_libsvm()
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    res = train_local(data, SolverParams(solver=solver, l2=l2, **TIGHT))
    assert res.objective == pytest.approx(f_sk, rel=1e-6)
    assert res.stop_reason in ("converged_grad", "converged_objective", "line_search_failed")


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_squared_loss_reaches_the_closed_form_ridge(solver):
    data = planted_problem(n=500, d=30, seed=22, loss="squared", weighted=True)
    l2 = 1e-2
    coef, b = ridge_closed_form(data, l2)
    f_star = objective_np(data, coef, b, l2, "squared")
    res = train_local(data, SolverParams(solver=solver, loss="squared", l2=l2, **TIGHT))
    assert res.objective == pytest.approx(f_star, rel=1e-9)
    np.testing.assert_allclose(res.weights, coef, rtol=1e-4, atol=1e-5)
    assert res.intercept == pytest.approx(b, abs=1e-5)


def test_history_of_an_lbfgs_run():
    data = planted_problem(n=300, d=20, seed=23)
    res = train_local(data, SolverParams(solver="hybrid", l2=1e-3, passes=6))
    h = res.history
    assert [e["pass"] for e in h] == list(range(1, len(h) + 1))
    assert h[0]["phase"] == "online" and h[0]["objective"] is None and h[0]["progressive_loss"] > 0
    lb = [e for e in h if e["phase"] == "lbfgs"]
    assert lb and all(e["objective"] is not None and e["grad_norm"] >= 0 and e["evaluations"] >= 1 for e in lb)
    assert all(b["objective"] <= a["objective"] for a, b in zip(lb, lb[1:], strict=False))
    for e in h:
        assert len(e["compute_s"]) == len(e["stall_s"]) == len(e["transfer_s"]) == 1
        assert e["elapsed_s"] >= 0 and e["elapsed_all_s"] == e["elapsed_s"] and "holdout_loss" not in e  # K = 1
    assert h[-1]["objective"] == res.objective


def test_the_lbfgs_phase_records_its_starting_objective_and_when_it_was_known():
    data = planted_problem(n=300, d=20, seed=23)
    online = train_local(data, SolverParams(solver="hybrid", l2=1e-3, passes=1))  # the online average
    for solver, start in (("hybrid", online.objective), ("lbfgs", np.log(2.0))):  # lbfgs: f(0) = log 2
        h = train_local(data, SolverParams(solver=solver, l2=1e-3, passes=6)).history
        i = next(i for i, e in enumerate(h) if e["phase"] == "lbfgs")
        first, before = h[i], (h[i - 1]["elapsed_s"] if i else 0.0)
        assert first["start_objective"] == pytest.approx(start, rel=1e-12), solver
        assert first["objective"] < first["start_objective"]
        assert 0.0 <= first["start_objective_s"] <= first["elapsed_s"] - before
        assert [e for e in h if "start_objective" in e or "start_objective_s" in e] == [first]


def test_hinge_loss_trains():
    data = planted_problem(n=400, d=20, seed=24, loss="hinge")
    l2 = 1e-2
    res = train_local(data, SolverParams(solver="hybrid", loss="hinge", l2=l2, passes=30))
    zero = objective_np(data, np.zeros(20), 0.0, l2, "hinge")
    assert res.objective < 0.8 * zero
    assert res.objective == pytest.approx(objective_np(data, res.weights, res.intercept, l2, "hinge"), rel=1e-5)


def _quadratic_phi(a: float, b: float):
    """φ(α) = a·(α − b)² along a line; returns (φ, φ', payload, finite)."""
    calls = []

    def phi(alpha):
        calls.append(alpha)
        return a * (alpha - b) ** 2, 2 * a * (alpha - b), alpha, True

    return phi, calls


@pytest.mark.parametrize("b", [1e-3, 0.3, 1.0, 7.0, 300.0])
def test_line_search_satisfies_strong_wolfe(b):
    phi, _ = _quadratic_phi(2.0, b)
    f0, d0, _, _ = phi(0.0)
    res = strong_wolfe(phi, f0, d0, 1.0)
    assert res.ok and res.wolfe
    t = res.trial
    assert t.value <= f0 + 1e-4 * t.alpha * d0
    assert abs(t.slope) <= 0.9 * abs(d0)


def test_line_search_backs_off_non_finite_values():
    def phi(alpha):
        if alpha > 0.01:
            return float("inf"), float("nan"), None, False
        return (alpha - 0.005) ** 2, 2 * (alpha - 0.005), alpha, True

    res = strong_wolfe(phi, 0.005**2, -0.01, 1.0)
    assert res.ok and 0 < res.trial.alpha <= 0.01 and res.any_finite


def test_line_search_rejects_an_ascent_direction():
    phi, _ = _quadratic_phi(1.0, 1.0)
    with pytest.raises(ValueError, match="descent"):
        strong_wolfe(phi, 1.0, 0.5, 1.0)


def _one_hot_fields(n: int, fields: int, levels: int, seed: int) -> CSRData:
    """Click-like rows: one active level per field (so every field's columns sum to the
    intercept column), labels from a planted model."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    cols = rng.integers(0, levels, (n, fields)) + np.arange(fields) * levels
    x = sp.csr_matrix((np.ones(n * fields), cols.ravel(), np.arange(0, n * fields + 1, fields)),
                      shape=(n, fields * levels))
    beta = rng.normal(0.0, 0.7, fields * levels)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ beta) + 1.0))).astype(np.float64)
    return CSRData.from_scipy(x, y)


def test_the_first_line_searches_start_at_the_newton_step():
    """On one-hot click-like rows, step 1 along the first (Jacobi) direction overshoots: each
    margin moves by the sum of ~fields coordinates. The 1-D Newton step from one curvature pass
    lands near the line minimum: the first pass takes fewer evaluations, same optimum; with
    lbfgs_newton_steps = k the first k L-BFGS passes make one curvature pass each."""
    data = _one_hot_fields(3000, 12, 15, seed=5)
    runs = {k: train_local(data, SolverParams(solver="hybrid", l2=1e-4, lbfgs_newton_steps=k, **TIGHT))
            for k in (0, 1, 2)}
    old, new = runs[0].history[1], runs[1].history[1]
    # evaluations of the first L-BFGS pass include the one at the starting point
    assert old["evaluations"] >= 3 and "curvature_passes" not in old
    assert new["curvature_passes"] == 1 and new["evaluations"] == 2  # accepted at the first trial
    for k, res in runs.items():
        assert res.objective == pytest.approx(runs[0].objective, rel=1e-9)
        assert [e.get("curvature_passes", 0) for e in res.history[1:]][: k + 1] == [1] * k + [0]
        assert all("curvature_passes" not in e for e in res.history[k + 1 :])


def test_hinge_starts_at_step_one_and_a_bad_newton_step_falls_back_to_one():
    """The hinge loss has no curvature: no curvature pass, step 1 (a penalty-only Newton step
    along the unpenalized intercept would be absurd). A curvature that is not a finite positive
    number gives step 1 too."""
    import math

    from terascale.solvers.lbfgs import LBFGSPhase

    data = planted_problem(n=400, d=20, seed=31)
    res = train_local(data, SolverParams(solver="hybrid", loss="hinge", l2=1e-3, passes=8))
    assert all("curvature_passes" not in e for e in res.history)
    assert res.stop_reason != "line_search_failed" and res.history[1]["step"] is not None

    class Fake:
        memory = type("M", (), {"count": 0})()
        run = type("R", (), {"params": SolverParams(), "loss_id": 0})()
        theta = None

        def __init__(self, curv):
            self.objective = type("O", (), {"curvature": staticmethod(lambda theta, p, sample_rows: curv)})()

    for curv, want in ((2.0, 0.5), (math.inf, 1.0), (None, 1.0), (0.0, 1.0), (-1.0, 1.0), (1e-320, 1.0)):
        assert LBFGSPhase._first_step(Fake(curv), None, -1.0) == (want, 1)
