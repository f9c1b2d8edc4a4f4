"""Every problem's optimum against scikit-learn on the same objective, on generated data and on
scikit-learn's bundled data sets parsed from LibSVM text by the project's own parser."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd import CocoaParams, train_cocoa
from tests.scd.helpers import (
    breast_cancer,
    diabetes,
    make_data,
    model_vector,
    objective,
    run_ranks,
    sklearn_fit,
    split_rows,
)

LAM = 1e-2
DUAL = [name for name, spec in LOSSES.items() if spec.dual]
BINARY_DUAL = [name for name in DUAL if LOSSES[name].labels == "binary"]
CASES = [(loss, "dual") for loss in DUAL] + [("squared", "primal")]


def _tol(loss: str) -> float:
    """A smooth loss (ℓ' Lipschitz: the catalogue's curvature) has a strongly concave dual and
    SDCA's gap falls linearly; the hinge dual converges sublinearly."""
    return 1e-11 if LOSSES[loss].curvature else 1e-9


def _params(loss, formulation, **kw):
    return CocoaParams(loss=loss, formulation=formulation, l2=kw.pop("l2", LAM),
                       tol=_tol(loss), max_rounds=5000, **kw)


def _train(data, loss, formulation, **kw):
    return train_cocoa(data, LocalCommunicator(), _params(loss, formulation, **kw))


def _check(loss, data, result, lam, fit_intercept=True, scaling=1.0):
    """Gap below 1e-6, objective equal to scikit-learn's, coefficients close (the gap bounds
    ||beta - beta*||^2 <= 2 gap / lam by strong convexity)."""
    assert result.converged and 0.0 <= result.gap < 1e-6
    ref = sklearn_fit(loss, data, lam, scaling if fit_intercept else None)
    ours = model_vector(result, fit_intercept, scaling)
    p_ours = objective(loss, data, ours, lam, scaling if fit_intercept else None)
    p_ref = objective(loss, data, ref, lam, scaling if fit_intercept else None)
    assert p_ours == pytest.approx(p_ref, rel=1e-7, abs=1e-9)
    assert p_ours == pytest.approx(result.primal, rel=1e-6)
    bound = np.sqrt(2.0 * result.gap / lam)  # + float32 rounding of our weights
    assert np.linalg.norm(ours - ref) <= bound + 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("loss, formulation", CASES)
def test_generated_data(loss, formulation):
    data = make_data(loss, seed=1)
    _check(loss, data, _train(data, loss, formulation), LAM)


@pytest.mark.parametrize("loss, formulation", [("squared", "dual"), ("logistic", "dual"), ("squared_hinge", "dual"),
                                               ("squared", "primal")])
def test_importance_weights(loss, formulation):
    data = make_data(loss, seed=2, weighted=True)
    _check(loss, data, _train(data, loss, formulation), LAM)


@pytest.mark.parametrize("loss, formulation", CASES)
def test_without_intercept(loss, formulation):
    data = make_data(loss, seed=3)
    result = _train(data, loss, formulation, fit_intercept=False)
    assert result.intercept == 0.0
    _check(loss, data, result, LAM, fit_intercept=False)


def test_intercept_scaling():
    data = make_data("logistic", seed=4)
    result = _train(data, "logistic", "dual", intercept_scaling=3.0)
    _check("logistic", data, result, LAM, scaling=3.0)


@pytest.mark.parametrize("loss", BINARY_DUAL)
def test_breast_cancer(loss):
    data = breast_cancer()
    assert data.n_rows == 569 and data.n_features == 32
    _check(loss, data, _train(data, loss, "dual", l2=1e-2), 1e-2)


@pytest.mark.parametrize("formulation", ["dual", "primal"])
def test_diabetes_ridge(formulation):
    data = diabetes()
    assert data.n_rows == 442 and data.n_features == 16
    _check("squared", data, _train(data, "squared", formulation, l2=1e-3), 1e-3)


def test_two_ranks_reach_the_sklearn_optimum():
    """Squared hinge on K = 2 ranks (real TreeNodes, adaptive aggregation): LinearSVC's optimum
    (its default loss), as on one rank."""
    loss = "squared_hinge"
    data = make_data(loss, seed=5)
    results = run_ranks(split_rows(data, 2),
                        lambda shard, node: train_cocoa(shard, node, _params(loss, "dual")))
    assert results[0].weights.tobytes() == results[1].weights.tobytes()
    _check(loss, data, results[0], LAM)
