"""The online kernel against a slow, obvious pure-Python reference of the documented update
(float64, dicts, and the invariant step taken from a numerical ODE solution rather than the
closed forms), plus ordering, normalization and state-restoration properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.integrate import solve_ivp

from terascale.solvers.data import CSRData
from terascale.solvers.kernels.losses import LOSS_IDS, loss_derivative, loss_value
from terascale.solvers.kernels.online import (
    OK,
    G,
    S,
    W,
    new_state,
    online_pass,
    restore_normalizers,
)
from terascale.solvers.shard import Shard


def _ode_margin(lid, m0, y, h, kappa):
    """m(h) for dm/dτ = −κ·ℓ'(m), τ in [0, h] (the definition of the invariant step)."""
    sol = solve_ivp(lambda _t, m: [-kappa * loss_derivative(lid, m[0], y)], (0.0, h), [m0],
                    method="DOP853", rtol=1e-12, atol=1e-14)
    return float(sol.y[0, -1])


def reference_pass(rows, labels, weights, d, loss, eta, invariant, w=None, g2=None, scale=None,
                   t=0.0, n_norm=0.0):
    """One pass of the module docstring's update, written the plain way."""
    lid = LOSS_IDS[loss]
    w = dict(w or {})
    g2 = dict(g2 or {})
    scale = dict(scale or {})
    b = d  # the intercept's key
    scale[b] = 1.0
    loss_sum = 0.0
    for (idx, val), y, h in zip(rows, labels, weights, strict=True):
        feats = [(j, x) for j, x in zip(idx, val, strict=True) if x != 0.0]
        for j, x in feats:
            if abs(x) > scale.get(j, 0.0):
                if scale.get(j, 0.0) > 0.0:
                    w[j] = w.get(j, 0.0) * scale[j] / abs(x)
                scale[j] = abs(x)
        feats.append((b, 1.0))
        m = sum(w.get(j, 0.0) * x for j, x in feats)
        t += h
        n_norm += h * sum((x / scale[j]) ** 2 for j, x in feats)
        loss_sum += h * loss_value(lid, m, y)
        g = loss_derivative(lid, m, y)
        if g == 0.0:
            continue
        for j, x in feats:
            g2[j] = g2.get(j, 0.0) + h * (g * x) ** 2
        rate = {j: 1.0 / (scale[j] * math.sqrt(g2[j])) if g2[j] > 0 else 0.0 for j, _ in feats}
        eta_t = eta * math.sqrt(t / n_norm)
        kappa = eta_t * sum(rate[j] * x * x for j, x in feats)
        if invariant:
            u = (m - _ode_margin(lid, m, y, h, kappa)) / kappa
        else:
            u = h * g
        for j, x in feats:
            w[j] = w.get(j, 0.0) - eta_t * u * rate[j] * x
    return w, g2, scale, t, n_norm, loss_sum


def tiny_data(seed: int, loss: str, n: int = 40, d: int = 9) -> CSRData:
    """Non-binary values whose scale grows over the rows (exercises the renormalization)."""
    rng = np.random.default_rng(seed)
    x = sp.random(n, d, density=0.4, random_state=rng, format="csr").toarray()
    x *= rng.choice([-1.0, 1.0], x.shape) * np.linspace(0.3, 3.0, n)[:, None]
    y = rng.normal(size=n) if loss == "squared" else (rng.random(n) < 0.4).astype(float)
    return CSRData.from_scipy(sp.csr_matrix(x), y, weights=rng.uniform(0.2, 3.0, n), n_features=d)


def _rows(data):
    return [(data.indices[a:b].tolist(), data.values[a:b].astype(float).tolist())
            for a, b in zip(data.indptr[:-1], data.indptr[1:], strict=True)]


def _kernel(data, loss, eta, invariant, order=None, passes=1):
    s = Shard.from_csr(data)
    state = new_state(data.n_features)
    totals = np.zeros(2)
    order = np.zeros(0, np.int64) if order is None else order
    outs = [online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, order, state, totals,
                        LOSS_IDS[loss], eta, invariant, 0, s.n_rows, 0.0, 0.0) for _ in range(passes)]
    return state, totals, outs


def _as_array(dct, d):
    return np.array([dct.get(j, 0.0) for j in range(d + 1)])


