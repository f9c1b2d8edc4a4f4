"""Batch kernels over a CSR shard: loss, gradient and Hessian diagonal sums in one pass, and
margins for prediction.

Parameters ``theta`` are float64 of length n_features + 1, the intercept last. For rows i with
importance weight hᵢ and margin mᵢ = xᵢ·β + b (accumulated in float64):

    loss_sum  = Σᵢ hᵢ·ℓ(yᵢ, mᵢ)
    grad[j]  += Σᵢ hᵢ·ℓ'(yᵢ, mᵢ)·x_ij,    grad[d] += Σᵢ hᵢ·ℓ'(yᵢ, mᵢ)
    hess[j]  += Σᵢ hᵢ·ℓ''(yᵢ, mᵢ)·x_ij²,  hess[d] += Σᵢ hᵢ·ℓ''(yᵢ, mᵢ)

The values xᵢⱼ come in any layout of :mod:`solvers.kernels.values` (``values``, ``vpos``).
These are the local, unnormalized sums (the driver adds them over ranks, divides by Σhᵢ and
adds the penalty); ``grad`` / ``hess`` of length 0 are skipped. The next row's entries of
``theta`` and ``grad`` are prefetched while a row is processed. A non-finite margin or loss
stops the pass and is reported with its row (status BAD_MARGIN / BAD_LOSS), never summed.
"""

from __future__ import annotations

import math

from numba import njit

from terascale.solvers.kernels.losses import (
    LOGISTIC,
    logistic_terms,
    loss_curvature,
    loss_derivative,
    loss_value,
)
from terascale.solvers.kernels.prefetch import prefetch_row
from terascale.solvers.kernels.sampling import next_sampled
from terascale.solvers.kernels.values import DENSE, ONE, PLAIN, row_start, value_at

OK = 0
BAD_MARGIN = 1
BAD_LOSS = 2


@njit(cache=True, nogil=True)
def row_terms(loss_id, m, y):
    """(status, ℓ, ℓ') of a row with margin m and label y: BAD_MARGIN or BAD_LOSS when the
    margin or the loss is not finite (the logistic loss from one exp, see logistic_terms)."""
    if not math.isfinite(m):
        return BAD_MARGIN, 0.0, 0.0
    if loss_id == LOGISTIC:
        loss, g, _ = logistic_terms(m, y)
    else:
        loss = loss_value(loss_id, m, y)
        g = loss_derivative(loss_id, m, y)
    if not math.isfinite(loss):
        return BAD_LOSS, loss, g
    return OK, loss, g


@njit(cache=True, nogil=True)
def loss_grad_hess(indptr, indices, values, vpos, labels, weights, theta, loss_id, grad, hess,
                   start, stop, loss_sum):
    """Accumulate the sums of the module docstring over rows ``start..stop-1``, the loss onto
    ``loss_sum`` (consecutive ranges carrying it give the same bits as one call); returns
    ``(loss_sum, status, row)``."""
    n_rows = labels.shape[0]
    d = theta.shape[0] - 1
    want_grad = grad.shape[0] > 0
    want_hess = hess.shape[0] > 0
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    for r in range(start, stop):
        a = indptr[r]
        b = indptr[r + 1]
        if r + 1 < n_rows:  # overlap the next row's cache misses with this row's work
            for k in range(b, indptr[r + 2]):
                prefetch_row(theta, indices[k])
                if want_grad:
                    prefetch_row(grad, indices[k])
        cur, mode = row_start(values, vpos, a, b, cur)
        m = theta[d]
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            m += theta[indices[k]] * x
        y = float(labels[r])
        status, loss, g = row_terms(loss_id, m, y)
        if status != OK:
            return loss_sum, status, r
        h = float(weights[r])
        loss_sum += h * loss
        hg = h * g
        if want_grad and hg != 0.0:
            e = cur
            for k in range(a, b):
                if mode == PLAIN:
                    x = ONE
                elif mode == DENSE:
                    x = values[k]
                else:
                    x, e = value_at(values, vpos, k, e)
                grad[indices[k]] += hg * x
            grad[d] += hg
        if want_hess:
            hc = h * loss_curvature(loss_id, m, y)
            if hc != 0.0:
                e = cur
                for k in range(a, b):
                    if mode == PLAIN:
                        x = ONE
                    elif mode == DENSE:
                        x = values[k]
                    else:
                        x, e = value_at(values, vpos, k, e)
                    xf = float(x)
                    hess[indices[k]] += hc * xf * xf
                hess[d] += hc
    return loss_sum, OK, -1


