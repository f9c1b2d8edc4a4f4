"""Numba kernels of dual SCD (SDCA) over one shard stored by example (CSR).

Arrays only: ``indptr`` int64, ``indices`` int32, ``values`` float32, ``labels`` and ``weights``
float32, dual variables ``alpha`` and shared vectors float64. The shared vector ``u`` has
``n_features + 1`` entries; entry ``bias_index = n_features`` belongs to the augmented constant
feature of value ``bias_scale`` (0 when there is no intercept, which leaves that entry at 0).

One coordinate step on example i (``scale = sigma / (lam N)``, see ``losses.dual_step``)::

    dot   = x_i . u + bias_scale u[bias]
    q     = scale c_i ||x_i||^2
    a'    = dual_step(loss, y_i, a_i, dot, q)
    u    += scale c_i (a' - a_i) x_i        (and the bias entry)

With ``sigma = 1`` and ``u = w(alpha)`` this is plain SDCA. With ``u = w + sigma dw_local`` it is
the step on CoCoA+'s local subproblem; the caller recovers ``dw_local = (u - w) / sigma``.

The multi-threaded epoch follows Snap ML (Ioannou et al.): the rows are cut into buckets of
``bucket_size`` consecutive examples, the buckets are shuffled every epoch and dealt to
``n_parts`` partitions (dynamic re-partitioning), each partition works on its own replica of the
shared vector with ``sigma_part = sigma * n_parts``, and the replicas are merged once per epoch:
``u += (1 / n_parts) sum_p (u_p - u)``, i.e. the partitions' updates are *added* (CoCoA+ with
sigma' = n_parts inside the worker). That keeps every epoch a monotone ascent step of the
worker's subproblem, so the threaded solver converges to the same optimum as the sequential one.
The result depends only on the bucket order, never on thread timing.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from terascale.solvers.kernels.prefetch import prefetch_row
from terascale.solvers.scd.losses import clamp_dual, dual_step, dual_value, primal_loss

ROW_AHEAD = 8  # rows between prefetching a row's data and its step (about one bucket)


@njit(cache=True, nogil=True)
def row_sq_norms(indptr, values, bias_scale):
    """||x_i||^2 of every row, the augmented constant feature included."""
    n = indptr.shape[0] - 1
    out = np.empty(n, np.float64)
    b2 = bias_scale * bias_scale
    for i in range(n):
        acc = b2
        for k in range(indptr[i], indptr[i + 1]):
            v = np.float64(values[k])
            acc += v * v
        out[i] = acc
    return out


@njit(cache=True, nogil=True)
def _step_row(i, indptr, indices, values, labels, weights, sqn, alpha, u, loss, scale,
              bias_scale, bias_index):
    dot = bias_scale * u[bias_index]
    for k in range(indptr[i], indptr[i + 1]):
        dot += np.float64(values[k]) * u[indices[k]]
    c = np.float64(weights[i])
    a = alpha[i]
    a_new = dual_step(loss, np.float64(labels[i]), a, dot, scale * c * sqn[i])
    if a_new != a:
        alpha[i] = a_new
        coef = scale * c * (a_new - a)
        for k in range(indptr[i], indptr[i + 1]):
            u[indices[k]] += coef * np.float64(values[k])
        u[bias_index] += coef * bias_scale


@njit(cache=True, nogil=True)
def _prefetch_features(i, indptr, indices, table):
    """Start loading the shared-vector entries of row i (a hint: it changes no value). Issued
    for the next row before a row's step, it overlaps that row's cache misses with this row's
    dot product and Newton steps."""
    for k in range(indptr[i], indptr[i + 1]):
        prefetch_row(table, indices[k])


@njit(cache=True, nogil=True)
def _prefetch_row_data(r, indptr, indices, values, labels, weights, sqn, alpha):
    """Start loading what the step of row r reads first: its non-zeros, label, weight, norm and
    dual variable (``indptr[r]`` itself is read here). Rows come in shuffled buckets, so each
    bucket starts with cache and TLB misses in every per-row array. A hint: no value changes."""
    a = indptr[r]
    prefetch_row(indices, a)
    prefetch_row(values, a)
    prefetch_row(labels, r)
    prefetch_row(weights, r)
    prefetch_row(sqn, r)
    prefetch_row(alpha, r)


@njit(cache=True, nogil=True)
def _prefetch_ahead(j, order, indptr, indices, values, labels, weights, sqn, alpha):
    """Before the step of ``order[j]``: the row data of ``order[j + ROW_AHEAD]`` and the
    ``indptr`` entry of ``order[j + 2 ROW_AHEAD]``."""
    m = order.shape[0]
    if j + 2 * ROW_AHEAD < m:
        prefetch_row(indptr, order[j + 2 * ROW_AHEAD])
    if j + ROW_AHEAD < m:
        _prefetch_row_data(order[j + ROW_AHEAD], indptr, indices, values, labels, weights, sqn,
                           alpha)


@njit(cache=True, nogil=True)
def dual_epoch(indptr, indices, values, labels, weights, sqn, alpha, u, order, loss, scale,
               bias_scale, bias_index):
    """One sequential epoch over the rows in ``order`` (the reference solver)."""
    m = order.shape[0]
    for j in range(m):
        _prefetch_ahead(j, order, indptr, indices, values, labels, weights, sqn, alpha)
        if j + 1 < m:
            _prefetch_features(order[j + 1], indptr, indices, u)
        _step_row(order[j], indptr, indices, values, labels, weights, sqn, alpha, u, loss, scale,
                  bias_scale, bias_index)


@njit(cache=True, nogil=True)
def _step_row_with_gap(i, indptr, indices, values, labels, weights, sqn, alpha, wu, loss, scale,
                       bias_scale, bias_index, acc):
    """``_step_row`` on ``u = wu[:, 1]`` that first takes row i's gap terms at ``w = wu[:, 0]``:
    adds (c phi(x_i . w), c h(alpha_i)) of the state before the step to ``acc``."""
    z = bias_scale * wu[bias_index, 0]
    dot = bias_scale * wu[bias_index, 1]
    for k in range(indptr[i], indptr[i + 1]):
        v = np.float64(values[k])
        f = indices[k]
        z += v * wu[f, 0]
        dot += v * wu[f, 1]
    c = np.float64(weights[i])
    y = np.float64(labels[i])
    a = alpha[i]
    acc[0] += c * primal_loss(loss, y, z)
    acc[1] += c * dual_value(loss, y, a)
    a_new = dual_step(loss, y, a, dot, scale * c * sqn[i])
    if a_new != a:
        alpha[i] = a_new
        coef = scale * c * (a_new - a)
        for k in range(indptr[i], indptr[i + 1]):
            wu[indices[k], 1] += coef * np.float64(values[k])
        wu[bias_index, 1] += coef * bias_scale


@njit(cache=True, nogil=True)
def dual_epoch_with_gap(indptr, indices, values, labels, weights, sqn, alpha, wu, order, loss,
                        scale, bias_scale, bias_index):
    """``dual_epoch`` that also returns ``dual_objective_sums`` of the point it starts from.

    ``wu`` is (n_features + 1, 2): column 0 the round's w (read only), column 1 the replica u
    the steps update (it starts equal to w). Each row's margin against w and its conjugate
    term are taken just before its step, so when ``order`` visits every row once the sums are
    those of (alpha, w) at the start of the epoch. The interleaving puts w_j and u_j in one
    cache line: the gap costs no separate pass over the data and almost no extra memory
    traffic.
    """
    acc = np.zeros(2)
    m = order.shape[0]
    for j in range(m):
        _prefetch_ahead(j, order, indptr, indices, values, labels, weights, sqn, alpha)
        if j + 1 < m:
            _prefetch_features(order[j + 1], indptr, indices, wu)
        _step_row_with_gap(order[j], indptr, indices, values, labels, weights, sqn, alpha, wu,
                           loss, scale, bias_scale, bias_index, acc)
    return acc[0], acc[1]


@njit(cache=True, nogil=True)
def _ordered_pair_sum(parts):
    """(sum parts[:, 0], sum parts[:, 1]) in row order: partial sums of partitions or chunks
    added in a fixed order, so the total does not depend on thread timing."""
    total_loss = 0.0
    total_conj = 0.0
    for r in range(parts.shape[0]):
        total_loss += parts[r, 0]
        total_conj += parts[r, 1]
    return total_loss, total_conj


@njit(cache=True, parallel=True)
def dual_epoch_buckets(indptr, indices, values, labels, weights, sqn, alpha, u, bucket_order,
                       bucket_size, replicas, loss, scale_part, bias_scale, bias_index, with_gap):
    """One bucketed epoch on ``replicas.shape[0]`` partitions, each with its own shared-vector
    replica; ``scale_part = sigma * n_parts / (lam N)``. Merges the replicas into ``u``.

    ``replicas`` is (n_parts, n_features + 1, 2): column 1 is the partition's replica, column 0
    a copy of ``u`` as the epoch found it. With ``with_gap`` each row's margin against that copy
    and its conjugate term are taken just before its step (in the same cache line as the
    replica's entry, as in ``dual_epoch_with_gap``), and the function returns the gap sums of
    (alpha, u) at the start of the epoch, partition sums added in partition order; otherwise
    (0, 0)."""
    n = labels.shape[0]
    n_parts = replicas.shape[0]
    nb = bucket_order.shape[0]
    parts = np.zeros((n_parts, 2))
    for p in prange(n_parts):
        rep = replicas[p]
        rep[:, 0] = u
        rep[:, 1] = u
        rep_u = rep[:, 1]
        acc = np.zeros(2)  # partition-local (parts' rows share a cache line)
        last = (p + 1) * nb // n_parts
        for j in range(p * nb // n_parts, last):
            start = bucket_order[j] * bucket_size
            stop = min(start + bucket_size, n)
            if j + 2 < last:  # the bucket after next: its indptr entry
                prefetch_row(indptr, bucket_order[j + 2] * bucket_size)
            if j + 1 < last:
                _prefetch_row_data(bucket_order[j + 1] * bucket_size, indptr, indices, values,
                                   labels, weights, sqn, alpha)
            for i in range(start, stop):
                if i + 1 < stop:
                    _prefetch_features(i + 1, indptr, indices, rep)
                elif j + 1 < last:
                    _prefetch_features(bucket_order[j + 1] * bucket_size, indptr, indices, rep)
                if with_gap:
                    _step_row_with_gap(i, indptr, indices, values, labels, weights, sqn, alpha,
                                       rep, loss, scale_part, bias_scale, bias_index, acc)
                else:
                    _step_row(i, indptr, indices, values, labels, weights, sqn, alpha, rep_u, loss,
                              scale_part, bias_scale, bias_index)
        parts[p, 0] = acc[0]
        parts[p, 1] = acc[1]
    # merge: u += (1 / P) sum_p (replica_p - u), the partitions summed in a fixed order
    inv = 1.0 / n_parts
    for j in prange(u.shape[0]):
        base = u[j]
        acc = 0.0
        for p in range(n_parts):
            acc += replicas[p, j, 1] - base
        u[j] = base + acc * inv
    return _ordered_pair_sum(parts)


@njit(cache=True, nogil=True)
def objective_sums_rows(indptr, indices, values, labels, weights, alpha, w, loss, bias_scale,
                         bias_index, lo, hi):
    """(sum c phi(x . w), sum c h(alpha)) over rows [lo, hi), in row order."""
    loss_sum = 0.0
    conj_sum = 0.0
    wb = bias_scale * w[bias_index]
    for i in range(lo, hi):
        z = wb
        for k in range(indptr[i], indptr[i + 1]):
            z += np.float64(values[k]) * w[indices[k]]
        c = np.float64(weights[i])
        y = np.float64(labels[i])
        loss_sum += c * primal_loss(loss, y, z)
        conj_sum += c * dual_value(loss, y, alpha[i])
    return loss_sum, conj_sum


@njit(cache=True, nogil=True)
def dual_objective_sums(indptr, indices, values, labels, weights, alpha, w, loss, bias_scale,
                        bias_index):
    """(sum_i c_i phi_i(x_i . w), sum_i c_i h_i(alpha_i)) over this shard: the pieces of P and D."""
    return objective_sums_rows(indptr, indices, values, labels, weights, alpha, w, loss,
                                bias_scale, bias_index, 0, labels.shape[0])


@njit(cache=True, parallel=True)
def dual_objective_sums_chunked(indptr, indices, values, labels, weights, alpha, w, loss,
                                bias_scale, bias_index, n_chunks):
    """``dual_objective_sums`` on numba threads: ``n_chunks`` fixed row ranges summed in
    parallel, the partial sums then added in chunk order, so the result depends on
    ``n_chunks`` only, never on the number of threads or their timing."""
    n = labels.shape[0]
    parts = np.zeros((n_chunks, 2))
    for c in prange(n_chunks):
        parts[c, 0], parts[c, 1] = objective_sums_rows(
            indptr, indices, values, labels, weights, alpha, w, loss, bias_scale, bias_index,
            c * n // n_chunks, (c + 1) * n // n_chunks)
    return _ordered_pair_sum(parts)


@njit(cache=True, nogil=True)
def scaled_difference(out, u, w, inv_sigma):
    """out = (u - w) * inv_sigma (the local shared-vector update of a CoCoA+ subproblem)."""
    for j in range(u.shape[0]):
        out[j] = (u[j] - w[j]) * inv_sigma


@njit(cache=True, nogil=True)
def apply_dual_step(loss, labels, alpha, dalpha, gamma):
    """alpha += gamma dalpha, b = s alpha put back into its domain by ``losses.clamp_dual``
    ([0, 1] for hinge/logistic, b >= 0 for squared hinge; round-off only: gamma never exceeds the
    feasible step)."""
    for i in range(alpha.shape[0]):
        d = dalpha[i]
        if d == 0.0:
            continue
        alpha[i] = clamp_dual(loss, np.float64(labels[i]), alpha[i] + gamma * d)


@njit(cache=True, nogil=True)
def axpy(y, a, x):
    """y += a x, element by element (no fused multiply-add: the same bytes on every machine)."""
    for j in range(y.shape[0]):
        y[j] += a * x[j]
