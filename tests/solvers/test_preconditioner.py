"""The field-level coarse correction of the L-BFGS preconditioner: the coarse matrix against a
dense Sᵀ·∇²f·S, its sampling, the floored LDLᵀ, M⁻¹ against the dense D⁻¹ + S·E⁻¹·Sᵀ, fewer
passes on one-hot click-like fields with the same optimum, K ranks, and the API's checks."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.active import ActiveFeatures
from terascale.solvers.api import SolverParams
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.data import CSRData
from terascale.solvers.kernels import coarse as KC
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.kernels.sampling import SAMPLE_RUN
from terascale.solvers.local_table import LocalTable
from terascale.solvers.preconditioner import TwoLevel, coarse_matrix, compact_groups
from terascale.solvers.shard import Shard
from tests.solvers.helpers import (
    keep,
    loss_np,
    objective_np,
    planted_problem,
    sklearn_logistic,
    split_rows,
    train_local,
    train_on_tree,
)


def _group_map(n_features: int, seed: int) -> np.ndarray:
    """Random groups 3, 7, 9 (uint8; unused numbers in between) and 255 (none) for a tenth."""
    rng = np.random.default_rng(seed)
    g = rng.choice(np.array([3, 7, 9], dtype=np.uint8), n_features)
    g[rng.random(n_features) < 0.1] = 255
    return g


def _dense_S(group_map: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """S over [active features, intercept]: one column per group present, then the intercept."""
    present = sorted(set(group_map[ids].tolist()) - {255})
    S = np.zeros((ids.size + 1, len(present) + 1))
    for c, j in enumerate(ids):
        if group_map[j] != 255:
            S[c, present.index(group_map[j])] = 1.0
    S[-1, -1] = 1.0
    return S


def _curvature(loss: str, m: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return loss_np(loss, m, labels.astype(np.float64))[2]


def _table(data: CSRData) -> tuple[LocalTable, ActiveFeatures]:
    table = LocalTable(Shard.from_csr(data))
    space = ActiveFeatures(np.sort(table.ids), data.n_features)
    return table.bind(space), space


@pytest.mark.parametrize("loss", [name for name, spec in LOSSES.items() if spec.curvature])
def test_coarse_matrix_is_the_hessian_on_the_coarse_space(loss):
    """E = Sᵀ·∇²f(θ)·S + λ·diag(group sizes) (the intercept unpenalized) over weighted rows with
    real values, features in no group and rows holding several features of one group."""
    data = planted_problem(n=500, d=60, density=0.2, seed=3, loss=loss, weighted=True)
    gmap = _group_map(data.n_features, seed=4)
    table, space = _table(data)
    rng = np.random.default_rng(5)
    theta = np.append(rng.normal(0.0, 0.5, space.size), -0.2)
    l2 = 0.01
    group, sizes = compact_groups(gmap, space.ids)
    E = coarse_matrix(LocalCommunicator(), table, group, sizes, theta, LOSS_IDS[loss], l2,
                      float(data.weights.sum(dtype=np.float64)))
    x = np.hstack([data.to_scipy().toarray()[:, space.ids], np.ones((data.n_rows, 1))])
    h = data.weights.astype(np.float64)
    hc = h * _curvature(loss, x @ theta, data.labels)
    S = _dense_S(gmap, space.ids)
    want = (x @ S).T @ (hc[:, None] * (x @ S)) / h.sum()
    want += l2 * np.diag(np.append((S[:-1] > 0).sum(axis=0)[:-1], 0.0))
    np.testing.assert_allclose(E, want, rtol=1e-10, atol=1e-14)
    assert np.array_equal(E, E.T)
    assert E.shape == (4, 4)  # groups 3, 7, 9 renumbered 0..2, then the intercept


def test_the_coarse_matrix_samples_every_stride_th_run_of_rows():
    """With stride 3 the kernel adds exactly the rows of runs 0, 3, ... (SAMPLE_RUN rows each)
    and returns their weight."""
    n = 3 * SAMPLE_RUN + 100
    data = planted_problem(n=n, d=30, density=0.2, seed=8, weighted=True)
    gmap = _group_map(data.n_features, seed=9)
    table, space = _table(data)
    theta = np.append(np.random.default_rng(10).normal(0.0, 0.3, space.size), 0.1)
    group, sizes = compact_groups(gmap, space.ids)
    k = sizes.size + 1
    E = np.zeros((k, k))
    s = table.shard
    from terascale.solvers.kernels.features import load_column

    t = np.zeros((table.size + 1, 2))
    load_column(theta, table.compact_of, t, 0)
    used, status, _ = KC.coarse_rows(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, t,
                                     group[table.compact_of], sizes.size, LOSS_IDS["logistic"], 0,
                                     s.n_rows, 3, E)
    rows = np.r_[0 : SAMPLE_RUN, 3 * SAMPLE_RUN : n]
    x = np.hstack([data.to_scipy().toarray()[:, space.ids], np.ones((n, 1))])[rows]
    h = data.weights.astype(np.float64)[rows]
    hc = h * _curvature("logistic", x @ theta, data.labels[rows])
    S = _dense_S(gmap, space.ids)
    assert status == KC.OK
    assert used == pytest.approx(h.sum(), rel=1e-12)
    np.testing.assert_allclose(E, (x @ S).T @ (hc[:, None] * (x @ S)), rtol=1e-10, atol=1e-12)


def test_ldl_solves_and_raises_singular_pivots_to_the_floor():
    rng = np.random.default_rng(11)
    a = rng.normal(size=(6, 6))
    spd = a @ a.T + 0.1 * np.eye(6)
    L, D = KC.ldl_factor(spd, 1e-12)
    t = rng.normal(size=6)
    z = t.copy()
    KC.ldl_solve(L, D, z)
    np.testing.assert_allclose(z, np.linalg.solve(spd, t), rtol=1e-9)
    # column 2 = column 0 + column 1: singular; the floored factor is E + a non-negative diagonal
    b = rng.normal(size=(3, 4))
    sing = np.vstack([b, b[0] + b[1]])
    sing = sing @ sing.T
    L, D = KC.ldl_factor(sing, 1e-6)
    rebuilt = L @ np.diag(D) @ L.T
    extra = rebuilt - sing
    np.testing.assert_allclose(extra - np.diag(np.diag(extra)), 0.0, atol=1e-9)
    assert np.all(np.diag(extra) >= -1e-12) and np.diag(extra).max() > 0.0
    z = np.ones(4)
    KC.ldl_solve(L, D, z)
    assert np.isfinite(z).all()


def test_two_level_apply_and_quad_are_the_dense_operator():
    rng = np.random.default_rng(12)
    d = 9
    inv_diag = rng.uniform(0.5, 2.0, d + 1)
    group = np.array([0, 1, 0, -1, 2, 2, 1, 0, -1])
    a = rng.normal(size=(4, 4))
    E = a @ a.T + np.eye(4)
    pre = TwoLevel(inv_diag, group, E)
    S = np.zeros((d + 1, 4))
    S[np.flatnonzero(group >= 0), group[group >= 0]] = 1.0
    S[d, 3] = 1.0
    dense = np.diag(inv_diag) + S @ np.linalg.solve(E, S.T)
    q = rng.normal(size=d + 1)
    np.testing.assert_allclose(pre.apply(q), dense @ q, rtol=1e-12)
    y32 = q.astype(np.float32)  # the memory's pairs are float32
    assert pre.quad(y32) == pytest.approx(y32.astype(np.float64) @ dense @ y32.astype(np.float64), rel=1e-12)


def _click_fields(n: int, fields: int, levels: int, seed: int, missing: float = 0.3) -> tuple[CSRData, np.ndarray]:
    """One-hot click-like rows (one level per field; the last two fields missing in a fraction of
    the rows) from a planted model, and the group map (the field of each column)."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    cols = rng.integers(0, levels, (n, fields)) + np.arange(fields) * levels
    keep_ = np.ones((n, fields), dtype=bool)
    keep_[:, -2:] = rng.random((n, 2)) >= missing
    counts = keep_.sum(axis=1)
    x = sp.csr_matrix((np.ones(int(counts.sum())), cols[keep_], np.r_[0, np.cumsum(counts)]),
                      shape=(n, fields * levels))
    beta = rng.normal(0.0, 0.7, fields * levels)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ beta) + 1.0))).astype(np.float64)
    return CSRData.from_scipy(x, y), np.repeat(np.arange(fields, dtype=np.uint8), levels)


