"""The three value layouts of a shard (solvers.kernels.values): binary, binary with exceptions
and dense give the same bits in every solver, pass and prediction, and read_shard/MemorySink
pick the compact layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from terascale.pipeline.shard_sink import MemorySink
from terascale.solvers.api import SolverParams
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.values import dense, exceptions
from terascale.solvers.predict import decision_function
from tests.solvers.helpers import planted_problem, train_local


def _mostly_ones(seed: int, n: int = 500, d: int = 60, rate: float = 0.02) -> CSRData:
    """Binary click-like rows where a few entries hold a count of 2 or 3 (bucket collisions)."""
    base = planted_problem(n=n, d=d, density=0.12, seed=seed)
    rng = np.random.default_rng(seed)
    vals = np.ones(base.nnz, np.float32)
    hit = rng.random(base.nnz) < rate
    vals[hit] = rng.choice([2.0, 3.0], int(hit.sum()))
    return dataclasses.replace(base, values=vals)


def _layouts(data: CSRData) -> dict[str, CSRData]:
    v, p = exceptions(data.values)
    out = {"dense": data, "exceptions": dataclasses.replace(data, values=v, vpos=p)}
    if p.size == 0:
        out["binary"] = dataclasses.replace(data, values=np.zeros(0, np.float32))
    return out


@pytest.mark.parametrize("solver", ["online", "lbfgs", "hybrid"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_layouts_train_the_same_model_bit_for_bit(solver, shuffle):
    data = _mostly_ones(seed=3)
    layouts = _layouts(data)
    assert layouts["exceptions"].vpos.size > 0
    params = SolverParams(solver=solver, passes=4, l2=1e-3, shuffle=shuffle)
    held = np.arange(data.n_rows) % 7 == 0
    results = {}
    for name, d in layouts.items():
        tr, ho = d.split_held_out(held)
        results[name] = train_local(tr, params, holdout=ho)
    ref = results["dense"]
    for r in results.values():
        assert r.weights.tobytes() == ref.weights.tobytes()
        assert r.intercept == ref.intercept and r.objective == ref.objective


def test_binary_layout_equals_dense_ones():
    data = _mostly_ones(seed=5, rate=0.0)
    layouts = _layouts(data)
    assert set(layouts) == {"dense", "exceptions", "binary"}
    params = SolverParams(solver="hybrid", passes=4, l2=1e-3)
    a, b = (train_local(layouts[k], params) for k in ("dense", "binary"))
    assert a.weights.tobytes() == b.weights.tobytes() and a.objective == b.objective


def test_predictions_and_row_selection_keep_the_values():
    data = _mostly_ones(seed=7, rate=0.05)
    layouts = _layouts(data)
    w = np.random.default_rng(0).normal(size=data.n_features)
    ref = decision_function(data, w, 0.25)
    mask = np.random.default_rng(1).random(data.n_rows) < 0.6
    want = data.take_rows(mask)
    for d in layouts.values():
        assert decision_function(d, w, 0.25).tobytes() == ref.tobytes()
        got = d.take_rows(mask)
        np.testing.assert_array_equal(got.full_values(), want.values)
        np.testing.assert_array_equal(got.indices, want.indices)
        assert got.to_scipy().toarray().tobytes() == want.to_scipy().toarray().tobytes()


def test_memory_sink_keeps_only_the_exceptions():
    data = _mostly_ones(seed=9, rate=0.01)
    lens = np.diff(data.indptr)
    sink = MemorySink(data.n_rows, data.nnz // 2)  # a low hint: the reserve must grow
    cut = data.n_rows // 3
    z = int(data.indptr[cut])
    sink.append(lens[:cut], data.indices[:z], None, data.labels[:cut], data.weights[:cut])
    sink.append(lens[cut:], data.indices[z:], data.values[z:], data.labels[cut:], data.weights[cut:])
    got = sink.finish(data.n_features)
    want_vals = data.values.copy()
    want_vals[:z] = 1.0  # the first rows came without values: all ones
    _, p = exceptions(want_vals)
    np.testing.assert_array_equal(got.vpos, p)
    np.testing.assert_array_equal(got.full_values(), want_vals)
    np.testing.assert_array_equal(got.indptr, data.indptr)
    assert got.values.size == p.size < data.nnz // 20


def test_memory_sink_turns_dense_when_exceptions_would_cost_more():
    data = planted_problem(n=200, d=30, seed=2)  # real values everywhere
    sink = MemorySink(data.n_rows, data.nnz)
    sink.append(np.diff(data.indptr), data.indices, data.values, data.labels, data.weights)
    got = sink.finish(data.n_features)
    assert got.vpos.size == 0 and got.values.tobytes() == data.values.tobytes()
    with pytest.raises(ValueError, match="rows appended"):
        MemorySink(1, 1).finish(4)


def test_dense_and_exceptions_round_trip():
    v = np.array([1, 2, 1, 1, 0.5, 1], np.float32)
    vals, pos = exceptions(v)
    assert pos.tolist() == [1, 4] and vals.tolist() == [2.0, 0.5]
    assert dense(vals, pos, 6).tolist() == v.tolist()
    assert dense(np.zeros(0, np.float32), np.zeros(0, np.int64), 3).tolist() == [1.0, 1.0, 1.0]
