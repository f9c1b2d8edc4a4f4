"""Scalar loss kernels: value, first and second derivative in the margin, and the
importance-invariant step, for every loss the solvers support.

A loss is picked by its catalogue id (:mod:`terascale.solvers.catalogue`; kernels branch on it
per row, and the branch is perfectly predicted); an unknown id raises ValueError. ``m`` is the
margin ``x·β + b``, ``y`` the label, all in float64.

- ``LOGISTIC`` (y ∈ {0, 1}):  ℓ = y·softplus(−m) + (1−y)·softplus(m),  ℓ' = σ(m) − y,
  ℓ'' = σ(m)·σ(−m), with softplus(a) = max(a, 0) + log1p(exp(−|a|)) (never overflows) and σ
  evaluated on the side where exp cannot overflow.
- ``SQUARED`` (any real y):  ℓ = ½(m − y)²,  ℓ' = m − y,  ℓ'' = 1.
- ``HINGE`` (y ∈ {0, 1} mapped to s = 2y − 1 ∈ {−1, +1}):  ℓ = max(0, 1 − s·m),
  ℓ' = −s if s·m < 1 else 0,  ℓ'' = 0 (the curvature of a piecewise-linear loss).
- ``SQUARED_HINGE`` (labels as hinge):  ℓ = max(0, 1 − s·m)²,  ℓ' = −2s·(1 − s·m) if s·m < 1
  else 0,  ℓ'' = 2 if s·m < 1 else 0 (the generalized second derivative; ℓ' is Lipschitz).

Importance-invariant step (Karampatziakis & Langford, 2011). An update ``w ← w − u·D·x`` with a
diagonal rate ``D`` moves the margin by ``−u·κ``, where ``κ = xᵀ D x``. Instead of the gradient
scalar ``u = h·ℓ'(m)`` for an example of importance weight ``h``, :func:`invariant_scalar`
returns the ``u`` for which the margin follows the ODE ``dm/dτ = −κ·ℓ'(m)`` for ``τ ∈ [0, h]``,
i.e. the limit of infinitely many infinitesimal gradient steps. It never overshoots the
label, so an example of weight ``h`` acts like ``h`` copies of weight 1 taken one after another:

- squared:  m(h) = y + (m − y)·e^{−hκ},  so  u = (m − y)·(1 − e^{−hκ}) / κ.
- logistic: with z = s·m, z(h) = z + δ where δ ≥ 0 solves  δ + e^{z}(e^{δ} − 1) = hκ
  (integrate (1 + e^{z}) dz = κ dτ); u = −s·δ / κ.  δ is found by Halley's method from an
  upper bound (the left side is convex and increasing in δ).
- hinge:    the margin moves toward s·m = 1 and stops there: δ = min(hκ, max(0, 1 − z)),
  u = −s·δ / κ.
- squared hinge: for z < 1, dz/dτ = 2κ(1 − z), so z(h) = 1 − (1 − z)·e^{−2hκ}:
  δ = max(0, 1 − z)·(1 − e^{−2hκ}),  u = −s·δ / κ.
"""

from __future__ import annotations

import math

from numba import njit

from terascale.solvers.catalogue import HINGE, LOGISTIC, LOSS_IDS, SQUARED, SQUARED_HINGE

__all__ = ["HINGE", "LOGISTIC", "LOSS_IDS", "SQUARED", "SQUARED_HINGE", "invariant_scalar", "logistic_terms",
           "loss_curvature", "loss_derivative", "loss_value", "sigmoid", "softplus"]

# Beyond e^{z} = 1e300 the logistic derivative (≈ e^{−z}) is zero to float32 precision.
_EXP_BIG = 1e300
_HALLEY_MAX_ITER = 30
# Halley converges cubically: a last step of relative size 1e-5 leaves an error near 1e-15.
_HALLEY_RTOL = 1e-5


@njit(cache=True)
def softplus(a):
    """log(1 + e^a) without overflow."""
    if a > 0.0:
        return a + math.log1p(math.exp(-a))
    return math.log1p(math.exp(a))


@njit(cache=True)
def sigmoid(a):
    """1 / (1 + e^{−a}), computed on the side where exp cannot overflow."""
    if a >= 0.0:
        return 1.0 / (1.0 + math.exp(-a))
    e = math.exp(a)
    return e / (1.0 + e)


@njit(cache=True)
def loss_value(loss_id, m, y):
    """ℓ(y, m)."""
    if loss_id == LOGISTIC:
        return y * softplus(-m) + (1.0 - y) * softplus(m)
    if loss_id == SQUARED:
        d = m - y
        return 0.5 * d * d
    s = 2.0 * y - 1.0
    if loss_id == HINGE:
        return max(0.0, 1.0 - s * m)
    if loss_id == SQUARED_HINGE:
        r = max(0.0, 1.0 - s * m)
        return r * r
    raise ValueError("unknown loss id")


