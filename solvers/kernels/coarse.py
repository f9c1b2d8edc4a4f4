"""Kernels of the field-level coarse correction (:mod:`solvers.preconditioner`).

The coarse space has one column per feature group (a field of the click log: every hashed
bucket a field's tokens fall into, see ``pipeline.groups``) and one for the intercept:
S = [s_0 … s_{G−1}, e_b], s_g the indicator of the group's features. The coarse matrix is
E = Sᵀ·∇²f·S; its data part is a sum over rows of ℓ''ᵢ·aᵢ·aᵢᵀ with aᵢ = Sᵀ·[xᵢ, 1] (the row's
value summed per group, and 1 for the intercept).

``group`` arrays hold a group number per feature (compact or local numbering), -1 for a
feature in no group; the intercept's column is number G (``n_groups``). The vector kernels
(:func:`restrict`, :func:`prolong`, :func:`ldl_factor`, :func:`ldl_solve`) run on every rank
on identical bytes, so like :mod:`solvers.kernels.vector` they use a fixed order, no BLAS and
float64 arithmetic (entries widened with ``np.float64``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from terascale.solvers.kernels.losses import loss_curvature
from terascale.solvers.kernels.objective import BAD_MARGIN, OK
from terascale.solvers.kernels.sampling import next_sampled
from terascale.solvers.kernels.values import DENSE, ONE, PLAIN, row_start, value_at


@njit(cache=True, nogil=True)
def coarse_rows(indptr, indices, values, vpos, labels, weights, table, group, n_groups, loss_id,
                start, stop, stride, E):
    """Add Σᵢ hᵢ·ℓ''(yᵢ, mᵢ)·aᵢ·aᵢᵀ into E ((G+1)×(G+1), symmetric) over the rows r of
    ``start..stop-1`` in every ``stride``-th run of rows (:mod:`solvers.kernels.sampling`),
    mᵢ = xᵢ·θ + b from ``table[:, 0]`` = θ (local numbering, the intercept in the last row) and
    ``group`` by local slot.

    Complement form: with uᵢ = 1 − aᵢ (0 for a field the row holds once with value 1, 1 for a
    field it lacks), Σ cᵢ·aᵢ·aᵢᵀ = C·11ᵀ − s·1ᵀ − 1·sᵀ + U with C = Σ cᵢ, s = Σ cᵢ·uᵢ and U = Σ
    cᵢ·uᵢ·uᵢᵀ, which only touch a row's few missing (or repeated) fields instead of a dense
    (G+1)² update per row. Returns (Σ hᵢ over the rows used, status, row)."""
    d = table.shape[0] - 1
    k = n_groups + 1
    v = np.zeros(k)
    nz = np.empty(k, dtype=np.int64)
    svec = np.zeros(k)
    U = np.zeros((k, k))
    total = 0.0
    used = 0.0
    r = next_sampled(start, stride)
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    while r < stop:
        a = indptr[r]
        b = indptr[r + 1]
        m = table[d, 0]
        for g in range(n_groups):
            v[g] = 1.0
        cur, mode = row_start(values, vpos, a, b, cur)
        e = cur
        for kk in range(a, b):
            if mode == PLAIN:
                xv = ONE
            elif mode == DENSE:
                xv = values[kk]
            else:
                xv, e = value_at(values, vpos, kk, e)
            x = np.float64(xv)
            j = indices[kk]
            m += table[j, 0] * x
            g = group[j]
            if g >= 0:
                v[g] -= x
        if not math.isfinite(m):
            return used, BAD_MARGIN, r
        h = np.float64(weights[r])
        used += h
        hc = h * loss_curvature(loss_id, m, np.float64(labels[r]))
        r = next_sampled(r + 1, stride)
        if hc == 0.0:
            continue
        total += hc
        n = 0
        for g in range(n_groups):  # v now holds u = 1 − a (the intercept's u is 0)
            if v[g] != 0.0:
                nz[n] = g
                n += 1
        for p in range(n):
            gp = nz[p]
            cp = hc * v[gp]
            svec[gp] += cp
            for q in range(p, n):
                U[gp, nz[q]] += cp * v[nz[q]]
    for p in range(k):
        for q in range(p, k):
            e = total - svec[p] - svec[q] + U[p, q]
            E[p, q] += e
            if q != p:
                E[q, p] += e
    return used, OK, -1


@njit(cache=True, nogil=True)
def restrict(q, group, n_groups, out):
    """out = Sᵀ·q: out[g] = Σ q[j] over the features j of group g (in index order), out[G] =
    q[-1] (the intercept)."""
    for g in range(n_groups + 1):
        out[g] = 0.0
    d = q.shape[0] - 1
    for j in range(d):
        g = group[j]
        if g >= 0:
            out[g] += np.float64(q[j])
    out[n_groups] = np.float64(q[d])


@njit(cache=True, nogil=True)
def prolong(z, group, n_groups, r):
    """r += S·z: r[j] += z[group[j]] for every grouped feature, r[-1] += z[G]."""
    d = r.shape[0] - 1
    for j in range(d):
        g = group[j]
        if g >= 0:
            r[j] += z[g]
    r[d] += z[n_groups]


@njit(cache=True, nogil=True)
def ldl_factor(E, floor):
    """E = L·D·Lᵀ (E symmetric, n×n) with every pivot raised to at least ``floor``: returns
    (L unit lower-triangular, D). A raised pivot makes the factor that of E plus a non-negative
    diagonal: positive definite, so directions along which E is singular (the data and the
    penalty do not bend the objective there) get a large but finite step."""
    n = E.shape[0]
    L = np.zeros((n, n))
    D = np.zeros(n)
    for j in range(n):
        s = E[j, j]
        for k in range(j):
            s -= L[j, k] * L[j, k] * D[k]
        D[j] = s if s > floor else floor
        L[j, j] = 1.0
        for i in range(j + 1, n):
            s = E[i, j]
            for k in range(j):
                s -= L[i, k] * L[j, k] * D[k]
            L[i, j] = s / D[j]
    return L, D


@njit(cache=True, nogil=True)
def ldl_solve(L, D, t):
    """t ← (L·D·Lᵀ)⁻¹·t, in place."""
    n = t.shape[0]
    for i in range(n):
        s = t[i]
        for k in range(i):
            s -= L[i, k] * t[k]
        t[i] = s
    for i in range(n):
        t[i] /= D[i]
    for i in range(n - 1, -1, -1):
        s = t[i]
        for k in range(i + 1, n):
            s -= L[k, i] * t[k]
        t[i] = s
