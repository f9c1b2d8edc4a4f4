"""Threads per rank (``train.threads``, :mod:`solvers.threads`): the block partition, the pass
driver (progress from the calling thread, errors, abandoning), the fixed-order reductions of the
gradient, Hessian, curvature, coarse and held-out passes against the kernels called block by
block (bit for bit, and the same bits on every run), L-BFGS with T = 2 and 3 threads at
scikit-learn's optimum on one rank and on two ranks over real sockets, and the Hogwild online
pass against the single-thread pass."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import terascale.solvers.online as online_module
import terascale.solvers.shard as shard_module
from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.active import ActiveFeatures
from terascale.solvers.api import SolverParams, train
from terascale.solvers.kernels import coarse as KC
from terascale.solvers.kernels import objective as K
from terascale.solvers.kernels.values import exceptions
from terascale.solvers.local_table import LocalTable
from terascale.solvers.objective import DistributedObjective, shard_sums, table_sums
from terascale.solvers.preconditioner import compact_groups
from terascale.solvers.setup import Inputs
from terascale.solvers.shard import Shard
from terascale.solvers.threads import SERIAL, RowThreads, split_positions, split_rows
from tests.solvers import helpers
from tests.solvers.helpers import (
    objective_np,
    planted_problem,
    sklearn_logistic,
    train_local,
    train_on_tree,
)

LOGISTIC = 0
TIGHT = {"tol": 1e-12, "passes": 200}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 97 rows: every block of a pass is walked in several chunks."""
    monkeypatch.setattr(shard_module, "CHUNK_ROWS", 97)


@pytest.fixture(scope="module")
def problem():
    return planted_problem(n=2000, d=300, density=0.03, seed=5, weighted=True)


def _work(indptr: np.ndarray, lo: int, hi: int) -> int:
    return int(indptr[hi] - indptr[lo]) + (hi - lo)


# ---------------------------------------------------------------------------------------------
# The partition.


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_blocks_cover_the_rows_in_order_with_balanced_work(problem, parts):
    indptr = Shard.from_csr(problem).indptr
    cuts = split_rows(indptr, parts)
    assert cuts[0] == 0 and cuts[-1] == problem.n_rows and np.all(np.diff(cuts) >= 0)
    assert len(cuts) == parts + 1
    total = _work(indptr, 0, problem.n_rows)
    longest = int(np.max(np.diff(indptr))) + 1
    for i in range(parts):
        assert abs(_work(indptr, cuts[i], cuts[i + 1]) - total / parts) <= longest + 1
    np.testing.assert_array_equal(split_rows(indptr, parts), cuts)  # deterministic
    # a sub-range, and more blocks than rows (empty blocks)
    sub = split_rows(indptr, parts, 10, 50)
    assert sub[0] == 10 and sub[-1] == 50 and np.all(np.diff(sub) >= 0)
    tiny = split_rows(indptr[:4], 7)
    assert tiny[0] == 0 and tiny[-1] == 3 and np.all(np.diff(tiny) >= 0)


def test_positions_of_a_permutation_are_cut_by_their_rows_work(problem):
    indptr = Shard.from_csr(problem).indptr
    order = np.random.default_rng(1).permutation(problem.n_rows).astype(np.int64)
    cuts = split_positions(indptr, order, 3)
    assert cuts[0] == 0 and cuts[-1] == problem.n_rows and np.all(np.diff(cuts) > 0)
    row_work = np.diff(indptr)[order] + 1
    per_block = [int(row_work[cuts[i]:cuts[i + 1]].sum()) for i in range(3)]
    assert max(per_block) - min(per_block) <= 2 * int(row_work.max())
    assert list(split_positions(indptr, order[:0], 3)) == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# The pass driver.


def test_progress_comes_from_the_calling_thread_and_is_monotone():
    seen: list[tuple[int, int]] = []
    workers: set[int] = set()
    cuts = np.array([0, 40, 100, 130])

    def work(i, lo, hi, tick):
        workers.add(threading.get_ident())
        for a in range(lo, hi, 10):
            tick(min(a + 10, hi) - lo)
        return i

    with RowThreads(3) as threads:
        assert threads.run(work, cuts, lambda rows: seen.append((threading.get_ident(), rows))) == [0, 1, 2]
    assert {t for t, _ in seen} == {threading.get_ident()}
    rows = [r for _, r in seen]
    assert rows == sorted(rows) and rows[-1] == 130
    assert threading.get_ident() not in workers


