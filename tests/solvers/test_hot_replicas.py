"""Per-thread replicas of the hot features (:mod:`solvers.hot`, :mod:`solvers.kernels.hot`):
the blocks' layout (no 128-byte unit of memory holds rows of two threads), the relabelling round trip, the merge rule against its formula, one thread on replicas giving
the plain pass's bits, the hot set, and training with T = 2 on data handed over (the replicas
in use): the shard's feature ids come back exactly, the online pass tracks the single-thread
pass, and the hybrid reaches scikit-learn's optimum."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.hot import ALIGN, HotReplicas, choose_hot
from terascale.solvers.kernels.features import mark_features
from terascale.solvers.kernels.hot import (
    merge_replicas,
    seed_replicas,
)
from terascale.solvers.kernels.online import G, S, W, new_state, online_pass
from terascale.solvers.shard import Shard
from terascale.solvers.threads import RowThreads
from tests.solvers.helpers import (
    copy_data,
    local_numbers,
    objective_np,
    planted_problem,
    sklearn_logistic,
    train_local,
)

LOGISTIC = 0


def _skewed(n: int = 4000, d: int = 3000, seed: int = 0) -> CSRData:
    """Rows of 12 features: 4 from a few very frequent ones, 8 from a long tail (click-like)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 40, size=(n, 4))
    tail = rng.integers(40, d, size=(n, 8))
    rows = [np.unique(np.concatenate([h, t])) for h, t in zip(head, tail, strict=True)]
    indptr = np.zeros(n + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([r.shape[0] for r in rows])
    indices = np.concatenate(rows).astype(np.int32)
    beta = rng.normal(0, 0.7, d)
    margin = np.array([beta[r].sum() for r in rows]) - 0.5
    labels = (rng.random(n) < 1 / (1 + np.exp(-margin))).astype(np.float32)
    return CSRData(indptr, indices, np.ones(indices.shape[0], np.float32), labels, np.ones(n, np.float32), d)


def _hot(data: CSRData, threads: int) -> HotReplicas:
    return HotReplicas(choose_hot(Shard.from_csr(data)), data.n_features, threads)


def test_the_hot_set_is_the_frequent_features_most_frequent_first():
    data = _skewed()
    ids = choose_hot(Shard.from_csr(data))
    counts = np.bincount(data.indices, minlength=data.n_features)
    assert set(ids.tolist()) == set(np.flatnonzero(counts >= data.n_rows / 1024).tolist())
    assert set(range(40)) <= set(ids.tolist())
    assert np.all(np.diff(counts[ids]) <= 0)
    assert np.array_equal(ids, choose_hot(Shard.from_csr(data)))  # deterministic


@pytest.mark.parametrize("n", [1 << 22, 1 << 20, 1000, 7])
def test_no_aligned_unit_of_memory_holds_rows_of_two_threads(n):
    """Every (H, T) puts thread i's rows (its H hot replicas and its intercept) in ALIGN-byte units
    of memory that no other thread's rows, nor a canonical row, fall in: the intercept replica of
    thread 0 once shared a line with thread 1's hottest features (module docstring of
    solvers.hot). The kernel's arguments address exactly those rows."""
    for h in (1, 2, 3, 4, 7, 8, 904, 2047, 2048, 2418, 7330):
        for threads in (2, 3):
            hot = HotReplicas(np.arange(h, dtype=np.int64), n, threads)
            state = hot.extended_table()
            assert state.shape[0] >= n + 1 and state[n, S] == 1.0 and not state[: n].any()
            base = state.ctypes.data
            units = {}  # ALIGN unit of memory -> owner (thread, or -1 for the canonical rows)
            for r in range(n + 1):
                if r < 8 or r > n - 8:
                    units.setdefault((base + 16 * r) // ALIGN, -1)
            for i in range(threads):
                top, offset, bias = hot.kernel_args(i)
                assert top == n
                rows = [n + 1 + q + offset for q in range(h)] + [bias]
                assert rows == list(range(hot.first + i * hot.stride, hot.first + i * hot.stride + h + 1))
                assert rows[-1] < state.shape[0]
                for r in rows:
                    for b in (base + 16 * r, base + 16 * r + 15):
                        assert units.setdefault(b // ALIGN, i) == i, (h, threads, i, r)


def test_relabel_round_trip_and_marks():
    data = _skewed()
    hot = _hot(data, 2)
    shard = Shard.from_csr(copy_data(data))
    with RowThreads(2) as threads:
        hot.relabel(shard, threads)
        assert hot.relabelled
        want = np.zeros(data.n_features, np.uint8)
        mark_features(data.indices, want)
        np.testing.assert_array_equal(hot.take_marks(), want)  # made on 2 threads while relabelling
        assert hot.take_marks() is None  # handed over once
        is_hot = np.isin(data.indices, hot.hot_ids)
        assert np.all(shard.indices[is_hot] > data.n_features)
        np.testing.assert_array_equal(shard.indices[~is_hot], data.indices[~is_hot])
        np.testing.assert_array_equal(hot.hot_ids[shard.indices[is_hot] - data.n_features - 1], data.indices[is_hot])
        hot.unlabel(shard, threads)
    np.testing.assert_array_equal(shard.indices, data.indices)


def test_the_merge_follows_its_formula():
    rng = np.random.default_rng(3)
    n, threads = 50, 3
    hot_ids = np.array([7, 3, 40], dtype=np.int64)
    h = HotReplicas(hot_ids, n, threads)
    state = h.extended_table()
    state[: n + 1] = rng.random((n + 1, 4)).astype(np.float32)
    seed_replicas(state, hot_ids, n, h.first, h.stride, threads)
    before = state.copy()
    for i in range(threads):  # each thread moves its replicas; thread 2 leaves feature 3 alone
        for q in range(4):
            r = h.first + i * h.stride + q
            if (i, q) == (2, 1):
                continue
            state[r, W] = rng.normal()
            state[r, G] += np.float32(rng.random())
            state[r, S] = max(state[r, S], np.float32(rng.random() * 1.5))
            state[r, 3] += np.float32(i)
    got = state.copy()
    merge_replicas(got, hot_ids, n, h.first, h.stride, threads)
    for q, c in enumerate([*hot_ids.tolist(), n]):
        rows = [h.first + i * h.stride + q for i in range(threads)]
        s = max(float(before[c, S]), *(float(state[r, S]) for r in rows))
        dg = np.array([float(state[r, G]) - float(before[c, G]) for r in rows])
        w = np.array([float(state[r, W]) * (float(state[r, S]) / s if float(state[r, S]) < s else 1.0) for r in rows])
        num = den = 0.0
        for i in range(threads):  # in thread order, as the kernel adds
            if dg[i] > 0:
                num += dg[i] * w[i]
                den += dg[i]
        if (dg > 0).sum() == 1:
            assert got[c, W] == np.float32(w[dg > 0][0])
        else:
            assert float(got[c, W]) == pytest.approx(num / den, rel=1e-6, abs=1e-7)  # float32, up to rounding
        assert got[c, G] == np.float32(float(before[c, G]) + den)
        assert got[c, S] == np.float32(s) and got[c, 3] == max(state[r, 3] for r in [c, *rows])
    np.testing.assert_array_equal(np.delete(got[: n + 1], [*hot_ids, n], axis=0),
                                  np.delete(before[: n + 1], [*hot_ids, n], axis=0))


@pytest.mark.parametrize("shuffled", [False, True])
def test_one_thread_on_replicas_gives_the_plain_passs_bits(shuffled):
    data = _skewed(seed=1)
    order = np.random.default_rng(0).permutation(data.n_rows).astype(np.int64) if shuffled else np.zeros(0, np.int64)
    plain = new_state(data.n_features)
    tot_plain = np.zeros(2)
    want = online_pass(data.indptr, data.indices, data.values, np.zeros(0, np.int64), data.labels,
                       np.ones(data.n_rows, np.float32), order, plain, tot_plain, LOGISTIC, 0.5, True, 0, data.n_rows, 0.0, 0.0)
    hot = _hot(data, 1)
    shard = Shard.from_csr(copy_data(data))
    with RowThreads(1) as threads:
        hot.relabel(shard, threads)
    state = hot.extended_table()
    hot.seed(state)
    tot = np.zeros(2)
    got = online_pass(shard.indptr, shard.indices, data.values, np.zeros(0, np.int64), data.labels,
                      np.ones(data.n_rows, np.float32), order, state, tot, LOGISTIC, 0.5, True, 0, data.n_rows, 0.0, 0.0,
                      0.0, *hot.kernel_args(0))
    hot.merge(state)
    assert got == want
    np.testing.assert_array_equal(tot, tot_plain)
    np.testing.assert_array_equal(state[: data.n_features + 1], plain)


@pytest.mark.parametrize("solver", ["online", "hybrid"])
def test_two_threads_on_data_handed_over_give_it_back_and_track_one_thread(solver):
    """The replicas are in use (T = 2, consume_data): the data's feature ids are those it had
    before. Stated tolerance (online, one pass over 6000 rows): the progressive loss within 5%
    of T = 1's and the objective within 3% (each thread learns the hot features from its own
    half of the rows until the merge, as ranks do until they average), both far below the
    all-zero model's (log 2). The hybrid reaches T = 1's optimum."""
    data = _skewed(n=6000, seed=2)
    params = dict(solver=solver, passes=1 if solver == "online" else 60, l2=1e-3, early_stop_passes=0, tol=1e-12)
    one = train_local(copy_data(data), SolverParams(threads=1, **params))
    handed = copy_data(data)
    two = train_local(handed, SolverParams(threads=2, **params), consume_data=True)
    if solver == "online":
        np.testing.assert_array_equal(handed.indices, data.indices)
        assert two.history[0]["progressive_loss"] == pytest.approx(one.history[0]["progressive_loss"], rel=0.05)
        assert two.objective == pytest.approx(one.objective, rel=0.03)
        assert two.objective < 0.8 * np.log(2.0)
    else:  # L-BFGS renumbers a handed-over index array in place: its optimum is the check
        assert two.objective == pytest.approx(one.objective, rel=1e-7)


def test_hybrid_with_replicas_reaches_sklearns_optimum():
    data = dataclasses.replace(planted_problem(n=3000, d=80, density=0.1, seed=4))
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    res = train_local(copy_data(data), SolverParams(solver="hybrid", l2=l2, threads=2, tol=1e-12, passes=200),
                      consume_data=True)
    assert res.history[0]["phase"] == "online"
    assert res.objective == pytest.approx(f_sk, rel=1e-6)


def test_a_regularization_path_on_data_handed_over_uses_the_replicas_and_gives_the_ids_back(monkeypatch):
    """train.l2 = auto's online phase (step 0) relabels the data for its duration and gives the ids
    back: the L-BFGS steps then number the original ids (their shared table, in place)."""
    import terascale.solvers.hot as hot_module

    calls = []
    relabel = hot_module.HotReplicas.relabel
    monkeypatch.setattr(hot_module.HotReplicas, "relabel", lambda self, *a: (calls.append(1), relabel(self, *a))[1])
    data = _skewed(n=3000, seed=5)
    holdout = _skewed(n=600, seed=6)
    handed = copy_data(data)
    res = train_local(handed, SolverParams(solver="hybrid", l2="auto", threads=2, passes=20, early_stop_passes=0),
                      holdout=holdout, consume_data=True)
    assert calls and np.isfinite(res.objective)
    np.testing.assert_array_equal(handed.indices, local_numbers(data))
