"""A logistic gradient pass made of gathers only, measured beside the L-BFGS pass (issue 41).

The L-BFGS gradient pass scatters each row's residual into the gradient: with T threads, block
b > 0 into a table of its own, the tables added in block order. On 16 cores it flattened at
4.5x from 8 threads on (2026-11-28, the H100 machine), where a plain gather over the same
indices scaled 17x: T tables of tens of MB each, written at random, then merged. This computes
the same gradient without a scatter:

1. rows, in T blocks of about equal work: ``z_i = θ_0 + Σ_j θ_j`` (binary rows; θ_0 the
   intercept), ``r_i = c_i (σ(z_i) − y_i)``, the loss ``c_i log(1 + e^{−s_i z_i})``;
2. columns, in T blocks of about equal non-zeros, from a CSC copy of the rows (row ids ascending
   in each column): ``g_j = Σ_{i ∈ col j} r_i``, each entry one thread's sum in row order, so
   the same bits for any T; the intercept's ``Σ r_i`` and the loss from step 1's blocks, added
   in block order.

No table per thread and no merge; the price is the CSC copy (4 bytes a non-zero and 8 a column),
made once per training. Features are numbered by first use, as the rank's working table numbers
them (``solvers.local_table``). A prototype for the benchmark (``bench_threads``'s
``gradient_by_columns``), not the solver's pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from terascale.solvers.threads import split_rows


def by_first_use(indices: np.ndarray) -> tuple[np.ndarray, int]:
    """(indices renumbered 0.. in order of first occurrence, how many distinct)."""
    uniq, first = np.unique(indices, return_index=True)
    new = np.empty(int(uniq[-1]) + 1 if uniq.size else 0, np.int32)
    new[uniq[np.argsort(first, kind="stable")]] = np.arange(uniq.size, dtype=np.int32)
    return new[indices], int(uniq.size)


@njit(cache=True)
def csc_of(indptr, indices, n_cols):
    """(colptr, rows) of a binary CSR (counting sort: rows ascend within a column)."""
    colptr = np.zeros(n_cols + 1, np.int64)
    for k in range(indices.shape[0]):
        colptr[indices[k] + 1] += 1
    for j in range(n_cols):
        colptr[j + 1] += colptr[j]
    fill = colptr[:-1].copy()
    rows = np.empty(indices.shape[0], np.int32)
    for i in range(indptr.shape[0] - 1):
        for k in range(indptr[i], indptr[i + 1]):
            j = indices[k]
            rows[fill[j]] = i
            fill[j] += 1
    return colptr, rows


@njit(nogil=True, cache=True)
def _row_pass(indptr, indices, theta, labels, weights, lo, hi, r):
    """Rows lo..hi-1: r_i = c_i (σ(z_i) − y_i); -> (Σ c log(1 + e^{−s z}), Σ r_i)."""
    loss = 0.0
    total = 0.0
    for i in range(lo, hi):
        z = theta[0]
        for k in range(indptr[i], indptr[i + 1]):
            z += theta[indices[k] + 1]
        c = weights[i]
        m = z if labels[i] > 0.5 else -z
        if m > 0.0:
            loss += c * np.log1p(np.exp(-m))
            p = 1.0 / (1.0 + np.exp(-z))
        else:
            loss += c * (-m + np.log1p(np.exp(m)))
            e = np.exp(z)
            p = e / (1.0 + e)
        r[i] = c * (p - labels[i])
        total += r[i]
    return loss, total


@njit(nogil=True, cache=True)
def _col_pass(colptr, rows, r, lo, hi, g):
    """g[j + 1] = Σ r over column j's rows, for columns lo..hi-1."""
    for j in range(lo, hi):
        acc = 0.0
        for k in range(colptr[j], colptr[j + 1]):
            acc += r[rows[k]]
        g[j + 1] = acc


class ColumnGradient:
    """The rows (renumbered by first use) and their CSC copy; ``evaluate(theta, pool, t)`` ->
    (loss, gradient), θ and the gradient laid out as [intercept, feature 0, 1, ...]."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, labels: np.ndarray, weights: np.ndarray):
        self.indptr = np.asarray(indptr, np.int64)
        self.indices, self.n_cols = by_first_use(indices)
        self.colptr, self.rows = csc_of(self.indptr, self.indices, self.n_cols)
        self.labels = np.asarray(labels, np.float64)
        self.weights = np.asarray(weights, np.float64)
        self.r = np.empty(self.labels.shape[0])

    @property
    def dim(self) -> int:
        return self.n_cols + 1

    def evaluate(self, theta: np.ndarray, pool: ThreadPoolExecutor | None, t: int) -> tuple[float, np.ndarray]:
        g = np.empty(self.dim)
        row_cuts = split_rows(self.indptr, t)
        col_cuts = split_rows(self.colptr, t)

        def rows(i):
            return _row_pass(self.indptr, self.indices, theta, self.labels, self.weights,
                             row_cuts[i], row_cuts[i + 1], self.r)

        def cols(i):
            _col_pass(self.colptr, self.rows, self.r, col_cuts[i], col_cuts[i + 1], g)

        run = map if pool is None or t == 1 else pool.map
        parts = list(run(rows, range(t)))
        list(run(cols, range(t)))
        loss = total = 0.0
        for part_loss, part_total in parts:  # block order
            loss += part_loss
            total += part_total
        g[0] = total
        return loss, g
