"""The dual local solver runs on its shard's features renumbered by frequency: the same alpha and
u, bit for bit, as the kernels over the original feature ids, and u = w on the features the
shard lacks."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.data import CSRData
from terascale.solvers.scd.dual_kernels import dual_epoch, dual_epoch_buckets, row_sq_norms
from terascale.solvers.scd.local_solver import DualLocalSolver, _Schedule, epoch_rng, numba_threads
from terascale.solvers.scd.losses import loss_code
from tests.scd.helpers import make_data

LAM = 1e-2


def _spread(data: CSRData, factor: int, seed: int) -> CSRData:
    """The rows with feature j renamed to a random distinct id in a ``factor``x larger space."""
    rng = np.random.default_rng(seed)
    emb = rng.choice(data.n_features * factor, data.n_features, replace=False).astype(np.int32)
    indices, values = emb[data.indices], data.values.copy()
    for r in range(data.n_rows):  # keep each row's ids sorted (the CSR contract)
        a, b = data.indptr[r], data.indptr[r + 1]
        order = np.argsort(indices[a:b])
        indices[a:b], values[a:b] = indices[a:b][order], values[a:b][order]
    return CSRData(data.indptr, indices, values, data.labels, data.weights, data.n_features * factor)


def _reference(d: CSRData, alpha, w, sigma, epochs, threads, seed, rank, round_index):
    """The epochs over the original ids, with full-length u and replicas."""
    code, n_w = loss_code("logistic"), float(d.weights.sum(dtype=np.float64))
    sqn = row_sq_norms(d.indptr, d.values, 1.0)
    sched = _Schedule(d.n_rows, threads, 8)
    a, u = alpha.copy(), w.copy()
    replicas = np.zeros((threads, d.n_features + 1, 2))
    for e in range(epochs):
        order = sched.order(epoch_rng(seed, rank, round_index, e))
        if threads == 1:
            dual_epoch(d.indptr, d.indices, d.values, d.labels, d.weights, sqn, a, u, order, code,
                       sigma / (LAM * n_w), 1.0, d.n_features)
        else:
            with numba_threads(threads):
                dual_epoch_buckets(d.indptr, d.indices, d.values, d.labels, d.weights, sqn, a, u,
                                   order, 8, replicas, code, sigma * threads / (LAM * n_w), 1.0,
                                   d.n_features, False)
    return a, u


@pytest.mark.parametrize("threads", [1, 2])
def test_renumbered_epochs_are_the_original_ones(threads):
    data = _spread(make_data("logistic", n=300, d=24, density=0.3, seed=8), 16, seed=9)
    rng = np.random.default_rng(10)
    alpha, _ = _reference(data, np.zeros(data.n_rows), np.zeros(data.n_features + 1), 1.0, 1, 1,
                          3, 0, 0)  # a feasible alpha away from 0
    w = rng.normal(size=data.n_features + 1) * 0.1  # non-zero also where the shard has no rows
    solver = DualLocalSolver(data, loss_code("logistic"), LAM, float(data.weights.sum(dtype=np.float64)),
                             1.0, threads, bucket_size=8)
    assert solver.space.size == len(np.unique(data.indices)) < data.n_features
    a_ref, u_ref = _reference(data, alpha, w, 2.0, 3, threads, 0, 1, 5)
    a1, u1 = (x.copy() for x in solver.solve(alpha, w, 2.0, 3, 0, 1, 5))
    assert a1.tobytes() == a_ref.tobytes() and u1.tobytes() == u_ref.tobytes()
    a2, u2, _ = solver.solve_with_gap(alpha, w, 2.0, 3, 0, 1, 5)
    assert a2.tobytes() == a_ref.tobytes() and u2.tobytes() == u_ref.tobytes()
    absent = np.setdiff1d(np.arange(data.n_features), data.indices)
    assert np.array_equal(u2[absent], w[absent])
