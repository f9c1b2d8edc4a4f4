"""The scalar formulas: dual coordinate steps against a brute-force 1-D maximisation, and the
numerical guards of the logistic pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd.losses import (
    B_EPS,
    HINGE,
    LOGISTIC,
    SQUARED,
    SQUARED_HINGE,
    clamp_dual,
    dual_line_terms,
    dual_lower,
    dual_step,
    dual_upper,
    dual_value,
    log1pexp,
    loss_code,
    primal_loss,
    sigmoid,
)

#: every loss with an SDCA step, by id (the catalogue's ``dual`` column)
DUAL_IDS = [spec.id for spec in LOSSES.values() if spec.dual]


def _b_range(loss, b, dot):
    """A closed interval of b = s a' that holds the step's maximiser: the domain, or for the
    squared hinge [0, 2 + 2|dot| + 2b] (its objective's derivative 1 - b'/2 - m - q (b' - b) is
    negative beyond, for any q >= 0)."""
    hi = dual_upper(loss)
    if loss == SQUARED_HINGE:
        hi = 2.0 + 2.0 * abs(dot) + 2.0 * abs(b)
    return max(dual_lower(loss), 0.0), hi


def _brute_step(loss, y, a, dot, q):
    """argmax_a' h(a') - (a' - a) dot - q (a' - a)^2 / 2 by bounded scalar search over b = s a'."""
    s = 1.0 if y > 0.5 else -1.0

    def neg(b):
        a2 = s * b if loss != SQUARED else b
        return -(dual_value(loss, y, a2) - (a2 - a) * dot - 0.5 * q * (a2 - a) ** 2)

    if loss == SQUARED:
        res = minimize_scalar(neg, bracket=(a - 10, a + 10), tol=1e-12)
        return res.x
    lo, hi = _b_range(loss, s * a, dot)
    res = minimize_scalar(neg, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    best = min([res.x, lo, hi], key=neg)
    return s * best


def _random_dual_point(loss, rng):
    """(y, a): a label and a feasible dual variable of ``loss``."""
    if loss == SQUARED:
        return float(rng.standard_normal() * 3), float(rng.standard_normal())
    y = float(rng.integers(0, 2))
    s = 1.0 if y > 0.5 else -1.0
    b = rng.uniform(0.0, 3.0) if loss == SQUARED_HINGE else rng.uniform(0.01, 0.99)
    return y, s * float(b)


@pytest.mark.parametrize("loss", DUAL_IDS)
def test_dual_step_is_the_exact_maximiser(loss):
    rng = np.random.default_rng(loss)
    for _ in range(200):
        y, a = _random_dual_point(loss, rng)
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


@pytest.mark.parametrize("loss", DUAL_IDS)
def test_dual_value_is_the_negated_conjugate(loss):
    """h(a) = -phi*(-a) = inf_z phi(z) + a z, the infimum found numerically (a scalar search
    around the minimiser of the strictly convex or piecewise-linear function of z)."""
    rng = np.random.default_rng(100 + loss)
    for _ in range(50):
        y, a = _random_dual_point(loss, rng)

        def f(z, y=y, a=a):
            return primal_loss(loss, y, z) + a * z

        res = minimize_scalar(f, bounds=(-60.0, 60.0), method="bounded", options={"xatol": 1e-12})
        s = 1.0 if y > 0.5 else -1.0
        best = min(f(res.x), f(s))  # hinge: the infimum sits on the kink z = s
        assert dual_value(loss, y, a) == pytest.approx(best, rel=1e-9, abs=1e-9), (loss, y, a)


@pytest.mark.parametrize("y, b, m, q, want", [
    (1.0, 0.0, 0.0, 0.0, 2.0),  # alpha = 0, w = 0: (1 - 0 + 0) / (1/2)
    (1.0, 0.5, 0.2, 1.0, 1.3 / 1.5),  # (1 - 0.2 + 1 * 0.5) / (1 + 1/2)
    (0.0, 0.5, 0.2, 1.0, 1.3 / 1.5),  # label 0: s = -1, a = -b, dot = -m
    (1.0, 1.0, 3.0, 0.5, 0.0),  # 1 - 3 + 0.5 < 0: clipped at b' = 0
    (1.0, 2.0, -1.0, 4.0, 10.0 / 4.5),  # (1 + 1 + 8) / 4.5 (b' > 1: no upper bound)
])
def test_squared_hinge_step_closed_form(y, b, m, q, want):
    """b' = max(0, (1 - m + q b) / (q + 1/2)), the maximiser of b' - b'^2/4 - (b' - b) m -
    q (b' - b)^2 / 2 over b' >= 0, with a = s b and dot = s m."""
    s = 1.0 if y > 0.5 else -1.0
    assert s * dual_step(SQUARED_HINGE, y, s * b, s * m, q) == pytest.approx(want, rel=1e-15, abs=0.0)


@settings(max_examples=400, deadline=None)
@given(
    b=st.one_of(st.floats(0.0, 1e6), st.sampled_from([0.0, 1e-300, 0.5, 2.0, 1e6])),
    m=st.floats(-1e6, 1e6),
    q=st.one_of(st.floats(0.0, 1e8), st.sampled_from([0.0, 1e-12, 20.0, 1e8])),
    y=st.sampled_from([0.0, 1.0]),
)
@example(b=0.0, m=0.0, q=0.0, y=1.0)  # the first step of a run
@example(b=0.0, m=1.0, q=5.0, y=0.0)  # on the margin: b' = 0 exactly
@example(b=3.0, m=1e6, q=1e-12, y=1.0)  # far beyond the margin: clipped at 0
def test_squared_hinge_step_stationarity_property(b, m, q, y):
    """For any feasible state, margin and curvature the step is feasible and satisfies the KKT
    conditions of max_{b' >= 0} b' - b'^2/4 - (b' - b) m - q (b' - b)^2 / 2: the derivative
    1 - b'/2 - m - q (b' - b) is 0 at b' > 0 and <= 0 at b' = 0."""
    s = 1.0 if y > 0.5 else -1.0
    new = s * dual_step(SQUARED_HINGE, y, s * b, s * m, q)
    assert math.isfinite(new) and new >= 0.0
    grad = 1.0 - 0.5 * new - m - q * (new - b)
    scale = 1.0 + abs(m) + q * max(new, b) + new  # the size of the terms that cancel
    if new > 0.0:
        assert abs(grad) <= 1e-12 * scale
    else:
        assert grad <= 1e-12 * scale


@pytest.mark.parametrize("loss", DUAL_IDS)
def test_line_terms_and_clamp_keep_the_domain(loss):
    """``dual_line_terms``' bound is the largest feasible step of one coordinate, and
    ``clamp_dual`` maps any a back into the domain and leaves a feasible one alone."""
    rng = np.random.default_rng(200 + loss)
    lo, hi = dual_lower(loss), dual_upper(loss)
    for _ in range(100):
        y, a = _random_dual_point(loss, rng)
        s = 1.0 if y > 0.5 else -1.0
        d = float(rng.standard_normal())
        _, p1, bound = dual_line_terms(loss, y, 1.0, a, d)
        assert p1 >= 0.0  # phi is concave along the line
        assert clamp_dual(loss, y, a) == a
        if math.isinf(bound):
            assert loss == SQUARED or (loss == SQUARED_HINGE and s * d > 0.0)
            continue
        end = s * (a + bound * d)  # b at the bound: on the domain's edge
        assert min(abs(end - max(lo, 0.0)), abs(end - min(hi, 1.0))) <= 1e-12
        assert s * clamp_dual(loss, y, a + 2.0 * bound * d) in (0.0, 1.0)


def test_unknown_loss_ids_raise():
    for fn, args in [(primal_loss, (1.0, 0.5)), (dual_value, (1.0, 0.5)),
                     (dual_step, (1.0, 0.5, 0.1, 1.0)), (clamp_dual, (1.0, 0.5)),
                     (dual_line_terms, (1.0, 1.0, 0.5, 0.1))]:
        with pytest.raises(ValueError, match="unknown loss id"):
            fn(len(LOSSES), *args)
    for fn in (dual_lower, dual_upper):
        with pytest.raises(ValueError, match="unknown loss id"):
            fn(len(LOSSES))


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
    assert primal_loss(SQUARED_HINGE, 0.0, -0.25) == pytest.approx(0.5625)  # (1 - 0.25)^2
    assert primal_loss(SQUARED_HINGE, 1.0, 1.5) == 0.0
    assert dual_value(SQUARED_HINGE, 0.0, -1.0) == pytest.approx(0.75)  # b - b^2/4 at b = 1
    assert dual_value(SQUARED_HINGE, 1.0, 2.0) == pytest.approx(1.0)  # its maximum, = phi(0)
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
