"""K ranks over real TreeNodes (threads on 127.0.0.1) against the single-process twin:
the same L-BFGS optimum for K = 1, 2, 4 (one rank empty too), bit-identical results on every
rank, and the online weighted average against a numpy reference of its formula."""

from __future__ import annotations

import time

import numpy as np
import pytest

from terascale.solvers.api import SolverParams, train
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.kernels.online import G, W, new_state, online_pass
from terascale.solvers.shard import Shard
from tests.allreduce.harness import run_tree
from tests.solvers.helpers import (
    TREE_NODE_KWARGS,
    keep,
    planted_problem,
    split_rows,
    train_local,
    train_on_tree,
)

L2 = 1e-3


def _assert_identical_on_all_ranks(results):
    first = results[0]
    for r, res in enumerate(results[1:], start=1):
        assert res.weights.tobytes() == first.weights.tobytes(), f"rank {r} weights differ"
        assert res.intercept == first.intercept and res.objective == first.objective, r
        assert res.history == first.history, f"rank {r} history differs"
        assert res.stop_reason == first.stop_reason


@pytest.fixture(scope="module")
def problem():
    return planted_problem(n=900, d=50, seed=31, weighted=True)


@pytest.fixture(scope="module")
def single(problem):
    return train_local(problem, SolverParams(solver="lbfgs", l2=L2, tol=1e-12, passes=200))


@pytest.mark.parametrize("k,empty", [(1, None), (2, None), (4, None), (4, 2)])
@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_same_optimum_for_any_number_of_ranks(problem, single, k, empty, solver):
    shards = split_rows(problem, k, empty_rank=empty)
    results = train_on_tree(shards, SolverParams(solver=solver, l2=L2, tol=1e-12, passes=200))
    _assert_identical_on_all_ranks(results)
    res = results[0]
    assert res.objective == pytest.approx(single.objective, rel=1e-10)
    np.testing.assert_allclose(res.weights, single.weights, rtol=1e-4, atol=1e-5)
    for entry in res.history:
        assert len(entry["compute_s"]) == len(entry["stall_s"]) == len(entry["transfer_s"]) == k
        assert min(entry["compute_s"] + entry["stall_s"] + entry["transfer_s"]) >= 0.0


def _local_first_pass(shard, params):
    s = Shard.from_csr(shard)
    state = new_state(shard.n_features)
    online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, np.zeros(0, np.int64), state,
                np.zeros(2), LOSS_IDS[params.loss], params.learning_rate, params.invariant, 0,
                s.n_rows, 0.0, 0.0)
    return state


def test_online_weighted_average_matches_the_formula(problem):
    """After one pass: w = Σ_k G_k⊙w_k / Σ_k G_k (0 where no rank has G), G = mean of G_k."""
    k = 3
    params = SolverParams(solver="online", l2=L2, passes=1)
    shards = split_rows(problem, k)
    states = []
    results = train_on_tree(shards, params, on_pass_end=keep(states))
    _assert_identical_on_all_ranks(results)
    local = [_local_first_pass(s, params).astype(np.float64) for s in shards]
    num = sum(st[:, G] * st[:, W] for st in local)
    den = sum(st[:, G] for st in local)
    expected = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    got = np.append(results[0].weights, results[0].intercept)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
    assert (got[den == 0] == 0).all()
    state = states[0]  # one callback per rank; all equal
    np.testing.assert_allclose(state["G"], den / k, rtol=1e-6)
    for other in states[1:]:
        assert other["G"].tobytes() == state["G"].tobytes()


def test_untouched_coordinates_stay_zero():
    data = planted_problem(n=200, d=30, seed=32)
    x = data.to_scipy().tolil()
    x[:, 7] = 0  # feature 7 never occurs
    from terascale.solvers.data import CSRData

    data = CSRData.from_scipy(x.tocsr(), data.labels, n_features=30)
    res = train_on_tree(split_rows(data, 2), SolverParams(solver="online", l2=1e-6, passes=2))[0]
    assert res.weights[7] == 0.0


