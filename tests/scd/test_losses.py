"""The scalar formulas: dual coordinate steps against a brute-force 1-D maximisation, and the
numerical guards of the logistic pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from terascale.solvers.scd.losses import (
    B_EPS,
    HINGE,
    LOGISTIC,
    SQUARED,
    dual_step,
    dual_value,
    log1pexp,
    loss_code,
    primal_loss,
    sigmoid,
)


def _brute_step(loss, y, a, dot, q):
    """argmax_a' h(a') - (a' - a) dot - q (a' - a)^2 / 2 by bounded scalar search over b = s a'."""
    s = 1.0 if y > 0.5 else -1.0

    def neg(b):
        a2 = s * b if loss != SQUARED else b
        return -(dual_value(loss, y, a2) - (a2 - a) * dot - 0.5 * q * (a2 - a) ** 2)

    if loss == SQUARED:
        res = minimize_scalar(neg, bracket=(a - 10, a + 10), tol=1e-12)
        return res.x
    res = minimize_scalar(neg, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-12})
    best = min([res.x, 0.0, 1.0], key=neg)
    return s * best


@pytest.mark.parametrize("loss", [SQUARED, LOGISTIC, HINGE])
def test_dual_step_is_the_exact_maximiser(loss):
    rng = np.random.default_rng(loss)
    for _ in range(200):
        y = float(rng.integers(0, 2)) if loss != SQUARED else float(rng.standard_normal() * 3)
        s = 1.0 if y > 0.5 else -1.0
        a = float(rng.standard_normal()) if loss == SQUARED else s * float(rng.uniform(0.01, 0.99))
        dot = float(rng.standard_normal() * 3)
        q = float(rng.choice([0.0, 1e-3, 0.3, 5.0, 200.0]))
        got = dual_step(loss, y, a, dot, q)
        want = _brute_step(loss, y, a, dot, q)

        def obj(a2, y=y, a=a, dot=dot, q=q):
            return dual_value(loss, y, a2) - (a2 - a) * dot - 0.5 * q * (a2 - a) ** 2

        # objective at our step is at least the brute force's (up to the search tolerance)
        assert obj(got) >= obj(want) - 1e-9, (loss, y, a, dot, q, got, want)
        if loss != HINGE or q > 0:  # hinge with q = 0 is linear: any maximiser will do
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("b, m, q", [
    (0.003569598219524153, -6.127768166301095, 11.87711059646716),  # plain Newton oscillated here
    (0.9, 7.5, 40.0),
    (0.5, 0.0, 1e4),
    (1.0 - 1e-15, -15.4, 1e7),  # huge q, b at the domain's edge
    (1e-15, 30.0, 20.0),  # alpha = 0 at the start, a well-classified row
    (0.2, -3.0, 20.0),  # root on the convex side (t > 0), start on the concave side
])
def test_logistic_step_solves_its_stationarity_condition_at_large_q(b, m, q):
    """The logistic step's root t of -t - m - q (sigmoid(t) - b) = 0, also where Newton's
    iterates jump between the bracket's ends (large q): it must be found, not the 50th iterate."""
    new = dual_step(LOGISTIC, 1.0, b, m, q)  # y = 1: b = a, m = dot
    t = math.log(new) - math.log1p(-new)
    assert abs(-t - m - q * (new - b)) <= 1e-9 * (1.0 + abs(t) + q)
    want = _brute_step(LOGISTIC, 1.0, b, m, q)
    assert new == pytest.approx(want, abs=1e-6)


def test_logistic_step_stays_strictly_inside_the_domain():
    for dot in (-800.0, -40.0, 0.0, 40.0, 800.0):
        for a in (0.0, B_EPS, 0.5, 1.0 - B_EPS, 1.0):
            for q in (0.0, 1e-9, 1.0, 1e6):
                b = dual_step(LOGISTIC, 1.0, a, dot, q)
                assert B_EPS <= b <= 1.0 - B_EPS and math.isfinite(dual_value(LOGISTIC, 1.0, b))


