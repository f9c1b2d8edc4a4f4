"""A line search satisfying the strong Wolfe conditions (Nocedal & Wright, Algorithms 3.5 and
3.6, with safeguarded cubic interpolation).

For φ(α) = f(θ + α·p) with φ'(0) < 0, find α > 0 with

    φ(α) ≤ φ(0) + c1·α·φ'(0)      (sufficient decrease)
    |φ'(α)| ≤ c2·|φ'(0)|          (curvature)

Each trial costs one function evaluation (one data pass and one AllReduce). A non-finite trial
value counts as "too far" and the interval shrinks toward the last good point. Pure Python on
scalars: identical inputs give identical trial steps on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

C1 = 1e-4
C2 = 0.9
MAX_EVALS = 20
_EXPAND = 2.0
_SAFEGUARD = 0.1


@dataclass
class Trial:
    alpha: float
    value: float
    slope: float  # φ'(α)
    payload: Any = None  # whatever φ returned alongside (e.g. the point and its gradient)


@dataclass
class LineSearchResult:
    ok: bool  # a point with sufficient decrease was found
    wolfe: bool  # ... that also satisfies the strong curvature condition
    trial: Trial | None
    evaluations: int
    any_finite: bool  # some trial had a finite value


Phi = Callable[[float], tuple[float, float, Any, bool]]  # α -> (φ, φ', payload, finite)


def _cubic_min(lo: Trial, hi: Trial) -> float:
    """Minimizer of the cubic interpolating φ and φ' at lo and hi, safeguarded inside the
    interval (bisection when the cubic has no usable minimizer or hi is not finite)."""
    a, b = lo.alpha, hi.alpha
    width = b - a
    mid = a + 0.5 * width
    if not (math.isfinite(hi.value) and math.isfinite(hi.slope)):
        return mid
    d1 = lo.slope + hi.slope - 3.0 * (lo.value - hi.value) / (a - b)
    disc = d1 * d1 - lo.slope * hi.slope
    if disc < 0.0:
        return mid
    d2 = math.copysign(math.sqrt(disc), width)
    denom = hi.slope - lo.slope + 2.0 * d2
    if denom == 0.0:
        return mid
    x = b - width * (hi.slope + d2 - d1) / denom
    lo_guard, hi_guard = sorted((a + _SAFEGUARD * width, b - _SAFEGUARD * width))
    if not math.isfinite(x):
        return mid
    return min(max(x, lo_guard), hi_guard)


def strong_wolfe(phi: Phi, value0: float, slope0: float, alpha0: float = 1.0, *, c1: float = C1,
                 c2: float = C2, max_evals: int = MAX_EVALS) -> LineSearchResult:
    """Search along a descent direction (``slope0`` < 0) starting with step ``alpha0``."""
    if not slope0 < 0.0:
        raise ValueError(f"not a descent direction: slope {slope0}")
    state = {"evals": 0, "finite": False}

    def probe(alpha: float) -> Trial:
        value, slope, payload, finite = phi(alpha)
        state["evals"] += 1
        state["finite"] |= finite
        if not finite:
            value, slope = math.inf, math.nan
        return Trial(alpha, value, slope, payload)

    def armijo(t: Trial) -> bool:
        return t.value <= value0 + c1 * t.alpha * slope0

    def curvature(t: Trial) -> bool:
        return abs(t.slope) <= -c2 * slope0

    def done(t: Trial | None, wolfe: bool) -> LineSearchResult:
        return LineSearchResult(t is not None, wolfe, t, state["evals"], state["finite"])

    def zoom(lo: Trial, hi: Trial) -> LineSearchResult:
        # lo: the lowest sufficient-decrease point so far (alpha 0 = the start), hi: the other end
        while state["evals"] < max_evals and abs(hi.alpha - lo.alpha) > 1e-16 * max(lo.alpha, hi.alpha):
            t = probe(_cubic_min(lo, hi))
            if not armijo(t) or t.value >= lo.value:
                hi = t
                continue
            if curvature(t):
                return done(t, True)
            if t.slope * (hi.alpha - lo.alpha) >= 0.0:
                hi = lo
            lo = t
        return done(lo if lo.alpha > 0.0 else None, False)

    prev = Trial(0.0, value0, slope0)
    alpha = alpha0
    while state["evals"] < max_evals:
        t = probe(alpha)
        if not armijo(t) or (prev.alpha > 0.0 and t.value >= prev.value):
            return zoom(prev, t)
        if curvature(t):
            return done(t, True)
        if t.slope >= 0.0:
            return zoom(t, prev)
        prev = t
        alpha *= _EXPAND
    return done(prev if prev.alpha > 0.0 else None, False)
