"""Shared helpers of the solver tests: generated problems, shard splitting, a real AllReduce
tree in threads, and numpy references of the objective."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.api import SolverParams, train
from terascale.solvers.data import CSRData
from terascale.solvers.state import copy_state
from tests.allreduce.harness import run_tree

# Real TreeNodes, but chunks big enough that small vectors go in a few frames, and timeouts
# that tolerate a numba compile on another thread.
TREE_NODE_KWARGS = {"chunk_bytes": 4096, "io_timeout_s": 60.0}


def planted_problem(n: int = 600, d: int = 40, density: float = 0.15, seed: int = 0,
                    loss: str = "logistic", weighted: bool = False) -> CSRData:
    """Random sparse rows (values in ±[0.5, 2]) with labels from a planted linear model."""
    rng = np.random.default_rng(seed)
    x = sp.random(n, d, density=density, random_state=rng, format="csr",
                  data_rvs=lambda k: rng.uniform(0.5, 2.0, k) * rng.choice([-1.0, 1.0], k))
    beta = rng.normal(0.0, 1.0, d)
    m = x @ beta - 0.3
    if loss == "squared":
        y = m + 0.3 * rng.normal(size=n)
    else:
        y = (rng.random(n) < 1.0 / (1.0 + np.exp(-m))).astype(np.float64)
    w = rng.uniform(0.5, 2.0, n) if weighted else None
    return CSRData.from_scipy(x, y, weights=w, n_features=d)


def binary_rows(rows: list[list[int]], n_features: int) -> CSRData:
    """CSR data whose row i holds features ``rows[i]`` with value 1 (label 0, weight 1)."""
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    indices = np.array([j for r in rows for j in r], dtype=np.int32)
    n = len(rows)
    return CSRData(indptr, indices, np.ones(indices.size, np.float32), np.zeros(n, np.float32),
                   np.ones(n, np.float32), n_features)


def row_slice(data: CSRData, lo: int, hi: int) -> CSRData:
    a, b = int(data.indptr[lo]), int(data.indptr[hi])
    return CSRData(data.indptr[lo : hi + 1] - a, data.indices[a:b].copy(), data.values[a:b].copy(),
                   data.labels[lo:hi].copy(), data.weights[lo:hi].copy(), data.n_features)


def split_rows(data: CSRData, k: int, empty_rank: int | None = None) -> list[CSRData]:
    """k contiguous row blocks of uneven size; ``empty_rank`` gets no rows."""
    owners = [r for r in range(k) if r != empty_rank]
    cuts = np.linspace(0, data.n_rows, len(owners) + 1).astype(int)
    cuts[1:-1] += np.arange(1, len(owners)) * 3  # uneven
    shards = {r: row_slice(data, int(cuts[i]), int(cuts[i + 1])) for i, r in enumerate(owners)}
    return [shards.get(r, CSRData.empty(data.n_features)) for r in range(k)]


def train_on_tree(shards: list[CSRData], params: SolverParams, holdouts=None, **kwargs):
    """Train with one real TreeNode per shard (threads on 127.0.0.1); results per rank."""
    k = len(shards)

    def body(node):
        hold = holdouts[node.rank] if holdouts is not None else None
        return train(shards[node.rank], node, params, holdout=hold, **kwargs)

    return run_tree(k, body, node_kwargs=TREE_NODE_KWARGS, timeout=120.0).results


def keep(states: list):
    """An on_pass_end callback appending a copy of every state to ``states``."""
    return lambda state: states.append(copy_state(state))


def copy_data(data: CSRData) -> CSRData:
    """A deep copy (for runs that consume their data, ``train(consume_data=True)``)."""
    return CSRData(data.indptr.copy(), data.indices.copy(), data.values.copy(), data.labels.copy(),
                   None if data.weights is None else data.weights.copy(), data.n_features)


def local_numbers(data: CSRData) -> np.ndarray:
    """``data.indices`` in L-BFGS's local numbering (:mod:`solvers.local_table`, written in place
    into data handed over): each feature's rank in the order the rows first use it."""
    first = np.sort(np.unique(data.indices, return_index=True)[1])
    local = np.full(data.n_features, -1, np.int32)
    local[data.indices[first]] = np.arange(first.size, dtype=np.int32)
    return local[data.indices]


def train_local(data: CSRData, params: SolverParams, **kwargs):
    return train(data, LocalCommunicator(), params, **kwargs)


