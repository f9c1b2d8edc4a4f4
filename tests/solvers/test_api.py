"""The train() contract the Spark task relies on: no collective before the first pass over the
data is done (the task joins the tree on its first collective), progress heartbeats during
passes, chunked passes equal to whole ones, warm starts, and the registry of parameters."""

from __future__ import annotations

import numpy as np
import pytest

import terascale.solvers.shard as solver_shard
from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.api import SolverParams, train
from tests.solvers.helpers import keep, planted_problem, train_local


class RecordingCommunicator(LocalCommunicator):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def allreduce(self, arr):
        self.events.append(("collective",))
        return super().allreduce(arr)

    def allreduce_scalars(self, values):
        self.events.append(("collective",))
        return super().allreduce_scalars(values)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(solver_shard, "CHUNK_ROWS", 37)


@pytest.mark.parametrize("solver", ["online", "lbfgs", "hybrid"])
def test_no_collective_before_the_first_pass_is_done(small_chunks, solver):
    data = planted_problem(n=200, d=10, seed=81)
    events = []
    train(data, RecordingCommunicator(events), SolverParams(solver=solver, l2=1e-6, passes=3),
          progress=lambda p, rows: events.append(("progress", p, rows)))
    first = events.index(("collective",))
    assert events[first - 1] == ("progress", 1, 200)
    pass1 = [e[2] for e in events[:first]]
    assert pass1 == [37, 74, 111, 148, 185, 200]
    assert all(e[1] >= 1 for e in events if e[0] == "progress")
    assert any(e[0] == "progress" and e[1] == 3 for e in events)


def test_progress_can_abandon_the_run():
    class StandDown(Exception):
        pass

    def progress(p, rows):
        raise StandDown(f"lost the race at pass {p}")

    with pytest.raises(StandDown, match="pass 1"):
        train_local(planted_problem(n=50, d=5, seed=82), SolverParams(), progress=progress)


@pytest.mark.parametrize("solver", ["online", "hybrid", "lbfgs"])
def test_chunked_passes_give_the_same_result(monkeypatch, solver):
    data = planted_problem(n=300, d=12, seed=83)
    params = SolverParams(solver=solver, passes=4, l2=1e-3, shuffle=True)
    whole = train_local(data, params)
    monkeypatch.setattr(solver_shard, "CHUNK_ROWS", 29)
    chunked = train_local(data, params)
    assert chunked.weights.tobytes() == whole.weights.tobytes()
    assert chunked.objective == whole.objective


def test_warm_start():
    data = planted_problem(n=300, d=12, seed=84)
    params = SolverParams(solver="lbfgs", l2=1e-3, tol=1e-10, passes=100)
    opt = train_local(data, params)
    again = train_local(data, params, init=(opt.weights, opt.intercept))
    assert again.passes < opt.passes / 2
    assert again.objective == pytest.approx(opt.objective, rel=1e-9)
    states = []
    train_local(data, SolverParams(solver="online", l2=1e-6, passes=1), init=(opt.weights, opt.intercept),
                on_pass_end=keep(states))
    # one online pass from the optimum stays close to it
    np.testing.assert_allclose(states[0]["weights"], opt.weights, atol=0.3)


def test_warm_start_is_checked():
    data = planted_problem(n=30, d=6, seed=85)
    with pytest.raises(ValueError, match="init: weights have length 5, the data 6 features"):
        train_local(data, SolverParams(), init=(np.zeros(5), 0.0))
    with pytest.raises(ValueError, match="not finite"):
        train_local(data, SolverParams(), init=(np.zeros(6), float("nan")))


def test_params_round_trip_and_defaults():
    p = SolverParams()
    assert (p.solver, p.loss, p.l2, p.passes, p.online_passes, p.learning_rate, p.lbfgs_memory,
            p.tol, p.early_stop_passes, p.seed) == ("hybrid", "logistic", "auto", 20, 1, 0.5, 15,
                                                    1e-7, 3, 0)
    assert SolverParams.from_json(p.to_json()) == p
