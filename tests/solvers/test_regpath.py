"""train.l2 = auto and train.l1 = auto: the regularization path (solvers.regpath) picks the λ with
the best held-out loss, is deterministic on every rank, resumes on the same λ, and refuses what
it cannot do."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import scipy.sparse as sp

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.api import SolverParams, train
from terascale.solvers.catalogue import AUTO_PENALTIES
from terascale.solvers.constraints import ConfigError
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError
from terascale.solvers.regpath import PATHS, PathRule, choose, step_holdout
from terascale.solvers.state import copy_state
from tests.allreduce.harness import run_tree
from tests.solvers.helpers import (
    TREE_NODE_KWARGS,
    copy_data,
    keep,
    local_numbers,
    loss_np,
    objective_np,
    planted_problem,
    row_slice,
    split_rows,
    train_local,
    train_on_tree,
)
from tests.solvers.test_api import RecordingCommunicator

LAMBDAS = PATHS["l2"].values()
# converged fits: every λ reaches its optimum whatever it starts from
CONVERGED = {"solver": "lbfgs", "l2": "auto", "early_stop_passes": 0, "tol": 1e-10, "passes": 300}


def scaled_problem(c: float = 0.03, n: int = 3000, d: int = 300, seed: int = 11) -> tuple[CSRData, CSRData]:
    """(training rows, held-out rows) of a planted problem whose feature values are scaled by c:
    λ acts as λ/c², which puts the best held-out λ inside the path (about its 5th value)."""
    data = planted_problem(n=n, d=d, density=0.03, seed=seed)
    data = CSRData(data.indptr, data.indices, (data.values * c).astype(np.float32), data.labels, data.weights, d)
    m = int(n * 0.8)
    return row_slice(data, 0, m), row_slice(data, m, n)


def holdout_logloss(hold: CSRData, weights: np.ndarray, intercept: float) -> float:
    """numpy reference: the weighted mean logistic loss of a model on the held-out rows."""
    x = hold.to_scipy()
    m = x @ weights.astype(np.float64) + intercept
    loss, _, _ = loss_np("logistic", m, hold.labels.astype(np.float64))
    w = hold.weights.astype(np.float64)
    return float(w @ loss / w.sum())


def without_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def numbers(history: list[dict]) -> list[dict]:
    """A history without its wall-clock fields (the numbers a rerun must repeat bit for bit)."""
    timing = ("elapsed_s", "elapsed_all_s", "compute_s", "stall_s", "transfer_s", "step_elapsed_s", "step_elapsed_all_s",
              "start_objective_s")
    return [{k: v for k, v in e.items() if k not in timing} for e in history]


def test_the_l2_path_rule():
    assert LAMBDAS == [float(v) for v in np.logspace(-4, -8, 8)]
    assert (LAMBDAS[0], LAMBDAS[-1], len(LAMBDAS)) == (1e-4, 1e-8, 8)
    assert all(a > b for a, b in zip(LAMBDAS, LAMBDAS[1:], strict=False))


def walk(rule: PathRule, loss, rows: int = 0) -> tuple[list[float], str]:
    """The values a path with ``rule`` tries when the held-out loss at λ is ``loss(λ)``, and
    why it stops (the rule alone, no fitting)."""
    records: list[dict] = []
    while (value := rule.next_value(records, rows)) is not None:
        records.append({rule.penalty: value, "holdout_loss": loss(value)})
        assert len(records) <= rule.max_steps()
    return [r[rule.penalty] for r in records], rule.over(records, rows)


def test_choice_ties_go_to_the_larger_lambda_and_the_path_stops_after_two_worse_steps():
    rule = PATHS["l2"]
    recs = [{"l2": v, "holdout_loss": h} for v, h in zip(LAMBDAS, (0.5, 0.4, 0.4, 0.45), strict=False)]
    assert choose(recs) == 1  # the tie with step 2 goes to the larger λ
    assert rule.over(recs[:3]) is None and rule.over(recs) == "patience"
    assert choose([{"holdout_loss": None}, {"holdout_loss": 0.7}]) == 1
    assert choose([{"holdout_loss": None}]) == 0
    assert rule.over([{"l2": v, "holdout_loss": 1.0 - i / 10} for i, v in enumerate(LAMBDAS)]) == "end"
    h = [{"pass": 1, "holdout_loss": 0.5}, {"pass": 2, "holdout_loss": 0.3}, {"pass": 3, "holdout_loss": 0.3},
         {"pass": 4, "holdout_loss": 0.4}]
    assert step_holdout(h, early_stopping=True) == (0.3, 2)  # the first best pass, as the tracker keeps it
    assert step_holdout(h, early_stopping=False) == (0.4, 4)
    assert step_holdout([{"pass": 1}], early_stopping=True) == (None, 0)


def test_a_path_whose_first_value_wins_turns_up_until_a_step_is_worse():
    """The held-out loss unimodal in log λ with its minimum at λ*: the path's best step is the
    value nearest λ* in log on the grid of the values down and up, wherever λ* lies."""
    rule = PATHS["l2"]
    # 198,000 and 6,000 rows: logspace's first value is 100/N plus one ulp there
    for rows, star in itertools.product((10_000_000, 198_000, 6_000, 0), (7e-4, 3e-2, 3e-6, 1e-5, 4e-5, 1e-6, 2e-7,
                                                                           1e-9, 1e-12)):
        star *= 1e7 / (rows or 1e6)  # the same place relative to the path's values
        down, up = rule.values(rows), rule.up_values(rows)
        assert len(up) == 4 and up[0] == pytest.approx(down[0] ** 2 / down[1], rel=1e-12)
        assert all(b > a for a, b in zip([down[0], *up], up, strict=False))
        grid = sorted(down + up)
        tried, stop = walk(rule, lambda v, s=star: (np.log10(v) - np.log10(s)) ** 2, rows)
        nearest = min(grid, key=lambda v, s=star: abs(np.log10(v) - np.log10(s)))
        best = min(tried, key=lambda v, s=star: (abs(np.log10(v) - np.log10(s)), -v))
        assert best == nearest, (rows, star, tried)
        if star > down[0]:  # the turn: two values down, then up while each step wins, one step past
            assert tried[:2] == down[:2] and tried[2:] == up[: len(tried) - 2]
            assert stop == ("end" if nearest == up[-1] else "bracketed")
        elif star < down[1]:  # down only, as before
            assert tried == down[: len(tried)] and stop in ("end", "patience"), (rows, star, tried)
    # a rule without values up goes on down after a worse second step, as the path did before
    flat = PathRule("l2", 1e-4, 1e-8, 8)
    tried, stop = walk(flat, lambda v: -np.log10(v))  # the larger λ, the better
    assert tried == flat.values()[:3] and stop == "patience"
    assert flat.max_steps() == 8 and rule.max_steps() == 8


def test_the_path_picks_the_fixed_lambda_with_the_best_held_out_loss():
    tr, ho = scaled_problem()
    res = train_local(tr, SolverParams(**CONVERGED), holdout=ho)
    separate = []
    for lam in LAMBDAS:
        fit = train_local(tr, SolverParams(**{**CONVERGED, "l2": lam}), holdout=ho)
        assert fit.stop_reason.startswith("converged")
        separate.append(holdout_logloss(ho, fit.weights, fit.intercept))
    best = int(np.argmin(separate))
    assert 0 < best < len(LAMBDAS) - 1  # an interior optimum: the test can tell a wrong choice
    path = res.path
    assert path["penalty"] == "l2" and path["chosen_step"] == best and path["value"] == LAMBDAS[best]
    # the path's steps reached the same optima from their warm starts
    for st in path["steps"]:
        assert st["holdout_loss"] == pytest.approx(separate[st["step"]], rel=1e-6)
    # the result is the chosen step's model, with f at the chosen λ
    assert holdout_logloss(ho, res.weights, res.intercept) == pytest.approx(separate[best], rel=1e-6)
    assert res.objective == pytest.approx(objective_np(tr, res.weights, res.intercept, LAMBDAS[best]), rel=1e-9)
    # the history holds every step's passes, numbered on, each with its λ
    assert [e["pass"] for e in res.history] == list(range(1, len(res.history) + 1))
    assert sorted({e["l2"] for e in res.history}, reverse=True) == [st["l2"] for st in path["steps"]]
    assert res.passes == sum(st["passes"] for st in path["steps"]) == len(res.history)


def test_the_path_returns_the_minimiser_of_the_lambda_it_reports():
    """With the run's defaults (early stopping on for fixed λ) and a path that starts far too
    strong (the rows passed as 30: λ_0 = 3.3), whose first L-BFGS passes score worse than the
    hybrid's online pass: every step still returns its last pass, and the chosen weights are a
    stationary point of the objective at the reported λ (numpy's gradient)."""
    tr, ho = scaled_problem(c=1.0)
    params = SolverParams(solver="hybrid", l2="auto", passes=200, tol=1e-12)
    assert params.early_stop_passes > 0
    res = train_local(tr, params, holdout=ho, path_rows=30)
    steps = res.path["steps"]
    assert steps[0]["l2"] == pytest.approx(100 / 30) and res.path["rows"] == 30
    offset = 0
    for st in steps:
        offset += st["passes"]
        assert st["best_pass"] == offset and st["stop_reason"].startswith("converged"), st
    lam = res.path["value"]
    assert res.objective == pytest.approx(objective_np(tr, res.weights, res.intercept, lam), rel=1e-9)
    x = tr.to_scipy()
    w = tr.weights.astype(np.float64)
    _, d1, _ = loss_np("logistic", x @ res.weights.astype(np.float64) + res.intercept, tr.labels.astype(np.float64))
    grad = np.append(x.T @ (w * d1), w @ d1) / w.sum()
    grad[:-1] += lam * res.weights
    _, d0, _ = loss_np("logistic", np.zeros(tr.n_rows), tr.labels.astype(np.float64))
    grad0 = np.append(x.T @ (w * d0), w @ d0) / w.sum()
    assert np.abs(grad).max() <= 1e-4 * np.abs(grad0).max()  # float32 weights: not much below


@pytest.mark.parametrize("solver,l1", [("hybrid", 0.0), ("lbfgs", 0.0), ("lbfgs", 3e-6)])
def test_each_step_is_the_fixed_lambda_fit_warm_started_from_the_step_before(solver, l1):
    """Replayed as separate runs (step 0: the solver; later steps: L-BFGS from the step before's
    returned weights), each without early stopping as the path runs its steps (the run's
    early_stop_passes is left at its default, 3: a path ignores it): the same held-out losses
    and weights, bit for bit.
    With train.l1 > 0 (elastic net) the path runs over l2 with l1 fixed, each step OWL-QN."""
    tr, ho = scaled_problem(n=1500, d=200)
    params = SolverParams(solver=solver, l2="auto", l1=l1, passes=12)
    res = train_local(tr, params, holdout=ho)
    init, replay = None, []
    for st in res.path["steps"]:
        p = dataclasses.replace(params, l2=st["l2"], solver=solver if st["step"] == 0 else "lbfgs",
                                early_stop_passes=0)
        fit = train_local(tr, p, holdout=ho, init=init)
        assert step_holdout(fit.history, early_stopping=False)[0] == st["holdout_loss"]
        assert st["best_pass"] == st["passes"] + sum(s["passes"] for s in res.path["steps"][: st["step"]])
        assert (len(fit.history), fit.stop_reason, fit.objective) == (st["passes"], st["stop_reason"], st["objective"])
        replay.append(fit)
        init = (fit.weights, fit.intercept)
    chosen = replay[res.path["chosen_step"]]
    assert res.weights.tobytes() == chosen.weights.tobytes() and res.intercept == chosen.intercept
    if l1 > 0:
        assert 0 < np.count_nonzero(res.weights) < tr.n_features  # sparse, not empty
    holdouts = [st["holdout_loss"] for st in res.path["steps"]]
    assert res.path["chosen_step"] == holdouts.index(min(holdouts))


def test_the_path_is_deterministic_and_ranks_agree():
    tr, ho = scaled_problem()
    params = SolverParams(**CONVERGED)
    a = train_local(tr, params, holdout=ho)
    b = train_local(tr, params, holdout=ho)
    assert a.weights.tobytes() == b.weights.tobytes() and a.intercept == b.intercept
    assert without_times(a.path["steps"]) == without_times(b.path["steps"])
    assert numbers(a.history) == numbers(b.history)
    two = train_on_tree(split_rows(tr, 2), params, holdouts=split_rows(ho, 2))
    assert two[0].weights.tobytes() == two[1].weights.tobytes()  # bit-identical on every rank
    assert two[0].path == two[1].path and numbers(two[0].history) == numbers(two[1].history)
    assert two[0].path["chosen_step"] == a.path["chosen_step"]  # K = 2 makes the choice K = 1 makes
    for s1, s2 in zip(a.path["steps"], two[0].path["steps"], strict=True):
        assert s2["holdout_loss"] == pytest.approx(s1["holdout_loss"], rel=1e-6)


def test_hybrid_path_on_two_ranks_is_the_same_on_both_and_repeats():
    tr, ho = scaled_problem(n=1500, d=200)
    params = SolverParams(solver="hybrid", l2="auto", passes=10)
    runs = [train_on_tree(split_rows(tr, 2), params, holdouts=split_rows(ho, 2)) for _ in range(2)]
    for r in runs:
        assert r[0].weights.tobytes() == r[1].weights.tobytes() and r[0].path == r[1].path
    assert runs[0][0].weights.tobytes() == runs[1][0].weights.tobytes()
    assert without_times(runs[0][0].path["steps"]) == without_times(runs[1][0].path["steps"])


@pytest.mark.parametrize("solver", ["hybrid", "lbfgs"])
def test_resume_from_a_checkpoint_inside_the_path_continues_on_the_same_lambda(solver):
    tr, ho = scaled_problem(n=1500, d=200)
    params = SolverParams(solver=solver, l2="auto", passes=12)
    states = []
    full = train_local(tr, params, holdout=ho, on_pass_end=keep(states))
    assert [s["pass"] for s in states] == list(range(1, len(full.history) + 1))
    assert all(s["params"]["l2"] == "auto" for s in states)
    assert [s["stop_reason"] for s in states[:-1]] == [None] * (len(states) - 1) and states[-1]["stop_reason"]
    # inside step 0 (the hybrid: after its online pass), inside a later step, and at a step's end
    picks = [states[0], next(s for s in states if s["path_step"] == 2 and s["path_step_stop"] is None),
             next(s for s in states if s["path_step"] == 1 and s["path_step_stop"] is not None)]
    for saved in picks:
        later = []
        res = train_local(tr, params, holdout=ho, resume=copy_state(saved), on_pass_end=keep(later))
        assert res.weights.tobytes() == full.weights.tobytes() and res.intercept == full.intercept
        assert without_times(res.path["steps"]) == without_times(full.path["steps"])
        assert numbers(res.history) == numbers(full.history)
        # the first pass after the resume is on the checkpoint's λ
        assert later[0]["pass"] == saved["pass"] + 1
        step = saved["path_step"] + (saved["path_step_stop"] is not None)
        assert later[0]["history"][-1]["l2"] == LAMBDAS[step]


def test_a_turned_path_picks_the_best_value_above_and_resumes_on_its_lambda_with_the_same_bits():
    """The rows passed as 10^9 put the path's values (1e-7 down) below the held-out optimum: it
    turns after step 1, goes up from step 0's model, and stops when a step up is worse. A
    checkpoint at the turn (step 1's end), inside the first step up and inside a later one
    resumes to the uninterrupted run's bits."""
    tr, ho = scaled_problem(n=1500, d=200)
    params = SolverParams(solver="hybrid", l2="auto", passes=12)
    rule, rows = PATHS["l2"], 10**9
    states = []
    full = train_local(tr, params, holdout=ho, path_rows=rows, on_pass_end=keep(states))
    steps = full.path["steps"]
    up = rule.up_values(rows)
    assert [s["l2"] for s in steps] == [*rule.values(rows)[:2], *up[: len(steps) - 2]] and len(steps) >= 4
    holdouts = [s["holdout_loss"] for s in steps]
    assert holdouts[1] > holdouts[0] and full.path["stop"] == "bracketed"
    chosen = full.path["chosen_step"]
    assert chosen == int(np.argmin(holdouts)) == len(steps) - 2 and full.path["value"] == up[chosen - 2]
    assert holdout_logloss(ho, full.weights, full.intercept) == pytest.approx(holdouts[chosen], rel=1e-5)
    picks = [next(s for s in states if s["path_step"] == 1 and s["path_step_stop"] is not None),
             next(s for s in states if s["path_step"] == 2 and s["path_step_stop"] is None),
             next(s for s in states if s["path_step"] == 3 and s["path_step_stop"] is None)]
    for saved in picks:
        later = []
        res = train_local(tr, params, holdout=ho, path_rows=rows, resume=copy_state(saved), on_pass_end=keep(later))
        assert res.weights.tobytes() == full.weights.tobytes() and res.intercept == full.intercept
        assert without_times(res.path["steps"]) == without_times(full.path["steps"])
        assert numbers(res.history) == numbers(full.history)
        step = saved["path_step"] + (saved["path_step_stop"] is not None)
        assert later[0]["history"][-1]["l2"] == steps[step]["l2"]


def test_no_collective_before_the_first_pass_with_a_path():
    tr, ho = scaled_problem(n=400, d=40)
    events = []
    train(tr, RecordingCommunicator(events), SolverParams(solver="hybrid", l2="auto", passes=3), holdout=ho,
          progress=lambda p, rows: events.append(("progress", p, rows)))
    first = events.index(("collective",))
    assert events[first - 1] == ("progress", 1, tr.n_rows)
    passes = [e[1] for e in events if e[0] == "progress"]
    assert passes == sorted(passes) and max(passes) > 3  # numbered on across the steps


def test_auto_without_held_out_rows_is_refused_on_every_rank():
    tr, _ = scaled_problem(n=400, d=40)
    with pytest.raises(InvalidInputError, match=r"train.l2 = 'auto' chooses l2 by the held-out loss, and no rank has "
                                                r"held-out rows: .*train.holdout_period > 1.*or set train.l2 to a number"):
        train_local(tr, SolverParams(solver="lbfgs", l2="auto"))
    # on a tree: empty held-out shards everywhere, so every rank raises after the first pass
    shards, empty = split_rows(tr, 2), CSRData.empty(tr.n_features)
    run = run_tree(2, lambda node: train(shards[node.rank], node, SolverParams(l2="auto"), holdout=empty),
                   node_kwargs=TREE_NODE_KWARGS, timeout=120.0, check=False)
    assert all(isinstance(e, InvalidInputError) and "no rank has held-out rows" in str(e) for e in run.errors)


@pytest.mark.parametrize("kwargs,message", [
    ({"solver": "online"}, r"train.l2 = 'auto': must be a number with train.solver = 'online': 'auto' fits a "
                           r"regularization path, which needs a solver that can \('hybrid', 'lbfgs'\)"),
    ({"solver": "cocoa"}, r"train.l2 = 'auto': must be a number with train.solver = 'cocoa'"),
    ({"l2": "automatic"}, r"train.l2 = 'automatic': must be 'auto' or a finite number in \[0, inf\)"),
    ({"l2": float("inf")}, r"train.l2 = inf: must be 'auto' or a finite number"),
])
def test_bad_l2_values_name_the_key_and_what_is_allowed(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SolverParams(**{"l2": "auto", **kwargs})


def test_a_fixed_lambda_state_does_not_resume_a_path_and_back():
    tr, ho = scaled_problem(n=400, d=40)
    fixed, path = [], []
    train_local(tr, SolverParams(solver="lbfgs", l2=1e-6, passes=2), holdout=ho, on_pass_end=keep(fixed))
    train_local(tr, SolverParams(solver="lbfgs", l2="auto", passes=2), holdout=ho, on_pass_end=keep(path))
    with pytest.raises(ValueError, match=r"resume state: params.l2 = 1e-06 differs from this run's 'auto'"):
        train_local(tr, SolverParams(solver="lbfgs", l2="auto", passes=2), holdout=ho, resume=fixed[-1])
    with pytest.raises(ValueError, match=r"resume state: params.l2 = 'auto' differs from this run's 1e-06"):
        train_local(tr, SolverParams(solver="lbfgs", l2=1e-6, passes=2), holdout=ho, resume=path[-1])
    other = dict(path[-1], path_values=[1.0, 0.1])
    with pytest.raises(ValueError, match=r"resume state: path_values = \[1.0, 0.1\] differ from this run's"):
        train_local(tr, SolverParams(solver="lbfgs", l2="auto", passes=2), holdout=ho, resume=other)


@pytest.mark.parametrize("solver", ["lbfgs", "hybrid"])
def test_the_path_renumbers_rows_handed_over_in_place_once_with_the_same_bits(solver):
    """consume_data with a path: the steps share L-BFGS's working table, so the rows are renumbered
    in place once (no copy of the indices) and the result is a kept-data run's, bit for bit."""
    tr, ho = scaled_problem(n=600, d=60)
    params = SolverParams(solver=solver, l2="auto", passes=8)
    kept = train_local(tr, params, holdout=ho)
    mine = copy_data(tr)
    handed = train(mine, LocalCommunicator(), params, holdout=ho, consume_data=True)
    assert len(kept.path["steps"]) >= 3
    assert handed.weights.tobytes() == kept.weights.tobytes() and handed.intercept == kept.intercept
    assert without_times(handed.path["steps"]) == without_times(kept.path["steps"])
    assert mine.indices.tobytes() == local_numbers(tr).tobytes()  # the table's numbers, written in place


def l1_problem(c: float = 0.003, n: int = 3000, d: int = 300, k: int = 30, seed: int = 5) -> tuple[CSRData, CSRData]:
    """(training rows, held-out rows): binary features scaled by c, labels from a planted model
    on k of the d features, so L1 helps; λ₁ acts as λ₁/c, which puts the best held-out λ₁ inside
    the path (its 3rd value, 7.2e-6, keeping about 56 of the 300 weights)."""
    rng = np.random.default_rng(seed)
    x = sp.random(n, d, density=0.03, random_state=rng, format="csr", data_rvs=lambda m: np.ones(m))
    beta = np.zeros(d)
    beta[rng.choice(d, k, replace=False)] = rng.normal(0.0, 2.0, k)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ beta - 0.5)))).astype(np.float64)
    data = CSRData.from_scipy(x * c, y, n_features=d)
    m = int(n * 0.8)
    return row_slice(data, 0, m), row_slice(data, m, n)


