"""L1 and elastic net (``train.l1``): OWL-QN against trusted optima (scipy's L-BFGS-B on the
split-variable form, scikit-learn's saga and liblinear on real data written as LibSVM), K = 1, 2,
4 ranks against one, resume from every pass, the online kernel's lazy shrinkage against a plain
reference, the kernels against numpy, and the errors for a bad ``l1``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize

from terascale.solvers.api import SolverParams
from terascale.solvers.constraints import ConfigError
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.kernels.online import G, S, T, W, l1_catch_up, new_state, online_pass
from terascale.solvers.kernels.owlqn import align_direction, l1_norm, project_point, pseudo_gradient
from terascale.solvers.shard import Shard
from tests.solvers.helpers import (
    keep,
    loss_np,
    planted_problem,
    split_rows,
    train_local,
    train_on_tree,
)
from tests.solvers.test_resume import _round_trip, _same

L1, L2 = 0.01, 1e-3


def objective_l1(data: CSRData, weights, intercept: float, l1: float, l2: float) -> float:
    """The mean-form elastic-net objective in numpy float64 (the slow, obvious reference)."""
    x = data.to_scipy().astype(np.float64)
    beta = np.asarray(weights, dtype=np.float64)
    per_row = loss_np("logistic", x @ beta + intercept, data.labels.astype(np.float64))[0]
    h = data.weights.astype(np.float64)
    return float(h @ per_row / h.sum() + l1 * np.abs(beta).sum() + 0.5 * l2 * beta @ beta)


def scipy_l1_optimum(data: CSRData, l1: float, l2: float):
    """(weights, intercept, f*) of the elastic-net objective from scipy's L-BFGS-B on the smooth
    split form β = u − v, u, v ≥ 0 (f = loss + λ₁·Σ(u + v) + (λ₂/2)‖u − v‖²: the same minimum),
    run until it cannot reduce f any more."""
    x = data.to_scipy().astype(np.float64)
    y = data.labels.astype(np.float64)
    h = data.weights.astype(np.float64)
    h = h / h.sum()
    d = data.n_features

    def f_and_grad(z):
        u, v, b = z[:d], z[d : 2 * d], z[2 * d]
        beta = u - v
        value, d1, _ = loss_np("logistic", x @ beta + b, y)
        g = h * d1
        gb = x.T @ g + l2 * beta
        f = float(h @ value + l1 * (u.sum() + v.sum()) + 0.5 * l2 * beta @ beta)
        return f, np.concatenate([gb + l1, l1 - gb, [g.sum()]])

    res = scipy.optimize.minimize(f_and_grad, np.zeros(2 * d + 1), jac=True, method="L-BFGS-B",
                                  bounds=[(0.0, None)] * (2 * d) + [(None, None)],
                                  options={"gtol": 1e-14, "ftol": 1e-16, "maxiter": 100_000, "maxcor": 30})
    return res.x[:d] - res.x[d : 2 * d], float(res.x[2 * d]), float(res.fun)


@pytest.fixture(scope="module")
def problem():
    return planted_problem(n=900, d=50, seed=31, weighted=True)


@pytest.fixture(scope="module")
def reference(problem):
    return scipy_l1_optimum(problem, L1, L2)


# ---------------------------------------------------------------------------------------------
# kernels


def test_pseudo_gradient_projection_and_alignment_against_numpy():
    rng = np.random.default_rng(0)
    theta = rng.choice([-1.0, 0.0, 0.0, 2.0], 201)
    grad = rng.normal(0.0, 0.5, 201)
    grad[:5] = [0.3, -0.3, 0.05, -0.05, 0.0]
    theta[:5] = 0.0
    l1 = 0.1
    out = np.empty(201)
    pseudo_gradient(theta, grad, l1, out)
    beta, g = theta[:-1], grad[:-1]
    want = np.where(beta > 0, g + l1, np.where(beta < 0, g - l1,
                    np.where(g + l1 < 0, g + l1, np.where(g - l1 > 0, g - l1, 0.0))))
    np.testing.assert_array_equal(out[:-1], want)
    assert out[-1] == grad[-1]  # the intercept: unpenalized
    assert out[2] == 0.0 and out[3] == 0.0 and out[0] == pytest.approx(0.2) and out[1] == pytest.approx(-0.2)

    p = rng.normal(size=201)
    aligned = p.copy()
    slope = align_direction(aligned, out)
    keep_mask = p * out < 0
    np.testing.assert_array_equal(aligned, np.where(keep_mask, p, 0.0))
    assert slope == pytest.approx(float(np.sum((p * out)[keep_mask])), rel=1e-14) and slope < 0

    point = theta + 3.0 * aligned
    project_point(point, theta, out)
    xi = np.where(beta != 0, np.sign(beta), np.sign(-out[:-1]))
    np.testing.assert_array_equal(point[:-1], np.where((theta + 3.0 * aligned)[:-1] * xi > 0,
                                                       (theta + 3.0 * aligned)[:-1], 0.0))
    assert point[-1] == theta[-1] + 3.0 * aligned[-1]
    assert l1_norm(theta) == pytest.approx(np.abs(beta).sum(), rel=1e-15)


# ---------------------------------------------------------------------------------------------
# the optimum


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_owlqn_reaches_the_scipy_optimum_of_the_l1_objective(problem, reference, solver):
    w_ref, b_ref, f_ref = reference
    res = train_local(problem, SolverParams(solver=solver, l1=L1, l2=L2, tol=1e-12, passes=300))
    assert res.stop_reason.startswith("converged")
    f = objective_l1(problem, res.weights, res.intercept, L1, L2)
    assert res.objective == pytest.approx(f, rel=1e-12)  # the reported objective is f, L1 term included
    assert abs(f - f_ref) <= 1e-10 * f_ref
    np.testing.assert_allclose(res.weights, w_ref, atol=2e-6)
    # the zeros are exact: the same support as the reference's (away from rounding)
    big = np.abs(w_ref) > 1e-6
    assert np.array_equal(res.weights != 0, big)
    assert 0 < big.sum() < problem.n_features  # a sparse optimum, not a trivial one


def test_elastic_net_and_a_zero_model_at_large_l1(problem):
    w_ref, b_ref, f_ref = scipy_l1_optimum(problem, 0.004, 0.05)
    res = train_local(problem, SolverParams(solver="hybrid", l1=0.004, l2=0.05, tol=1e-12, passes=300))
    assert abs(objective_l1(problem, res.weights, res.intercept, 0.004, 0.05) - f_ref) <= 1e-10 * f_ref
    np.testing.assert_allclose(res.weights, w_ref, atol=2e-6)
    # λ₁ above ‖∇loss(0, b*)‖∞: β* = 0 exactly, only the intercept is fitted
    big = train_local(problem, SolverParams(solver="lbfgs", l1=10.0, l2=L2, tol=1e-12, passes=100))
    assert not big.weights.any()
    y, h = problem.labels.astype(np.float64), problem.weights.astype(np.float64)
    rate = float(h @ y / h.sum())
    assert big.intercept == pytest.approx(math.log(rate / (1 - rate)), rel=1e-7)


def test_l1_objective_matches_scikit_learn_on_real_data_written_as_libsvm(tmp_path):
    """Breast cancer (scikit-learn's bundled copy of the UCI data, 569 rows, 30 features),
    standardized and written as LibSVM, read back; the same objective as scikit-learn's:
    LogisticRegression minimises C·Σᵢℓᵢ + ‖β‖₁ (saga: b unpenalized), i.e. ours times 1/λ₁ with
    C = 1/(n·λ₁); elastic net: C·Σᵢℓᵢ + r‖β‖₁ + (1−r)/2‖β‖², C = 1/(n·(λ₁+λ₂)), r = λ₁/(λ₁+λ₂).
    liblinear penalizes its bias feature (value s = intercept_scaling): with s = 1e4 the extra
    |b|/s term moves f by < 1e-9 relative. liblinear's coordinate order is random: seeded, since
    at tol 1e-12 some orders never meet its stopping rule and run all 200,000 iterations (~30 s). OWL-QN's f must be within 1e-6 (relative) of each, and
    no worse than any."""
    from sklearn.datasets import dump_svmlight_file, load_breast_cancer, load_svmlight_file
    from sklearn.linear_model import LogisticRegression

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    path = tmp_path / "breast_cancer.libsvm"
    dump_svmlight_file(x, y, str(path), zero_based=False)
    xs, ys = load_svmlight_file(str(path), n_features=30, zero_based=False)
    data = CSRData.from_scipy(xs.tocsr(), ys, n_features=30)
    n = data.n_rows
    xd = data.to_scipy().astype(np.float64)  # the float32 values we train on, for sklearn too
    figures = {}
    for name, l1, l2 in (("l1", 0.01, 0.0), ("elasticnet", 0.01, 0.02)):
        ours = train_local(data, SolverParams(solver="hybrid", l1=l1, l2=l2, tol=1e-12, passes=500))
        f_ours = objective_l1(data, ours.weights.astype(np.float64), ours.intercept, l1, l2)
        refs = {}
        if name == "l1":
            saga = LogisticRegression(l1_ratio=1.0, C=1.0 / (n * l1), solver="saga", tol=1e-12, max_iter=200_000)
            lib = LogisticRegression(l1_ratio=1.0, C=1.0 / (n * l1), solver="liblinear", tol=1e-12,
                                     max_iter=200_000, intercept_scaling=1e4, random_state=0)
            refs = {"saga": saga.fit(xd, data.labels), "liblinear": lib.fit(xd, data.labels)}
        else:
            saga = LogisticRegression(C=1.0 / (n * (l1 + l2)), l1_ratio=l1 / (l1 + l2),
                                      solver="saga", tol=1e-12, max_iter=200_000)
            refs = {"saga": saga.fit(xd, data.labels)}
        for ref_name, clf in refs.items():
            f_ref = objective_l1(data, clf.coef_[0], float(clf.intercept_[0]), l1, l2)
            figures[f"{name}/{ref_name}"] = (f_ours, f_ref)
            assert abs(f_ours - f_ref) <= 1e-6 * f_ref, (name, ref_name, f_ours, f_ref)
            assert f_ours <= f_ref * (1 + 1e-10), (name, ref_name, f_ours, f_ref)
            assert np.array_equal(ours.weights != 0, np.abs(clf.coef_[0]) > 1e-5), (name, ref_name)
        assert 0 < np.count_nonzero(ours.weights) < 30
    print(figures)


# ---------------------------------------------------------------------------------------------
# ranks, resume


@pytest.mark.parametrize("k,empty", [(1, None), (2, None), (4, None), (4, 1)])
@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_owlqn_on_k_ranks_reaches_the_same_optimum_with_the_same_bits_on_every_rank(problem, reference, k, empty,
                                                                                   solver):
    params = SolverParams(solver=solver, l1=L1, l2=L2, tol=1e-12, passes=300)
    results = train_on_tree(split_rows(problem, k, empty_rank=empty), params)
    first = results[0]
    for r, res in enumerate(results[1:], start=1):
        assert res.weights.tobytes() == first.weights.tobytes(), f"rank {r} weights differ"
        assert res.intercept == first.intercept and res.objective == first.objective
        assert res.history == first.history
    assert abs(first.objective - reference[2]) <= 1e-10 * reference[2]
    np.testing.assert_allclose(first.weights, reference[0], atol=2e-6)
    assert np.array_equal(first.weights != 0, np.abs(reference[0]) > 1e-6)


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_owlqn_resumed_from_every_pass_ends_where_the_uninterrupted_run_ends(solver):
    data = planted_problem(n=400, d=30, seed=51)
    params = SolverParams(solver=solver, l1=0.005, l2=1e-3, passes=14, online_passes=2)
    states = []
    full = train_local(data, params, on_pass_end=keep(states))
    assert [s["pass"] for s in states] == list(range(1, full.passes + 1))
    assert np.count_nonzero(full.weights) < 30
    for state in states:
        _same(train_local(data, params, resume=_round_trip(state)), full)


def test_owlqn_resumes_on_two_ranks():
    data = planted_problem(n=500, d=30, seed=52)
    params = SolverParams(solver="hybrid", l1=0.005, l2=1e-3, passes=10, online_passes=2)
    shards = split_rows(data, 2)
    states = []
    full = train_on_tree(shards, params, on_pass_end=keep(states))
    mid = [s for s in states if s["pass"] == 4][0]  # L-BFGS phase, written by rank 0 and 1 alike
    resumed = train_on_tree(shards, params, resume=_round_trip(mid))
    for a, b in zip(full, resumed, strict=True):
        assert a.weights.tobytes() == b.weights.tobytes() and a.objective == b.objective


def test_resume_refuses_a_state_with_another_l1():
    data = planted_problem(n=200, d=10, seed=5)
    states = []
    train_local(data, SolverParams(solver="lbfgs", l1=0.01, l2=1e-6, passes=3), on_pass_end=keep(states))
    with pytest.raises(ValueError, match=r"params.l1 = 0.01 differs"):
        train_local(data, SolverParams(solver="lbfgs", l1=0.02, l2=1e-6, passes=5), resume=states[-1])


# ---------------------------------------------------------------------------------------------
# the online pass's shrinkage


def reference_l1_pass(data: CSRData, eta: float, l1: float):
    """One plain-gradient (non-invariant) online pass with the lazy L1 shrink of
    :mod:`solvers.kernels.online` (step 6 and the catch-up), in float64 dicts, written plainly."""
    d = data.n_features
    w, g2, scale, clock = {}, {}, {d: 1.0}, {}
    t = n_norm = 0.0
    for r in range(data.n_rows):
        a, b = data.indptr[r], data.indptr[r + 1]
        feats = [(int(j), float(x)) for j, x in zip(data.indices[a:b], data.values[a:b], strict=True) if x != 0.0]
        h, y = float(data.weights[r]), float(data.labels[r])
        for j, x in feats:
            if abs(x) > scale.get(j, 0.0):
                if scale.get(j, 0.0) > 0.0:
                    w[j] = w.get(j, 0.0) * scale[j] / abs(x)
                scale[j] = abs(x)
        m = sum(w.get(j, 0.0) * x for j, x in feats) + w.get(d, 0.0)
        t += h
        n_norm += h * (1.0 + sum((x / scale[j]) ** 2 for j, x in feats))
        g = 1.0 / (1.0 + math.exp(-m)) - y
        for j, x in feats + [(d, 1.0)]:
            g2[j] = g2.get(j, 0.0) + h * (g * x) ** 2
        eta_t = eta * math.sqrt(t / n_norm)
        for j, x in feats:
            rate = 1.0 / (scale[j] * math.sqrt(g2[j]))
            wj = w.get(j, 0.0) - eta_t * h * g * rate * x
            shrink = eta_t * rate * l1 * (t - clock.get(j, 0.0))
            w[j] = math.copysign(max(0.0, abs(wj) - shrink), wj)
            clock[j] = t
        w[d] = w.get(d, 0.0) - eta_t * h * g / math.sqrt(g2[d])
    eta_t = eta * math.sqrt(t / n_norm)
    for j in range(d):
        if w.get(j, 0.0) != 0.0:
            shrink = eta_t / (scale[j] * math.sqrt(g2[j])) * l1 * (t - clock.get(j, 0.0))
            w[j] = math.copysign(max(0.0, abs(w[j]) - shrink), w[j])
    return np.array([w.get(j, 0.0) for j in range(d + 1)])


def _kernel_l1_pass(data: CSRData, eta: float, l1: float) -> np.ndarray:
    s = Shard.from_csr(data)
    state = new_state(data.n_features)
    totals = np.zeros(2)
    state[:, T] = totals[0]
    out = online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, np.zeros(0, np.int64), state,
                      totals, LOSS_IDS["logistic"], eta, False, 0, s.n_rows, 0.0, 0.0, l1)
    assert out[2] == 0
    l1_catch_up(state, totals[0], eta * math.sqrt(totals[0] / totals[1]), l1)
    assert (state[:-1, T] == np.float32(totals[0])).all() and (state[:, G] >= 0).all() and (state[:-1, S] >= 0).all()
    return state[:, W].astype(np.float64)


def test_online_l1_shrink_matches_the_plain_reference_and_makes_zeros():
    data = planted_problem(n=300, d=40, density=0.1, seed=8, weighted=True)
    for l1 in (0.0, 0.002, 0.02):
        got = _kernel_l1_pass(data, 0.5, l1)
        want = reference_l1_pass(data, 0.5, l1)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
        assert np.array_equal(got[:-1] == 0.0, np.abs(want[:-1]) < 1e-7)
    plain = _kernel_l1_pass(data, 0.5, 0.0)
    sparse = _kernel_l1_pass(data, 0.5, 0.02)
    assert np.count_nonzero(sparse[:-1]) < np.count_nonzero(plain[:-1])


def test_online_solver_with_l1_is_sparser_and_l1_zero_keeps_the_bits(problem):
    base = train_local(problem, SolverParams(solver="online", l2=L2, passes=2))
    zero = train_local(problem, SolverParams(solver="online", l2=L2, l1=0.0, passes=2))
    assert base.weights.tobytes() == zero.weights.tobytes()
    sparse = train_local(problem, SolverParams(solver="online", l2=L2, l1=0.05, passes=2))
    assert np.count_nonzero(sparse.weights) < np.count_nonzero(base.weights)
    assert sparse.objective == pytest.approx(objective_l1(problem, sparse.weights, sparse.intercept, 0.05, L2),
                                             rel=1e-6)


def _split_features(scale_rank1: float = 1.0):
    """600 planted rows on 2 ranks: rank 0 (rows 0..302) holds features 0..19 only, rank 1 all
    40, its values of features 20.. scaled by ``scale_rank1``."""
    data = planted_problem(n=600, d=40, density=0.15, seed=9)
    x = data.to_scipy().tolil()
    x[:310, 20:] = 0.0
    x[310:, 20:] = x[310:, 20:] * scale_rank1
    data = CSRData.from_scipy(x.tocsr(), data.labels, data.weights)
    shards = split_rows(data, 2)
    only_other = np.setdiff1d(np.unique(shards[1].indices), np.unique(shards[0].indices))
    assert only_other.size >= 15
    return data, shards, only_other


def test_online_l1_on_ranks_holding_features_the_others_do_not():
    """After an averaging a rank holds w and G of features only another rank's rows have: the
    normalizers agreed at the first averaging let its catch-up shrink them for its own examples
    (before: a division by s_j = 0, ZeroDivisionError in pass 2). Every rank the same bits; the
    objective is numpy's elastic-net objective at the weights; sparser than without L1."""
    data, shards, only_other = _split_features()
    params = dict(solver="online", l2=1e-4, passes=3)
    plain_states, states = [], []
    dense = train_on_tree(shards, SolverParams(**params), on_pass_end=keep(plain_states))
    sparse = train_on_tree(shards, SolverParams(**params, l1=0.05), on_pass_end=keep(states))
    assert sparse[0].weights.tobytes() == sparse[1].weights.tobytes() and sparse[0].passes == 3
    assert np.count_nonzero(sparse[0].weights) < np.count_nonzero(dense[0].weights)
    assert np.count_nonzero(sparse[0].weights[only_other]) < np.count_nonzero(dense[0].weights[only_other])
    assert sparse[0].objective == pytest.approx(
        objective_l1(data, sparse[0].weights, sparse[0].intercept, 0.05, 1e-4), rel=1e-6)
    assert "online_scale" in states[-1] and "online_scale" not in plain_states[-1]  # only with L1


def test_online_l1_shares_the_holders_mean_normalizer():
    """The agreed s_j of a feature is the mean over the ranks that hold it of their max |x_j|
    (exact in float32 for two ranks), for every averaged feature some rank holds."""
    _, shards, only_other = _split_features(scale_rank1=3.0)
    states = []
    train_on_tree(shards, SolverParams(solver="online", l2=1e-4, l1=0.01, passes=2), on_pass_end=keep(states))
    ids, scale = states[-1]["online_scale_ids"], states[-1]["online_scale"]
    held = [np.zeros(40, np.float32) for _ in shards]
    for h, sh in zip(held, shards, strict=True):
        x = sh.to_scipy()
        h[:] = np.abs(x).max(axis=0).toarray().ravel()
    count = (held[0] > 0).astype(np.float32) + (held[1] > 0)
    want_ids = np.flatnonzero(count > 0)
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_array_equal(scale, ((held[0] + held[1]) / count)[want_ids])
    assert (scale[np.isin(ids, only_other)] == held[1][only_other]).all()  # one holder: its own


def test_online_l1_on_two_ranks_resumes_from_every_pass():
    """The agreed normalizers are in the checkpoint: a run resumed after any pass (which does not
    average again before its next catch-up) ends with the uninterrupted run's bits."""
    _, shards, _ = _split_features()
    params = SolverParams(solver="online", l2=1e-4, l1=0.05, passes=5, shuffle=True, seed=3)
    states = []
    full = train_on_tree(shards, params, on_pass_end=keep(states))
    for state in states[:-1]:
        resumed = train_on_tree(shards, params, resume=_round_trip(state))
        for a, b in zip(full, resumed, strict=True):
            _same(a, b)


def test_online_passes_with_stored_zeros_of_a_feature_another_rank_holds():
    """A stored zero (LibSVM's ``j:0``, or ``j:1 j:-1`` merged) of a feature whose non-zeros are
    all on another rank: after the averaging this rank holds G_j > 0 with s_j = 0, and step 3's
    rate divided by s_j (ZeroDivisionError in pass 2, with or without L1). The zero entries change
    nothing: the same model as without them, bit for bit."""
    import scipy.sparse as sp

    data = planted_problem(n=400, d=20, density=0.2, seed=10)
    x = data.to_scipy().tolil()
    x[:220, 19] = 0.0  # feature 19's non-zeros only in rank 1's rows (rank 0 holds rows 0..202)
    clean = x.tocsr()
    clean.eliminate_zeros()
    coo = clean.tocoo()
    rows = np.arange(0, 200, 7)  # explicit zeros of feature 19 in some of rank 0's rows
    with_zeros = sp.csr_matrix((np.r_[coo.data, np.zeros(rows.size)],
                                (np.r_[coo.row, rows], np.r_[coo.col, np.full(rows.size, 19)])), shape=clean.shape)
    a = CSRData.from_scipy(clean, data.labels, data.weights)
    b = CSRData.from_scipy(with_zeros, data.labels, data.weights)
    assert b.nnz == a.nnz + rows.size
    for l1 in (0.0, 0.01):
        params = SolverParams(solver="online", l2=1e-4, l1=l1, passes=3)
        want = train_on_tree(split_rows(a, 2), params)
        got = train_on_tree(split_rows(b, 2), params)
        assert got[0].passes == 3
        assert got[0].weights.tobytes() == want[0].weights.tobytes() and got[0].intercept == want[0].intercept


# ---------------------------------------------------------------------------------------------
# errors


def test_negative_l1_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^train\.l1 = -0\.5: must be 'auto' or a finite number in \[0, inf\)$"):
        SolverParams(l1=-0.5)
    with pytest.raises(ConfigError, match=r"train\.l1 = nan"):
        SolverParams(l1=float("nan"))
    with pytest.raises(ConfigError, match=r"train\.l1 = 0\.1: must be 0 with train\.solver = 'cocoa'"):
        SolverParams(solver="cocoa", l1=0.1, l2=1e-3)


def test_negative_l1_in_the_configuration_is_refused_naming_the_key():
    from terascale.jobs.config import load_config

    with pytest.raises(ConfigError, match=r"train\.l1 = -1"):
        load_config([], ["train.l1=-1"])
    assert load_config([], ["train.l1=0.25"]).train.l1 == 0.25
