"""The distributed objective and its kernel: gradient and Hessian diagonal against finite
differences for every loss (intercept included), the numpy reference, prediction, and
non-finite detection."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers import shard as shard_mod
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.errors import DivergenceError
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.kernels.objective import BAD_MARGIN, OK, loss_grad_hess
from terascale.solvers.kernels.sampling import SAMPLE_RUN
from terascale.solvers.objective import DistributedObjective
from terascale.solvers.predict import decision_function, predict_proba
from terascale.solvers.setup import Inputs
from terascale.solvers.shard import Shard
from tests.solvers.helpers import loss_np, objective_np, planted_problem

L2 = 0.03
#: losses whose ℓ'' the solvers use (the catalogue's curvature)
CURVED = [name for name, spec in LOSSES.items() if spec.curvature]


def _objective(data, loss, l2=L2):
    comm = LocalCommunicator()
    inputs = Inputs(0, data, None, loss)
    inputs.agree(comm)
    return DistributedObjective(inputs, comm, LOSS_IDS[loss], l2)


def _theta(d, seed=3):
    return np.random.default_rng(seed).normal(0.0, 0.5, d + 1)


@pytest.mark.parametrize("loss", sorted(LOSS_IDS))
def test_value_matches_numpy_reference(loss):
    data = planted_problem(n=300, d=25, seed=1, loss=loss, weighted=True)
    theta = _theta(25)
    got = _objective(data, loss).evaluate(theta).value
    assert got == pytest.approx(objective_np(data, theta[:-1], theta[-1], L2, loss), rel=1e-12)


@pytest.mark.parametrize("loss", sorted(LOSS_IDS))
def test_gradient_matches_finite_differences(loss):
    data = planted_problem(n=300, d=25, seed=2, loss=loss, weighted=True)
    obj = _objective(data, loss)
    theta = _theta(25)
    grad = obj.evaluate(theta).grad
    eps = 1e-6
    fd = np.empty_like(theta)
    for j in range(theta.shape[0]):  # the last coordinate is the intercept
        e = np.zeros_like(theta)
        e[j] = eps
        fd[j] = (obj.evaluate(theta + e).value - obj.evaluate(theta - e).value) / (2 * eps)
    # the hinge kink: a row within eps of margin 1 would spoil its difference; the data has none
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
    assert grad[-1] != 0.0


@pytest.mark.parametrize("loss", CURVED)
def test_hessian_diagonal_matches_finite_differences(loss):
    data = planted_problem(n=300, d=25, seed=4, loss=loss, weighted=True)
    obj = _objective(data, loss)
    theta = _theta(25)
    hess = obj.evaluate(theta, with_hessian=True).hess_diag
    eps = 1e-5
    fd = np.empty_like(theta)
    for j in range(theta.shape[0]):
        e = np.zeros_like(theta)
        e[j] = eps
        fd[j] = (obj.evaluate(theta + e).grad[j] - obj.evaluate(theta - e).grad[j]) / (2 * eps)
    np.testing.assert_allclose(hess, fd, rtol=1e-6, atol=1e-9)
    assert hess[-1] == pytest.approx(fd[-1]) and hess[-1] > 0  # intercept: no penalty


def test_hinge_hessian_is_the_penalty_only():
    data = planted_problem(n=100, d=10, seed=5, loss="hinge")
    hess = _objective(data, "hinge").evaluate(_theta(10), with_hessian=True).hess_diag
    np.testing.assert_array_equal(hess, np.r_[np.full(10, L2), 0.0])


def test_empty_shard_contributes_nothing():
    data = planted_problem(n=50, d=6, seed=6)
    s = Shard.from_csr(data.empty(6))
    grad = np.zeros(7)
    hess = np.zeros(7)
    assert loss_grad_hess(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, _theta(6), 0, grad, hess, 0, 0, 0.0) == (0.0, OK, -1)
    assert not grad.any() and not hess.any()


def test_non_finite_margin_is_reported_with_its_row():
    data = planted_problem(n=40, d=6, seed=7)
    s = Shard.from_csr(data)
    feature = int(s.indices[s.indptr[5]])  # the first feature of row 5
    theta = np.zeros(7)
    theta[feature] = np.inf
    first = next(r for r in range(40) if feature in s.indices[s.indptr[r] : s.indptr[r + 1]])
    _, status, row = loss_grad_hess(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, theta, 0,
                                    np.zeros(7), np.zeros(0), 0, s.n_rows, 0.0)
    assert status == BAD_MARGIN and row == first
    ev = _objective(data, "logistic", l2=0.0).evaluate(theta)
    assert not ev.finite
    with pytest.raises(DivergenceError, match=f"rank 0: non-finite margin at row {first}"):
        ev.raise_if_not_finite("at the test point")


def test_squared_loss_overflow_is_detected():
    data = planted_problem(n=20, d=4, seed=8, loss="squared")
    theta = np.full(5, 1e300)
    obj = _objective(data, "squared")
    assert not obj.evaluate(theta).finite
    with pytest.raises(DivergenceError, match="non-finite"):
        obj.value(theta)


def test_prediction_matches_scipy():
    data = planted_problem(n=80, d=12, seed=9)
    w = np.random.default_rng(0).normal(size=12).astype(np.float32)
    m = decision_function(data, w, 0.25)
    np.testing.assert_allclose(m, data.to_scipy() @ w.astype(np.float64) + 0.25, rtol=1e-6)
    p = predict_proba(data, w * 1e4, 0.0)  # huge margins: no overflow, p in [0, 1]
    assert np.isfinite(p).all() and p.min() >= 0.0 and p.max() <= 1.0


def _table_objective(data, loss, l2=L2):
    from terascale.solvers.active import ActiveFeatures
    from terascale.solvers.local_table import LocalTable

    obj = _objective(data, loss, l2)
    table = LocalTable(obj.shard)
    space = ActiveFeatures.agree(obj.comm, table.ids, data.n_features, np.zeros(data.n_features + 1))
    return obj.restricted(table.bind(space)), space


@pytest.mark.parametrize("loss", CURVED)
def test_curvature_along_a_direction_matches_the_dense_hessian_and_finite_differences(loss):
    data = planted_problem(n=300, d=25, seed=6, loss=loss, weighted=True)
    obj, space = _table_objective(data, loss)
    theta, p = _theta(space.size, seed=7), _theta(space.size, seed=8)
    # dense reference: pᵀ (Xᵀ diag(w·ℓ'') X / W + λ·I_β) p, X with a ones column for the intercept
    x = np.hstack([data.to_scipy().toarray()[:, space.ids], np.ones((data.n_rows, 1))])
    m, u = x @ theta, x @ p
    w = data.weights.astype(np.float64)
    ell2 = loss_np(loss, m, data.labels.astype(np.float64))[2]
    ref = np.sum(w * ell2 * u * u) / w.sum() + L2 * np.dot(p[:-1], p[:-1])
    got = obj.curvature(theta, p)
    assert got == pytest.approx(ref, rel=1e-12)
    eps = 1e-5
    fd = (obj.evaluate(theta + eps * p).grad - obj.evaluate(theta - eps * p).grad) @ p / (2 * eps)
    assert got == pytest.approx(fd, rel=1e-6)


def test_sampled_curvature_uses_every_stride_th_run_scaled_to_the_rank_weight(monkeypatch):
    """With a sample the rank adds exactly the rows of every stride-th run of SAMPLE_RUN rows
    (row chunks split runs without changing which rows) and scales their sum by its weight over
    theirs; a sample no smaller than the shard gives the exact curvature, bit for bit."""
    n = 5 * SAMPLE_RUN + 100
    data = planted_problem(n=n, d=30, density=0.2, seed=11, weighted=True)
    obj, space = _table_objective(data, "logistic")
    theta, p = 0.3 * _theta(space.size, seed=12), _theta(space.size, seed=13)
    x = np.hstack([data.to_scipy().toarray()[:, space.ids], np.ones((n, 1))])
    w = data.weights.astype(np.float64)
    stride = n // (2 * SAMPLE_RUN)  # 2: runs 0, 2 and 4
    rows = np.r_[0:SAMPLE_RUN, 2 * SAMPLE_RUN : 3 * SAMPLE_RUN, 4 * SAMPLE_RUN : 5 * SAMPLE_RUN]
    m, u = x[rows] @ theta, x[rows] @ p
    ell2 = 1.0 / (1.0 + np.exp(-m)) / (1.0 + np.exp(m))
    part = np.sum(w[rows] * ell2 * u * u) * (w.sum() / w[rows].sum())
    want = part / w.sum() + L2 * np.dot(p[:-1], p[:-1])
    assert stride == 2
    assert obj.curvature(theta, p, sample_rows=2 * SAMPLE_RUN) == pytest.approx(want, rel=1e-12)
    exact = obj.curvature(theta, p)
    assert obj.curvature(theta, p, sample_rows=n) == exact
    assert obj.curvature(theta, p, sample_rows=10 * n) == exact
    assert exact != obj.curvature(theta, p, sample_rows=2 * SAMPLE_RUN)
    monkeypatch.setattr(shard_mod, "CHUNK_ROWS", 700)  # chunk borders inside runs
    assert obj.curvature(theta, p, sample_rows=2 * SAMPLE_RUN) == pytest.approx(want, rel=1e-12)


def test_sampled_curvature_estimates_the_exact_one_on_a_large_shard():
    """About 1/16 of the rows of a 65k-row shard estimate pᵀ∇²f·p within 2%."""
    data = planted_problem(n=1 << 16, d=400, density=0.03, seed=14)
    obj, space = _table_objective(data, "logistic", l2=1e-6)
    theta, p = 0.2 * _theta(space.size, seed=15), _theta(space.size, seed=16)
    exact = obj.curvature(theta, p)
    est = obj.curvature(theta, p, sample_rows=1 << 12)
    assert est != exact
    assert est == pytest.approx(exact, rel=0.02)


def test_curvature_reports_a_non_finite_margin_and_needs_the_table():
    data = planted_problem(n=50, d=6, seed=9)
    obj, space = _table_objective(data, "logistic")
    theta = np.zeros(space.size + 1)
    theta[0] = np.inf
    assert obj.curvature(theta, np.ones(space.size + 1)) is None
    with pytest.raises(RuntimeError, match="working table"):
        _objective(data, "logistic").curvature(np.zeros(7), np.ones(7))
