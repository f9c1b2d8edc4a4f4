"""Deterministic vector kernels for the L-BFGS driver.

Every rank runs the same optimizer arithmetic on bit-identical AllReduce results, so the
results must not depend on the machine: these loops use a fixed summation order (four
interleaved partial sums combined as (s0 + s1) + (s2 + s3)), no fast-math reassociation and no
BLAS (whose blocking and threading vary with the CPU and the thread count). Inputs may be
float32 or float64; arithmetic and results are float64: entries are widened with
``np.float64(x)``, not ``float(x)``, which numba types as float32 for a float32 entry (a product
of two float32 entries would then be rounded to float32).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def dot(a, b):
    """Σ a[i]·b[i]."""
    n = a.shape[0]
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += np.float64(a[i]) * np.float64(b[i])
        s1 += np.float64(a[i + 1]) * np.float64(b[i + 1])
        s2 += np.float64(a[i + 2]) * np.float64(b[i + 2])
        s3 += np.float64(a[i + 3]) * np.float64(b[i + 3])
        i += 4
    while i < n:
        s0 += np.float64(a[i]) * np.float64(b[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def weighted_dot(a, w, b):
    """Σ a[i]·w[i]·b[i]."""
    n = a.shape[0]
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += np.float64(a[i]) * np.float64(w[i]) * np.float64(b[i])
        s1 += np.float64(a[i + 1]) * np.float64(w[i + 1]) * np.float64(b[i + 1])
        s2 += np.float64(a[i + 2]) * np.float64(w[i + 2]) * np.float64(b[i + 2])
        s3 += np.float64(a[i + 3]) * np.float64(w[i + 3]) * np.float64(b[i + 3])
        i += 4
    while i < n:
        s0 += np.float64(a[i]) * np.float64(w[i]) * np.float64(b[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def axpy(alpha, x, y):
    """y ← y + alpha·x, in place (y float64)."""
    for i in range(y.shape[0]):
        y[i] += alpha * np.float64(x[i])


@njit(cache=True)
def norm2(a):
    """‖a‖₂ = √(a·a)."""
    return math.sqrt(dot(a, a))


@njit(cache=True, nogil=True)
def _rounded(a, b, i):
    """float32(a[i] − b[i]) as a float64."""
    return np.float64(np.float32(a[i] - b[i]))


@njit(cache=True, nogil=True)
def pair_products(x1, x0, g1, g0):
    """(s·y, y·y) of the float32-rounded pair s = f32(x1 − x0), y = f32(g1 − g0), without
    storing it: the same bits as :func:`dot` on the stored float32 vectors."""
    n = x1.shape[0]
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    b0 = 0.0
    b1 = 0.0
    b2 = 0.0
    b3 = 0.0
    i = 0
    while i + 4 <= n:
        y = _rounded(g1, g0, i)
        a0 += _rounded(x1, x0, i) * y
        b0 += y * y
        y = _rounded(g1, g0, i + 1)
        a1 += _rounded(x1, x0, i + 1) * y
        b1 += y * y
        y = _rounded(g1, g0, i + 2)
        a2 += _rounded(x1, x0, i + 2) * y
        b2 += y * y
        y = _rounded(g1, g0, i + 3)
        a3 += _rounded(x1, x0, i + 3) * y
        b3 += y * y
        i += 4
    while i < n:
        y = _rounded(g1, g0, i)
        a0 += _rounded(x1, x0, i) * y
        b0 += y * y
        i += 1
    return (a0 + a1) + (a2 + a3), (b0 + b1) + (b2 + b3)


@njit(cache=True, nogil=True)
def store_pair(x1, x0, g1, g0, s_out, y_out):
    """s_out = f32(x1 − x0), y_out = f32(g1 − g0)."""
    for i in range(x1.shape[0]):
        s_out[i] = np.float32(x1[i] - x0[i])
        y_out[i] = np.float32(g1[i] - g0[i])
