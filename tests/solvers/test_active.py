"""The L-BFGS phase's active feature set (solvers.active): agreed over ranks, in id order, exact compaction (features outside it stay exactly 0), and checkpoints with and
without the set."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.active import ActiveFeatures, _word_layout, agree_marks
from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.lbfgs import LBFGSPhase
from terascale.solvers.objective import DistributedObjective
from terascale.solvers.run import TrainRun
from terascale.solvers.setup import AgreeingCommunicator, Inputs
from terascale.solvers.shard import Shard
from terascale.solvers.state import check_resume
from terascale.solvers.tracker import PassTracker
from tests.allreduce.harness import run_tree
from tests.solvers.helpers import TREE_NODE_KWARGS, binary_rows, keep, planted_problem, train_local


def test_set_is_agreed_over_ranks_in_id_order():
    # features 2, 5, 7, 9, 1 occur on some rank; 4 only in the starting point
    shards = [binary_rows([[2, 7], [2, 5], [2, 7]], 12), binary_rows([[5, 9], [5, 2], [], [1]], 12)]
    theta0 = np.zeros(13)
    theta0[4] = 0.5
    theta0[-1] = 3.0  # the intercept is never a member: it stays last

    def body(node):
        local = np.unique(shards[node.rank].indices)
        return ActiveFeatures.agree(node, local, 12, theta0).ids

    ids = run_tree(2, body, node_kwargs=TREE_NODE_KWARGS, timeout=60.0).results
    assert [list(i) for i in ids] == [[1, 2, 4, 5, 7, 9]] * 2


@pytest.mark.parametrize("k", [1, 3])
def test_presence_marks_are_agreed_exactly_through_packed_digits(k):
    """agree_marks returns the union of the ranks' marks, for feature counts that do not fill the
    last word, features every rank marks (every digit at its largest, K) and features none
    marks."""
    n = 1001
    rng = np.random.default_rng(41 + k)
    marks = [(rng.random(n) < 0.3).astype(np.uint8) for _ in range(k)]
    for m in marks:
        m[:40] = 1  # marked by every rank: each digit K, each word (K+1)^m − 1
        m[40:80] = 0
    want = np.flatnonzero(np.bitwise_or.reduce(marks))

    def body(node):
        return agree_marks(node, marks[node.rank].copy())

    got = run_tree(k, body, node_kwargs=TREE_NODE_KWARGS, timeout=60.0).results
    for ids in got:
        np.testing.assert_array_equal(ids, want)


def test_presence_word_layout_keeps_every_sum_exact():
    """(K+1)^digits ≤ 2^24 for float32 words (2^53 for float64), and one more digit would not fit."""
    for k, digits in ((1, 24), (2, 15), (16, 5), (4095, 2), (4096, 1), ((1 << 24) - 1, 1)):
        base, got, dtype = _word_layout(k)
        assert (base, got, dtype) == (k + 1, digits, np.float32)
        assert base**got <= 1 << 24 < base ** (got + 1)
    assert _word_layout(1 << 24) == ((1 << 24) + 1, 2, np.float64)


def test_compact_expand_and_renumber():
    space = ActiveFeatures(np.array([6, 0, 3]), 8)
    theta = np.arange(9, dtype=np.float64) + 1.0
    np.testing.assert_array_equal(space.compact(theta), [7.0, 1.0, 4.0, 9.0])
    np.testing.assert_array_equal(space.expand(space.compact(theta)), [1, 0, 0, 4, 0, 0, 7, 0, 9])
    shard = Shard.from_csr(binary_rows([[0, 3], [6], [3, 6, 0]], 8))
    small = space.renumbered(shard.indices)
    assert small.dtype == np.int32
    np.testing.assert_array_equal(small, [1, 2, 0, 2, 0, 1])
    with pytest.raises(ValueError, match="outside the agreed active set"):
        space.renumbered(Shard.from_csr(binary_rows([[0, 5]], 8)).indices)


def _embedded(data: CSRData, n_features: int, seed: int) -> tuple[CSRData, np.ndarray]:
    """The same rows with feature j renamed to emb[j] (increasing) in a larger space."""
    rng = np.random.default_rng(seed)
    emb = np.sort(rng.choice(n_features, data.n_features, replace=False))
    return CSRData(data.indptr, emb[data.indices].astype(np.int32), data.values, data.labels,
                   data.weights, n_features), emb


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_empty_buckets_change_nothing_and_stay_zero(solver):
    """L-BFGS runs on the features that occur: spreading them over 64x more buckets (in the same
    id order) gives the same weights bit for bit, and exact zeros in the empty buckets."""
    data = planted_problem(n=500, d=40, seed=61)
    big, emb = _embedded(data, 40 * 64, seed=62)
    params = SolverParams(solver=solver, l2=1e-3, passes=12, tol=1e-12)
    small_res, big_res = train_local(data, params), train_local(big, params)
    assert big_res.weights[emb].tobytes() == small_res.weights.tobytes()
    rest = np.ones(big.n_features, bool)
    rest[emb] = False
    assert not big_res.weights[rest].any()
    assert big_res.intercept == small_res.intercept and big_res.objective == small_res.objective


def test_a_warm_start_outside_the_data_is_shrunk_to_the_optimum():
    """A feature with no rows but a non-zero initial weight is in the set, and L-BFGS drives it
    to its optimum 0 (the penalty is its only term)."""
    data = planted_problem(n=400, d=30, seed=63)
    big = CSRData(data.indptr, data.indices, data.values, data.labels, data.weights, 32)
    init = (np.r_[np.zeros(30), 0.0, 2.5], 0.0)
    params = SolverParams(solver="lbfgs", l2=1e-2, passes=100, tol=1e-10)
    res = train_local(big, params, init=init)
    cold = train_local(big, params)
    assert abs(res.weights[31]) < 1e-5 and res.weights[30] == 0.0
    assert res.objective == pytest.approx(cold.objective, rel=1e-9)


def test_the_hybrid_lbfgs_works_on_the_set_its_online_phase_averaged(monkeypatch):
    """After the online phase L-BFGS reuses the averaged set (no second agreement): the data's
    features and a warm start's feature outside the data, which the averaging set to 0 (no rank
    has a gradient for it) and L-BFGS keeps at 0; the result equals a run without that feature."""
    data = planted_problem(n=400, d=30, seed=66)
    big = CSRData(data.indptr, data.indices, data.values, data.labels, data.weights, 33)
    init = (np.r_[np.zeros(30), 0.0, 2.5, 0.0], 0.0)  # feature 31: no rows; 30, 32: none, 0

    def no_second_agreement(*args, **kwargs):
        raise AssertionError("L-BFGS agreed on a set of its own")

    monkeypatch.setattr(ActiveFeatures, "agree", no_second_agreement)
    params = SolverParams(solver="hybrid", l2=1e-3, passes=12, tol=1e-12)
    res = train_local(big, params, init=init)
    present = np.unique(data.indices).size
    assert res.history[1]["active_features"] == present + 1
    assert res.weights[31] == 0.0 and res.weights[30] == 0.0 and res.weights[32] == 0.0
    plain = train_local(big, params, init=(np.zeros(33), 0.0))
    assert plain.history[1]["active_features"] == present
    assert res.objective == pytest.approx(plain.objective, rel=1e-12)


def test_a_checkpoint_without_the_set_resumes_over_every_feature():
    """A state written before the phase was compacted (pairs over all features in id order, no
    ``lbfgs_active``) resumes and ends at the uninterrupted run's optimum."""
    data = planted_problem(n=400, d=30, seed=64)
    big, emb = _embedded(data, 48, seed=65)
    params = SolverParams(solver="lbfgs", l2=1e-3, passes=40, tol=1e-12)
    states = []
    full = train_local(big, params, on_pass_end=keep(states))
    old = dict(states[4], version=1)
    ids = old.pop("lbfgs_active")

    def widen(compact: np.ndarray, fill: float) -> np.ndarray:
        out = np.full(compact.shape[:-1] + (big.n_features + 1,), fill, dtype=compact.dtype)
        out[..., ids] = compact[..., :-1]
        out[..., -1] = compact[..., -1]
        return out

    old["lbfgs_S"], old["lbfgs_Y"] = widen(old["lbfgs_S"], 0.0), widen(old["lbfgs_Y"], 0.0)
    old["lbfgs_grad"] = widen(old["lbfgs_grad"], 0.0)
    old["lbfgs_inv_diag"] = widen(old["lbfgs_inv_diag"], 1.0 / params.l2)
    resumed = train_local(big, params, resume=old)
    assert resumed.objective == pytest.approx(full.objective, rel=1e-10)
    np.testing.assert_allclose(resumed.weights, full.weights, atol=1e-5)
    assert not np.delete(resumed.weights, emb).any()


