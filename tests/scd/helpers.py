"""Data, reference objectives and scikit-learn twins for the SCD / CoCoA tests.

The slow, obvious objective below is written from the definition, in float64 numpy, on the
dense matrix with the intercept column appended: P(beta) = (1/N) sum c phi + (lam/2)||beta||^2.
scikit-learn models with the same objective (N = sum of the weights):

* ridge:    ``Ridge(alpha = lam N, fit_intercept=False)``           (sum c (y - x.b)^2 + alpha ||b||^2 = 2N P)
* logistic: ``LogisticRegression(C = 1/(lam N), fit_intercept=False)`` (C sum c log(1 + e^-sz) + ||b||^2/2 = P/lam)
* hinge:    ``LinearSVC(C = 1/(lam N), loss="hinge", fit_intercept=False, dual=True)``
* squared hinge: ``LinearSVC(C = 1/(lam N), loss="squared_hinge", fit_intercept=False, dual=True)``
  (C sum c max(0, 1 - s z)^2 + ||b||^2/2 = P/lam)

each fitted on ``[X, intercept_scaling * 1]`` so the constant column is regularized exactly like
our augmented feature.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.spec import FeatureSpec
from terascale.solvers.data import CSRData
from tests.allreduce.harness import run_tree

NODE_KWARGS = {"chunk_bytes": 1 << 16}


def make_data(loss: str, n: int = 240, d: int = 16, density: float = 0.5, seed: int = 0,
              weighted: bool = False) -> CSRData:
    """Sparse Gaussian features, a planted model, noisy labels (0/1 or real)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * (rng.random((n, d)) < density)
    beta = rng.standard_normal(d)
    margin = x @ beta + 0.5
    if loss == "squared":
        y = margin + 0.3 * rng.standard_normal(n)
    else:
        y = (margin + 0.7 * rng.standard_normal(n) > 0).astype(np.float32)
    w = rng.uniform(0.5, 2.0, n) if weighted else None
    return CSRData.from_scipy(sp.csr_matrix(x), y, weights=w, n_features=d)


def dense_augmented(data: CSRData, scaling: float | None) -> np.ndarray:
    """float64 dense X (from the float32 CSR), with a constant column ``scaling`` if given."""
    x = data.to_scipy().toarray().astype(np.float64)
    if scaling is None:
        return x
    return np.hstack([x, np.full((x.shape[0], 1), scaling)])


def objective(loss: str, data: CSRData, beta: np.ndarray, lam: float,
              scaling: float | None = 1.0) -> float:
    """P(beta) from the definition (beta includes the intercept coefficient if scaling)."""
    x = dense_augmented(data, scaling)
    y = data.labels.astype(np.float64)
    c = data.weights.astype(np.float64)
    z = x @ beta
    m = (2 * y - 1) * z
    if loss == "squared":
        per = 0.5 * (z - y) ** 2
    elif loss == "logistic":
        per = np.logaddexp(0.0, -m)
    elif loss == "hinge":
        per = np.maximum(0.0, 1.0 - m)
    elif loss == "squared_hinge":
        per = np.maximum(0.0, 1.0 - m) ** 2
    else:
        raise ValueError(f"no reference objective for loss {loss!r}")
    return float(c @ per / c.sum() + 0.5 * lam * beta @ beta)


