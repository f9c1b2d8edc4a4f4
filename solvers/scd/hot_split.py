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
Hessian's columns), the constant as the hot block's last column (value ``bias_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from terascale.solvers.data import CSRData

DEFAULT_MAX_HOT = 8192  # the Hessian: 8192² float64 = 512 MiB on the device; Cholesky ~0.2 TFLOP


@dataclass(frozen=True)
class Sparse:
    """One CSR (or CSC) matrix as the kernels read it: int64 pointers, int32 indices, float32 values."""

    ptr: np.ndarray
    idx: np.ndarray
    val: np.ndarray

    @classmethod
    def of(cls, m: sp.csr_matrix | sp.csc_matrix) -> Sparse:
        return cls(m.indptr.astype(np.int64), m.indices.astype(np.int32), m.data.astype(np.float32))

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
    if tau_max < 1 or max_hot < 0:
        raise ValueError(f"tau_max = {tau_max} and max_hot = {max_hot}: expected >= 1 and >= 0")
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


def split(data: CSRData, bias_scale: float, tau_max: int, max_hot: int = DEFAULT_MAX_HOT) -> HotSplit:
    """The split of ``data`` (+ the constant column of value ``bias_scale``, unless 0) for
    ``tau_max`` rows in flight at most (see ``choose_hot``)."""
    n, d = data.n_rows, data.n_features
    x = sp.csr_matrix((data.values.astype(np.float64), data.indices, data.indptr), shape=(n, d))
    constant = None
    if bias_scale != 0.0:
        x = sp.hstack([x, sp.csr_matrix(np.full((n, 1), float(bias_scale)))], format="csr")
        constant = d
    else:
        x = sp.hstack([x, sp.csr_matrix((n, 1))], format="csr")  # the constant's slot, empty
    x.sort_indices()
    omega = np.bincount(x.indices, minlength=d + 1)
    hot, tau = choose_hot(omega, n, tau_max, max_hot, constant)
    is_hot = np.zeros(d + 1, np.bool_)
    is_hot[hot] = True
    cold = np.flatnonzero(~is_hot).astype(np.int64)
    xc = x[:, cold].tocsr()
    xh = x[:, hot].tocsr()
    xc.sort_indices()
    xh.sort_indices()
    omega_c = omega[cold].astype(np.float64)
    beta = 1.0 + np.maximum(omega_c - 1.0, 0.0) * (tau - 1) / max(1, n - 1)
    sqn = np.asarray(xc.multiply(xc) @ beta).ravel() if n else np.zeros(0)
    h = np.diff(xh.indptr).astype(np.int64)
    return HotSplit(hot=hot, cold=cold, tau=tau, cold_rows=Sparse.of(xc), cold_cols=Sparse.of(xc.tocsc()),
                    hot_rows=Sparse.of(xh), hot_cols=Sparse.of(xh.tocsc()), sqn=sqn.astype(np.float64),
                    hessian_work=int(np.sum(h * (h + 1) // 2)))
