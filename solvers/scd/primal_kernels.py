"""Numba kernels of primal SCD for ridge regression over columns stored by feature (CSC).

The shared vector is the margin vector ``z = X beta`` over *all* rows (one entry per example).
Coordinate m of the local block, with ``g_m = sum_i c_i x_im (u_i - y_i)`` and
``s_m = sum_i c_i x_im^2``, minimises ``P`` (or CoCoA's local subproblem for sigma > 1)::

    delta  = -(g_m + lam N beta_m) / (sigma s_m + lam N)
    beta_m += delta,     u += sigma delta x_m                (Parnell et al., Eq. 2)

``u`` is ``z`` plus sigma times the local change of the margins; the caller recovers the
change as ``(u - z) / sigma``. The threaded epoch deals buckets of consecutive columns to
``n_parts`` partitions with ``sigma_part = sigma * n_parts`` and private replicas of ``u``,
merged by adding the partitions' updates (as in ``dual_kernels``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True)
def filter_owned(indptr, indices, values, col_slot):
    """The entries of a CSR block whose column is owned (``col_slot >= 0``), with column indices
    replaced by local slots: (indptr int64, slots int32, values float32)."""
    n = indptr.shape[0] - 1
    nnz = 0
    for k in range(indptr[n]):
        if col_slot[indices[k]] >= 0:
            nnz += 1
    out_ptr = np.zeros(n + 1, np.int64)
    out_idx = np.empty(nnz, np.int32)
    out_val = np.empty(nnz, np.float32)
    pos = 0
    for i in range(n):
        for k in range(indptr[i], indptr[i + 1]):
            s = col_slot[indices[k]]
            if s >= 0:
                out_idx[pos] = s
                out_val[pos] = values[k]
                pos += 1
        out_ptr[i + 1] = pos
    return out_ptr, out_idx, out_val


@njit(cache=True, nogil=True)
def csc_count(slots, counts):
    """counts[s + 1] += 1 for every entry (pass 1 of a CSR -> CSC transpose)."""
    for k in range(slots.shape[0]):
        counts[slots[k] + 1] += 1


@njit(cache=True, nogil=True)
def csc_fill(indptr, slots, values, row_offset, fill, rows, vals):
    """Scatter a CSR block into CSC arrays (pass 2); ``fill`` holds each column's next free
    position and advances. Rows are numbered from ``row_offset``; within a column they come
    out ascending when blocks are filled in row order."""
    n = indptr.shape[0] - 1
    for i in range(n):
        for k in range(indptr[i], indptr[i + 1]):
            s = slots[k]
            pos = fill[s]
            rows[pos] = row_offset + i
            vals[pos] = values[k]
            fill[s] = pos + 1


@njit(cache=True, nogil=True)
def col_sq_norms(colptr, rows, vals, weights):
    """s_m = sum_i c_i x_im^2 of every local column."""
    m = colptr.shape[0] - 1
    out = np.empty(m, np.float64)
    for j in range(m):
        acc = 0.0
        for k in range(colptr[j], colptr[j + 1]):
            v = np.float64(vals[k])
            acc += np.float64(weights[rows[k]]) * v * v
        out[j] = acc
    return out


@njit(cache=True, nogil=True)
def _step_col(j, colptr, rows, vals, labels, weights, csq, beta, u, lam_n, sigma):
    g = 0.0
    for k in range(colptr[j], colptr[j + 1]):
        i = rows[k]
        g += np.float64(weights[i]) * np.float64(vals[k]) * (u[i] - np.float64(labels[i]))
    delta = -(g + lam_n * beta[j]) / (sigma * csq[j] + lam_n)
    if delta != 0.0:
        beta[j] += delta
        coef = sigma * delta
        for k in range(colptr[j], colptr[j + 1]):
            u[rows[k]] += coef * np.float64(vals[k])


@njit(cache=True, nogil=True)
def primal_epoch(colptr, rows, vals, labels, weights, csq, beta, u, order, lam_n, sigma):
    """One sequential epoch over the local columns in ``order`` (the reference solver)."""
    for t in range(order.shape[0]):
        _step_col(order[t], colptr, rows, vals, labels, weights, csq, beta, u, lam_n, sigma)


@njit(cache=True, parallel=True)
def primal_epoch_buckets(colptr, rows, vals, labels, weights, csq, beta, u, bucket_order,
                         bucket_size, replicas, lam_n, sigma_part):
    """One bucketed epoch over columns on ``replicas.shape[0]`` partitions (see module doc)."""
    m = colptr.shape[0] - 1
    n_parts = replicas.shape[0]
    nb = bucket_order.shape[0]
    for p in prange(n_parts):
        rep = replicas[p]
        rep[:] = u
        for t in range(p * nb // n_parts, (p + 1) * nb // n_parts):
            start = bucket_order[t] * bucket_size
            stop = min(start + bucket_size, m)
            for j in range(start, stop):
                _step_col(j, colptr, rows, vals, labels, weights, csq, beta, rep, lam_n,
                          sigma_part)
    inv = 1.0 / n_parts
    for i in prange(u.shape[0]):
        base = u[i]
        acc = 0.0
        for p in range(n_parts):
            acc += replicas[p, i] - base
        u[i] = base + acc * inv


@njit(cache=True, nogil=True)
def dual_map_sq_norm(colptr, rows, vals, labels, weights, z):
    """sum over local columns of (sum_i c_i x_im (y_i - z_i))^2 = (lam N)^2 ||w_local(alpha)||^2
    for the dual point alpha = y - z of ridge regression."""
    total = 0.0
    for j in range(colptr.shape[0] - 1):
        g = 0.0
        for k in range(colptr[j], colptr[j + 1]):
            i = rows[k]
            g += np.float64(weights[i]) * np.float64(vals[k]) * (np.float64(labels[i]) - z[i])
        total += g * g
    return total


@njit(cache=True, nogil=True)
def residual_sums(z, labels, weights):
    """(sum_i c_i (z_i - y_i)^2 / 2, sum_i c_i h(y_i - z_i)) with h(a) = a y - a^2/2 = (y^2 - z^2)/2."""
    loss_sum = 0.0
    conj_sum = 0.0
    for i in range(z.shape[0]):
        c = np.float64(weights[i])
        y = np.float64(labels[i])
        r = z[i] - y
        loss_sum += 0.5 * c * r * r
        conj_sum += 0.5 * c * (y * y - z[i] * z[i])
    return loss_sum, conj_sum


@njit(cache=True, nogil=True)
def residual_direction_sums(z, dz, labels, weights):
    """(sum_i c_i (z_i - y_i) dz_i, sum_i c_i dz_i^2): the margin terms of Eq. 7."""
    a = 0.0
    b = 0.0
    for i in range(z.shape[0]):
        c = np.float64(weights[i])
        a += c * (z[i] - np.float64(labels[i])) * dz[i]
        b += c * dz[i] * dz[i]
    return a, b
