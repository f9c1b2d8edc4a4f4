"""The hot / cold split of a shard's features for the GPU dual (host side, no GPU).

Why (issue 41, ``docs/design-notes``): with τ rows in flight, TPA-SCD's rows read a feature's
coordinate up to τ − 1 updates late; a feature held by ω_j rows sees about ω_j τ / n concurrent
writers, and the ESO damping that keeps the epoch from diverging shrinks every step of every
row that holds a frequent feature. On click data (an intercept in every row, a few tokens in most)
that costs ~30x the sequential solver's epochs. So the features are split by ω_j:

* **hot** H: the constant (when there is one) and every feature with ω_j > n / τ, the most
  frequent first, at most ``max_hot`` of them. Their weights ``w_H`` leave the asynchronous loop:
  they are a primal block solved by Newton steps (``gpu_hot_solver``);
* **cold** C: the rest. Each is held by at most n / τ rows, so τ rows in flight rarely share
  one, and the ESO weights over C alone stay below 2 (β_j = 1 + (ω_j − 1)(τ − 1)/(n − 1)).

When more than ``max_hot`` features qualify (long rows, e.g. text: the Hessian of the block
would not fit, ``max_hot``² float64s), the rows in flight are lowered instead, to τ = n / ω of the
most frequent cold feature: fewer rows at once, each still damped by less than 2x. So the rows
in flight come from the data, not from a setting.

The matrices: the cold part as CSR over a compact numbering of C (the asynchronous epoch) and as
CSC (its transpose products), the hot part as CSR (row margins) and CSC (the gradient, the
Hessian's columns), the constant as the hot block's last column (value ``bias_scale``). Made in
a few passes over the non-zeros (numba): the device's set-up, not a cost of every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from terascale.solvers.data import CSRData

DEFAULT_MAX_HOT = 8192  # the Hessian: 8192² float64 = 512 MiB on the device; Cholesky ~0.2 TFLOP
#: the Hessian's products Σ_i h_i (h_i + 1) / 2 at most this many times the non-zeros (the click
#: benchmark's 2M rows at τ = 4,224: 922M for 67M non-zeros, 13.8x)
WORK_PER_NNZ = 32


@dataclass(frozen=True)
class Sparse:
    """One CSR (or CSC) matrix as the kernels read it: int64 pointers, int32 indices, float32 values."""

    ptr: np.ndarray
    idx: np.ndarray
    val: np.ndarray

    @property
    def nnz(self) -> int:
        return int(self.ptr[-1])


@dataclass(frozen=True)
class HotSplit:
    """The split of one shard (see the module docstring). ``hot`` / ``cold``: feature ids in the
    augmented numbering (``n_features`` is the constant), ascending (the constant, when hot,
    last); ``tau``: the rows in flight the cold ESO was made for; ``sqn``: each row's
    Σ_{j∈C} β_j x_ij², the cold epoch's damped quadratic coefficient."""

    hot: np.ndarray
    cold: np.ndarray
    tau: int
    cold_rows: Sparse
    cold_cols: Sparse
    hot_rows: Sparse
    hot_cols: Sparse
    sqn: np.ndarray
    hessian_work: int  # Σ_i h_i (h_i + 1) / 2, h_i the row's hot non-zeros: the Hessian's products

    @property
    def n_hot(self) -> int:
        return int(self.hot.shape[0])


