"""Generated rows shaped like the webspam sample of Parnell et al. (262,938 rows, 680,715
features, long rows of positive, unit-norm values, about 60% of one class; λ = 1e-3 there).

Row i has a length L_i drawn log-normally around ``mean_nnz``; feature j (by frequency rank) is
in it with probability ``min(1, L_i f_j)``, ``f_j ∝ (j + 1)^-exponent`` (Σ f = 1): a few hundred
features in nearly every row (common trigrams), a long tail in few. Drawn by geometric skips
within log-spaced bands of ranks (the probability taken as the band's mean), so the indices of a
row come out sorted and unique, in one pass over the non-zeros. Values: uniform in [0.2, 1],
then each row scaled to unit norm. Labels ±1: the sign of a planted model's margin plus noise,
split at its 40th percentile. Deterministic for a seed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from terascale.solvers.data import CSRData

PAPER = {"rows": 262_938, "features": 680_715}


def _bands(features: int, growth: float = 1.25) -> np.ndarray:
    edges = [0, 1]
    while edges[-1] < features:
        edges.append(min(features, max(edges[-1] + 1, int(edges[-1] * growth))))
    return np.asarray(edges, np.int64)


@njit(cache=True)
def _fill(lengths, edges, band_f, capacity, seed):
    np.random.seed(seed)
    n = lengths.shape[0]
    indptr = np.zeros(n + 1, np.int64)
    indices = np.empty(capacity, np.int32)
    values = np.empty(capacity, np.float32)
    k = 0
    for i in range(n):
        start = k
        for b in range(edges.shape[0] - 1):
            lo = edges[b]
            hi = edges[b + 1]
            q = lengths[i] * band_f[b]
            if q >= 1.0:
                for j in range(lo, hi):
                    if k >= capacity:
                        return indptr, indices, values, -1
                    indices[k] = j
                    k += 1
                continue
            if q <= 0.0:
                continue
            step = np.log1p(-q)
            pos = lo - 1
            while True:
                pos += 1 + int(np.log(1.0 - np.random.random()) / step)
                if pos >= hi:
                    break
                if k >= capacity:
                    return indptr, indices, values, -1
                indices[k] = pos
                k += 1
        norm = 0.0
        for t in range(start, k):
            v = 0.2 + 0.8 * np.random.random()
            values[t] = v
            norm += v * v
        if norm > 0.0:
            s = 1.0 / np.sqrt(norm)
            for t in range(start, k):
                values[t] = values[t] * s
        indptr[i + 1] = k
    return indptr, indices, values, k


@njit(cache=True)
def _margins(indptr, indices, values, beta):
    out = np.zeros(indptr.shape[0] - 1)
    for i in range(out.shape[0]):
        acc = 0.0
        for k in range(indptr[i], indptr[i + 1]):
            acc += values[k] * beta[indices[k]]
        out[i] = acc
    return out


def webspam_like(rows: int = PAPER["rows"], features: int = PAPER["features"], mean_nnz: int = 3000,
                 exponent: float = 1.0, seed: int = 0) -> CSRData:
    """The rows (see the module docstring); labels ±1 (for the squared loss: ridge regression)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(mean_nnz) - 0.125, 0.5, rows)  # mean ≈ mean_nnz
    f = 1.0 / np.arange(1, features + 1, dtype=np.float64) ** exponent
    f /= f.sum()
    edges = _bands(features)
    band_f = np.add.reduceat(f, edges[:-1]) / np.diff(edges)
    capacity = int(1.05 * lengths.sum()) + 64 * rows + 1024
    indptr, indices, values, k = _fill(lengths, edges, band_f, capacity, seed)
    if k < 0:
        raise RuntimeError(f"webspam_like: more than {capacity} non-zeros drawn (seed {seed}); raise the capacity")
    indices, values = indices[:k].copy(), values[:k].copy()
    beta = rng.standard_normal(features) * np.sqrt(np.arange(1, features + 1) ** 0.5)  # rarer: larger
    m = _margins(indptr, indices, values, beta)
    m += 0.3 * m.std() * rng.standard_normal(rows)
    labels = np.where(m > np.quantile(m, 0.4), 1.0, -1.0).astype(np.float32)
    return CSRData(indptr, indices, values, labels, np.ones(rows, np.float32), features)
