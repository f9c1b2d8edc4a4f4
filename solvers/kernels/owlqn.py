"""Kernels of OWL-QN (Andrew & Gao 2007, "Scalable training of L1-regularized log-linear
models") over θ = [β, b], the intercept b last and unpenalized.

With the smooth part's gradient g = ∇(loss term + (λ₂/2)·‖β‖²) and λ₁ > 0, the pseudo-gradient
◇f of f = smooth + λ₁·‖β‖₁ is, per coordinate j of β,

    ◇_j = g_j + λ₁·sign(β_j)     if β_j ≠ 0
    ◇_j = g_j + λ₁               if β_j = 0 and g_j + λ₁ < 0
    ◇_j = g_j − λ₁               if β_j = 0 and g_j − λ₁ > 0
    ◇_j = 0                      otherwise (0 is optimal along j)

and ◇_b = g_b: the directional derivative of f is −◇ along −◇, the steepest descent direction.
The orthant of a step is ξ_j = sign(β_j), or sign(−◇_j) where β_j = 0 (:func:`project_point`);
a direction component whose sign disagrees with −◇_j is zeroed (:func:`align_direction`, the
intercept included, so the direction stays a descent direction for ◇).

Every loop is sequential over the coordinates and every sum is in a fixed order, so identical
inputs give identical bits on every rank (:mod:`solvers.kernels.vector`).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def pseudo_gradient(theta, grad, l1, out):
    """out = ◇f at θ (module docstring) from the smooth gradient ``grad``; ``out`` may be a new
    array of θ's length (the intercept's entry copied from ``grad``)."""
    d = theta.shape[0] - 1
    for j in range(d):
        x = theta[j]
        g = grad[j]
        if x > 0.0:
            out[j] = g + l1
        elif x < 0.0:
            out[j] = g - l1
        elif g + l1 < 0.0:
            out[j] = g + l1
        elif g - l1 > 0.0:
            out[j] = g - l1
        else:
            out[j] = 0.0
    out[d] = grad[d]


@njit(cache=True, nogil=True)
def align_direction(p, pg):
    """Zero p_j wherever p_j·◇_j ≥ 0 (the sign of p_j is not that of −◇_j), in place; returns
    the slope ◇·p of what is left (≤ 0; 0 when nothing is left), summed in index order."""
    slope = 0.0
    for j in range(p.shape[0]):
        prod = p[j] * pg[j]
        if prod < 0.0:
            slope += prod
        else:
            p[j] = 0.0
    return slope


@njit(cache=True, nogil=True)
def project_point(point, theta, pg):
    """Project a trial point onto the orthant of θ, in place: β_j of ``point`` becomes 0 where
    its sign differs from ξ_j = sign(θ_j), or sign(−◇_j) where θ_j = 0 (ξ_j = 0 pins β_j at 0).
    The intercept (last entry) is left as it is."""
    d = theta.shape[0] - 1
    for j in range(d):
        x = theta[j]
        if x > 0.0:
            xi = 1.0
        elif x < 0.0:
            xi = -1.0
        elif pg[j] < 0.0:
            xi = 1.0
        elif pg[j] > 0.0:
            xi = -1.0
        else:
            xi = 0.0
        if point[j] * xi <= 0.0:
            point[j] = 0.0


@njit(cache=True, nogil=True)
def l1_norm(theta):
    """‖β‖₁ = Σ_j |β_j| over θ without its last entry (the intercept), in index order with four
    interleaved partial sums (as :func:`solvers.kernels.vector.dot`)."""
    n = theta.shape[0] - 1
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += abs(np.float64(theta[i]))
        s1 += abs(np.float64(theta[i + 1]))
        s2 += abs(np.float64(theta[i + 2]))
        s3 += abs(np.float64(theta[i + 3]))
        i += 4
    while i < n:
        s0 += abs(np.float64(theta[i]))
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def directional_change(point, theta, pg):
    """◇·(point − θ): the first-order change OWL-QN's sufficient-decrease test compares with."""
    s = 0.0
    for j in range(theta.shape[0]):
        s += pg[j] * (point[j] - theta[j])
    return s
