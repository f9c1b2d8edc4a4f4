"""Dual CoCoA with the rows re-dealt to the ranks every round (``partition = "redeal"``):
real TreeNodes in threads on 127.0.0.1, against one rank and against fixed shards."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.data import CSRData
from terascale.solvers.scd import CocoaParams, train_cocoa
from terascale.solvers.scd.local_solver import _Schedule
from terascale.solvers.scd.redeal import gather_rows
from tests.scd.helpers import (
    make_data,
    model_vector,
    objective,
    run_and_resume,
    run_ranks,
    split_rows,
)

LAM = 1e-2


def _params(loss, **kw):
    kw = {"tol": 1e-8, "max_rounds": 3000, "partition": "redeal", **kw}
    return CocoaParams(loss=loss, l2=kw.pop("l2", LAM), **kw)


def _trace(result):
    return [(h["round"], h["primal"], h["dual"], h["gap"], h["gamma"]) for h in result.history]


@pytest.mark.parametrize("n, bucket, k", [(1, 1, 2), (17, 4, 2), (64, 8, 3), (1001, 8, 4), (5, 8, 4)])
def test_the_deal_gives_every_bucket_to_exactly_one_rank(n, bucket, k):
    s = _Schedule(n, 1, bucket)
    for rnd in (1, 2, 7):
        shares = [s.deal(3, rnd, r, k) for r in range(k)]
        together = np.sort(np.concatenate(shares))
        assert np.array_equal(together, np.arange(s.n_buckets))
        assert max(len(x) for x in shares) - min(len(x) for x in shares) <= 1
    assert not np.array_equal(s.deal(3, 1, 0, k), s.deal(3, 2, 0, k)) or s.n_buckets < 4


@pytest.mark.parametrize("values", ["real", "ones"])
def test_gather_rows_is_every_shard_in_rank_order(values):
    data = make_data("logistic", n=90, seed=51)
    if values == "ones":
        data = CSRData(data.indptr, data.indices, np.ones_like(data.values), data.labels,
                       data.weights, data.n_features)
    shards = split_rows(data, 3, empty=1)

    def body(shard, node):
        return gather_rows(shard, node), [c["op"] for c in node.stats()["calls"]]

    for got, ops in run_ranks(shards, body):
        for name in ("indptr", "indices", "values", "labels", "weights"):
            assert np.array_equal(getattr(got, name), getattr(data, name)), name
            assert getattr(got, name).dtype == getattr(data, name).dtype, name
        # per shard: row pointers, indices, labels, weights, and the values unless all are 1
        # (as they are in the empty shard)
        assert ops.count("broadcast") == (12 if values == "ones" else 14)


def test_every_rank_gathers_the_same_float32_rows_from_float64_input():
    """A shard handed over as float64 travels as float32; its own rank must use the same
    float32 values as the others (else the ranks would solve different problems)."""
    data = make_data("squared", n=60, seed=57)
    shards = []
    for lo, hi in ((0, 25), (25, 60)):
        a, b = data.indptr[lo], data.indptr[hi]
        shards.append(CSRData(data.indptr[lo:hi + 1] - a, data.indices[a:b],
                              data.values[a:b].astype(np.float64) / 3.0,
                              data.labels[lo:hi].astype(np.float64) / 3.0,
                              data.weights[lo:hi].astype(np.float64) / 3.0, data.n_features))
    assert shards[0].values.dtype == np.float64
    got = run_ranks(shards, lambda shard, node: gather_rows(shard, node))
    for name in ("values", "labels", "weights"):
        assert getattr(got[0], name).dtype == np.float32
        assert getattr(got[0], name).tobytes() == getattr(got[1], name).tobytes(), name


@pytest.mark.parametrize("loss", [name for name, spec in LOSSES.items() if spec.dual])
def test_k_ranks_reach_the_single_rank_optimum(loss):
    data = make_data(loss, n=200, seed=52)
    reference = train_cocoa(data, LocalCommunicator(), _params(loss, partition="fixed"))
    for k in (2, 3):
        results = run_ranks(split_rows(data, k), lambda shard, node: train_cocoa(shard, node, _params(loss)))
        first = results[0]
        for r in results[1:]:
            assert r.weights.tobytes() == first.weights.tobytes() and _trace(r) == _trace(first)
        assert first.converged and reference.converged
        assert first.primal == pytest.approx(reference.primal, rel=1e-7)
        bound = np.sqrt(2.0 * (first.gap + reference.gap) / LAM)
        assert np.abs(first.weights - reference.weights).max() <= bound + 1e-6


@pytest.mark.parametrize("max_rounds", [6, 3000])
def test_history_objectives_are_over_all_rows(max_rounds):
    """The gap pieces come from the dealt rows while rounds run and from fixed slices at a
    round-budget stop; either way the primal is the objective over all rows."""
    data = make_data("logistic", n=150, seed=53)
    res = run_ranks(split_rows(data, 2),
                    lambda shard, node: train_cocoa(shard, node, _params("logistic", max_rounds=max_rounds)))[0]
    assert res.converged == (max_rounds > 6)
    beta = model_vector(res)
    assert res.primal == pytest.approx(objective("logistic", data, beta, LAM), rel=1e-6)


def test_threads_inside_ranks():
    data = make_data("squared", n=200, seed=54)
    reference = train_cocoa(data, LocalCommunicator(), _params("squared", partition="fixed"))
    params = _params("squared", threads=2, bucket_size=4)
    results = run_ranks(split_rows(data, 2), lambda shard, node: train_cocoa(shard, node, params))
    res = results[0]
    assert res.converged and res.primal == pytest.approx(reference.primal, rel=1e-7)
    assert results[1].weights.tobytes() == res.weights.tobytes() and _trace(results[1]) == _trace(res)


def test_redeal_converges_where_fixed_shards_stall():
    """Small lam N (= 2) and shards from one distribution: with fixed shards the gap of two
    ranks decays sublinearly, with the rows re-dealt every round it decays like one rank's."""
    data = make_data("logistic", n=2000, d=40, density=0.3, seed=55)
    lam = 2.0 / data.n_rows
    rounds = {}
    for partition in ("fixed", "redeal"):
        params = _params("logistic", l2=lam, tol=1e-6, max_rounds=150, partition=partition)
        res = run_ranks(split_rows(data, 2), lambda shard, node, p=params: train_cocoa(shard, node, p))[0]
        rounds[partition] = res.rounds if res.converged else None
    one = train_cocoa(data, LocalCommunicator(), _params("logistic", l2=lam, tol=1e-6, max_rounds=150,
                                                          partition="fixed"))
    assert one.converged
    assert rounds["redeal"] is not None and rounds["redeal"] <= 2 * one.rounds
    assert rounds["fixed"] is None or rounds["fixed"] >= 3 * rounds["redeal"]


def test_resume_on_two_ranks():
    data = make_data("logistic", n=200, seed=56)
    params = _params("logistic", tol=1e-9, max_rounds=400)
    full, resumed, saved = run_and_resume(split_rows(data, 2), params, at_round=3)
    assert saved[0].local.shape == (data.n_rows,)  # every rank keeps every row's alpha
    assert np.array_equal(saved[0].local, saved[1].local)
    assert saved[0].shared.shape == (data.n_features + 1,)
    for a, b in zip(full, resumed, strict=True):
        assert a.weights.tobytes() == b.weights.tobytes() and _trace(a) == _trace(b)


def test_partition_is_checked():
    with pytest.raises(ValueError, match=r"cocoa.partition = 'shuffle': must be one of"):
        CocoaParams(partition="shuffle")
    with pytest.raises(ValueError, match=r"cocoa.partition = 'redeal': needs cocoa.partition = 'fixed' with formulation 'primal'"):
        CocoaParams(loss="squared", formulation="primal", partition="redeal")
