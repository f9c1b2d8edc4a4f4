"""numba.cuda kernels of TPA-SCD (Parnell et al., Sec. III-C, Algorithm 2): one SCD epoch on the GPU.

Twice parallel, asynchronous: every coordinate of the epoch's permutation ``order`` is handled
by one thread block (a grid-stride loop when the grid is smaller than the permutation), and the
blocks run concurrently on the SMs without any locking. Inside a block:

1. the block's threads split the coordinate's inner product (a row of the CSR matrix for the
   dual, a column of the CSC matrix for the primal) and reduce it in shared memory
   (``blockDim.x`` must be a power of two, at most ``MAX_THREADS``; the shared memory is
   dynamic, ``shared_bytes(blockDim.x)`` bytes given at launch, see ``shared_bytes``);
2. thread 0 computes the coordinate update with the same math as the CPU kernels
   (``losses.dual_step`` / ``primal_kernels._step_col``, re-implemented here as device
   functions) and writes the local variable;
3. all threads add the update into the shared vector with ``cuda.atomic.add`` (float64).

Conventions are those of ``dual_kernels`` / ``primal_kernels``: ``scale = sigma / (lam N)`` for
the dual, ``lam_n = lam N`` and ``sigma`` for the primal; the dual shared vector has
``n_features + 1`` entries, the last one the constant feature of value ``bias_scale``. Because
other blocks may update the shared vector while a block reads it, a coordinate may see a
slightly stale ``u`` (that is the algorithm: asynchronous, Hogwild-style reads, atomic writes).
Under the CUDA simulator blocks run one after another, so an epoch equals the sequential CPU
epoch up to the summation order of the inner products. On a device up to τ blocks run at once,
so the dual's step uses ``sqn[i]`` = Σ_j β_j x_ij² in place of ||x_i||² (β from
``gpu_local_solver.eso_weights``; β = 1 when τ = 1): without that damping the constant feature,
in every row, takes τ steps computed from one stale value and the epoch diverges.

Only ``numba.cuda`` is imported here; the module imports on machines without CUDA (kernels are
compiled lazily at their first launch).
"""

from __future__ import annotations

import math

from numba import cuda, float64

import terascale.solvers.scd.numba_compat  # noqa: F401 - np.row_stack before the first kernel compiles

# the catalogue's loss ids (the same the CPU kernels use; the catalogue imports no numba)
from terascale.solvers.catalogue import HINGE, LOGISTIC, SQUARED, SQUARED_HINGE

MAX_THREADS = 256  # blockDim.x must be a power of two <= this
B_EPS = 1e-15
_NEWTON_MAX_ITER = 50
_NEWTON_TOL = 1e-11


def shared_bytes(threads: int) -> int:
    """Dynamic shared memory of a launch of a kernel here or in ``gpu_reduce_kernels`` with
    ``threads`` threads per block: ``threads + 1`` float64s (the reduction buffer, then one slot
    for the coordinate step a block broadcasts).

    Dynamic (``cuda.shared.array(0, ...)``, sized at launch) rather than static on purpose: the
    CUDA simulator allocates a static shared array lazily, when the first thread of a block
    reaches its line, with an unlocked look-up-then-insert, so two threads of one block can each
    get a private array (a reduction then adds uninitialised memory: wrong sums at random,
    more often while other Python threads, e.g. other ranks, compete for the GIL). It allocates
    the dynamic buffer once per launch, before any thread starts. On a device this sizes the
    buffer to the block instead of ``MAX_THREADS``.
    """
    return 8 * (int(threads) + 1)


# -- device functions: the coordinate step (same math as solvers.scd.losses) -------------------


@cuda.jit(device=True)
def _sigmoid(t):
    if t >= 0.0:
        return 1.0 / (1.0 + math.exp(-t))
    e = math.exp(t)
    return e / (1.0 + e)


@cuda.jit(device=True)
def _concave_root(b, m, q, t):
    """Device twin of ``losses._concave_root`` (the root only)."""
    t = max(min(t, 0.0), -m - q * (1.0 - b))
    for _ in range(_NEWTON_MAX_ITER):
        p = _sigmoid(t)
        g = -t - m - q * (p - b)
        if g == 0.0:
            break
        nt = min(t + g / (1.0 + q * p * (1.0 - p)), 0.0)
        done = abs(nt - t) <= _NEWTON_TOL * (1.0 + abs(t))
        t = nt
        if done:
            break
    return t


@cuda.jit(device=True)
def _logistic_b(b, m, q):
    """argmax_b' entropy(b') - (b' - b) m - q (b' - b)^2 / 2: Newton in logit space on the
    root's side of 0, mirrored to the concave side (the device twin of ``losses._logistic_root``
    and ``losses._logistic_b``)."""
    if q <= 0.0:
        return min(max(_sigmoid(-m), B_EPS), 1.0 - B_EPS)
    if b <= 0.0:
        tw = -math.inf
    elif b >= 1.0:
        tw = math.inf
    else:
        tw = math.log(b) - math.log1p(-b)
    if -m - q * (0.5 - b) > 0.0:
        t = -_concave_root(1.0 - b, -m, q, -tw)
    else:
        t = _concave_root(b, m, q, tw)
    return min(max(_sigmoid(t), B_EPS), 1.0 - B_EPS)


