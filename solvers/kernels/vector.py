"""Deterministic vector kernels for the L-BFGS driver.

Every rank runs the same optimizer arithmetic on bit-identical AllReduce results, so the
results must not depend on the machine: these loops use a fixed summation order (four
interleaved partial sums combined as (s0 + s1) + (s2 + s3)), no fast-math reassociation and no
BLAS (whose blocking and threading vary with the CPU and the thread count). Inputs may be
float32 or float64; arithmetic and results are float64.
"""

from __future__ import annotations

import math

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
        s0 += float(a[i]) * float(b[i])
        s1 += float(a[i + 1]) * float(b[i + 1])
        s2 += float(a[i + 2]) * float(b[i + 2])
        s3 += float(a[i + 3]) * float(b[i + 3])
        i += 4
    while i < n:
        s0 += float(a[i]) * float(b[i])
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
        s0 += float(a[i]) * float(w[i]) * float(b[i])
        s1 += float(a[i + 1]) * float(w[i + 1]) * float(b[i + 1])
        s2 += float(a[i + 2]) * float(w[i + 2]) * float(b[i + 2])
        s3 += float(a[i + 3]) * float(w[i + 3]) * float(b[i + 3])
        i += 4
    while i < n:
        s0 += float(a[i]) * float(w[i]) * float(b[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def axpy(alpha, x, y):
    """y ← y + alpha·x, in place (y float64)."""
    for i in range(y.shape[0]):
        y[i] += alpha * float(x[i])


@njit(cache=True)
def norm2(a):
    """‖a‖₂ = √(a·a)."""
    return math.sqrt(dot(a, a))