def _passes_to(history: list[dict], target: float) -> int:
    return next(e["pass"] for e in history if e["objective"] is not None and e["objective"] <= target)


def test_the_coarse_correction_cuts_the_passes_on_one_hot_fields():
    """Shifting a complete field's weights against the intercept leaves every margin unchanged:
    with a small λ, Jacobi-preconditioned L-BFGS crawls along those directions. The coarse
    correction reaches the same optimum (scikit-learn's) in far fewer passes."""
    data, gmap = _click_fields(4000, 10, 20, seed=13)
    l2 = 1e-5
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    params = {"solver": "hybrid", "l2": l2, "tol": 1e-12, "passes": 300}
    coarse = train_local(data, SolverParams(**params), groups=gmap)
    jacobi = train_local(data, SolverParams(**params), groups=gmap.copy() * 0 + 255)
    plain = train_local(data, SolverParams(**params, lbfgs_coarse=False), groups=gmap)
    # no group among the active features: Jacobi alone, as with the correction turned off
    assert [e["objective"] for e in jacobi.history] == [e["objective"] for e in plain.history]
    for res in (coarse, plain):
        assert res.objective == pytest.approx(f_sk, rel=1e-7)
    target = f_sk + 1e-6 * abs(f_sk)
    assert _passes_to(coarse.history, target) * 2 <= _passes_to(plain.history, target)


