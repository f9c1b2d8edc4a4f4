"""The threaded local solver (Snap ML scheme) reaches the sequential optimum, deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.catalogue import LOSSES
from terascale.solvers.scd import CocoaParams, train_cocoa
from tests.scd.helpers import dense_augmented, make_data

LAM = 1e-2
CASES = [(name, "dual") for name, spec in LOSSES.items() if spec.dual] + [("squared", "primal")]


def _fit(data, loss, formulation, threads, **kw):
    kw = {"bucket_size": 4, "tol": 1e-10, "max_rounds": 5000, **kw}
    params = CocoaParams(loss=loss, formulation=formulation, l2=LAM, threads=threads, **kw)
    states = []
    return train_cocoa(data, LocalCommunicator(), params, on_round_end=states.append), states


@pytest.mark.parametrize("loss, formulation", CASES)
def test_threads_reach_the_sequential_optimum(loss, formulation):
    data = make_data(loss, n=300, seed=21)
    seq, _ = _fit(data, loss, formulation, 1)
    for threads in (2, 3):  # 3 partitions on 2 numba threads: more partitions than cores
        par, states = _fit(data, loss, formulation, threads)
        assert par.converged and par.gap < 1e-9
        assert par.primal == pytest.approx(seq.primal, rel=1e-8)
        bound = np.sqrt(2.0 * (par.gap + seq.gap) / LAM)
        assert np.abs(par.weights - seq.weights).max() <= bound + 1e-6
        if formulation == "dual":  # no drift: the merged shared vector is still w(alpha)
            last = states[-1]
            x = dense_augmented(data, 1.0)
            c = data.weights.astype(np.float64)
            w_alpha = x.T @ (c * last.local) / (LAM * c.sum())
            np.testing.assert_allclose(last.shared, w_alpha, rtol=0, atol=1e-12)


def test_threaded_runs_are_reproducible():
    data = make_data("logistic", n=300, seed=22)
    a, _ = _fit(data, "logistic", "dual", 2, max_rounds=7)
    b, _ = _fit(data, "logistic", "dual", 2, max_rounds=7)
    assert a.weights.tobytes() == b.weights.tobytes() and a.rounds == b.rounds == 7


def test_bucket_larger_than_the_shard():
    data = make_data("logistic", n=50, seed=23)
    res, _ = _fit(data, "logistic", "dual", 2, bucket_size=64)  # one bucket: one busy partition
    seq, _ = _fit(data, "logistic", "dual", 1)
    assert res.converged and res.primal == pytest.approx(seq.primal, rel=1e-8)


@pytest.mark.parametrize("n, bucket", [(103, 8), (96, 8), (50, 1), (5, 16)])
def test_sequential_order_is_a_permutation_of_whole_buckets(n, bucket):
    """The sequential solver's epoch order: every coordinate once, in runs of ``bucket``
    consecutive coordinates (the last run shorter), the runs shuffled; bucket 1 = a plain
    permutation. Same seed, same order."""
    from terascale.solvers.scd.local_solver import _Schedule, epoch_rng

    sched = _Schedule(n, 1, bucket)
    order = sched.order(epoch_rng(0, 0, 1, 0))
    assert np.array_equal(np.sort(order), np.arange(n))
    same = np.diff(order // bucket) == 0
    assert np.count_nonzero(~same) == sched.n_buckets - 1  # every bucket is one run
    assert np.all(np.diff(order)[same] == 1)  # in storage order
    assert np.array_equal(order, sched.order(epoch_rng(0, 0, 1, 0)))
    if n >= 50:
        assert not np.array_equal(order, np.arange(n))  # shuffled


@pytest.mark.skipif(__import__("numba").config.NUMBA_NUM_THREADS < 2,
                    reason="numba runs on one thread here")
def test_threaded_gap_pass_equals_the_sequential_one_for_any_thread_count():
    from terascale.solvers.scd.dual_kernels import dual_objective_sums, dual_objective_sums_chunked
    from terascale.solvers.scd.local_solver import numba_threads
    from terascale.solvers.scd.losses import LOGISTIC

    data = make_data("logistic", n=301, seed=5)
    rng = np.random.default_rng(3)
    alpha = np.where(data.labels > 0.5, 1.0, -1.0) * rng.uniform(0.01, 0.99, data.n_rows)
    w = rng.normal(size=data.n_features + 1)
    args = (data.indptr, data.indices, data.values, data.labels, data.weights, alpha, w, LOGISTIC,
            1.0, data.n_features)
    want = dual_objective_sums(*args)
    got = []
    for threads in (1, 2):
        with numba_threads(threads):
            got.append(dual_objective_sums_chunked(*args, 64))
    assert got[0] == got[1]  # bit for bit: the chunks, not the threads, fix the order
    np.testing.assert_allclose(got[0], want, rtol=1e-13)
    assert dual_objective_sums_chunked(*args, 1) == want  # one chunk: the sequential sum