def test_abandoning_a_pass_stops_every_block_and_the_pool_serves_the_next_pass():
    """Each block ticks until a tick raises: it waits at its 60th row until the calling thread
    has given up (more than 50 rows in all), so no block can finish first, whatever the
    scheduling; both must then be stopped by their ticks."""
    started = threading.Barrier(2, timeout=30)
    gave_up = threading.Event()
    ended = [None, None]

    def work(i, lo, hi, tick):
        started.wait()
        n = 0
        try:
            while True:  # only a tick that raises ends it: the pass was abandoned
                n += 1
                tick(n)
                if n == 60:
                    assert gave_up.wait(30), "the calling thread never gave up"
        except BaseException as e:
            ended[i] = type(e).__name__
            raise

    def give_up(rows):
        if rows > 50:
            gave_up.set()
            raise KeyboardInterrupt("stand down")

    with RowThreads(2) as threads:
        with pytest.raises(KeyboardInterrupt, match="stand down"):
            threads.run(work, np.array([0, 1, 2]), give_up)
        assert ended == ["_Stopped", "_Stopped"]  # both blocks stopped by their ticks
        assert threads.run(lambda i, lo, hi, tick: (lo, hi), np.array([0, 5, 9])) == [(0, 5), (5, 9)]


def test_a_blocks_error_is_raised_after_every_block_ended():
    def work(i, lo, hi, tick):
        if i == 1:
            raise ValueError("block 1 failed")
        for r in range(lo, hi):
            tick(r - lo + 1)
        return i

    with RowThreads(3) as threads, pytest.raises(ValueError, match="block 1 failed"):
        threads.run(work, np.array([0, 1000, 2000, 3000]), lambda rows: None)


def test_one_thread_runs_on_the_caller_without_a_pool(problem):
    s = Shard.from_csr(problem)
    before = threading.active_count()
    grad = np.zeros(s.n_features + 1)
    counts = []
    shard_sums(s, np.zeros(s.n_features + 1), LOGISTIC, grad, on_rows=lambda r: counts.append(threading.active_count()))
    assert counts and set(counts) == {before}
    assert SERIAL._pool is None


# ---------------------------------------------------------------------------------------------
# Gradient, Hessian, curvature, coarse: the block-by-block reference, bit for bit.


def _theta(n_features: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.3, n_features + 1)


def _reference_sums(s: Shard, theta: np.ndarray, parts: int):
    """Each block's kernel call into arrays of its own, then added in block order."""
    cuts = split_rows(s.indptr, parts)
    loss, grad, hess = 0.0, None, None
    for i in range(parts):
        g, h = np.zeros(s.n_features + 1), np.zeros(s.n_features + 1)
        total, status, _ = K.loss_grad_hess(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, theta, LOGISTIC,
                                            g, h, int(cuts[i]), int(cuts[i + 1]), 0.0)
        assert status == K.OK
        if i == 0:
            loss, grad, hess = total, g, h
        else:
            loss += total
            grad += g
            hess += h
    return loss, grad, hess


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_gradient_and_hessian_sums_are_the_block_order_reduction(problem, small_chunks, parts):
    s = Shard.from_csr(problem)
    theta = _theta(s.n_features)
    ref = _reference_sums(s, theta, parts)
    with RowThreads(parts) as threads:
        runs = []
        for _ in range(2):
            g, h = np.zeros(s.n_features + 1), np.zeros(s.n_features + 1)
            rows = []
            loss, problem_ = shard_sums(s, theta, LOGISTIC, g, h, rows.append, threads)
            assert problem_ is None and rows[-1] == s.n_rows and rows == sorted(rows)
            runs.append((loss, g, h))
            held = shard_sums(s, theta, LOGISTIC, threads=threads)  # the held-out pass: loss only
            assert held == (loss, None)
    for loss, g, h in runs:  # the same bits on every run, and the reference's
        assert loss == ref[0]
        np.testing.assert_array_equal(g, ref[1])
        np.testing.assert_array_equal(h, ref[2])
    one = _reference_sums(s, theta, 1)
    assert runs[0][0] == pytest.approx(one[0], rel=1e-12)
    np.testing.assert_allclose(runs[0][1], one[1], rtol=1e-10, atol=1e-12)


def _table(problem, theta):
    s = Shard.from_csr(problem)
    table = LocalTable(s)
    space = ActiveFeatures(np.arange(s.n_features, dtype=np.int64), s.n_features)
    table.bind(space)
    return s, table, space


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_working_tables_passes_give_the_shards_bits_for_any_threads(problem, small_chunks, parts):
    """The local numbering changes where a sum is stored, never the order of additions: the
    table's threaded pass has the bits of the shard's threaded pass, on every run."""
    theta = _theta(problem.n_features)
    s, table, space = _table(problem, theta)
    ref = _reference_sums(Shard.from_csr(problem), theta, parts)
    with RowThreads(parts) as threads:
        for with_hessian in (True, False, True):
            g, h = np.zeros(s.n_features + 1), np.zeros(s.n_features + 1) if with_hessian else np.zeros(0)
            loss, bad = table_sums(table, space.compact(theta), LOGISTIC, g, h, None, threads)
            assert bad is None and loss == ref[0]
            np.testing.assert_array_equal(g, ref[1])
            if with_hessian:
                np.testing.assert_array_equal(h, ref[2])
    assert (len(table._threads.get(2, [])) == parts - 1) if parts > 1 else not table._threads