L1_CONVERGED = {"solver": "lbfgs", "l2": 0.0, "l1": "auto", "early_stop_passes": 0, "tol": 1e-10, "passes": 300}


def test_the_path_values_scale_with_the_rows():
    assert LAMBDAS == pytest.approx(list(np.logspace(-4, -8, 8)), rel=1e-12)  # rows not known
    for rows in (200_000, 1_000_000, 20_000_000):  # l2: λN from 100 down to 0.01, 8 values
        v = PATHS["l2"].values(rows)
        assert v[0] * rows == pytest.approx(100.0) and v[-1] * rows == pytest.approx(0.01) and len(v) == 8
        assert all(a / b == pytest.approx(10 ** (4 / 7)) for a, b in zip(v, v[1:], strict=False))
    assert PATHS["l2"].values(1_000_000) == pytest.approx(LAMBDAS, rel=1e-12)  # the same path at 10^6 rows
    assert PATHS["l1"].values(20_000_000) == PATHS["l1"].values() == LAMBDAS  # l1: fixed (regpath docstring)


def test_the_l1_path_rule_and_one_auto_penalty_per_run():
    assert PATHS["l1"].values() == LAMBDAS  # the same fixed values, 1e-4 down to 1e-8 (regpath docstring)
    assert set(AUTO_PENALTIES) == set(PATHS)  # every penalty the catalogue lets be auto has a rule
    with pytest.raises(ConfigError, match=r"train.l2 = 'auto' and train.l1 = 'auto': a run fits one regularization "
                                          r"path, over one penalty; set the other to a number"):
        SolverParams(l2="auto", l1="auto")
    with pytest.raises(ConfigError, match=r"train.l1 = 'auto': must be a number with train.solver = 'online'"):
        SolverParams(solver="online", l2=1e-6, l1="auto")
    with pytest.raises(ConfigError, match=r"train.l1 = 'auto': must be 0 with train.solver = 'cocoa'"):
        SolverParams(solver="cocoa", l2=1e-6, l1="auto")
    with pytest.raises(ConfigError, match=r"train.l1 = -1e-06: must be 'auto' or a finite number in \[0, inf\)"):
        SolverParams(l2=1e-6, l1=-1e-6)