def test_k_ranks_reach_the_same_optimum_with_the_coarse_correction():
    data, gmap = _click_fields(1500, 6, 12, seed=14)
    params = SolverParams(solver="hybrid", l2=1e-4, tol=1e-12, passes=200)
    one = train_local(data, params, groups=gmap)
    for k, empty in ((2, None), (3, 1)):
        results = train_on_tree(split_rows(data, k, empty_rank=empty), params, groups=gmap)
        assert len({r.weights.tobytes() for r in results}) == 1  # every rank the same bits
        assert results[0].objective == pytest.approx(one.objective, rel=1e-9)


def test_owlqn_uses_the_coarse_correction_only_where_l2_bounds_its_shift():
    """With λ₁ > λ₂ the coarse part would move whole fields by up to λ₁/λ₂ (the L1 term of the
    pseudo-gradient over the penalty's curvature): OWL-QN runs on Jacobi alone, the same passes
    as with the correction turned off (before: at λ₂ = 0 every other pass a line search of 21
    evaluations, the objective after 40 passes 0.4632 against 0.4566). With λ₂ ≥ λ₁ it keeps
    the correction and gets to the same optimum in fewer passes."""
    data, gmap = _click_fields(4000, 10, 20, seed=13)
    for l2 in (0.0, 1e-4):
        params = {"solver": "hybrid", "l1": 1e-3, "l2": l2, "passes": 12, "early_stop_passes": 0}
        states = []
        on = train_local(data, SolverParams(**params), groups=gmap, on_pass_end=keep(states))
        off = train_local(data, SolverParams(**params, lbfgs_coarse=False), groups=gmap)
        same = ("objective", "grad_norm", "step", "evaluations")
        assert [[e.get(k) for k in same] for e in on.history] == [[e.get(k) for k in same] for e in off.history]
        assert on.weights.tobytes() == off.weights.tobytes()
        assert "lbfgs_coarse_E" not in states[-1]
        assert max(e.get("evaluations", 0) for e in on.history) <= 3
    params = {"solver": "hybrid", "l1": 1e-3, "l2": 3e-3, "tol": 1e-12, "passes": 60, "early_stop_passes": 0}
    states = []
    on = train_local(data, SolverParams(**params), groups=gmap, on_pass_end=keep(states))
    off = train_local(data, SolverParams(**params, lbfgs_coarse=False), groups=gmap)
    assert "lbfgs_coarse_E" in states[-1]
    assert on.objective == pytest.approx(off.objective, rel=1e-9)
    target = on.objective + 1e-7 * abs(on.objective)
    assert _passes_to(on.history, target) < _passes_to(off.history, target)


def test_the_checkpoint_keeps_the_coarse_matrix_and_the_settings_that_turn_it_off():
    data, gmap = _click_fields(600, 5, 8, seed=15)
    for params, groups, coarse in (
        (SolverParams(solver="hybrid", l2=1e-4, passes=4), gmap, True),
        (SolverParams(solver="hybrid", l2=1e-4, passes=4, lbfgs_coarse=False), gmap, False),
        (SolverParams(solver="hybrid", l2=1e-4, passes=4), None, False),
        (SolverParams(solver="hybrid", loss="hinge", l2=1e-4, passes=4), gmap, False),
    ):
        states = []
        train_local(data, params, groups=groups, on_pass_end=keep(states))
        last = states[-1]
        assert last["phase"] == "lbfgs"
        assert ("lbfgs_coarse_E" in last) == coarse, params
        if coarse:
            assert last["lbfgs_coarse_E"].shape == (6, 6)  # 5 fields and the intercept
            np.testing.assert_array_equal(last["lbfgs_coarse_group"], gmap[last["lbfgs_active"]])


@pytest.mark.parametrize("bad", [np.zeros(5, np.uint8), np.zeros(40, np.int64), [0] * 40])
def test_a_bad_group_map_is_refused_by_name(bad):
    data = planted_problem(n=50, d=40, seed=16)
    with pytest.raises(ValueError, match=r"groups: must be a uint8 array of length n_features = 40"):
        train_local(data, SolverParams(solver="lbfgs"), groups=bad)
