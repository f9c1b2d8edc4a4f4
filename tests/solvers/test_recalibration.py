"""The held-out recalibration (:mod:`solvers.recalibration`, :mod:`solvers.kernels.calibration`):
the kernel's sums against numpy's formulas (extreme margins included), the fit against scipy's
minimiser of the same weighted loss, a planted miscalibration recovered, K ranks agreeing bit for
bit with each other and with one rank to rounding, and the cases with nothing to fit."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.kernels.calibration import SUMS, platt_sums
from terascale.solvers.recalibration import fit, recalibrate
from tests.allreduce.harness import run_tree
from tests.solvers.helpers import TREE_NODE_KWARGS, planted_problem, row_slice


def _planted(n: int, a: float, c: float, seed: int = 0):
    """Margins, labels drawn from σ(a·m + c), and weights (1 or 10, as downsampled negatives)."""
    rng = np.random.default_rng(seed)
    m = rng.normal(-1.0, 1.5, n)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(a * m + c)))).astype(np.float32)
    h = np.where(rng.random(n) < 0.3, 10.0, 1.0).astype(np.float32)
    return m, y, h


def _reference_loss(m, y, h, a, c):
    z = a * m + c
    return float(np.sum(h * (np.logaddexp(0.0, z) - y * z)) / h.sum(dtype=np.float64))


def test_the_kernels_sums_follow_their_formulas_without_overflow():
    m, y, h = _planted(5000, 0.8, -0.3)
    m[:4] = [800.0, -800.0, 40.0, -40.0]  # e^z overflows float64 at |z| > 709
    y[:4] = [0, 1, 0, 1]
    h[10] = 0.0  # a row of weight 0 adds nothing
    for a, c in ((1.0, 0.0), (0.7, -0.4), (1.3, 0.2)):
        out = np.empty(SUMS)
        platt_sums(m, y, h, a, c, out)
        z = a * m + c
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -700, 700)))
        s = p * (1.0 - p)
        hh = h.astype(np.float64)
        want = [np.sum(hh * (np.logaddexp(0.0, z) - y * z)), np.sum(hh * (p - y) * m), np.sum(hh * (p - y)),
                np.sum(hh * s * m * m), np.sum(hh * s * m), np.sum(hh * s)]
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, want, rtol=1e-11, atol=1e-9)


def test_the_fit_is_scipys_minimum_of_the_weighted_held_out_loss():
    m, y, h = _planted(20000, 0.7, -0.4, seed=1)
    r = fit(LocalCommunicator(), m, y, h)
    ref = minimize(lambda p: _reference_loss(m, y, h, p[0], p[1]), [1.0, 0.0], method="BFGS",
                   options={"gtol": 1e-12})
    assert r is not None
    assert r.holdout_loss_after == pytest.approx(ref.fun, rel=1e-12)
    assert r.holdout_loss_after <= ref.fun * (1 + 1e-13)
    np.testing.assert_allclose([r.slope, r.shift], ref.x, atol=1e-6)
    assert r.holdout_loss_before == pytest.approx(_reference_loss(m, y, h, 1.0, 0.0), rel=1e-12)
    assert r.holdout_rows == 20000 and r.holdout_weight == pytest.approx(float(h.sum(dtype=np.float64)))
    assert 1 <= r.iterations < 20


def test_a_planted_miscalibration_is_recovered():
    """Labels from σ(0.6·m − 0.5): the model's margins m are over-confident and too high; the fit
    finds the slope and shift within their sampling error at 400k rows."""
    m, y, h = _planted(400_000, 0.6, -0.5, seed=2)
    r = fit(LocalCommunicator(), m, y, np.ones_like(h))
    assert r.slope == pytest.approx(0.6, abs=0.01) and r.shift == pytest.approx(-0.5, abs=0.015)
    assert r.holdout_loss_after < r.holdout_loss_before
    # negative downsampling: every click, one negative in ten weighted 10: the same parameters
    keep = (y == 1) | (np.random.default_rng(3).random(m.shape[0]) < 0.1)
    w = np.where(y == 1, 1.0, 10.0).astype(np.float32)
    r2 = fit(LocalCommunicator(), m[keep], y[keep], w[keep])
    assert r2.slope == pytest.approx(0.6, abs=0.03) and r2.shift == pytest.approx(-0.5, abs=0.04)


@pytest.mark.parametrize("k", [2, 3])
def test_k_ranks_fit_the_same_bits_and_one_ranks_optimum(k):
    m, y, h = _planted(9000, 0.8, 0.3, seed=4)
    cuts = np.linspace(0, m.shape[0], k + 1).astype(int)
    cuts[1] = cuts[0]  # rank 0 holds no rows

    def body(node):
        lo, hi = cuts[node.rank], cuts[node.rank + 1]
        return fit(node, m[lo:hi], y[lo:hi], h[lo:hi])

    results = run_tree(k, body, node_kwargs=TREE_NODE_KWARGS, timeout=120.0).results
    assert all(r == results[0] for r in results[1:])  # every field, bit for bit
    one = fit(LocalCommunicator(), m, y, h)
    assert results[0].holdout_loss_after == pytest.approx(one.holdout_loss_after, rel=1e-13)
    np.testing.assert_allclose([results[0].slope, results[0].shift], [one.slope, one.shift], atol=1e-9)
    assert fit(LocalCommunicator(), m, y, h) == one  # and the same bits on every run


def test_nothing_to_fit_gives_none():
    m, y, h = _planted(1000, 1.0, 0.0)
    assert fit(LocalCommunicator(), m, np.zeros_like(y), h) is None  # one class
    assert fit(LocalCommunicator(), m, np.ones_like(y), h) is None
    assert fit(LocalCommunicator(), m, y, np.zeros_like(h)) is None  # no weight
    assert fit(LocalCommunicator(), m[:0], y[:0], h[:0]) is None  # no rows


def test_constant_margins_move_only_the_shift():
    """The zero model's margins are all 0: the slope cannot be told apart, the shift is the
    log-odds of the weighted click rate."""
    _, y, h = _planted(3000, 1.0, 0.0, seed=5)
    r = fit(LocalCommunicator(), np.zeros(3000), y, h)
    rate = float(np.sum(h * y, dtype=np.float64) / np.sum(h, dtype=np.float64))
    assert r.slope == 1.0
    assert r.shift == pytest.approx(np.log(rate / (1 - rate)), abs=1e-9)


def test_recalibrate_scores_the_held_out_rows_with_the_model():
    data = planted_problem(n=2000, d=30, seed=6)
    rng = np.random.default_rng(7)
    w = rng.normal(0, 1.0, data.n_features)
    r = recalibrate(LocalCommunicator(), row_slice(data, 0, 2000), w, 0.25)
    m = data.to_scipy() @ w + 0.25
    ref = fit(LocalCommunicator(), m, data.labels, np.ones(2000, np.float32) if data.weights is None else data.weights)
    assert r.holdout_rows == ref.holdout_rows and r.iterations == ref.iterations
    np.testing.assert_allclose([r.slope, r.shift, r.holdout_loss_before, r.holdout_loss_after],
                               [ref.slope, ref.shift, ref.holdout_loss_before, ref.holdout_loss_after], rtol=1e-10)
    assert recalibrate(LocalCommunicator(), None, w, 0.25) is None  # a single rank with no held-out rows