def test_the_l1_path_picks_the_fixed_l1_with_the_best_held_out_loss():
    tr, ho = l1_problem()
    res = train_local(tr, SolverParams(**L1_CONVERGED), holdout=ho)
    separate, nonzeros, objectives = [], [], []
    for lam in LAMBDAS:  # each λ₁ fitted from zero: OWL-QN reaches the same optimum as from the warm start
        fit = train_local(tr, SolverParams(**{**L1_CONVERGED, "l1": lam}), holdout=ho)
        assert fit.stop_reason.startswith("converged")
        separate.append(holdout_logloss(ho, fit.weights, fit.intercept))
        nonzeros.append(int(np.count_nonzero(fit.weights)))
        objectives.append(fit.objective)
    best = int(np.argmin(separate))
    assert 0 < best < len(LAMBDAS) - 1 and 0 < nonzeros[best] < tr.n_features // 2  # interior and sparse
    path = res.path
    assert path["penalty"] == "l1" and path["chosen_step"] == best and path["value"] == LAMBDAS[best]
    assert path["stop"] == "patience" and len(path["steps"]) == best + 3  # two worse steps after the best
    for st in path["steps"]:  # the same optimum: f to 1e-9; the weights (so the held-out loss) less sharply
        assert st["objective"] == pytest.approx(objectives[st["step"]], rel=1e-9)
        assert st["holdout_loss"] == pytest.approx(separate[st["step"]], rel=1e-4)
        assert abs(st["nonzeros"] - nonzeros[st["step"]]) <= 1  # a weight at ~0 may land either side
    assert [st["nonzeros"] for st in path["steps"]] == sorted(st["nonzeros"] for st in path["steps"])  # denser
    assert np.count_nonzero(res.weights) == path["steps"][best]["nonzeros"]
    assert holdout_logloss(ho, res.weights, res.intercept) == pytest.approx(separate[best], rel=1e-4)
    f = objective_np(tr, res.weights, res.intercept, 0.0) + LAMBDAS[best] * np.abs(res.weights.astype(np.float64)).sum()
    assert res.objective == pytest.approx(f, rel=1e-9)
    assert sorted({e["l1"] for e in res.history}, reverse=True) == [st["l1"] for st in path["steps"]]