def choose_hot(omega: np.ndarray, n_rows: int, tau_max: int, max_hot: int,
               constant: int | None) -> tuple[np.ndarray, int]:
    """(hot feature ids, rows in flight) from the rows holding each feature (``omega``).

    Hot: ``constant`` (always, unless None) and every feature with ω_j > n / τ_max, most frequent
    first, at most ``max_hot`` in all. When some qualifying feature is left out, τ becomes
    n // ω of the most frequent cold feature (at least 1), so every cold feature is held by at most
    n / τ rows. τ never exceeds ``tau_max`` or the rows."""
    if tau_max < 1 or max_hot < (0 if constant is None else 1):
        raise ValueError(f"tau_max = {tau_max} and max_hot = {max_hot}: expected >= 1 and >= 1 "
                         "(>= 0 without a constant)")
    omega = np.asarray(omega, np.int64)
    n_rows = int(n_rows)
    tau = max(1, min(int(tau_max), n_rows))
    rank = np.argsort(-omega, kind="stable")
    if constant is not None:
        rank = np.concatenate([[constant], rank[rank != constant]])
    # omega_j * tau > n  <=>  omega_j > n / tau, in integers
    qualifies = omega[rank] * tau > n_rows
    if constant is not None:
        qualifies[0] = True
    n_q = int(qualifies.sum())  # they are a prefix: sorted by omega (the constant has omega = n)
    take = min(n_q, int(max_hot))
    hot = rank[:take]
    if take < n_q:  # too many hot candidates: fewer rows in flight instead
        top_cold = int(omega[rank[take]])
        tau = max(1, min(tau, n_rows // max(top_cold, 1)))
    hot = np.sort(hot)  # the constant, id n_features, the largest, comes last
    return hot.astype(np.int64), int(tau)


@njit(cache=True)
def _pair_work(indptr, indices, is_hot, extra, stride):
    """Σ_i h_i (h_i + 1) / 2 over every ``stride``-th row, h_i = row i's entries with ``is_hot``
    + ``extra`` (the constant)."""
    total = 0
    for i in range(0, indptr.shape[0] - 1, stride):
        h = extra
        for k in range(indptr[i], indptr[i + 1]):
            h += is_hot[indices[k]]
        total += h * (h + 1) // 2
    return total


SAMPLE_ROWS = 1 << 16  # the halving search estimates the Hessian's products from about this many rows


@dataclass(frozen=True)
class HotPlan:
    """What ``plan`` chose: the hot ids, the rows in flight (of ``tau_max`` asked for), the
    Hessian's products, the rows holding each feature."""

    hot: np.ndarray
    tau: int
    tau_max: int
    work: int
    omega: np.ndarray


def plan(data: CSRData, bias_scale: float, tau_max: int, max_hot: int = DEFAULT_MAX_HOT,
         work_per_nnz: float = WORK_PER_NNZ) -> HotPlan:
    """``choose_hot`` with at most ``max_hot`` features, halved until the Hessian's products
    (``hessian_work``) are at most ``work_per_nnz`` times the non-zeros: long rows (text) make
    the block's Hessian quadratic in a row's hot entries, and then fewer hot features (and fewer
    rows in flight) are taken. The halving is steered by a sample of rows (every
    n / ``SAMPLE_ROWS``-th); the products of the plan returned are counted over every row
    (numba passes over the indices)."""
    n, d = data.n_rows, data.n_features
    omega = np.bincount(data.indices, minlength=d + 1).astype(np.int64)
    constant = None
    if bias_scale != 0.0:
        omega[d] = n
        constant = d
    extra = 0 if constant is None else 1
    budget = work_per_nnz * max(data.nnz + extra * n, 1)
    indptr = data.indptr.astype(np.int64)
    stride = max(1, n // SAMPLE_ROWS)
    cap = int(max_hot)
    while True:
        hot, tau = choose_hot(omega, n, tau_max, cap, constant)
        is_hot = np.zeros(d + 1, np.int8)
        is_hot[hot] = 1
        is_hot[d] = 0  # the constant is not in the indices; ``extra`` counts it
        ext = extra if hot.size else 0
        # the search on every stride-th row (scaled up), the answer counted on all of them
        fits = stride == 1 or _pair_work(indptr, data.indices, is_hot, ext, stride) * stride <= budget
        work = int(_pair_work(indptr, data.indices, is_hot, ext, 1)) if fits or cap <= 1 else budget + 1
        if work <= budget or cap <= 1:
            return HotPlan(hot, tau, int(tau_max), work, omega)
        cap = min(cap, hot.shape[0]) // 2


@njit(cache=True)
def _partition(indptr, indices, values, is_hot, new_id, bias_scale, constant):
    """The rows' hot and cold entries (new ids), the constant (id ``constant`` >= 0) appended to
    every row's hot part: (hot_ptr, hot_idx, hot_val, cold_ptr, cold_idx, cold_val)."""
    n = indptr.shape[0] - 1
    hot_ptr = np.zeros(n + 1, np.int64)
    cold_ptr = np.zeros(n + 1, np.int64)
    extra = 1 if constant >= 0 else 0
    for i in range(n):
        h = extra
        for k in range(indptr[i], indptr[i + 1]):
            h += is_hot[indices[k]]
        hot_ptr[i + 1] = hot_ptr[i] + h
        cold_ptr[i + 1] = cold_ptr[i] + (indptr[i + 1] - indptr[i]) - (h - extra)
    hot_idx = np.empty(hot_ptr[n], np.int32)
    hot_val = np.empty(hot_ptr[n], np.float32)
    cold_idx = np.empty(cold_ptr[n], np.int32)
    cold_val = np.empty(cold_ptr[n], np.float32)
    for i in range(n):
        a = hot_ptr[i]
        b = cold_ptr[i]
        for k in range(indptr[i], indptr[i + 1]):
            j = indices[k]
            if is_hot[j]:
                hot_idx[a] = new_id[j]
                hot_val[a] = values[k]
                a += 1
            else:
                cold_idx[b] = new_id[j]
                cold_val[b] = values[k]
                b += 1
        if constant >= 0:
            hot_idx[a] = new_id[constant]
            hot_val[a] = bias_scale
    return hot_ptr, hot_idx, hot_val, cold_ptr, cold_idx, cold_val


@njit(cache=True)
def _transpose(ptr, idx, val, n_cols):
    """The CSC of a CSR matrix (counting sort: rows ascend within each column)."""
    colptr = np.zeros(n_cols + 1, np.int64)
    for k in range(idx.shape[0]):
        colptr[idx[k] + 1] += 1
    for j in range(n_cols):
        colptr[j + 1] += colptr[j]
    fill = colptr[:-1].copy()
    rows = np.empty(idx.shape[0], np.int32)
    vals = np.empty(idx.shape[0], np.float32)
    for i in range(ptr.shape[0] - 1):
        for k in range(ptr[i], ptr[i + 1]):
            j = idx[k]
            rows[fill[j]] = i
            vals[fill[j]] = val[k]
            fill[j] += 1
    return colptr, rows, vals


@njit(cache=True)
def _cold_sqn(ptr, idx, val, beta):
    out = np.zeros(ptr.shape[0] - 1)
    for i in range(ptr.shape[0] - 1):
        acc = 0.0
        for k in range(ptr[i], ptr[i + 1]):
            v = np.float64(val[k])
            acc += beta[idx[k]] * v * v
        out[i] = acc
    return out


def split(data: CSRData, bias_scale: float, tau_max: int, max_hot: int = DEFAULT_MAX_HOT,
          chosen: HotPlan | None = None) -> HotSplit:
    """The split of ``data`` (+ the constant column of value ``bias_scale``, unless 0) by
    ``chosen`` (default: ``plan(data, bias_scale, tau_max, max_hot)``). A feature's ω counts its
    entries (a duplicate within a row twice: an upper bound, as the ESO needs)."""
    n, d = data.n_rows, data.n_features
    chosen = chosen or plan(data, bias_scale, tau_max, max_hot)
    hot, tau, omega = chosen.hot, chosen.tau, chosen.omega
    constant = d if bias_scale != 0.0 else None
    values = data.values if data.values is not None else np.ones(data.indices.shape[0], np.float32)
    is_hot = np.zeros(d + 1, np.int8)
    is_hot[hot] = 1
    cold = np.flatnonzero(is_hot == 0).astype(np.int64)
    new_id = np.empty(d + 1, np.int32)
    new_id[hot] = np.arange(hot.shape[0], dtype=np.int32)
    new_id[cold] = np.arange(cold.shape[0], dtype=np.int32)
    with_constant = constant is not None and bool(is_hot[d])
    hp, hi, hv, cp, ci, cv = _partition(data.indptr.astype(np.int64), data.indices, values, is_hot, new_id,
                                        np.float32(bias_scale), d if with_constant else -1)
    beta = 1.0 + np.maximum(omega[cold] - 1.0, 0.0) * (tau - 1) / max(1, n - 1)
    h = np.diff(hp)
    return HotSplit(hot=hot, cold=cold, tau=tau, cold_rows=Sparse(cp, ci, cv),
                    cold_cols=Sparse(*_transpose(cp, ci, cv, cold.shape[0])),
                    hot_rows=Sparse(hp, hi, hv), hot_cols=Sparse(*_transpose(hp, hi, hv, hot.shape[0])),
                    sqn=_cold_sqn(cp, ci, cv, beta), hessian_work=int(np.sum(h * (h + 1) // 2)))
