"""The sequential dual solver takes the gap of its starting point during its first epoch
(``dual_epoch_with_gap``): the same steps as the plain epoch, bit for bit, and the same sums as
the separate gap pass, and the history still reports each point's own objectives."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd import CocoaParams, train_cocoa
from terascale.solvers.scd.dual_kernels import (
    dual_epoch,
    dual_epoch_with_gap,
    dual_objective_sums,
    row_sq_norms,
)
from terascale.solvers.scd.local_solver import DualLocalSolver
from terascale.solvers.scd.losses import dual_value, loss_code
from tests.scd.helpers import make_data, objective

LAM = 1e-2


def _point(data, loss, seed=1):
    """A feasible (alpha, w) away from the start: two plain epochs from zero."""
    code = loss_code(loss)
    sqn = row_sq_norms(data.indptr, data.values, 1.0)
    alpha, w = np.zeros(data.n_rows), np.zeros(data.n_features + 1)
    rng = np.random.default_rng(seed)
    scale = 1.0 / (LAM * float(data.weights.sum(dtype=np.float64)))
    for _ in range(2):
        dual_epoch(data.indptr, data.indices, data.values, data.labels, data.weights, sqn, alpha,
                   w, rng.permutation(data.n_rows), code, scale, 1.0, data.n_features)
    return sqn, alpha, w, scale


@pytest.mark.parametrize("loss", [name for name, spec in LOSSES.items() if spec.dual])
def test_fused_epoch_equals_gap_pass_then_epoch(loss):
    data = make_data(loss, n=257, seed=4, weighted=True)
    code = loss_code(loss)
    sqn, alpha, w, scale = _point(data, loss)
    order = np.random.default_rng(9).permutation(data.n_rows)
    d = data
    want_sums = dual_objective_sums(d.indptr, d.indices, d.values, d.labels, d.weights, alpha, w,
                                    code, 1.0, d.n_features)
    a1, u1 = alpha.copy(), w.copy()
    dual_epoch(d.indptr, d.indices, d.values, d.labels, d.weights, sqn, a1, u1, order, code,
               2.0 * scale, 1.0, d.n_features)
    a2, wu = alpha.copy(), np.column_stack([w, w])
    sums = dual_epoch_with_gap(d.indptr, d.indices, d.values, d.labels, d.weights, sqn, a2, wu,
                               order, code, 2.0 * scale, 1.0, d.n_features)
    assert np.array_equal(a1, a2) and np.array_equal(u1, wu[:, 1])  # the same steps
    assert np.array_equal(wu[:, 0], w)  # w is only read
    np.testing.assert_allclose(sums, want_sums, rtol=1e-12)  # other summation order


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_solver_with_gap_matches_the_plain_solver_over_several_epochs(threads):
    data = make_data("logistic", n=301, seed=6)
    _, alpha, w, _ = _point(data, "logistic")
    n_w = float(data.weights.sum(dtype=np.float64))
    plain = DualLocalSolver(data, loss_code("logistic"), LAM, n_w, 1.0, threads, bucket_size=8)
    fused = DualLocalSolver(data, loss_code("logistic"), LAM, n_w, 1.0, threads, bucket_size=8)
    a1, u1 = (x.copy() for x in plain.solve(alpha, w, 2.0, 3, 0, 1, 7))
    a2, u2, sums = fused.solve_with_gap(alpha, w, 2.0, 3, 0, 1, 7)
    assert np.array_equal(a1, a2) and np.array_equal(u1, u2)  # the same steps
    assert not np.array_equal(a1, alpha)
    d = data
    want = dual_objective_sums(d.indptr, d.indices, d.values, d.labels, d.weights, alpha, w,
                               loss_code("logistic"), 1.0, d.n_features)
    np.testing.assert_allclose(sums, want, rtol=1e-12)  # of the starting point


@pytest.mark.parametrize("loss, threads", [("logistic", 1), ("hinge", 1), ("logistic", 2), ("squared_hinge", 2)])
def test_history_reports_each_points_own_objectives(loss, threads):
    """Row r of the history is point r (its pieces are taken while round r+1 is computed):
    the primal equals the definition at the model of the state saved after round r."""
    data = make_data(loss, n=200, seed=8)
    code = loss_code(loss)
    states = []
    res = train_cocoa(data, LocalCommunicator(),
                      CocoaParams(loss=loss, l2=LAM, tol=0.0, max_rounds=6, threads=threads,
                                  bucket_size=4),
                      on_round_end=states.append)
    assert [row["round"] for row in res.history] == list(range(7))
    c = data.weights.astype(np.float64)
    for state in states:
        row = res.history[state.round]
        assert row["primal"] == pytest.approx(objective(loss, data, state.shared, LAM), rel=1e-12)
        conj = sum(ci * dual_value(code, float(yi), float(ai))
                   for ci, yi, ai in zip(c, data.labels, state.local, strict=True))
        dual = conj / c.sum() - 0.5 * LAM * float(state.shared @ state.shared)
        assert row["dual"] == pytest.approx(dual, rel=1e-12, abs=1e-14)