@pytest.mark.parametrize("parts", [2, 3])
def test_curvature_and_coarse_sums_are_the_block_order_reduction(problem, parts):
    theta = _theta(problem.n_features)
    p = _theta(problem.n_features, seed=9)
    s, table, space = _table(problem, theta)
    cuts = split_rows(table.shard.indptr, parts)
    for stride in (1, 2):
        table.load_direction(theta, p)
        ref = np.zeros(2)
        for i in range(parts):
            mine = np.zeros(2)
            assert K.curvature_along(table.shard.indptr, table.shard.indices, table.shard.values, table.shard.vpos, table.shard.labels,
                                     table.shard.weights, table._current, LOGISTIC, int(cuts[i]), int(cuts[i + 1]),
                                     stride, mine)[0] == K.OK
            ref += mine
        with RowThreads(parts) as threads:  # through the objective's pass (the one L-BFGS calls)
            inputs = Inputs(0, problem, None, "logistic")
            inputs.agree(LocalCommunicator())
            objective = DistributedObjective(inputs, LocalCommunicator(), LOGISTIC, 0.0, threads=threads).restricted(table)
            rows = problem.n_rows // 2 if stride == 2 else 0
            values = [objective.curvature(theta, p, rows) for _ in range(2)]
            assert values[0] == values[1]
            acc = ref[0] * (s.weight_sum() / ref[1]) if stride > 1 else ref[0]
            assert values[0] == acc / inputs.total_weight
    # the coarse matrix: one kernel call per block into its own matrix, added in block order
    groups = (np.arange(problem.n_features) % 5).astype(np.uint8)
    group, _ = compact_groups(groups, space.ids)
    local_group = group[table.compact_of]
    k = 6
    ref_e, used = np.zeros((k, k)), 0.0
    table.load(space.compact(theta), False)
    for i in range(parts):
        e = np.zeros((k, k))
        u, status, _ = KC.coarse_rows(table.shard.indptr, table.shard.indices, table.shard.values, table.shard.vpos, table.shard.labels,
                                      table.shard.weights, table._current, local_group, 5, LOGISTIC, int(cuts[i]),
                                      int(cuts[i + 1]), 1, e)
        assert status == KC.OK
        ref_e, used = (e, u) if i == 0 else (ref_e + e, used + u)
    ref_e *= s.weight_sum() / used
    with RowThreads(parts) as threads:
        for _ in range(2):
            E = np.zeros((k, k))
            assert table.coarse_sums(space.compact(theta), group, 5, LOGISTIC, 1, E, threads) is None
            np.testing.assert_array_equal(E, ref_e)


# ---------------------------------------------------------------------------------------------
# Solvers.


@pytest.mark.parametrize("threads", [2, 3])
def test_lbfgs_with_threads_reaches_sklearns_optimum_with_the_same_bits_every_run(threads):
    data = planted_problem(n=800, d=60, seed=21)
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    params = SolverParams(solver="lbfgs", l2=l2, threads=threads, **TIGHT)
    runs = [train_local(data, params) for _ in range(2)]
    res = runs[0]
    assert res.objective == pytest.approx(f_sk, rel=1e-6)
    assert res.objective <= f_sk * (1 + 1e-9)
    np.testing.assert_allclose(res.weights, coef, atol=2e-3 * max(1.0, np.abs(coef).max()))
    assert res.intercept == pytest.approx(b, abs=2e-3)
    np.testing.assert_array_equal(runs[1].weights, res.weights)
    assert runs[1].intercept == res.intercept and runs[1].objective == res.objective
    assert [e["objective"] for e in runs[1].history] == [e["objective"] for e in res.history]


@pytest.mark.parametrize("threads", [2, 3])
def test_two_ranks_with_threads_reach_the_optimum_identically_on_every_rank(threads):
    data = planted_problem(n=900, d=50, seed=8)
    hold = planted_problem(n=200, d=50, seed=9)
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    groups = (np.arange(50) % 4).astype(np.uint8)
    params = SolverParams(solver="lbfgs", l2=l2, threads=threads, early_stop_passes=0, **TIGHT)
    runs = [train_on_tree(helpers.split_rows(data, 2), params, holdouts=helpers.split_rows(hold, 2), groups=groups)
            for _ in range(2)]
    for results in runs:
        r0, r1 = results
        np.testing.assert_array_equal(r0.weights, r1.weights)
        assert r0.objective == r1.objective and r0.history[-1]["holdout_loss"] == r1.history[-1]["holdout_loss"]
        assert r0.objective == pytest.approx(f_sk, rel=1e-6)
        assert r0.history[0]["coarse_groups"] == 4
    np.testing.assert_array_equal(runs[0][0].weights, runs[1][0].weights)  # the same bits every run
    assert [e["holdout_loss"] for e in runs[0][0].history] == [e["holdout_loss"] for e in runs[1][0].history]


