"""Adaptive aggregation: the gamma the solver computes equals a brute-force line search (dense
grid, then bounded refinement) of the objective along the aggregated proposal of K = 4 workers,
the objective evaluated from its definition."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd import CocoaParams, train_cocoa
from terascale.solvers.scd.line_search import (
    dual_line_sums,
    hinge_gamma,
    logistic_gamma,
    logistic_line_derivs,
    ridge_dual_gamma,
    ridge_primal_gamma,
    seq_dot,
    squared_hinge_gamma,
)
from terascale.solvers.scd.local_solver import DualLocalSolver, PrimalLocalSolver
from terascale.solvers.scd.losses import loss_code
from terascale.solvers.scd.partition import FeatureBlock, feature_block
from tests.scd.helpers import dense_augmented, make_data, objective

LAM = 1e-2
K = 4


def _state_after(data, loss, formulation, rounds):
    """(local, shared) after a few rounds of a single-rank run: a point away from the start."""
    states = []
    params = CocoaParams(loss=loss, formulation=formulation, l2=LAM, max_rounds=rounds, tol=0.0)
    train_cocoa(data, LocalCommunicator(), params, on_round_end=states.append)
    return states[-1].local, states[-1].shared


def _brute_force(f, hi):
    """argmin of f on [0, hi]: a 4001-point grid, then a bounded search around the best point."""
    grid = np.linspace(0.0, hi, 4001)
    vals = np.array([f(g) for g in grid])
    j = int(np.argmin(vals))
    lo, up = grid[max(j - 1, 0)], grid[min(j + 1, grid.size - 1)]
    res = minimize_scalar(f, bounds=(lo, up), method="bounded", options={"xatol": 1e-12})
    return min([res.x, grid[j]], key=f)


def _dual_proposal(data, loss, alpha, w):
    """Each of K row blocks runs one sigma' = 1 epoch from (alpha, w); sum of the proposals."""
    x = data.to_scipy()
    n_w = float(data.weights.sum(dtype=np.float64))
    cuts = np.linspace(0, data.n_rows, K + 1).astype(int)
    dalpha, dw = np.zeros_like(alpha), np.zeros_like(w)
    from terascale.solvers.data import CSRData

    for k in range(K):
        a, b = cuts[k], cuts[k + 1]
        shard = CSRData.from_scipy(x[a:b], data.labels[a:b], data.weights[a:b], data.n_features)
        solver = DualLocalSolver(shard, loss_code(loss), LAM, n_w, 1.0)
        new_alpha, u = solver.solve(alpha[a:b], w, 1.0, 1, seed=5, rank=k, round_index=1)
        dalpha[a:b] = new_alpha - alpha[a:b]
        dw += u - w
    return dalpha, dw


def _dual_objective(data, loss, alpha):
    """D(alpha) from the definition, w(alpha) recomputed from alpha."""
    x = dense_augmented(data, 1.0)
    y, c = data.labels.astype(np.float64), data.weights.astype(np.float64)
    n_w = c.sum()
    w = x.T @ (c * alpha) / (LAM * n_w)
    b = (2 * y - 1) * alpha
    if loss == "squared":
        h = alpha * y - 0.5 * alpha**2
    elif loss == "hinge":
        h = np.clip(b, 0.0, 1.0)
    elif loss == "squared_hinge":
        b = np.maximum(b, 0.0)
        h = b - 0.25 * b**2
    elif loss == "logistic":
        b = np.clip(b, 0.0, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.nan_to_num(b * np.log(b)) - np.nan_to_num((1 - b) * np.log1p(-b))
    else:
        raise ValueError(f"no reference dual for loss {loss!r}")
    return c @ h / n_w - 0.5 * LAM * w @ w


@pytest.mark.parametrize("loss", [name for name, spec in LOSSES.items() if spec.dual])
def test_dual_gamma_equals_brute_force(loss):
    data = make_data(loss, seed=11)
    alpha, w = _state_after(data, loss, "dual", rounds=2)
    dalpha, dw = _dual_proposal(data, loss, alpha, w)
    n_w = float(data.weights.sum(dtype=np.float64))
    code = loss_code(loss)
    p0, p1, gmax = dual_line_sums(code, data.labels, data.weights, alpha, dalpha)
    wd, dd = seq_dot(w, dw), seq_dot(dw, dw)
    if loss == "squared":
        gamma = ridge_dual_gamma(p0, p1, wd, dd, LAM, n_w)
    elif loss == "hinge":
        gamma = hinge_gamma(p0, wd, dd, LAM, n_w, gmax)
    elif loss == "squared_hinge":
        gamma = squared_hinge_gamma(p0, p1, wd, dd, LAM, n_w, gmax)
    elif loss == "logistic":
        comm = LocalCommunicator()

        def derivs(g):
            return tuple(comm.allreduce_scalars(
                list(logistic_line_derivs(data.labels, data.weights, alpha, dalpha, g))))

        gamma = logistic_gamma(derivs, wd, dd, LAM, n_w, gmax, start=1.0 / K)
    else:
        raise ValueError(f"no line search for loss {loss!r}")
    assert gmax >= 1.0 - 1e-12
    hi = min(gmax, 4.0 * max(gamma, 1.0))
    best = _brute_force(lambda g: -_dual_objective(data, loss, alpha + g * dalpha), hi)
    assert gamma == pytest.approx(best, rel=1e-6, abs=1e-7)
    assert 1.0 / K < gamma  # the optimum is well away from averaging on this data


def _sub_block(block: FeatureBlock, cols: np.ndarray) -> FeatureBlock:
    """The columns ``cols`` (slots of ``block``) as a block of their own."""
    starts, stops = block.colptr[cols], block.colptr[cols + 1]
    take = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])
    colptr = np.concatenate([[0], np.cumsum(stops - starts)]).astype(np.int64)
    return replace(block, colptr=colptr, rows=block.rows[take], vals=block.vals[take],
                   owned=block.owned[cols])


