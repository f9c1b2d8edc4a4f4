"""numba.cuda kernels of the hot-block GPU dual (``gpu_hot_solver``; the split: ``hot_split``).

* ``cold_epoch``: TPA-SCD over a range of the epoch's permutation, the rows' cold features only,
  each margin ``offset[i] + x_iᶜ·u`` (``offset`` = the hot block's ``X_H w_H``, fixed during the
  range). A thread block per row, as ``gpu_kernels.tpa_dual_epoch``, but no feature held by many
  rows is written here: no single-address atomic per row (the constant is hot);
* row products (``row_dots``: ``out = base + X v``, a thread per row) and column products
  (``col_dots``: ``out = s Xᵀ r``, a block per column, tree-summed: the same bits every run);
* ``loss_derivs``: c φ'(z) and c φ''(z) of every row (squared and logistic);
* ``hessian_lower``: the lower triangle of ``X_Hᵀ diag(c φ'') X_H``, a block per segment of a
  hot column's rows (each row i of the segment adds ``c_i φ''_i x_ij x_im`` for its hot m ≤ j).
  Segments of one column meet in float64 atomics, so on a device the last bits of an entry
  depend on the order blocks run in (the simulator runs them in order: the same bits every run);
  ``hessian_finish``: scale, λ on the diagonal, the upper triangle mirrored;
* reductions (partial sums a block, combined by ``gpu_reduce_kernels.finish_partials`` in block
  order): the primal loss at ``z + t dz`` (the line search), the gap pieces, dot products.

Only ``numba.cuda`` is imported; kernels compile at their first launch. Device functions that
synchronise are defined here, next to the kernels calling them (``gpu_reduce_kernels`` says why).
"""

from __future__ import annotations

from numba import cuda, float64

import terascale.solvers.scd.numba_compat  # noqa: F401 - np.row_stack before the first kernel compiles
from terascale.solvers.catalogue import SQUARED
from terascale.solvers.scd.gpu_kernels import B_EPS, _dual_step, _sigmoid
from terascale.solvers.scd.gpu_reduce_kernels import _dual_value, _primal_loss


@cuda.jit(device=True)
def _block_sum(buf, tid, acc):
    """Sum of ``acc`` over the block's threads (tree order; every thread gets it)."""
    buf[tid] = acc
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()
        s //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit
def cold_epoch(indptr, indices, values, labels, weights, sqn, alpha, u, order, start, stop, loss,
               scale, offset):
    """SDCA steps for the rows ``order[start:stop]`` over the cold features (module docstring);
    ``sqn``: the rows' ESO-damped cold norms; ``scale`` = 1 / (λN)."""
    buf = cuda.shared.array(0, float64)  # dynamic: nthr sums, then buf[nthr] = the step
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    for t in range(start + cuda.blockIdx.x, stop, cuda.gridDim.x):
        i = order[t]
        lo = indptr[i]
        hi = indptr[i + 1]
        acc = 0.0
        for k in range(lo + tid, hi, nthr):
            acc += float64(values[k]) * u[indices[k]]
        dot = _block_sum(buf, tid, acc)
        if tid == 0:
            c = float64(weights[i])
            a = alpha[i]
            a_new = _dual_step(loss, float64(labels[i]), a, dot + offset[i], scale * c * sqn[i])
            coef = 0.0
            if a_new != a:
                alpha[i] = a_new
                coef = scale * c * (a_new - a)
            buf[nthr] = coef
        cuda.syncthreads()
        coef = buf[nthr]
        if coef != 0.0:
            for k in range(lo + tid, hi, nthr):
                cuda.atomic.add(u, indices[k], coef * float64(values[k]))
        cuda.syncthreads()  # buf[nthr] is rewritten by the next row


@cuda.jit
def row_dots(indptr, indices, values, v, base, use_base, out):
    """out[i] = (base[i] if use_base else 0) + Σ_k values[k] v[indices[k]] over row i."""
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        acc = base[i] if use_base else 0.0
        for k in range(indptr[i], indptr[i + 1]):
            acc += float64(values[k]) * v[indices[k]]
        out[i] = acc


@cuda.jit
def col_dots(colptr, rows, vals, r, s, out):
    """out[j] = s Σ_k vals[k] r[rows[k]] over column j (a block per column, tree-summed)."""
    buf = cuda.shared.array(0, float64)
    tid = cuda.threadIdx.x
    for j in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        acc = 0.0
        for k in range(colptr[j] + tid, colptr[j + 1], cuda.blockDim.x):
            acc += float64(vals[k]) * r[rows[k]]
        total = _block_sum(buf, tid, acc)
        if tid == 0:
            out[j] = s * total