def test_hybrid_with_two_threads_reaches_the_optimum():
    data = planted_problem(n=800, d=60, seed=21)
    l2 = 1e-3
    coef, b = sklearn_logistic(data, l2)
    f_sk = objective_np(data, coef, b, l2)
    res = train_local(data, SolverParams(solver="hybrid", l2=l2, threads=2, **TIGHT))
    assert res.history[0]["phase"] == "online"
    assert res.objective == pytest.approx(f_sk, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Hogwild.


def _online(data, threads: int, passes: int, shuffle: bool = False, monkeypatch=None):
    calls: set[int] = set()
    if monkeypatch is not None:  # record which threads ran the kernel
        kernel = online_module.online_pass

        def recording(*args):
            calls.add(threading.get_ident())
            return kernel(*args)

        monkeypatch.setattr(online_module, "online_pass", recording)
    res = train(data, LocalCommunicator(), SolverParams(solver="online", passes=passes, l2=1e-4, threads=threads,
                                                        shuffle=shuffle, early_stop_passes=0))
    if monkeypatch is not None:
        monkeypatch.undo()
    return res, calls


@pytest.mark.parametrize("shuffle", [False, True])
def test_hogwild_online_pass_tracks_the_single_thread_pass(small_chunks, monkeypatch, shuffle):
    """Stated tolerance: on a planted problem (6000 rows), T = 2's progressive loss of pass 1 is
    within 2% of T = 1's, and after 5 passes its objective within 1%; both are far below the
    all-zero model's (log 2). The kernel ran on two threads other than the caller's."""
    data = planted_problem(n=6000, d=200, density=0.05, seed=13)
    one, _ = _online(data, 1, 5, shuffle)
    two, callers = _online(data, 2, 5, shuffle, monkeypatch)
    assert len(callers) == 2 and threading.get_ident() not in callers
    p1, p2 = one.history[0]["progressive_loss"], two.history[0]["progressive_loss"]
    assert p2 == pytest.approx(p1, rel=0.02)
    assert two.objective == pytest.approx(one.objective, rel=0.01)
    assert two.objective < 0.8 * np.log(2.0)


def test_hogwild_pass_sees_every_row_once(small_chunks):
    """The blocks' increments of t = Σ h add up to the pass's total weight (every row once),
    shuffled or not; so does the progressive loss's weight."""
    data = planted_problem(n=3000, d=100, density=0.05, seed=3, weighted=True)
    total = float(np.sum(data.weights.astype(np.float64)))
    for shuffle in (False, True):
        res, _ = _online(data, 3, 2, shuffle)
        assert np.isfinite(res.objective) and len(res.history) == 2
        states = []
        train(data, LocalCommunicator(), SolverParams(solver="online", l2=1e-6, passes=1, threads=3, shuffle=shuffle),
              on_pass_end=states.append)
        assert states[0]["online_t"] == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("parts", [2, 3])
def test_threaded_sums_are_the_same_for_every_value_layout(small_chunks, parts):
    """Dense values, binary with exceptions, all ones (solvers.kernels.values): a block starting
    mid-shard finds its first exception itself, so each layout gives the dense layout's bits."""
    base = planted_problem(n=1500, d=200, density=0.04, seed=6)
    rng = np.random.default_rng(0)
    ones = np.where(rng.random(base.nnz) < 0.97, 1.0, 2.0).astype(np.float32)
    dense = dataclasses.replace(base, values=ones)
    vals, vpos = exceptions(ones)
    layouts = {"dense": dense, "exceptions": dataclasses.replace(dense, values=vals, vpos=vpos),
               "binary": dataclasses.replace(base, values=np.ones(base.nnz, np.float32))}
    layouts["binary_empty"] = dataclasses.replace(layouts["binary"], values=np.zeros(0, np.float32))
    theta = _theta(base.n_features)
    got = {}
    with RowThreads(parts) as threads:
        for name, data in layouts.items():
            s = Shard.from_csr(data)
            g, h = np.zeros(s.n_features + 1), np.zeros(s.n_features + 1)
            loss, bad = shard_sums(s, theta, LOGISTIC, g, h, None, threads)
            assert bad is None
            got[name] = (loss, g.tobytes(), h.tobytes())
    assert got["exceptions"] == got["dense"]
    assert got["binary_empty"] == got["binary"]
