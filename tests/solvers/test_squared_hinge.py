"""The squared hinge (the L2-SVM loss) through the train API's solvers, against two references
on the catalogue's objective f(β, b) = mean loss + (λ/2)‖β‖², b unpenalized:

* scipy's L-BFGS-B on the numpy reference objective with its exact gradient (f is smooth: ℓ' is
  Lipschitz), run to machine precision: the exact optimum f*;
* scikit-learn's LinearSVC (its default loss is the squared hinge), C = 1/(N·λ). liblinear
  penalizes its bias like a weight (a constant feature of value ``intercept_scaling``), so it
  minimises f + (λ/2)·(b/s)²: with s = 1e3 its f is f* to float64 resolution; with s = 1 it is
  exactly CoCoA's objective (the same augmented constant feature).

Tolerances are stated where they are used: L-BFGS and the hybrid reach f* to 1e-9 relative
(measured: a few 1e-14); the online solver, AdaGrad with a weighted average and no decay, is
within 2% after 20 passes (measured 0.7%); CoCoA's f lies between f* and f* + (λ/2)·b*² + its gap.
"""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.api import SolverParams
from tests.solvers.helpers import (
    objective_np,
    planted_problem,
    scipy_optimum,
    sklearn_squared_hinge,
    train_local,
)

LOSS = "squared_hinge"
CASES = {  # name -> (data, λ)
    "plain": (dict(n=800, d=60, seed=21), 1e-3),
    "weighted": (dict(n=800, d=60, seed=22, weighted=True), 1e-2),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    kw, l2 = CASES[request.param]
    data = planted_problem(loss=LOSS, **kw)
    w, b, f_star = scipy_optimum(data, l2, LOSS)
    return data, l2, w, b, f_star


def test_the_two_references_agree(case):
    data, l2, w, b, f_star = case
    coef, intercept = sklearn_squared_hinge(data, l2, intercept_scaling=1e3)
    assert objective_np(data, coef, intercept, l2, LOSS) == pytest.approx(f_star, rel=1e-12)
    np.testing.assert_allclose(coef, w, atol=1e-6)
    assert intercept == pytest.approx(b, abs=1e-6)
    assert f_star < objective_np(data, np.zeros(data.n_features), 0.0, l2, LOSS) == 1.0


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_lbfgs_and_hybrid_reach_the_optimum(case, solver):
    data, l2, w, b, f_star = case
    res = train_local(data, SolverParams(solver=solver, loss=LOSS, l2=l2, tol=1e-12, passes=200))
    assert res.objective == pytest.approx(f_star, rel=1e-9)
    assert res.objective >= f_star * (1 - 1e-12)  # f* is the minimum, to scipy's precision
    # the returned float32 weights have (nearly) the reported objective
    assert objective_np(data, res.weights, res.intercept, l2, LOSS) == pytest.approx(res.objective, rel=1e-6)
    np.testing.assert_allclose(res.weights, w, atol=1e-5 * max(1.0, np.abs(w).max()))
    assert res.intercept == pytest.approx(b, abs=1e-5)


def test_online_passes_get_close(case):
    """No convergence to f* is claimed (a fixed learning rate): within 2% after 20 passes."""
    data, l2, _, _, f_star = case
    res = train_local(data, SolverParams(solver="online", loss=LOSS, l2=l2, passes=20))
    assert f_star <= res.objective <= 1.02 * f_star
    assert objective_np(data, res.weights, res.intercept, l2, LOSS) == pytest.approx(res.objective, rel=1e-6)


def test_cocoa_reaches_linearsvc_with_the_same_penalized_bias(case):
    """CoCoA (intercept_scale s = 1) and LinearSVC(intercept_scaling=1) minimise the same
    g = f + (λ/2)·b²; the train API reports f itself, which g's minimiser keeps within
    [f*, f* + (λ/2)·b*² + gap] (f ≤ g ≤ g* + gap ≤ g(β*, b*) + gap)."""
    data, l2, _, b, f_star = case
    tol = 1e-12  # the relative gap; P(0) = 1 for the squared hinge, so it is absolute too
    res = train_local(data, SolverParams(solver="cocoa", loss=LOSS, l2=l2, tol=tol, passes=3000,
                                         intercept_scale=1.0))
    assert res.stop_reason == "converged_gap"

    def g(weights, intercept):
        return objective_np(data, weights, intercept, l2, LOSS) + 0.5 * l2 * intercept**2

    coef, intercept = sklearn_squared_hinge(data, l2, intercept_scaling=1.0)
    assert g(res.weights, res.intercept) == pytest.approx(g(coef, intercept), rel=1e-9)
    assert res.objective == pytest.approx(objective_np(data, res.weights, res.intercept, l2, LOSS), rel=1e-12)
    assert f_star * (1 - 1e-12) <= res.objective <= f_star + 0.5 * l2 * b**2 + tol + 1e-7 * f_star