def test_stable_logistic_pieces():
    assert primal_loss(LOGISTIC, 1.0, 1000.0) == pytest.approx(0.0, abs=1e-300)
    assert primal_loss(LOGISTIC, 1.0, -1000.0) == pytest.approx(1000.0)
    assert primal_loss(LOGISTIC, 0.0, 1000.0) == pytest.approx(1000.0)
    assert log1pexp(800.0) == 800.0 and log1pexp(-800.0) == 0.0
    assert sigmoid(-800.0) == 0.0 and sigmoid(800.0) == 1.0
    assert dual_value(LOGISTIC, 1.0, 0.0) == 0.0 and dual_value(LOGISTIC, 0.0, -1.0) == 0.0
    assert dual_value(LOGISTIC, 1.0, 0.5) == pytest.approx(math.log(2.0))


def test_primal_and_dual_values_by_definition():
    assert primal_loss(SQUARED, 2.0, 0.5) == pytest.approx(1.125)
    assert primal_loss(HINGE, 0.0, -0.25) == pytest.approx(0.75)  # label 0 -> s = -1
    assert primal_loss(HINGE, 1.0, 2.0) == 0.0
    assert dual_value(SQUARED, 2.0, 1.0) == pytest.approx(1.5)
    assert dual_value(HINGE, 0.0, -0.25) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="train.loss = 'poisson': must be one of"):
        loss_code("poisson")


@settings(max_examples=400, deadline=None)
@given(
    b=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, B_EPS, 1e-9, 0.5, 1.0 - 1e-9, 1.0 - B_EPS, 1.0])),
    m=st.floats(-1e3, 1e3),
    q=st.one_of(st.floats(0.0, 1e8), st.sampled_from([0.0, 1e-12, 20.0, 40.0, 1e6])),
)
@example(b=0.0, m=30.0, q=20.0)  # alpha = 0 at the start, a well-classified row
@example(b=1.0 - 1e-15, m=-15.4, q=1e7)
@example(b=0.2, m=-3.0, q=20.0)  # root on the convex side, warm start on the concave side
def test_logistic_step_stationarity_property(b, m, q):
    """For any state, margin and curvature the step lands strictly inside the domain and solves
    -t - m - q (b' - b) = 0 (t = logit b', i.e. b' = sigmoid(-m - q (b' - b))) unless the root
    lies beyond the B_EPS guard."""
    new = dual_step(LOGISTIC, 1.0, b, m, q)
    assert B_EPS <= new <= 1.0 - B_EPS
    if new in (B_EPS, 1.0 - B_EPS):
        return
    if min(new, 1.0 - new) < 1e-6:  # near the edges logit(b') loses digits: check b' itself
        assert abs(new - sigmoid(-m - q * (new - b))) <= 1e-12
        return
    t = math.log(new) - math.log1p(-new)
    scale = 1.0 + abs(t) + abs(m) + q * max(new, b)
    assert abs(-t - m - q * (new - b)) <= 1e-9 * scale


def test_logistic_step_takes_few_newton_steps_on_either_side_and_at_huge_q():
    """Both sides of the root and b at the domain's edges: at most a dozen steps for q <= 1e3,
    and never near the cap for q up to 1e9.
    (Computing sigmoid(t) - b directly near b = 1 is rounding noise at huge q, and Newton then
    ran to its cap of 50; the solver works on the mirrored small side instead.)"""
    from terascale.solvers.scd.losses import _logistic_root

    moderate, huge = [], []
    rng = np.random.default_rng(11)
    for _ in range(4000):
        b = float(rng.choice([rng.uniform(0, 1), 1.0 - 10 ** rng.uniform(-15, -1),
                              10 ** rng.uniform(-15, -1)]))
        q = float(10 ** rng.uniform(-3, 9))
        m = float(rng.normal(0.0, 10.0))
        t, steps = _logistic_root(b, m, q)
        assert math.isfinite(t)
        (moderate if q <= 1e3 else huge).append(steps)
    assert max(moderate) <= 12 and np.mean(moderate) <= 6, (max(moderate), np.mean(moderate))
    assert max(huge) <= 30 and np.mean(huge) <= 9, (max(huge), np.mean(huge))  # the cap is 50