@cuda.jit
def loss_derivs(loss, labels, weights, z, d1c, d2c):
    """d1c[i] = c_i φ'(z_i), d2c[i] = c_i φ''(z_i) (squared: z − y and 1; logistic, 0/1 labels:
    −s σ(−s z) and σ(z) σ(−z), s = ±1)."""
    for i in range(cuda.grid(1), z.shape[0], cuda.gridsize(1)):
        c = float64(weights[i])
        if loss == SQUARED:
            d1c[i] = c * (z[i] - float64(labels[i]))
            d2c[i] = c
        else:
            s = 1.0 if labels[i] > 0.5 else -1.0
            p = _sigmoid(-s * z[i])
            d1c[i] = -c * s * p
            d2c[i] = c * p * (1.0 - p)


@cuda.jit
def fill2d(h, value):
    """h[:, :] = value."""
    n = h.shape[0] * h.shape[1]
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        h[t // h.shape[1], t % h.shape[1]] = value


@cuda.jit
def hessian_lower(seg_col, seg_start, seg_rows, colptr, rows, vals, indptr, hidx, hvals, d2c, h):
    """h[j, m] += Σ_i d2c_i x_ij x_im for m ≤ j, over segments of the hot columns: segment s is up
    to ``seg_rows`` consecutive rows of column ``seg_col[s]`` from CSC position ``seg_start[s]``.
    A block takes a segment's rows one after another, its threads splitting each row's hot
    entries (distinct m), with a barrier between rows: within a block no two additions meet."""
    tid = cuda.threadIdx.x
    for s in range(cuda.blockIdx.x, seg_col.shape[0], cuda.gridDim.x):
        j = seg_col[s]
        stop = min(seg_start[s] + seg_rows, colptr[j + 1])
        for k in range(seg_start[s], stop):
            i = rows[k]
            v = d2c[i] * float64(vals[k])
            if v != 0.0:  # the same for every thread of the block
                for p in range(indptr[i] + tid, indptr[i + 1], cuda.blockDim.x):
                    m = hidx[p]
                    if m <= j:
                        cuda.atomic.add(h, (j, m), v * float64(hvals[p]))
            cuda.syncthreads()


@cuda.jit
def hessian_finish(h, inv_n, lam):
    """h = h / N + λ I on the lower triangle, then the upper triangle mirrored from it."""
    n = h.shape[0]
    for t in range(cuda.grid(1), n * n, cuda.gridsize(1)):
        j = t // n
        k = t % n
        if k < j:
            v = h[j, k] * inv_n
            h[j, k] = v
            h[k, j] = v
        elif k == j:
            h[j, j] = h[j, j] * inv_n + lam


@cuda.jit
def axpy(y, a, x):
    """y += a x."""
    for i in range(cuda.grid(1), y.shape[0], cuda.gridsize(1)):
        y[i] += a * x[i]


@cuda.jit
def loss_partials(loss, labels, weights, z, dz, t, part):
    """part[b, 0] = Σ c φ(z_i + t dz_i) over block b's share of the rows."""
    buf = cuda.shared.array(0, float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(cuda.grid(1), z.shape[0], cuda.gridsize(1)):
        acc += float64(weights[i]) * _primal_loss(loss, float64(labels[i]), z[i] + t * dz[i])
    total = _block_sum(buf, tid, acc)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = total


@cuda.jit
def gap_partials(loss, labels, weights, z, ca_hat, part):
    """The primal point's own dual, α̂_i = −φ'(z_i) (logistic: kept inside (0, 1) in s α̂):
    ca_hat[i] = c_i α̂_i; part[b] = (Σ c φ(z_i), Σ c h(α̂_i)) over block b's share."""
    buf = cuda.shared.array(0, float64)
    tid = cuda.threadIdx.x
    p_acc = 0.0
    d_acc = 0.0
    for i in range(cuda.grid(1), z.shape[0], cuda.gridsize(1)):
        y = float64(labels[i])
        c = float64(weights[i])
        if loss == SQUARED:
            a = y - z[i]
        else:
            s = 1.0 if y > 0.5 else -1.0
            a = s * min(max(_sigmoid(-s * z[i]), B_EPS), 1.0 - B_EPS)
        ca_hat[i] = c * a
        p_acc += c * _primal_loss(loss, y, z[i])
        d_acc += c * _dual_value(loss, y, a)
    p_tot = _block_sum(buf, tid, p_acc)
    d_tot = _block_sum(buf, tid, d_acc)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = p_tot
        part[cuda.blockIdx.x, 1] = d_tot


@cuda.jit
def dual_partials(loss, labels, weights, alpha, ca, part):
    """ca[i] = c_i α_i; part[b, 0] = Σ c h(α_i) over block b's share (the iterates' own dual)."""
    buf = cuda.shared.array(0, float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(cuda.grid(1), alpha.shape[0], cuda.gridsize(1)):
        c = float64(weights[i])
        ca[i] = c * alpha[i]
        acc += c * _dual_value(loss, float64(labels[i]), alpha[i])
    total = _block_sum(buf, tid, acc)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = total


@cuda.jit
def dot_partials(a, b, part):
    """part[blk, 0] = Σ a_i b_i over block blk's share."""
    buf = cuda.shared.array(0, float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        acc += a[i] * b[i]
    total = _block_sum(buf, tid, acc)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = total