def _lbfgs_run(data: CSRData, params: SolverParams, agreed: bool) -> TrainRun:
    """What ``train`` hands a solver, with the input agreement done already or not."""
    comm = LocalCommunicator()
    inputs = Inputs(0, data, None, params.loss)
    solver_comm = AgreeingCommunicator(comm, inputs)
    if agreed:
        inputs.agree(comm)
    loss_id = LOSS_IDS[params.loss]
    return TrainRun(solver_comm, params, inputs, loss_id,
                    DistributedObjective(inputs, solver_comm, loss_id, params.l2),
                    PassTracker(solver_comm, inputs, loss_id, 0))


def test_the_starting_point_is_the_same_whether_or_not_a_pass_came_first():
    """The start evaluated before the set is agreed (first pass) or after it (hybrid) gives the
    same bits: f with the penalty summed in compact order, the gradient and the preconditioner.
    A resumed hybrid run starts its L-BFGS phase on the first branch, the uninterrupted one on
    the second."""
    params = SolverParams(solver="lbfgs", l2=0.3)
    for seed in range(10):
        data, _ = _embedded(planted_problem(n=200, d=120, seed=70 + seed), 400, seed=seed)
        theta0 = np.zeros(data.n_features + 1)
        rng = np.random.default_rng(seed)
        theta0[np.unique(data.indices)] = rng.normal(size=np.unique(data.indices).size)
        theta0[-1] = 0.25
        first, later = (LBFGSPhase.start(_lbfgs_run(data, params, agreed), theta0) for agreed in (False, True))
        assert first.value == later.value, seed
        assert first.grad.tobytes() == later.grad.tobytes()
        assert first.precond.inv_diag.tobytes() == later.precond.inv_diag.tobytes()
        assert first.space.ids.tobytes() == later.space.ids.tobytes()