def test_hybrid_with_holdout_bit_identical_on_every_rank(problem):
    holdout = planted_problem(n=300, d=50, seed=33)
    k = 4
    results = train_on_tree(split_rows(problem, k), SolverParams(l2=L2, passes=8),
                            holdouts=split_rows(holdout, k))
    _assert_identical_on_all_ranks(results)
    assert all("holdout_loss" in e for e in results[0].history)


def test_the_averaging_kernels_give_numpys_float32_bits():
    """pack_for_average / unpack_average compute in one pass what the float32 numpy formulas do
    over the rows ``ids`` and the intercept's: the same bits (products, quotients, 0 where
    Σ G = 0, G / K); the other rows are left as they are."""
    from terascale.solvers.kernels.online import pack_for_average, unpack_average

    rng = np.random.default_rng(40)
    state = rng.normal(size=(1000, 3)).astype(np.float32)
    state[:, G] = np.abs(state[:, G])
    state[::7, G] = 0.0
    ids = np.flatnonzero(rng.random(999) < 0.6)
    rows = np.append(ids, 999)
    n = rows.size
    buf = np.empty(2 * n, dtype=np.float32)
    pack_for_average(state, ids, buf)
    assert buf[:n].tobytes() == (state[rows, G] * state[rows, W]).tobytes()
    assert buf[n:].tobytes() == state[rows, G].tobytes()
    tot = (buf * np.float32(3.0)).astype(np.float32)
    out = state.copy()
    unpack_average(tot, out, ids, 3)
    want_w = np.zeros(n, dtype=np.float32)
    np.divide(tot[:n], tot[n:], out=want_w, where=tot[n:] > 0)
    assert out[rows, W].tobytes() == want_w.tobytes()
    assert out[rows, G].tobytes() == (tot[n:] / np.float32(3)).tobytes()
    others = np.setdiff1d(np.arange(1000), rows)
    assert out[others].tobytes() == state[others].tobytes()


def test_averaging_the_marked_rows_gives_the_bits_of_averaging_every_row():
    """Rows that are 0 (w and G) on every rank stay 0 either way: averaging only the features some
    rank marked (data, or non-zero state) leaves every rank's table as averaging all rows."""
    from terascale.solvers.kernels.online import mark_state, pack_for_average, unpack_average

    rng = np.random.default_rng(43)
    d1, k = 2001, 3
    states = []
    for r in range(k):
        st = rng.normal(size=(d1, 3)).astype(np.float32)
        st[:, G] = np.abs(st[:, G])
        st[rng.random(d1) < 0.5, :] = 0.0  # rows this rank never touched
        st[:300] = 0.0  # rows no rank touched
        st[5 + r, W] = 0.7  # a warm start's weight with no gradient
        st[5 + r, G] = 0.0
        states.append(st)
    marks = np.zeros(d1 - 1, dtype=np.uint8)
    for st in states:
        mark_state(st, marks)
    assert not marks[300:].all() and marks[5:5 + k].all()

    def averaged(ids):
        n = ids.size + 1
        bufs = [np.empty(2 * n, dtype=np.float32) for _ in range(k)]
        for st, buf in zip(states, bufs, strict=True):
            pack_for_average(st, ids, buf)
        tot = bufs[0] + bufs[1] + bufs[2]  # the same order for both
        outs = [st.copy() for st in states]
        for out in outs:
            unpack_average(tot, out, ids, k)
        return outs

    full = averaged(np.arange(d1 - 1))
    compact = averaged(np.flatnonzero(marks))
    for a, b in zip(full, compact, strict=True):
        assert a[:, :2].tobytes() == b[:, :2].tobytes()


def test_elapsed_all_counts_from_the_last_rank_start(problem):
    """A rank that starts 0.5 s late (a slow read): elapsed_s counts from the first rank's start,
    elapsed_all_s from the last one's, the same on every rank."""
    shards = split_rows(problem, 2)

    def body(node):
        if node.rank == 1:
            time.sleep(0.5)
        return train(shards[node.rank], node, SolverParams(solver="hybrid", l2=1e-3, passes=3))

    results = run_tree(2, body, node_kwargs=TREE_NODE_KWARGS, timeout=120.0).results
    assert results[0].history == results[1].history
    for e in results[0].history:
        assert 0.0 <= e["elapsed_all_s"] and e["elapsed_s"] - e["elapsed_all_s"] >= 0.45