@pytest.mark.parametrize("loss", sorted(LOSS_IDS))
@pytest.mark.parametrize("invariant", [True, False])
def test_kernel_matches_the_reference(loss, invariant):
    data = tiny_data(seed=len(loss) + invariant, loss=loss)
    d = data.n_features
    eta = 0.5 if invariant else 0.1
    state, totals, outs = _kernel(data, loss, eta, invariant, passes=2)
    ref = reference_pass(_rows(data), data.labels.astype(float), data.weights.astype(float), d, loss, eta, invariant)
    ref = reference_pass(_rows(data), data.labels.astype(float), data.weights.astype(float), d, loss, eta, invariant, *ref[:5])
    w, g2, scale, t, n_norm, loss_sum = ref
    assert outs[1][2] == OK
    np.testing.assert_allclose(state[:, W], _as_array(w, d), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state[:, G], _as_array(g2, d), rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(state[:, S], _as_array(scale, d).astype(np.float32))
    np.testing.assert_allclose(totals, [t, n_norm], rtol=1e-7)  # (x/s)² is float32
    assert outs[1][0] == pytest.approx(loss_sum, rel=1e-6)
    assert outs[1][1] == pytest.approx(float(np.sum(data.weights, dtype=np.float64)), rel=1e-12)


def test_order_is_the_same_as_permuting_the_rows():
    data = tiny_data(seed=11, loss="logistic")
    perm = np.random.default_rng(0).permutation(data.n_rows).astype(np.int64)
    x = data.to_scipy()[perm]
    permuted = CSRData.from_scipy(x, data.labels[perm], data.weights[perm], data.n_features)
    a, ta, _ = _kernel(data, "logistic", 0.5, True, order=perm)
    b, tb, _ = _kernel(permuted, "logistic", 0.5, True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ta, tb)


def test_deterministic():
    data = tiny_data(seed=12, loss="logistic")
    a, _, _ = _kernel(data, "logistic", 0.5, True, passes=3)
    b, _, _ = _kernel(data, "logistic", 0.5, True, passes=3)
    assert a.tobytes() == b.tobytes()


def test_restore_normalizers_equals_what_a_pass_leaves():
    data = tiny_data(seed=13, loss="logistic")
    data.weights[[0, 5]] = 0.0  # rows of weight 0 do not count
    state, _, _ = _kernel(data, "logistic", 0.5, True)
    fresh = new_state(data.n_features)
    restore_normalizers(data.indptr, data.indices, data.values, data.vpos, data.weights, fresh)
    np.testing.assert_array_equal(fresh[:, S], state[:, S])


def test_scale_invariance_of_the_prediction_path():
    """Normalized updates: scaling a feature by c scales its learned weight by 1/c, so the
    predictions do not change (up to float32 rounding)."""
    data = tiny_data(seed=14, loss="logistic")
    c = np.ones(data.n_features)
    c[3] = 1000.0
    scaled = CSRData(data.indptr, data.indices, (data.values * c[data.indices]).astype(np.float32),
                     data.labels, data.weights, data.n_features)
    a, _, _ = _kernel(data, "logistic", 0.5, True)
    b, _, _ = _kernel(scaled, "logistic", 0.5, True)
    np.testing.assert_allclose(b[:-1, W] * c, a[:-1, W], rtol=1e-4, atol=1e-6)


def test_empty_rows_and_empty_shard():
    data = CSRData.from_scipy(sp.csr_matrix((5, 4)), [0, 1, 1, 0, 1], n_features=4)
    state, totals, outs = _kernel(data, "logistic", 0.5, True)
    assert outs[0][2] == OK and state[-1, W] != 0.0 and not state[:-1, W].any()
    state, totals, outs = _kernel(CSRData.empty(4), "logistic", 0.5, True)
    assert outs[0][:3] == (0.0, 0.0, OK) and not state[:, W].any()


def test_a_pass_in_chunks_equals_one_call():
    data = tiny_data(seed=15, loss="logistic")
    s = Shard.from_csr(data)
    whole, _, _ = _kernel(data, "logistic", 0.5, True)
    perm = np.random.default_rng(1).permutation(data.n_rows).astype(np.int64)
    for order in (np.zeros(0, np.int64), perm):
        state = new_state(data.n_features)
        totals = np.zeros(2)
        for start, stop in ((0, 7), (7, 8), (8, 8), (8, data.n_rows)):
            online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, order, state, totals,
                        LOSS_IDS["logistic"], 0.5, True, start, stop, 0.0, 0.0)
        ref, tref, _ = _kernel(data, "logistic", 0.5, True, order=order if order.size else None)
        assert state.tobytes() == ref.tobytes() and totals.tobytes() == tref.tobytes()
    assert ref.tobytes() != whole.tobytes()  # the permutation mattered
