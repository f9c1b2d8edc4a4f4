"""numba.cuda kernels that keep a CoCoA round's local-variable work on the device.

The gap pieces, the line-search pieces and the logistic line-search derivatives are sums (and
one minimum) over the local variables; here they are reduced where those variables live, and
only the few resulting scalars cross the bus. Twins of the CPU kernels (same formulas, float64
accumulation):

=========================  =============================================================
``dual_eval_partials``     ``dual_kernels.dual_objective_sums``  (block per row)
``dual_line_partials``     ``line_search.dual_line_sums``
``logistic_partials``      ``line_search.logistic_line_derivs``
``primal_eval_partials``   ``seq_dot(beta, beta)``, ``primal_kernels.dual_map_sq_norm``
``primal_line_partials``   ``seq_dot(beta, dbeta)``, ``seq_dot(dbeta, dbeta)``
``commit_dual_kernel``     ``dual_kernels.apply_dual_step``
``commit_primal_kernel``   ``dual_kernels.axpy(beta, gamma, dbeta)``
=========================  =============================================================

A reduction is two launches: every block accumulates its grid-stride share, reduces it across
its threads in (dynamic) shared memory -- launch with ``gpu_kernels.shared_bytes(threads)``
bytes of it -- and writes one row of ``part`` (blocks x columns); then
``finish_partials`` adds the rows (or takes their minimum) in block order. The grid is a
function of the problem size only (``gpu_device.launch_shape`` / ``coord_grid``) and nothing is
atomic, so a reduction returns the same bytes every time on the same device; the result differs
from the sequential CPU sum by round-off only. The local variables of the committed point are
``x0``; the proposal of the round is ``x`` (so ``dlocal = x - x0``).
"""

from __future__ import annotations

import math

from numba import cuda, float64

from terascale.solvers.catalogue import HINGE, LOGISTIC, SQUARED, SQUARED_HINGE
from terascale.solvers.scd.gpu_kernels import B_EPS

INF = math.inf


# -- device functions: the losses (same formulas as solvers.scd.losses) -------------------------
# A kernel cannot raise: a loss id these do not know gives NaN (the host checks the id before
# any launch, ``gpu.GpuDualLocalSolver``).


@cuda.jit(device=True)
def _sign(y):
    return 1.0 if y > 0.5 else -1.0


@cuda.jit(device=True)
def _log1pexp(x):
    if x > 0.0:
        return x + math.log1p(math.exp(-x))
    return math.log1p(math.exp(x))


@cuda.jit(device=True)
def _primal_loss(loss, y, z):
    if loss == SQUARED:
        r = z - y
        return 0.5 * r * r
    m = _sign(y) * z
    if loss == LOGISTIC:
        return _log1pexp(-m)
    if loss == HINGE:
        return 1.0 - m if m < 1.0 else 0.0
    if loss == SQUARED_HINGE:
        return (1.0 - m) * (1.0 - m) if m < 1.0 else 0.0
    return math.nan


@cuda.jit(device=True)
def _dual_value(loss, y, a):
    if loss == SQUARED:
        return a * y - 0.5 * a * a
    b = _sign(y) * a
    if loss == LOGISTIC:
        v = 0.0
        if b > 0.0:
            v -= b * math.log(b)
        if b < 1.0:
            v -= (1.0 - b) * math.log1p(-b)
        return v
    if loss == HINGE:
        return b
    if loss == SQUARED_HINGE:
        return b - 0.25 * b * b
    return math.nan


@cuda.jit(device=True)
def _line_terms(loss, y, c, a, d):
    """Device twin of ``losses.dual_line_terms``: (p0, p1, bound) of one moved coordinate."""
    if loss == SQUARED:
        return c * d * (y - a), c * d * d, INF
    s = _sign(y)
    b = s * a
    db = s * d
    if loss == SQUARED_HINGE:
        return c * db * (1.0 - 0.5 * b), 0.5 * c * db * db, (-b / db if db < 0.0 else INF)
    bound = (1.0 - b) / db if db > 0.0 else -b / db
    if loss == HINGE:
        return c * db, 0.0, bound
    if loss == LOGISTIC:
        return 0.0, 0.0, bound
    return math.nan, math.nan, math.nan


@cuda.jit(device=True)
def _clamp_dual(loss, y, a):
    """Device twin of ``losses.clamp_dual``."""
    if loss == SQUARED:
        return a
    s = _sign(y)
    if loss == LOGISTIC or loss == HINGE:
        return s * min(max(s * a, 0.0), 1.0)
    if loss == SQUARED_HINGE:
        return s * max(s * a, 0.0)
    return math.nan


# Device functions that synchronise live next to the kernels calling them: the CUDA simulator
# swaps ``cuda`` in a device function's module for each call and a block's threads race on that
# swap when the module is not the kernel's own (``gpu_kernels._block_sum`` would fail here).


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


@cuda.jit(device=True)
def _block_min(buf, tid, val):
    """Minimum of ``val`` over the block's threads (every thread gets it)."""
    buf[tid] = val
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] = min(buf[tid], buf[tid + s])
        cuda.syncthreads()
        s //= 2
    out = buf[0]
    cuda.syncthreads()
    return out


# -- partial sums --------------------------------------------------------------------------------


