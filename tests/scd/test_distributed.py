"""CoCoA across K ranks (real TreeNodes in threads on 127.0.0.1) against K = 1."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd import CocoaParams, train_cocoa
from tests.scd.helpers import make_data, run_ranks, split_rows

LAM = 1e-2


def _params(loss, formulation, **kw):
    kw = {"tol": 1e-8, "max_rounds": 3000, **kw}
    return CocoaParams(loss=loss, formulation=formulation, l2=LAM, **kw)


def _assert_identical_across_ranks(results):
    first = results[0]
    for r in results[1:]:
        assert r.weights.tobytes() == first.weights.tobytes()
        assert r.intercept == first.intercept and r.rounds == first.rounds
        assert [(h["primal"], h["dual"], h["gamma"]) for h in r.history] == [
            (h["primal"], h["dual"], h["gamma"]) for h in first.history
        ]


def _assert_same_optimum(result, reference):
    assert result.converged and reference.converged
    assert result.primal == pytest.approx(reference.primal, rel=1e-7)
    bound = np.sqrt(2.0 * (result.gap + reference.gap) / LAM)
    assert np.abs(result.weights - reference.weights).max() <= bound + 1e-6


@pytest.mark.parametrize(
    "loss, formulation",
    [(name, "dual") for name, spec in LOSSES.items() if spec.dual] + [("squared", "primal")],
)
def test_k_ranks_reach_the_single_rank_optimum(loss, formulation):
    data = make_data(loss, n=200, seed=31)
    params = _params(loss, formulation)
    reference = train_cocoa(data, LocalCommunicator(), params)
    for k in (2, 4):
        results = run_ranks(split_rows(data, k), lambda shard, node: train_cocoa(shard, node, params))
        _assert_identical_across_ranks(results)
        _assert_same_optimum(results[0], reference)
        for row in results[0].history:
            times = row["compute_s"] + row["stall_s"] + row["transfer_s"]
            assert len(times) == 3 * k and min(times) >= 0.0
        assert sum(sum(row["transfer_s"]) for row in results[0].history) > 0.0


@pytest.mark.parametrize("aggregation", ["adaptive", "add"])
def test_one_vector_allreduce_per_round(aggregation):
    """Ridge: every round is exactly one allreduce (the shared-vector update and every scalar
    for gamma and the gap); the set-up is one scalar allreduce."""
    data = make_data("squared", n=200, seed=35)
    params = _params("squared", "dual", aggregation=aggregation)

    def body(shard, node):
        result = train_cocoa(shard, node, params)
        return result, [call["op"] for call in node.stats()["calls"]]

    for result, ops in run_ranks(split_rows(data, 3), body):
        assert ops.count("allreduce_scalars") == 1 and ops.count("broadcast") == 0
        assert ops.count("allreduce") == result.rounds + 1  # + the message carrying the last gap


@pytest.mark.parametrize("aggregation", ["avg", "add", "adaptive"])
def test_every_aggregation_converges(aggregation):
    data = make_data("logistic", n=200, seed=32)
    params = _params("logistic", "dual", aggregation=aggregation, local_epochs=2)
    reference = train_cocoa(data, LocalCommunicator(), params)
    results = run_ranks(split_rows(data, 2), lambda shard, node: train_cocoa(shard, node, params))
    _assert_identical_across_ranks(results)
    _assert_same_optimum(results[0], reference)
    gammas = {h["gamma"] for h in results[0].history[1:]}
    if aggregation == "avg":
        assert gammas == {0.5}
    elif aggregation == "add":
        assert gammas == {1.0}
    else:
        assert len(gammas) > 1 and min(gammas) > 0.0


@pytest.mark.parametrize("loss, formulation", [("logistic", "dual"), ("squared", "primal")])
def test_an_empty_shard(loss, formulation):
    data = make_data(loss, n=150, seed=33)
    params = _params(loss, formulation)
    reference = train_cocoa(data, LocalCommunicator(), params)
    shards = split_rows(data, 3, empty=1)
    assert shards[1].n_rows == 0
    results = run_ranks(shards, lambda shard, node: train_cocoa(shard, node, params))
    _assert_identical_across_ranks(results)
    _assert_same_optimum(results[0], reference)


def test_threads_inside_ranks():
    """K = 2 ranks with 2 partitions each (hierarchical: CoCoA+ inside, CoCoA across)."""
    data = make_data("squared", n=200, seed=34)
    params = _params("squared", "dual", threads=2, bucket_size=4)
    reference = train_cocoa(data, LocalCommunicator(), _params("squared", "dual"))
    results = run_ranks(split_rows(data, 2), lambda shard, node: train_cocoa(shard, node, params))
    _assert_identical_across_ranks(results)
    _assert_same_optimum(results[0], reference)