@pytest.mark.parametrize("solver", ["hybrid", "lbfgs"])
def test_each_l1_step_is_the_fixed_l1_fit_warm_started_from_the_step_before(solver):
    """The replay of an L1 path as separate runs (step 0 the solver, later steps OWL-QN from the
    step before's weights), each without early stopping as the path runs its steps: the same
    bits, and the steps' records hold their models' non-zero counts."""
    tr, ho = l1_problem(n=1500, d=200)
    params = SolverParams(solver=solver, l2=1e-8, l1="auto", passes=12)
    res = train_local(tr, params, holdout=ho)
    init, replay = None, []
    for st in res.path["steps"]:
        p = dataclasses.replace(params, l1=st["l1"], solver=solver if st["step"] == 0 else "lbfgs",
                                early_stop_passes=0)
        fit = train_local(tr, p, holdout=ho, init=init)
        assert step_holdout(fit.history, early_stopping=False)[0] == st["holdout_loss"]
        assert (len(fit.history), fit.stop_reason, fit.objective) == (st["passes"], st["stop_reason"], st["objective"])
        assert st["nonzeros"] == np.count_nonzero(fit.weights)
        replay.append(fit)
        init = (fit.weights, fit.intercept)
    chosen = replay[res.path["chosen_step"]]
    assert res.weights.tobytes() == chosen.weights.tobytes() and res.intercept == chosen.intercept
    assert 0 < np.count_nonzero(res.weights) < tr.n_features


def test_the_l1_path_is_the_same_on_two_ranks_and_resumes_on_its_l1():
    tr, ho = l1_problem(n=1500, d=200)
    params = SolverParams(solver="lbfgs", l2=0.0, l1="auto", passes=10)
    one = train_local(tr, params, holdout=ho)
    shards, holds = split_rows(tr, 2), split_rows(ho, 2)
    two = train_on_tree(shards, params, holdouts=holds)
    assert [st["step"] for st in two[0].path["steps"]] == [st["step"] for st in one.path["steps"]]
    assert two[0].weights.tobytes() == two[1].weights.tobytes()
    assert two[0].path["chosen_step"] == one.path["chosen_step"]
    states = []
    full = train_local(tr, params, holdout=ho, on_pass_end=keep(states))
    mid = next(s for s in states if s["path_step"] == 1 and s["path_step_stop"] is None)
    resumed = train_local(tr, params, holdout=ho, resume=copy_state(mid))
    assert resumed.weights.tobytes() == full.weights.tobytes() and resumed.intercept == full.intercept
    assert without_times(resumed.path["steps"]) == without_times(full.path["steps"])