@cuda.jit
def dual_eval_partials(indptr, indices, values, labels, weights, alpha, w, n, loss, bias_scale,
                       bias_index, part):
    """part[b] = (sum c phi(x_i . w), sum c h(alpha_i)) over block b's rows (a row per block)."""
    buf = cuda.shared.array(0, float64)  # dynamic, gpu_kernels.shared_bytes(blockDim.x)
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    wb = bias_scale * w[bias_index]
    loss_sum = 0.0
    conj_sum = 0.0
    for i in range(cuda.blockIdx.x, n, cuda.gridDim.x):
        acc = 0.0
        for k in range(indptr[i] + tid, indptr[i + 1], nthr):
            acc += float64(values[k]) * w[indices[k]]
        z = wb + _block_sum(buf, tid, acc)
        c = float64(weights[i])
        y = float64(labels[i])
        loss_sum += c * _primal_loss(loss, y, z)
        conj_sum += c * _dual_value(loss, y, alpha[i])
    if tid == 0:
        part[cuda.blockIdx.x, 0] = loss_sum
        part[cuda.blockIdx.x, 1] = conj_sum


@cuda.jit
def dual_line_partials(loss, labels, weights, x, x0, n, part):
    """part[b] = (p0, p1, gamma_max) of ``dual_line_sums`` over block b's share, dalpha = x - x0."""
    buf = cuda.shared.array(0, float64)  # dynamic, gpu_kernels.shared_bytes(blockDim.x)
    tid = cuda.threadIdx.x
    p0 = 0.0
    p1 = 0.0
    gmax = INF
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        d = x[i] - x0[i]
        if d == 0.0:
            continue
        t0, t1, bound = _line_terms(loss, float64(labels[i]), float64(weights[i]), x0[i], d)
        p0 += t0
        p1 += t1
        gmax = min(gmax, bound)
    p0 = _block_sum(buf, tid, p0)
    p1 = _block_sum(buf, tid, p1)
    gmax = _block_min(buf, tid, gmax)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = p0
        part[cuda.blockIdx.x, 1] = p1
        part[cuda.blockIdx.x, 2] = gmax


@cuda.jit
def logistic_partials(labels, weights, x, x0, n, gamma, part):
    """part[b] = (sum c db log((1-b)/b), sum c db^2 / (b (1-b))) at b = s (alpha + gamma dalpha)."""
    buf = cuda.shared.array(0, float64)  # dynamic, gpu_kernels.shared_bytes(blockDim.x)
    tid = cuda.threadIdx.x
    s1 = 0.0
    s2 = 0.0
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        d = x[i] - x0[i]
        if d == 0.0:
            continue
        c = float64(weights[i])
        s = _sign(float64(labels[i]))
        b = s * (x0[i] + gamma * d)
        b = min(max(b, B_EPS), 1.0 - B_EPS)
        db = s * d
        s1 += c * db * (math.log1p(-b) - math.log(b))
        s2 += c * db * db / (b * (1.0 - b))
    s1 = _block_sum(buf, tid, s1)
    s2 = _block_sum(buf, tid, s2)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = s1
        part[cuda.blockIdx.x, 1] = s2


@cuda.jit
def primal_eval_partials(colptr, rows, vals, labels, weights, beta, z, m, part):
    """part[b] = (sum beta_j^2, sum (sum_i c_i x_ij (y_i - z_i))^2) over block b's columns."""
    buf = cuda.shared.array(0, float64)  # dynamic, gpu_kernels.shared_bytes(blockDim.x)
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    beta_sq = 0.0
    map_sq = 0.0
    for j in range(cuda.blockIdx.x, m, cuda.gridDim.x):
        acc = 0.0
        for k in range(colptr[j] + tid, colptr[j + 1], nthr):
            i = rows[k]
            acc += float64(weights[i]) * float64(vals[k]) * (float64(labels[i]) - z[i])
        g = _block_sum(buf, tid, acc)
        map_sq += g * g
        beta_sq += beta[j] * beta[j]
    if tid == 0:
        part[cuda.blockIdx.x, 0] = beta_sq
        part[cuda.blockIdx.x, 1] = map_sq


@cuda.jit
def primal_line_partials(x, x0, m, part):
    """part[b] = (sum beta dbeta, sum dbeta^2) over block b's share, dbeta = x - x0."""
    buf = cuda.shared.array(0, float64)  # dynamic, gpu_kernels.shared_bytes(blockDim.x)
    tid = cuda.threadIdx.x
    bd = 0.0
    dd = 0.0
    for j in range(cuda.grid(1), m, cuda.gridsize(1)):
        d = x[j] - x0[j]
        bd += x0[j] * d
        dd += d * d
    bd = _block_sum(buf, tid, bd)
    dd = _block_sum(buf, tid, dd)
    if tid == 0:
        part[cuda.blockIdx.x, 0] = bd
        part[cuda.blockIdx.x, 1] = dd


@cuda.jit
def finish_partials(part, n_blocks, n_sum, out):
    """out[j] = sum over blocks of part[:, j] (j < n_sum) or their minimum, in block order."""
    j = cuda.grid(1)
    if j < out.shape[0]:
        if j < n_sum:
            acc = 0.0
            for b in range(n_blocks):
                acc += part[b, j]
        else:
            acc = INF
            for b in range(n_blocks):
                acc = min(acc, part[b, j])
        out[j] = acc


# -- the CoCoA step on the local variables ------------------------------------------------------


@cuda.jit
def commit_dual_kernel(loss, labels, x, x0, gamma, n):
    """alpha = x0 + gamma (x - x0), b = s alpha put back into its domain (``_clamp_dual``); x = x0
    = alpha (the next round starts there). Unmoved coordinates keep their bytes."""
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        a = x0[i]
        d = x[i] - a
        if d != 0.0:
            a = _clamp_dual(loss, float64(labels[i]), a + gamma * d)
        x0[i] = a
        x[i] = a


@cuda.jit
def commit_primal_kernel(x, x0, gamma, m):
    """beta = x0 + gamma (x - x0); x = x0 = beta."""
    for j in range(cuda.grid(1), m, cuda.gridsize(1)):
        b = x0[j] + gamma * (x[j] - x0[j])
        x0[j] = b
        x[j] = b