def test_primal_gamma_equals_brute_force():
    data = make_data("squared", seed=12)
    beta, z = _state_after(data, "squared", "primal", rounds=1)
    full = feature_block(data, LocalCommunicator(), 1.0)
    n_w = float(data.weights.sum(dtype=np.float64))
    dbeta, dz = np.zeros_like(beta), np.zeros_like(z)
    for k in range(K):
        cols = np.arange(k, beta.shape[0], K)
        solver = PrimalLocalSolver(_sub_block(full, cols), LAM, n_w)
        new_beta, u = solver.solve(beta[cols], z, 1.0, 1, seed=5, rank=k, round_index=1)
        dbeta[cols] = new_beta - beta[cols]
        dz += u - z
    from terascale.solvers.scd.primal_kernels import residual_direction_sums

    a, b = residual_direction_sums(z, dz, full.labels, full.weights)
    gamma = ridge_primal_gamma(a, b, seq_dot(beta, dbeta), seq_dot(dbeta, dbeta), LAM, n_w)
    best = _brute_force(lambda g: objective("squared", data, beta + g * dbeta, LAM), 4.0)
    assert gamma == pytest.approx(best, rel=1e-6, abs=1e-7)
    assert 1.0 / K < gamma


def test_logistic_gamma_at_the_feasibility_limit_takes_two_evaluations():
    """phi' > 0 all the way to gamma_max (the limit is set by a coordinate with b ~ 0 and a
    tiny step): the search tests the limit instead of halving the distance ~40 times."""
    labels = np.array([1.0, 1.0, 0.0], np.float32)
    weights = np.ones(3, np.float32)
    alpha = np.array([0.1, 2e-15, -0.1])
    dalpha = np.array([0.1, -1e-15, -0.05])  # row 1 reaches b = 0 at gamma = 2, rows 0, 2 b < 1/2
    calls = []

    def derivs(g):
        calls.append(g)
        return logistic_line_derivs(labels, weights, alpha, dalpha, g)

    _, _, gmax = dual_line_sums(loss_code("logistic"), labels, weights, alpha, dalpha)
    assert gmax == pytest.approx(2.0)
    gamma = logistic_gamma(derivs, 0.0, 0.0, LAM, 3.0, gmax, start=1.0)
    assert gamma == gmax and calls == [1.0, gmax]


def test_logistic_gamma_interior_optimum_after_testing_the_limit():
    """When the limit is tested and phi' < 0 there, the interior root is still found exactly."""
    labels = np.array([1.0, 0.0], np.float32)
    weights = np.ones(2, np.float32)
    alpha = np.array([0.1, -0.1])
    dalpha = np.array([0.81, -0.81])  # gamma_max = 10/9: b -> 1 for both rows, phi' -> -inf
    derivs = lambda g: logistic_line_derivs(labels, weights, alpha, dalpha, g)  # noqa: E731
    _, _, gmax = dual_line_sums(loss_code("logistic"), labels, weights, alpha, dalpha)
    wd, dd, lam, n_w = 0.2, 0.3, 0.5, 2.0
    gamma = logistic_gamma(derivs, wd, dd, lam, n_w, gmax, start=1.0)
    s1, _ = derivs(gamma)
    assert 0.0 < gamma < gmax and abs(s1 / n_w - lam * (wd + gamma * dd)) < 1e-10


def test_squared_hinge_gamma_is_clipped_to_the_feasible_step():
    """Only coordinates moving toward b = 0 bound the step; the unclipped maximiser of the
    concave quadratic is (p0/N - lam <w, dw>) / (p1/N + lam ||dw||^2)."""
    code = loss_code("squared_hinge")
    labels = np.array([1.0, 0.0, 1.0], np.float32)
    weights = np.array([1.0, 2.0, 1.0], np.float32)
    alpha = np.array([0.5, -2.0, 0.0])  # b = 0.5, 2.0, 0.0
    dalpha = np.array([-0.25, 0.5, 3.0])  # db = -0.25 (b = 0 at gamma 2), -0.5 (at 4), +3 (none)
    p0, p1, gmax = dual_line_sums(code, labels, weights, alpha, dalpha)
    assert gmax == 2.0
    assert p0 == pytest.approx(-0.25 * 0.75 + 2 * -0.5 * 0.0 + 3.0 * 1.0)  # c db (1 - b/2)
    assert p1 == pytest.approx((0.0625 + 2 * 0.25 + 9.0) / 2)  # c db^2 / 2
    lam, n_w = 0.1, 4.0
    assert squared_hinge_gamma(p0, p1, 0.0, 1.0, lam, n_w, gmax) == pytest.approx(
        (p0 / n_w) / (p1 / n_w + lam))
    assert squared_hinge_gamma(p0, p1, -100.0, 1.0, lam, n_w, gmax) == gmax  # clipped above
    assert squared_hinge_gamma(p0, p1, 100.0, 1.0, lam, n_w, gmax) == 0.0  # and below
    assert squared_hinge_gamma(0.0, 0.0, 0.0, 0.0, lam, n_w, np.inf) == 1.0  # nothing moved
