"""Scalar loss kernels: derivatives against finite differences, numerical stability, and the
importance-invariant step against a numerical solution of its defining ODE."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.integrate import solve_ivp

from terascale.solvers.catalogue import LOSSES
from terascale.solvers.kernels.losses import (
    HINGE,
    LOGISTIC,
    LOSS_IDS,
    invariant_scalar,
    logistic_invariant_delta,
    logistic_terms,
    loss_curvature,
    loss_derivative,
    loss_value,
)

MARGINS = [-30.0, -5.0, -1.3, -0.2, 0.0, 0.4, 0.99, 2.5, 12.0, 40.0]
ALL_IDS = sorted(LOSS_IDS.values())
#: losses with a Lipschitz ℓ' (the catalogue's curvature): the invariant step's ODE has a smooth
#: right-hand side a numerical integrator can follow (the hinge's ℓ' jumps at the margin)
SMOOTH_IDS = [s.id for s in LOSSES.values() if s.curvature]


def _ez(loss_id: int, m: float, y: float) -> float:
    return logistic_terms(m, y)[2] if loss_id == LOGISTIC else 0.0


@pytest.mark.parametrize("loss", sorted(LOSS_IDS))
@pytest.mark.parametrize("y", [0.0, 1.0])
def test_derivatives_match_finite_differences(loss, y):
    lid = LOSS_IDS[loss]
    for m in MARGINS:
        s = 2 * y - 1
        if lid == HINGE and abs(1 - s * m) < 1e-3:
            continue  # the kink
        eps = 1e-6 * max(1.0, abs(m))
        fd1 = (loss_value(lid, m + eps, y) - loss_value(lid, m - eps, y)) / (2 * eps)
        fd2 = (loss_derivative(lid, m + eps, y) - loss_derivative(lid, m - eps, y)) / (2 * eps)
        assert loss_derivative(lid, m, y) == pytest.approx(fd1, rel=1e-6, abs=1e-9), (loss, m)
        assert loss_curvature(lid, m, y) == pytest.approx(fd2, rel=1e-5, abs=1e-9), (loss, m)


@pytest.mark.parametrize("m", [-1e6, -800.0, -40.0, 0.0, 40.0, 800.0, 1e6])
@pytest.mark.parametrize("y", [0.0, 1.0])
def test_logistic_is_stable_for_any_margin(m, y):
    loss, g, _ = logistic_terms(m, y)
    expected = np.logaddexp(0.0, -m if y == 1.0 else m)  # softplus(∓m)
    assert math.isfinite(loss) and math.isfinite(g)
    assert loss == pytest.approx(expected, rel=1e-12, abs=1e-300)
    assert loss == loss_value(LOGISTIC, m, y)
    assert g == loss_derivative(LOGISTIC, m, y)
    assert 0.0 <= loss_curvature(LOGISTIC, m, y) <= 0.25


def test_logistic_tiny_losses_keep_relative_precision():
    # log(1 + e^-40) = 4.248e-18: a naive softplus(m) - y·m would give 0
    assert logistic_terms(40.0, 1.0)[0] == pytest.approx(math.exp(-40.0), rel=1e-12)
    assert logistic_terms(-40.0, 0.0)[0] == pytest.approx(math.exp(-40.0), rel=1e-12)


def _ode_margin(loss_id: int, m0: float, y: float, h: float, kappa: float) -> float:
    """m(h) for dm/dτ = −κ·ℓ'(m), solved numerically: the definition of the invariant step."""
    sol = solve_ivp(lambda _t, m: [-kappa * loss_derivative(loss_id, m[0], y)], (0.0, h), [m0],
                    method="DOP853", rtol=1e-12, atol=1e-14)
    return float(sol.y[0, -1])


@pytest.mark.parametrize("loss_id", SMOOTH_IDS)
@pytest.mark.parametrize("m0", [-6.0, -0.5, 0.0, 1.5, 8.0])
@pytest.mark.parametrize("y", [0.0, 1.0])
@pytest.mark.parametrize("h,kappa", [(1.0, 1e-3), (1.0, 0.7), (2.5, 3.0), (10.0, 40.0)])
def test_invariant_step_solves_the_ode(loss_id, m0, y, h, kappa):
    u = invariant_scalar(loss_id, m0, y, h, kappa, _ez(loss_id, m0, y))
    assert m0 - u * kappa == pytest.approx(_ode_margin(loss_id, m0, y, h, kappa), rel=1e-8, abs=1e-9)


def test_hinge_invariant_step_stops_at_the_margin():
    # y = 1, m = -2: the margin moves to 1 at most
    assert -2.0 - invariant_scalar(HINGE, -2.0, 1.0, 100.0, 1.0, 0.0) * 1.0 == pytest.approx(1.0)
    assert -2.0 - invariant_scalar(HINGE, -2.0, 1.0, 0.5, 1.0, 0.0) * 1.0 == pytest.approx(-1.5)
    assert invariant_scalar(HINGE, 3.0, 1.0, 1.0, 1.0, 0.0) == 0.0


@pytest.mark.parametrize("loss_id", ALL_IDS)
def test_invariant_step_two_halves_equal_one_whole(loss_id):
    """Importance invariance: weight h at once = weight h/2 twice (same κ)."""
    for m0 in (-3.0, 0.2, 2.0):
        for y in (0.0, 1.0):
            h, kappa = 3.0, 0.8
            whole = m0 - kappa * invariant_scalar(loss_id, m0, y, h, kappa, _ez(loss_id, m0, y))
            m1 = m0 - kappa * invariant_scalar(loss_id, m0, y, h / 2, kappa, _ez(loss_id, m0, y))
            m2 = m1 - kappa * invariant_scalar(loss_id, m1, y, h / 2, kappa, _ez(loss_id, m1, y))
            assert m2 == pytest.approx(whole, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("loss_id", ALL_IDS)
def test_invariant_step_small_weight_is_a_gradient_step(loss_id):
    for m0 in (-2.0, 0.3, 0.999):
        u = invariant_scalar(loss_id, m0, 1.0, 1e-9, 0.5, _ez(loss_id, m0, 1.0))
        assert u == pytest.approx(1e-9 * loss_derivative(loss_id, m0, 1.0), rel=1e-6)


@settings(max_examples=300, deadline=None)
@given(z=st.floats(-700.0, 700.0), hk=st.floats(0.0, 1e6))
@example(z=0.0, hk=0.0)
@example(z=-700.0, hk=1e6)
@example(z=700.0, hk=1e-300)
@example(z=-30.0, hk=5e-324)
@example(z=20.0, hk=1e6)
@example(z=165.0, hk=4.315791136783749e-243)  # δ ≈ 9e-315 is subnormal: 1e-10 resolution
def test_logistic_delta_solves_its_equation(z, hk):
    ez = math.exp(z)
    d = logistic_invariant_delta(z, ez, hk)
    assert d >= 0.0 and math.isfinite(d)
    assert d <= hk
    if d > 0.0 and ez < 1e300:
        a_exp = math.exp(z + d)
        residual = d + (a_exp - ez if d >= 0.5 else ez * math.expm1(d)) - hk
        scale = d * (1.0 + a_exp)  # |∂/∂δ|·δ: the residual of a 1e-12-relative δ
        spacing = (1.0 + a_exp) * 5e-324  # the residual of one subnormal step of δ
        assert abs(residual) <= 1e-10 * scale + 1e-12 * hk + 2.0 * spacing + 1e-300