def sklearn_fit(loss: str, data: CSRData, lam: float, scaling: float | None = 1.0) -> np.ndarray:
    """The scikit-learn optimum of the same objective (coefficients incl. the constant column)."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.svm import LinearSVC

    x = dense_augmented(data, scaling)
    y = data.labels.astype(np.float64)
    c = data.weights.astype(np.float64)
    n_w = c.sum()
    if loss == "squared":
        model = Ridge(alpha=lam * n_w, fit_intercept=False, solver="cholesky")
    elif loss == "logistic":
        model = LogisticRegression(C=1.0 / (lam * n_w), fit_intercept=False, tol=1e-14,
                                   max_iter=100_000)
    elif loss in ("hinge", "squared_hinge"):
        # liblinear's dual CD stalls below tol ~1e-11 (it then hits max_iter); 1e-10 converges
        model = LinearSVC(C=1.0 / (lam * n_w), loss=loss, fit_intercept=False, dual=True,
                          tol=1e-10, max_iter=1_000_000, random_state=0)
    else:
        raise ValueError(f"no scikit-learn twin for loss {loss!r}")
    model.fit(x, y, sample_weight=c)
    return np.asarray(model.coef_, dtype=np.float64).ravel()


def model_vector(result, fit_intercept: bool = True, scaling: float = 1.0) -> np.ndarray:
    """Our result as one float64 vector comparable with ``sklearn_fit`` (intercept last)."""
    w = result.weights.astype(np.float64)
    return np.append(w, result.intercept / scaling) if fit_intercept else w


def split_rows(data: CSRData, k: int, empty: int | None = None) -> list[CSRData]:
    """K consecutive row shards (shard ``empty`` gets no rows)."""
    x = data.to_scipy()
    sizes = [0 if r == empty else 1 for r in range(k)]
    active = sum(sizes)
    cuts = np.linspace(0, data.n_rows, active + 1).astype(int)
    out, j = [], 0
    for r in range(k):
        if sizes[r] == 0:
            out.append(CSRData.empty(data.n_features))
            continue
        a, b = cuts[j], cuts[j + 1]
        j += 1
        out.append(CSRData.from_scipy(x[a:b], data.labels[a:b], data.weights[a:b],
                                      n_features=data.n_features))
    return out


def run_ranks(shards: list[CSRData], body, timeout: float = 120.0) -> list:
    """body(shard, node) on K real TreeNodes (threads, 127.0.0.1); results by rank."""
    run = run_tree(len(shards), lambda node: body(shards[node.rank], node),
                   node_kwargs=NODE_KWARGS, timeout=timeout)
    return run.results


def run_and_resume(shards: list[CSRData], params, at_round: int):
    """Train on K ranks keeping every rank's state after round ``at_round``, then resume every
    rank from it: (uninterrupted results, resumed results, the states by rank)."""
    from terascale.solvers.scd import train_cocoa

    saved: dict[int, object] = {}

    def first(shard, node):
        def keep(state):
            if state.round == at_round:
                saved[node.rank] = state
        return train_cocoa(shard, node, params, on_round_end=keep)

    full = run_ranks(shards, first)
    resumed = run_ranks(shards, lambda shard, node: train_cocoa(shard, node, params,
                                                                   resume=saved[node.rank]))
    return full, resumed, saved


def libsvm_dataset(x: np.ndarray, labels: np.ndarray, bits: int) -> CSRData:
    """Write ``x`` as LibSVM text and parse it with the project's BlockParser.

    The LibSVM parser takes 0/1 (or -1/+1) labels only; real-valued targets (ridge) are written
    as 0 and put back after parsing.
    """
    binary = bool(np.all((labels == 0) | (labels == 1)))
    lines = []
    for row, lab in zip(x, labels, strict=True):
        feats = " ".join(f"{j + 1}:{v:.9g}" for j, v in enumerate(row) if v != 0.0)
        lines.append(f"{int(lab) if binary else 0} {feats}")
    blob = np.frombuffer(("\n".join(lines) + "\n").encode(), dtype=np.uint8)
    pb = BlockParser(FeatureSpec(format="libsvm", bits=bits, libsvm_index_base=1), 1 << 16).parse(blob)
    assert pb.labels.shape[0] == x.shape[0], "every line must parse"
    y = pb.labels.copy() if binary else labels.astype(np.float32)
    n = y.shape[0]
    return CSRData(pb.indptr.copy(), pb.indices.copy(), pb.values.copy(), y,
                   np.ones(n, np.float32), 1 << bits)


def breast_cancer() -> CSRData:
    """scikit-learn's bundled breast cancer data (569 x 30), standardized, labels 0/1."""
    from sklearn.datasets import load_breast_cancer

    ds = load_breast_cancer()
    x = (ds.data - ds.data.mean(0)) / ds.data.std(0)
    return libsvm_dataset(x, ds.target.astype(np.float64), bits=5)


def diabetes() -> CSRData:
    """scikit-learn's bundled diabetes data (442 x 10), standardized features and target."""
    from sklearn.datasets import load_diabetes

    ds = load_diabetes()
    x = (ds.data - ds.data.mean(0)) / ds.data.std(0)
    y = (ds.target - ds.target.mean()) / ds.target.std()
    return libsvm_dataset(x, y, bits=4)
