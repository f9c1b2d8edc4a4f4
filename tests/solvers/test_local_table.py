"""A rank's working table for the L-BFGS passes (solvers.local_table): its features in
first-use order, bound to the agreed compact numbering; the sums of a pass over it are bit for
bit those of the plain kernel over the compact-numbered shard, for every loss, with values,
weights, the Hessian diagonal, and an empty shard."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.active import ActiveFeatures
from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.features import number_by_first_use
from terascale.solvers.kernels.losses import LOSS_IDS
from terascale.solvers.local_table import LocalTable
from terascale.solvers.objective import shard_sums, table_sums
from terascale.solvers.shard import Shard
from tests.solvers.helpers import binary_rows, copy_data, objective_np, planted_problem, train_local


def _rows(rows: list[list[int]], n_features: int) -> Shard:
    return Shard.from_csr(binary_rows(rows, n_features))


def test_number_by_first_use_keeps_preset_slots_and_numbers_the_rest_in_order():
    slot = np.array([-1, 5, -1, -1, -1, 0], dtype=np.int32)  # 1 and 5 preset
    indices = np.array([4, 1, 0, 4, 5, 2, 0], dtype=np.int32)
    out = np.empty(7, dtype=np.int32)
    assert number_by_first_use(indices, slot, out, 6) == 9
    np.testing.assert_array_equal(out, [6, 5, 7, 6, 0, 8, 7])
    np.testing.assert_array_equal(slot, [7, 5, 8, -1, 6, 0])


def test_layout_is_first_use_and_binds_to_the_compact_numbering():
    shard = _rows([[9, 4], [7, 2], [2, 4], [1, 6], [2, 3]], 12)
    table = LocalTable(shard)
    np.testing.assert_array_equal(table.ids, [9, 4, 7, 2, 1, 6, 3])
    np.testing.assert_array_equal(table.shard.indices, [0, 1, 2, 3, 3, 1, 4, 5, 3, 6])
    np.testing.assert_array_equal(table.shard.indptr, shard.indptr)
    assert table.size == 7 and table.shard.n_features == 7
    space = ActiveFeatures(np.array([0, 1, 2, 3, 4, 6, 7, 9]), 12)  # another rank holds 0
    assert table.bind(space) is table
    np.testing.assert_array_equal(table.compact_of, [7, 4, 6, 2, 1, 5, 3])
    assert table.n_compact == 8
    with pytest.raises(ValueError, match="outside the agreed active set"):
        LocalTable(shard).bind(ActiveFeatures(np.array([2, 4]), 12))


@pytest.mark.parametrize("loss", sorted(LOSS_IDS))
def test_table_sums_are_bit_identical_to_the_compact_shard_pass(loss):
    data = planted_problem(n=700, d=90, density=0.08, seed=3, loss=loss, weighted=True)
    shard = Shard.from_csr(data)
    table = LocalTable(shard)
    space = ActiveFeatures.agree(LocalCommunicator(), table.ids, data.n_features, np.zeros(data.n_features + 1))
    table.bind(space)
    compact = Shard(shard.indptr, space.renumbered(shard.indices), shard.values, shard.labels,
                    shard.weights, space.size)
    theta = np.random.default_rng(1).normal(0.0, 0.7, space.size + 1)
    loss_id = LOSS_IDS[loss]
    for with_hess in (False, True, False):  # the tables of both widths
        ref_g, ref_h = np.zeros(space.size + 1), np.zeros(space.size + 1)
        got_g, got_h = np.zeros(space.size + 1), np.zeros(space.size + 1)
        hess_ref = ref_h if with_hess else np.zeros(0)
        hess_got = got_h if with_hess else np.zeros(0)
        ref = shard_sums(compact, theta, loss_id, ref_g, hess_ref)
        got = table_sums(table, theta, loss_id, got_g, hess_got)
        assert got == ref
        assert got_g.tobytes() == ref_g.tobytes()
        assert got_h.tobytes() == ref_h.tobytes()
    loss_only = table_sums(table, theta, loss_id)
    assert loss_only == ref


def test_features_of_other_ranks_keep_a_zero_gradient_and_an_empty_shard_works():
    space = ActiveFeatures(np.array([3, 1, 5]), 8)
    shard = _rows([[1], [1, 5]], 8)
    table = LocalTable(shard).bind(space)
    g = np.zeros(4)
    loss, problem = table_sums(table, np.array([0.5, -0.25, 2.0, 0.125]), LOSS_IDS["logistic"], g)
    assert problem is None and g[0] == 0.0 and g[1] != 0.0 and g[2] != 0.0
    empty = LocalTable(_rows([], 8)).bind(space)
    g = np.zeros(4)
    assert table_sums(empty, np.ones(4), LOSS_IDS["logistic"], g) == (0.0, None)
    assert not g.any() and empty.size == 0


def test_a_non_finite_margin_is_reported_with_its_row():
    space = ActiveFeatures(np.array([0, 1]), 2)
    table = LocalTable(_rows([[0], [1], [0, 1]], 2)).bind(space)
    _, problem = table_sums(table, np.array([0.0, np.inf, 0.0]), LOSS_IDS["logistic"], np.zeros(3))
    assert problem == "non-finite margin at row 1"


def test_an_in_place_table_numbers_like_a_copy_and_takes_over_the_indices():
    data = planted_problem(n=200, d=30, seed=71)
    shard = Shard.from_csr(copy_data(data))
    copy, own = LocalTable(Shard.from_csr(data)), LocalTable(shard, in_place=True)
    assert own.shard.indices is shard.indices
    assert own.shard.indices.tobytes() == copy.shard.indices.tobytes()
    assert own.ids.tobytes() == copy.ids.tobytes()


@pytest.mark.parametrize("solver", ["hybrid", "lbfgs"])
def test_consumed_data_train_to_the_same_bits(solver):
    """train(consume_data=True) renumbers the data's indices in place for L-BFGS's working table
    and gives the weights of a run on a copy, bit for bit."""
    data = planted_problem(n=400, d=30, seed=72, weighted=True)
    params = SolverParams(solver=solver, l2=1e-3, passes=10, tol=1e-12)
    kept = train_local(copy_data(data), params)
    handed = copy_data(data)
    got = train_local(handed, params, consume_data=True)
    assert got.weights.tobytes() == kept.weights.tobytes()
    assert got.intercept == kept.intercept and got.objective == kept.objective
    assert handed.indices.tobytes() != data.indices.tobytes()  # now the table's local numbers


def test_consumed_data_give_the_objective_of_an_early_stopped_online_pass():
    """Early stopping's best pass is the online one (held-out labels flipped: every fit makes
    them worse), whose objective the run computes at the end: through the working table when
    the data were consumed, the same number as over the shard."""
    data = planted_problem(n=300, d=30, seed=70)
    flip = CSRData(data.indptr, data.indices, data.values, 1.0 - data.labels, data.weights, data.n_features)
    params = SolverParams(solver="hybrid", l2=1e-3, passes=10, tol=1e-12, early_stop_passes=2)
    kept = train_local(copy_data(data), params, holdout=copy_data(flip))
    got = train_local(copy_data(data), params, holdout=copy_data(flip), consume_data=True)
    assert kept.stop_reason == got.stop_reason == "early_stop"
    assert kept.history[0]["holdout_loss"] < min(e["holdout_loss"] for e in kept.history[1:])
    assert got.weights.tobytes() == kept.weights.tobytes()
    want = objective_np(data, kept.weights, kept.intercept, 1e-3)
    assert got.objective == pytest.approx(want, rel=1e-12)
    assert kept.objective == pytest.approx(want, rel=1e-12)