@njit(cache=True, nogil=True)
def loss_grad_hess_table(indptr, indices, values, vpos, labels, weights, table, loss_id,
                         want_grad, want_hess, start, stop, loss_sum):
    """:func:`loss_grad_hess` with θ and its accumulators interleaved in one float64 table:
    ``table[j, 0]`` = θ_j (the intercept in the last row), the gradient sums added into
    ``table[j, 1]`` (if ``want_grad``), the Hessian-diagonal sums into ``table[j, 2]`` (if
    ``want_hess``). The cache line that brings θ_j for a row's margin also holds the cells its
    gradient (and curvature) updates, so a pass takes one miss per cold feature instead of two
    or three. Same operations in the same order as :func:`loss_grad_hess`: the same bits."""
    n_rows = labels.shape[0]
    d = table.shape[0] - 1
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    for r in range(start, stop):
        a = indptr[r]
        b = indptr[r + 1]
        if r + 1 < n_rows:
            for k in range(b, indptr[r + 2]):
                prefetch_row(table, indices[k])
        cur, mode = row_start(values, vpos, a, b, cur)
        m = table[d, 0]
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            m += table[indices[k], 0] * x
        y = float(labels[r])
        status, loss, g = row_terms(loss_id, m, y)
        if status != OK:
            return loss_sum, status, r
        h = float(weights[r])
        loss_sum += h * loss
        hg = h * g
        if want_grad and hg != 0.0:
            e = cur
            for k in range(a, b):
                if mode == PLAIN:
                    x = ONE
                elif mode == DENSE:
                    x = values[k]
                else:
                    x, e = value_at(values, vpos, k, e)
                table[indices[k], 1] += hg * x
            table[d, 1] += hg
        if want_hess:
            hc = h * loss_curvature(loss_id, m, y)
            if hc != 0.0:
                e = cur
                for k in range(a, b):
                    if mode == PLAIN:
                        x = ONE
                    elif mode == DENSE:
                        x = values[k]
                    else:
                        x, e = value_at(values, vpos, k, e)
                    xf = float(x)
                    table[indices[k], 2] += hc * xf * xf
                table[d, 2] += hc
    return loss_sum, OK, -1


@njit(cache=True, nogil=True)
def curvature_along(indptr, indices, values, vpos, labels, weights, table, loss_id, start, stop, stride,
                    sums):
    """Add Σᵢ hᵢ·ℓ''(yᵢ, mᵢ)·uᵢ² into ``sums[0]`` and Σᵢ hᵢ into ``sums[1]`` over the rows of
    ``start..stop-1`` in every ``stride``-th run of rows (:mod:`solvers.kernels.sampling`; 1:
    every row), with mᵢ = xᵢ·θ + b and uᵢ = xᵢ·p + p_b from ``table[:, 0]`` = θ and
    ``table[:, 1]`` = p (the intercept in the last row): the data part of the curvature
    pᵀ∇²f·p along a direction, one gather pass and no scatter. Returns ``(status, row)``
    (BAD_MARGIN and the row for a non-finite margin, as :func:`loss_grad_hess`)."""
    d = table.shape[0] - 1
    acc = sums[0]
    used = sums[1]
    r = next_sampled(start, stride)
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    while r < stop:
        nxt = next_sampled(r + 1, stride)
        if nxt < stop:
            for k in range(indptr[nxt], indptr[nxt + 1]):
                prefetch_row(table, indices[k])
        m = table[d, 0]
        u = table[d, 1]
        a = indptr[r]
        b = indptr[r + 1]
        cur, mode = row_start(values, vpos, a, b, cur)
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                xv = ONE
            elif mode == DENSE:
                xv = values[k]
            else:
                xv, e = value_at(values, vpos, k, e)
            x = float(xv)
            j = indices[k]
            m += table[j, 0] * x
            u += table[j, 1] * x
        if not (math.isfinite(m) and math.isfinite(u)):
            sums[0], sums[1] = acc, used
            return BAD_MARGIN, r
        h = float(weights[r])
        acc += h * loss_curvature(loss_id, m, float(labels[r])) * u * u
        used += h
        r = nxt
    sums[0], sums[1] = acc, used
    return OK, -1


#: entries ahead whose ``coef`` line :func:`margins` prefetches (rows are short, so a row ahead
#: would leave few misses in flight): 2.8x over none on 39-entry rows of random 2^24 weights
MARGIN_LOOKAHEAD = 64


@njit(cache=True, nogil=True)
def margins(indptr, indices, values, vpos, coef, intercept, out):
    """out[i] = xᵢ·coef + intercept (float64 accumulation, entries in their order), for every
    row. ``coef`` is read at random: the entry MARGIN_LOOKAHEAD ahead is prefetched."""
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    end = indptr[indptr.shape[0] - 1]
    for r in range(indptr.shape[0] - 1):
        a = indptr[r]
        b = indptr[r + 1]
        cur, mode = row_start(values, vpos, a, b, cur)
        e = cur
        m = intercept
        for k in range(a, b):
            if k + MARGIN_LOOKAHEAD < end:
                prefetch_row(coef, indices[k + MARGIN_LOOKAHEAD])
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            m += coef[indices[k]] * x
        out[r] = m


@njit(cache=True, nogil=True)
def margin_loss_sum(m, labels, weights, loss_id):
    """Σᵢ hᵢ·ℓ(yᵢ, mᵢ) over given margins (float64)."""
    total = 0.0
    for r in range(m.shape[0]):
        total += float(weights[r]) * loss_value(loss_id, m[r], float(labels[r]))
    return total
