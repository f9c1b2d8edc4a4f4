"""The gather-only gradient prototype of ``bench_threads`` (``tests.benchmarks.gradient_by_columns``):
the logistic loss and gradient of the definition, the same bits for any number of threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp

from tests.benchmarks.gradient_by_columns import ColumnGradient, by_first_use


def _rows(n=500, d=300, per=12, seed=0):
    rng = np.random.default_rng(seed)
    cols = [np.unique((rng.pareto(1.2, per) * 7).astype(np.int64) % d) for _ in range(n)]
    indptr = np.concatenate([[0], np.cumsum([c.size for c in cols])]).astype(np.int64)
    return (indptr, np.concatenate(cols).astype(np.int32), (rng.random(n) < 0.3).astype(np.float32),
            rng.uniform(0.5, 2.0, n).astype(np.float32))


def test_first_use_numbering():
    new, n = by_first_use(np.array([7, 3, 7, 9, 3, 0], np.int32))
    assert new.tolist() == [0, 1, 0, 2, 1, 3] and n == 4


def test_loss_and_gradient_are_the_definitions_and_the_bits_do_not_depend_on_threads():
    indptr, indices, labels, weights = _rows()
    cg = ColumnGradient(indptr, indices, labels, weights)
    theta = np.random.default_rng(1).normal(0, 0.3, cg.dim)
    x = sp.csr_matrix((np.ones(indices.size), cg.indices, indptr), shape=(labels.size, cg.n_cols))
    z = theta[0] + x @ theta[1:]
    y, c = labels.astype(np.float64), weights.astype(np.float64)
    r = c * (1.0 / (1.0 + np.exp(-z)) - y)
    loss = float(c @ np.logaddexp(0.0, -np.where(y > 0.5, 1.0, -1.0) * z))
    with ThreadPoolExecutor(3) as pool:
        got = {t: cg.evaluate(theta, pool, t) for t in (1, 2, 3)}
    np.testing.assert_allclose(got[1][1], np.concatenate([[r.sum()], x.T @ r]), rtol=1e-12, atol=1e-12)
    assert abs(got[1][0] - loss) <= 1e-10 * loss
    assert got[2][1][1:].tobytes() == got[3][1][1:].tobytes() == got[1][1][1:].tobytes()
