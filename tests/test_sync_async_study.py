"""The sync-versus-async study's bookkeeping (tests/benchmarks/bench_sync_async.py) on a tiny
generated problem: the within-1% epoch, the clocks, and the mini-batch baseline against the
online kernel and the online solver on 2 ranks, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.solvers.api import SolverParams
from terascale.solvers.kernels.online import W, new_state, online_pass
from terascale.solvers.shard import Shard
from tests.benchmarks import bench_sync_async as B
from tests.solvers.helpers import train_on_tree


@pytest.fixture(scope="module")
def problem():
    return B.smoke_data(rows=1500, d=120, seed=3)


def _kernel_passes(data, passes: int) -> np.ndarray:
    """``passes`` plain online passes: one kernel call over all rows each, one state, one [t, N]."""
    s = Shard.from_csr(data)
    state, totals = new_state(s.n_features), np.zeros(2)
    for _ in range(passes):
        online_pass(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, np.zeros(0, np.int64), state,
                    totals, 0, 0.5, True, 0, s.n_rows, 0.0, 0.0)
    return state


def test_first_within_is_the_first_epoch_at_or_below_the_bound():
    f = [2.0, 1.5, 1.0101, 1.0099, 1.02, 1.0]
    assert B.first_within(f, 1.0) == 4  # 1.0101 > 1.01, 1.0099 <= 1.01; the later rise does not matter
    assert B.first_within(f, 1.0, tol=0.5) == 2  # 1.5 <= 1.5
    assert B.first_within([1.0 * 1.01], 1.0) == 1  # equality counts
    assert B.first_within([3.0, 2.0], 1.0) is None
    assert B.first_within([], 1.0) is None


def test_study_bookkeeping(problem):
    data, holdout = problem
    chosen = [ln for ln in B.learners(epochs=3, lbfgs_epochs=8, cocoa_epochs=2, batch_rows=(200,))
              if ln.name in ("online", "minibatch-T2-b200", "lbfgs", "hybrid")]
    res = B.study(data, holdout, chosen, repeats=1, ref_passes=300, log=lambda s: None)
    f_star = res["f_star"]
    assert res["target"] == pytest.approx(1.01 * f_star, rel=1e-15)
    assert f_star == pytest.approx(res["reference"]["objective"], rel=1e-6)
    reached = {}
    for name, row in res["learners"].items():
        traj = row["trajectories"][0]
        f = traj["objective"]
        assert len(f) == len(traj["seconds"]) == len(traj["holdout_loss"]) == row["epochs_run"] > 0
        assert min(f) >= f_star
        # every epoch scored by the one shared function; times positive and increasing
        assert all(t > 0 for t in traj["seconds"])
        assert all(b > a for a, b in zip(traj["seconds"], traj["seconds"][1:], strict=False))
        first = next((i + 1 for i, v in enumerate(f) if v <= 1.01 * f_star), None)
        assert row["epochs_to_target"] == first
        reached[name] = first is not None
        if first is None:
            assert row["seconds_to_target"] is None and row["reached"] == [False]
        else:
            assert all(v > 1.01 * f_star for v in f[: first - 1])
            assert row["seconds_to_target"] == traj["seconds"][first - 1]
        assert row["seconds_per_epoch"] == pytest.approx(traj["seconds"][-1] / len(f))
    assert reached["lbfgs"] and not reached["online"]  # both branches exercised
    # the doc's table row of each learner says the same
    table = B.markdown({"sizes": {"1500": res}})
    for name, row in res["learners"].items():
        e = row["epochs_to_target"]
        line = next(x for x in table.splitlines() if f"`{name}`" in x)
        assert line.startswith("| 1,500 |")
        assert line.split(" | ")[3] == (f"{e:g}" if e is not None else f"not in {row['epochs_run']}")


def test_minibatch_one_thread_all_rows_is_one_plain_online_pass(problem):
    data, _ = problem
    for epochs in (1, 2):
        ref = _kernel_passes(data, epochs)
        assert np.array_equal(B.minibatch_epochs(data, 1, data.n_rows, epochs), ref)
        # consecutive batches of one thread are the same pass (the kernel carries its state)
        assert np.array_equal(B.minibatch_epochs(data, 1, 97, epochs), ref)


def test_minibatch_epoch_callback_gets_the_weights(problem):
    data, _ = problem
    seen = []
    final = B.minibatch_epochs(data, 2, 50, 2, on_epoch=lambda w, b: seen.append((w.copy(), b)))
    assert len(seen) == 2
    assert np.array_equal(seen[-1][0], final[:-1, W].astype(np.float64)) and seen[-1][1] == float(final[-1, W])


def test_minibatch_two_threads_one_round_is_the_online_solver_on_two_ranks(problem):
    """b ≥ the block: one round per epoch, then the G-weighted average = per-coordinate averaging
    of two ranks holding the same blocks (solvers.averaging), and the totals' mean: every epoch
    bit for bit."""
    data, _ = problem
    per_epoch = []
    B.minibatch_epochs(data, 2, data.n_rows, 3, on_epoch=lambda w, b: per_epoch.append((w.copy(), b)))
    states = {}  # pass -> (weights, intercept): the same on both ranks
    train_on_tree(B.shards_of(data, 2), SolverParams(solver="online", passes=3, l2=B.LAMBDA),
                  on_pass_end=lambda s: states.__setitem__(s["pass"], (s["weights"].copy(), s["intercept"])))
    assert sorted(states) == [1, 2, 3]
    for p, (w, b) in enumerate(per_epoch, start=1):
        assert np.array_equal(w, states[p][0]) and b == states[p][1], f"epoch {p}"


def test_minibatch_plain_average_is_the_mean_of_the_blocks_passes(problem):
    data, _ = problem
    state = B.minibatch_epochs(data, 2, data.n_rows, 1, weighting="plain")
    a, b = (_kernel_passes(s, 1) for s in B.shards_of(data, 2))
    touched = np.zeros(data.n_features + 1, dtype=bool)
    touched[np.unique(data.indices)] = True
    touched[-1] = True
    expected = np.where(touched, (a[:, W] + b[:, W]) / np.float32(2), a[:, W])
    assert np.array_equal(state[:, W], expected)


def test_minibatch_rejects_bad_arguments(problem):
    data, _ = problem
    with pytest.raises(ValueError, match="batch_rows = 0"):
        B.minibatch_epochs(data, 2, 0, 1)
    with pytest.raises(ValueError, match="weighting"):
        B.minibatch_epochs(data, 2, 10, 1, weighting="median")