@njit(cache=True)
def loss_derivative(loss_id, m, y):
    """∂ℓ/∂m."""
    if loss_id == LOGISTIC:
        return sigmoid(m) - y
    if loss_id == SQUARED:
        return m - y
    s = 2.0 * y - 1.0
    if loss_id == HINGE:
        return -s if s * m < 1.0 else 0.0
    if loss_id == SQUARED_HINGE:
        return -2.0 * s * (1.0 - s * m) if s * m < 1.0 else 0.0
    raise ValueError("unknown loss id")


@njit(cache=True)
def loss_curvature(loss_id, m, y):
    """∂²ℓ/∂m² (0 for the hinge loss; the generalized one for the squared hinge)."""
    if loss_id == LOGISTIC:
        return sigmoid(m) * sigmoid(-m)
    if loss_id == SQUARED:
        return 1.0
    if loss_id == HINGE:
        return 0.0
    if loss_id == SQUARED_HINGE:
        return 2.0 if (2.0 * y - 1.0) * m < 1.0 else 0.0
    raise ValueError("unknown loss id")


@njit(cache=True)
def logistic_terms(m, y):
    """(ℓ, ℓ', e^{z}) of the logistic loss at margin m, label y ∈ {0, 1}, with z = s·m.

    One exp serves all three: e = exp(−|m|), ℓ = y·max(−m, 0) + (1−y)·max(m, 0) + log1p(e),
    σ(m) = 1/(1+e) for m ≥ 0 else e/(1+e), and e^{z} is e or 1/e (inf beyond float64).
    """
    e = math.exp(-abs(m))
    loss = y * max(-m, 0.0) + (1.0 - y) * max(m, 0.0) + math.log1p(e)
    p = 1.0 / (1.0 + e) if m >= 0.0 else e / (1.0 + e)
    z_positive = (m >= 0.0) == (y > 0.5)
    if z_positive:
        ez = 1.0 / e if e > 0.0 else math.inf
    else:
        ez = e
    return loss, p - y, ez


@njit(cache=True)
def logistic_invariant_delta(z, ez, hk):
    """δ ≥ 0 solving δ + e^{z}·(e^{δ} − 1) = hk, given z, ``ez`` = e^{z} and hk ≥ 0.

    Halley's method from the upper bound min(hk/(1+e^{z}), log(1 + hk·e^{−z})) (the left side
    is convex in δ, ≥ δ·(1+e^{z}) and ≥ e^{z}(e^{δ}−1)); it lands within ~1e-13 relative in
    1–2 iterations on average, at most a handful. e^{z}·e^{δ} is formed as exp(z + δ) when δ is
    not small, so nothing overflows for any z and hk.
    """
    if hk <= 0.0 or ez > _EXP_BIG:
        # a confident, correct prediction: the loss is flat to float64 precision
        return 0.0
    delta = hk / (1.0 + ez)
    if ez > 0.0:
        ratio = hk / ez
        delta = min(delta, math.log1p(ratio) if ratio < _EXP_BIG else math.log(hk) - z)
    for _ in range(_HALLEY_MAX_ITER):
        if delta < 0.5:
            a_em1 = ez * math.expm1(delta)  # e^z·(e^δ − 1)
            a_exp = a_em1 + ez
        else:
            a_exp = math.exp(z + delta)
            a_em1 = a_exp - ez
        f = delta + a_em1 - hk
        f1 = 1.0 + a_exp
        step = f * f1 / (f1 * f1 - 0.5 * f * a_exp)
        delta -= step
        if abs(step) <= _HALLEY_RTOL * delta:
            break
    return max(delta, 0.0)


@njit(cache=True)
def invariant_scalar(loss_id, m, y, h, kappa, ez):
    """The update scalar u of an importance-invariant step (see the module docstring).

    ``kappa = xᵀ D x > 0`` is the margin's rate of change per unit of update scalar, ``h`` the
    example's importance weight, ``ez`` = e^{s·m} (used by the logistic loss only; see
    :func:`logistic_terms`). The caller applies ``w ← w − u·D·x``.
    """
    hk = h * kappa
    if loss_id == SQUARED:
        return (m - y) * (-math.expm1(-hk)) / kappa
    s = 2.0 * y - 1.0
    if loss_id == LOGISTIC:
        return -s * logistic_invariant_delta(s * m, ez, hk) / kappa
    if loss_id == HINGE:
        return -s * min(hk, max(0.0, 1.0 - s * m)) / kappa
    if loss_id == SQUARED_HINGE:
        return -s * max(0.0, 1.0 - s * m) * (-math.expm1(-2.0 * hk)) / kappa
    raise ValueError("unknown loss id")