def test_resuming_on_rows_with_features_outside_the_saved_set_is_refused():
    data = planted_problem(n=300, d=30, seed=66)
    big = CSRData(data.indptr, data.indices, data.values, data.labels, data.weights, 40)
    params = SolverParams(solver="lbfgs", l2=1e-3, passes=6)
    states = []
    train_local(big, params, on_pass_end=keep(states))
    changed = big.indices.copy()
    changed[5] = 35  # a feature the run that wrote the state never saw
    other = CSRData(big.indptr, changed, big.values, big.labels, big.weights, 40)
    with pytest.raises(InvalidInputError, match=r"rank 0: resume state: this rank's training rows hold "
                                                r"features outside the state's active set"):
        train_local(other, params, resume=states[2])


def test_check_resume_reads_both_state_versions():
    data = planted_problem(n=100, d=10, seed=67)
    params = SolverParams(solver="lbfgs", l2=1e-3, passes=2)
    states = []
    train_local(data, params, on_pass_end=keep(states))
    assert states[-1]["version"] == 2
    for version in (1, 2):
        check_resume({**states[-1], "version": version}, params, 10)
    with pytest.raises(ValueError, match=r"resume state: version = 3: must be one of \(1, 2\)"):
        check_resume({**states[-1], "version": 3}, params, 10)
