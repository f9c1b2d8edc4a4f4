"""One rank's sums for the held-out recalibration (:mod:`solvers.recalibration`).

For rows i with margin mᵢ, label yᵢ ∈ {0, 1} and weight hᵢ, at (a, c) with zᵢ = a·mᵢ + c,
pᵢ = σ(zᵢ) and sᵢ = pᵢ(1 − pᵢ):

    out = [Σ hᵢ·ℓ(yᵢ, zᵢ),  Σ hᵢ(pᵢ − yᵢ)mᵢ,  Σ hᵢ(pᵢ − yᵢ),  Σ hᵢsᵢmᵢ²,  Σ hᵢsᵢmᵢ,  Σ hᵢsᵢ]

the logistic loss ℓ(y, z) = log(1 + e^z) − y·z, its gradient and its Hessian in (a, c). With
e = exp(−|z|): ℓ = y·max(−z, 0) + (1 − y)·max(z, 0) + log1p(e), σ(z) = 1/(1 + e) for z ≥ 0 and
e/(1 + e) below, and s = e/(1 + e)² (no overflow, no cancellation for any z). float64, summed in
row order; rows of weight 0 add nothing.
"""

from __future__ import annotations

import math

from numba import njit

SUMS = 6  # the length of ``out``


@njit(cache=True, nogil=True)
def platt_sums(margins, labels, weights, a, c, out):
    """Fill ``out`` (float64, :data:`SUMS` long) with the module docstring's sums."""
    for k in range(SUMS):
        out[k] = 0.0
    for i in range(margins.shape[0]):
        h = float(weights[i])
        if h == 0.0:
            continue
        m = margins[i]
        y = float(labels[i])
        z = a * m + c
        e = math.exp(-abs(z))
        q = 1.0 / (1.0 + e)
        p = q if z >= 0.0 else e * q
        s = e * q * q
        g = h * (p - y)
        hs = h * s
        out[0] += h * (y * max(-z, 0.0) + (1.0 - y) * max(z, 0.0) + math.log1p(e))
        out[1] += g * m
        out[2] += g
        out[3] += hs * m * m
        out[4] += hs * m
        out[5] += hs