def loss_np(loss: str, m: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ℓ, ℓ', ℓ'') of every row in numpy float64, from the definitions (s = 2y − 1; ℓ'' of the
    hinge is 0 and that of the squared hinge the generalized one, 2 where s·m < 1)."""
    s = 2.0 * y - 1.0
    if loss == "logistic":
        p = 0.5 * (1.0 + np.tanh(0.5 * m))  # σ(m) without overflow
        return np.logaddexp(0.0, m) - y * m, p - y, p * (1.0 - p)
    if loss == "squared":
        return 0.5 * (m - y) ** 2, m - y, np.ones_like(m)
    inside = s * m < 1.0
    if loss == "hinge":
        return np.maximum(0.0, 1.0 - s * m), np.where(inside, -s, 0.0), np.zeros_like(m)
    if loss == "squared_hinge":
        r = np.maximum(0.0, 1.0 - s * m)
        return r**2, -2.0 * s * r, np.where(inside, 2.0, 0.0)
    raise ValueError(f"no reference for loss {loss!r}")


def objective_np(data: CSRData, weights: np.ndarray, intercept: float, l2: float,
                 loss: str = "logistic") -> float:
    """The mean-form objective in numpy float64 (the slow, obvious reference)."""
    x = data.to_scipy().astype(np.float64)
    m = x @ np.asarray(weights, dtype=np.float64) + intercept
    per_row = loss_np(loss, m, data.labels.astype(np.float64))[0]
    h = data.weights.astype(np.float64)
    beta = np.asarray(weights, dtype=np.float64)
    return float(np.sum(h * per_row) / np.sum(h) + 0.5 * l2 * beta @ beta)


def scipy_optimum(data: CSRData, l2: float, loss: str):
    """(weights, intercept, f*) minimising the mean-form objective with scipy's L-BFGS-B from
    the numpy reference and its exact gradient (a loss with a Lipschitz ℓ'; b unpenalized),
    run until it can no longer reduce f (gtol 1e-13, ftol at machine precision)."""
    import scipy.optimize

    x = data.to_scipy().astype(np.float64)
    y = data.labels.astype(np.float64)
    h = data.weights.astype(np.float64) / float(np.sum(data.weights, dtype=np.float64))
    d = data.n_features

    def f_and_grad(theta):
        beta = theta[:d]
        value, d1, _ = loss_np(loss, x @ beta + theta[d], y)
        g = h * d1
        return float(h @ value + 0.5 * l2 * beta @ beta), np.append(x.T @ g + l2 * beta, g.sum())

    res = scipy.optimize.minimize(f_and_grad, np.zeros(d + 1), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-13, "ftol": 1e-16, "maxiter": 100_000, "maxcor": 30})
    return res.x[:d], float(res.x[d]), float(res.fun)


def sklearn_squared_hinge(data: CSRData, l2: float, intercept_scaling: float = 1e3):
    """scikit-learn's LinearSVC (default loss: squared hinge) on the same objective, C = 1/(N·λ)
    with N = Σ wᵢ. liblinear's bias is a constant feature of value ``intercept_scaling`` whose
    weight is penalized, so it minimises f(β, b) + (λ/2)·(b/s)²: with s = 1e3 that term moves f's
    minimum by O(λ²·(b/s)⁴), far below float64 resolution. The primal solver (``dual=False``,
    trust-region Newton) converges in a few dozen iterations; liblinear's dual CD crawls with a
    large s."""
    from sklearn.svm import LinearSVC

    h = data.weights.astype(np.float64)
    model = LinearSVC(C=1.0 / (l2 * h.sum()), loss="squared_hinge", dual=False, fit_intercept=True,
                      intercept_scaling=intercept_scaling, tol=1e-12, max_iter=100_000, random_state=0)
    model.fit(data.to_scipy().astype(np.float64), data.labels, sample_weight=h)
    return model.coef_[0], float(model.intercept_[0])


def sklearn_logistic(data: CSRData, l2: float):
    """scikit-learn's optimum of the same objective: C = 1/(n·λ), intercept unpenalized."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=1.0 / (data.n_rows * l2), tol=1e-12, max_iter=100_000)
    clf.fit(data.to_scipy().astype(np.float64), data.labels)
    return clf.coef_[0], float(clf.intercept_[0])


def ridge_closed_form(data: CSRData, l2: float):
    """Solve the normal equations of the weighted mean-form ridge with unpenalized intercept."""
    import scipy.linalg

    x = np.hstack([data.to_scipy().toarray().astype(np.float64), np.ones((data.n_rows, 1))])
    h = data.weights.astype(np.float64)
    hsum = h.sum()
    a = (x.T * h) @ x / hsum
    a[:-1, :-1] += l2 * np.eye(data.n_features)
    rhs = (x.T * h) @ data.labels.astype(np.float64) / hsum
    sol = scipy.linalg.solve(a, rhs, assume_a="sym")
    return sol[:-1], float(sol[-1])