@cuda.jit(device=True)
def _hinge_b(b, m, q):
    """argmax_{b' in [0, 1]} b' - (b' - b) m - q (b' - b)^2 / 2 (closed form)."""
    if q > 0.0:
        return min(max(b + (1.0 - m) / q, 0.0), 1.0)
    if m < 1.0:
        return 1.0
    if m > 1.0:
        return 0.0
    return b


@cuda.jit(device=True)
def _squared_hinge_b(b, m, q):
    """argmax_{b' >= 0} b' - b'^2/4 - (b' - b) m - q (b' - b)^2 / 2 (closed form)."""
    return max((1.0 - m + q * b) / (q + 0.5), 0.0)


@cuda.jit(device=True)
def _dual_step(loss, y, a, dot, q):
    """Device twin of ``losses.dual_step``; NaN for a loss id it does not know (a kernel cannot
    raise; the host checks the id before any launch, ``gpu.GpuDualLocalSolver``)."""
    if loss == SQUARED:
        return a + (y - a - dot) / (1.0 + q)
    s = 1.0 if y > 0.5 else -1.0
    b = s * a
    m = s * dot
    if loss == LOGISTIC:
        return s * _logistic_b(b, m, q)
    if loss == HINGE:
        return s * _hinge_b(b, m, q)
    if loss == SQUARED_HINGE:
        return s * _squared_hinge_b(b, m, q)
    return math.nan


@cuda.jit(device=True)
def _block_sum(buf, tid, acc):
    """Sum ``acc`` over the block's threads through shared memory (every thread gets the sum)."""
    buf[tid] = acc
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()
        s //= 2
    total = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before the buffer is reused
    return total


# -- kernels -------------------------------------------------------------------------------------


@cuda.jit
def row_sq_norms_kernel(indptr, indices, values, beta, bias_beta, bias_scale, out):
    """v_i = sum_j beta_j x_ij^2 (constant feature included, with ``bias_beta``) of every row;
    one thread per row (``beta`` = 1: ||x_i||^2; see ``gpu_local_solver.eso_weights``)."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        acc = bias_beta * bias_scale * bias_scale
        for k in range(indptr[i], indptr[i + 1]):
            v = float64(values[k])
            acc += beta[indices[k]] * v * v
        out[i] = acc


@cuda.jit
def col_sq_norms_kernel(colptr, rows, vals, weights, out):
    """s_m = sum_i c_i x_im^2 of every column; one thread per column."""
    j = cuda.grid(1)
    if j < out.shape[0]:
        acc = 0.0
        for k in range(colptr[j], colptr[j + 1]):
            v = float64(vals[k])
            acc += float64(weights[rows[k]]) * v * v
        out[j] = acc


@cuda.jit
def tpa_dual_epoch(indptr, indices, values, labels, weights, sqn, alpha, u, order, loss, scale,
                   bias_scale, bias_index):
    """One TPA-SCD epoch of SDCA over the rows in ``order`` (see the module docstring)."""
    buf = cuda.shared.array(0, float64)  # dynamic: nthr sums, then buf[nthr] = the step
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    for t in range(cuda.blockIdx.x, order.shape[0], cuda.gridDim.x):
        i = order[t]
        start = indptr[i]
        stop = indptr[i + 1]
        acc = 0.0
        for k in range(start + tid, stop, nthr):
            acc += float64(values[k]) * u[indices[k]]
        dot = _block_sum(buf, tid, acc)
        if tid == 0:
            dot += bias_scale * u[bias_index]
            c = float64(weights[i])
            a = alpha[i]
            a_new = _dual_step(loss, float64(labels[i]), a, dot, scale * c * sqn[i])
            coef = 0.0
            if a_new != a:
                alpha[i] = a_new
                coef = scale * c * (a_new - a)
                if bias_scale != 0.0:
                    cuda.atomic.add(u, bias_index, coef * bias_scale)
            buf[nthr] = coef
        cuda.syncthreads()
        coef = buf[nthr]
        if coef != 0.0:
            for k in range(start + tid, stop, nthr):
                cuda.atomic.add(u, indices[k], coef * float64(values[k]))
        cuda.syncthreads()  # buf[nthr] is rewritten by the next coordinate


@cuda.jit
def tpa_primal_epoch(colptr, rows, vals, labels, weights, csq, beta, u, order, lam_n, sigma):
    """One TPA-SCD epoch of primal ridge SCD over the local columns in ``order``."""
    buf = cuda.shared.array(0, float64)  # dynamic: nthr sums, then buf[nthr] = the step
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    for t in range(cuda.blockIdx.x, order.shape[0], cuda.gridDim.x):
        j = order[t]
        start = colptr[j]
        stop = colptr[j + 1]
        acc = 0.0
        for k in range(start + tid, stop, nthr):
            i = rows[k]
            acc += float64(weights[i]) * float64(vals[k]) * (u[i] - float64(labels[i]))
        g = _block_sum(buf, tid, acc)
        if tid == 0:
            delta = -(g + lam_n * beta[j]) / (sigma * csq[j] + lam_n)
            coef = 0.0
            if delta != 0.0:
                beta[j] += delta
                coef = sigma * delta
            buf[nthr] = coef
        cuda.syncthreads()
        coef = buf[nthr]
        if coef != 0.0:
            for k in range(start + tid, stop, nthr):
                cuda.atomic.add(u, rows[k], coef * float64(vals[k]))
        cuda.syncthreads()
