"""Automatic regularization: a path over a named penalty (``l2`` or ``l1``), chosen on the held-out split.

``train.l2 = auto`` fits, in one run, one model per value of a decreasing path

    λ_k = λ_first · 10^(−4k / (n − 1)),   k = 0 … n − 1,   λ_first = 100 / N,  n = 8,

N the dataset's rows (``train(path_rows=N)``; the train job passes the rows the data stands for,
every row of its shards or, for negatives kept at rate r and weighted 1/r, the rows before
downsampling, ``pipeline.sampling.population_rows``; so every rank has the same values before its first collective, which by design comes only after
the first pass over the data: speculative execution, :mod:`solvers.setup`). The values are stated
for the mean-form objective with feature values of order 1, which hashed tokens have (value 1):
the penalty then shrinks a feature seen in n_j = φ·N rows by about a factor
1/(1 + λN/(n_j·p(1−p))), so λN is the count of rows below which a feature barely counts, and the
held-out optimum sits at a roughly constant λN as the data grow (a few tens on generated click
logs from 200k to 20M rows: docs/pages/explanation/design-notes.md, "the path follows N"), where a path fixed in λ
would start ever further above it. The path runs from λN = 100 (features in fewer than ~100 rows
barely count) to λN = 0.01 (four decades in 8 values, a factor 3.7 a step). Without N (``path_rows`` = 0) the values are 1e-4 … 1e-8, the same path at N = 10^6.
Data with other value scales (LibSVM files) should be scaled to values of order 1 (max-abs) or
given a number.

**Each step.** Step 0 runs the configured solver (the hybrid: its online pass(es), then L-BFGS)
with λ_0, from the run's initial weights. Step k > 0 runs L-BFGS with λ_k (the hybrid's last
phase; the ``lbfgs`` solver itself), warm-started from step k − 1's returned weights. Every step
has the solver's whole budget (``passes``, the hybrid's online passes included in step 0) and
runs to its tolerance (``tol``) or that budget, **without early stopping** (``early_stop_passes``
applies to runs with a fixed λ), so a step returns the minimiser of its objective at λ_k, as far
as the tolerance goes: the λ the path reports is the one its weights minimise, and the objective
it reports is theirs (with early stopping inside a step, a step whose L-BFGS passes all scored
worse than its online pass would return that pass's average, a model no λ shaped). The step's
held-out loss is that of its last pass (the tracker's number, an AllReduce result, so the same bits on every rank).

**The choice.** The step with the smallest held-out loss; a tie goes to the earlier step (the
larger λ). The path stops early once ``PATIENCE`` = 2 steps in a row after the best are not
better (held-out loss is usually unimodal in λ; later steps would only cost time).

**The turn.** A path fixed at λN = 100 cannot tell whether a larger value would win when its
first value does; the more rows, the more the held-out optimum moves up in λN (generated click
logs: λN ≈ 27 wins at 1M and 3M rows, 100 from 10M on). So when step 1 is worse than step 0,
the minimum of a unimodal held-out loss lies at or above λ_0, and the path turns: it tries
λ_0·r, λ_0·r², … (r the factor a step, 3.7; at most ``up`` = 4 values, to λN ≈ 19,000), each
warm-started from the best model so far (the first from step 0's), while each beats the best; the
first that does not ends it ("bracketed": its neighbours below and above are both worse, so the
best value of the grid is found). Steps run in this order, so ``steps[k]`` is the k-th one run,
not the k-th largest; the most steps a path runs is ``max(n, 2 + up)`` = 8. The result
is the chosen step's model, its objective f at its λ, and its stop reason; ``history`` holds
every step's passes numbered on from the step before (each entry also carries the step and its
λ), and :attr:`TrainResult.path` the record::

    {"penalty": "l2", "value": λ*, "chosen_step": k*, "rule": "...", "stop": "end" | "patience" | "bracketed",
     "steps": [{"step", "l2", "objective", "holdout_loss", "passes", "seconds", "stop_reason",
                "best_pass", "nonzeros"}, ...]}

**Held-out rows are required.** With none on any rank the run stops after its first pass with
InvalidInputError on every rank (the job refuses ``train.holdout_period = 0`` with ``auto``
before it starts: a user who switched the split off gets an error naming both keys rather than
a split turned back on behind their back).

**Checkpoints.** A checkpoint taken during step k is the inner solver's state with the pass
numbers and history made global, plus ``path_step``, ``path_values``, ``path_records`` (the
steps done), ``path_pass_offset``, ``path_time_offset``, ``path_step_stop`` (the inner stop
reason) and the best model so far (``path_best_weights``, ``path_best_intercept``); its
``stop_reason`` is set only when the path is over. Resuming from it continues step k on the
same λ from that state (the λ of a step follows from the steps before it: :meth:`PathRule.next_value`),
so a resumed run ends with the bits of an uninterrupted one.

**The L1 path** (``train.l1 = auto``, with ``train.l2`` a number, 0 allowed) is the same
procedure over λ₁ with the same fixed values, 1e-4 down to 1e-8 (and the same turn, up to
λ₁ ≈ 0.019 where a sparser model wins): sparse to dense, as glmnet
runs its path, each step OWL-QN (:mod:`solvers.owlqn`) warm-started from the sparser model
before it. For hashed tokens (value 1) the coordinate j of the gradient at the optimum without
feature j is about φ_j·δ_j (φ_j the fraction of rows it is seen in, δ_j the mean residual
there), and λ₁ zeroes the features with φ_j·|δ_j| < λ₁: 1e-4 keeps only features seen in more
than about 1 row in 10^3 with a strong effect, 1e-8 removes almost nothing. The data-driven
start, λ₁ = ‖∇f(0)‖_∞ (the smallest λ₁ whose optimum is all zeros), would need a gradient pass,
hence a collective, before the first online pass, which by design comes only after it. Each
step's record also holds its model's non-zero count, the sparsity side of the trade-off.

**Another penalty.** :data:`PATHS` maps a parameter name to its :class:`PathRule`; a penalty
whose parameter accepts ``auto`` (``AutoOr`` in the catalogue, listed in
``catalogue.AUTO_PENALTIES``) gets a path by adding a rule. At most one penalty is ``auto`` in a
run (the catalogue refuses two, naming both keys).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from terascale.solvers.errors import InvalidInputError
from terascale.solvers.run import TrainResult
from terascale.solvers.state import take

PATIENCE = 2
#: the solver of the steps after the first (warm-started), by the run's solver
WARM_SOLVER = {"hybrid": "lbfgs"}


@dataclass(frozen=True)
class PathRule:
    """n values log-spaced from ``first`` down to ``last`` (see the module docstring); with
    ``first_times_rows`` > 0 and the data's rows N known, from ``first_times_rows / N`` down by
    the same ratio ``last / first``; and at most ``up`` values above the first, on by the same
    factor a step (tried only when the first value beats the second: :meth:`next_value`)."""

    penalty: str
    first: float
    last: float
    n: int
    first_times_rows: float = 0.0
    up: int = 0

    def bounds(self, rows: int = 0) -> tuple[float, float]:
        """(first, last) for data of ``rows`` rows (0: not known)."""
        if self.first_times_rows > 0 and rows > 0:
            first = self.first_times_rows / rows
            return first, first * (self.last / self.first)
        return self.first, self.last

    def values(self, rows: int = 0) -> list[float]:
        """The downward values, the first to the last."""
        first, last = self.bounds(rows)
        return [float(v) for v in np.logspace(math.log10(first), math.log10(last), self.n)]

    def up_values(self, rows: int = 0) -> list[float]:
        """The values above the first, nearest first: first · r^j, j = 1 … up, r the path's
        factor a step (first / second value)."""
        first, last = self.bounds(rows)
        step = (math.log10(first) - math.log10(last)) / (self.n - 1)
        return [float(10.0 ** (math.log10(first) + j * step)) for j in range(1, self.up + 1)]

    def max_steps(self) -> int:
        """The most steps a path runs: the n values down, or two of them and the ``up`` above."""
        return max(self.n, 2 + self.up)

    def next_value(self, records: list[dict], rows: int = 0) -> float | None:
        """The value of the step after ``records`` (the steps done, in the order run, each with
        its value under :attr:`penalty` and its held-out loss), None when the path is over
        (:meth:`over`). Down the values while they win or for :data:`PATIENCE` steps after the
        best; but when the second value is worse than the first, the held-out loss (unimodal in
        log λ) has its minimum at or above the first value, so the path turns: up from the
        first value, one factor a step, while each step beats the best so far."""
        if self.over(records, rows) is not None:
            return None
        ups = self._ups(records, rows)
        if ups or (self.up and len(records) == 2 and choose(records) == 0):
            return self.up_values(rows)[ups]
        return self.values(rows)[len(records)]

    def over(self, records: list[dict], rows: int = 0) -> str | None:
        """Why the path ends after ``records``, or None: "end" after its last value (down, or the
        last of the ``up`` values), "patience" after PATIENCE steps down worse than the best,
        "bracketed" when a step up is not better than the best (the step below it won too)."""
        if not records:
            return None
        best = choose(records)
        ups = self._ups(records, rows)
        if ups:
            if best != len(records) - 1:
                return "bracketed"
            return "end" if ups >= self.up else None
        if len(records) >= self.n:
            return "end"
        if len(records) - 1 - best >= PATIENCE:  # never after 2 steps: the turn's test comes first
            return "patience"
        return None

    def _ups(self, records: list[dict], rows: int) -> int:
        """How many of ``records`` are steps above the first value (by identity with
        :meth:`up_values`: ``values(rows)[0]`` may differ from ``first_times_rows / rows`` in its
        last bit, so no comparison with the first value would do)."""
        up = set(self.up_values(rows))
        return sum(1 for r in records if r[self.penalty] in up)

    def describe(self, rows: int = 0) -> str:
        first, last = self.bounds(rows)
        scaled = (f" ({self.first_times_rows:g} / {rows:,} rows)" if self.first_times_rows > 0 and rows > 0
                  else "")
        up = (f"; when the second value is worse than the first, up from the first by the same factor "
              f"(at most {self.up} values, to {self.up_values(rows)[-1]:.3g}) while each step beats the best"
              if self.up else "")
        return (f"{self.n} values of {self.penalty} log-spaced from {first:.3g}{scaled} down to {last:.3g}, each "
                f"warm-started from the one before; the smallest held-out loss wins (ties: the larger value); "
                f"stops after {PATIENCE} steps in a row worse than the best{up}")


PATHS: dict[str, PathRule] = {"l2": PathRule("l2", 1e-4, 1e-8, 8, first_times_rows=100.0, up=4),
                              "l1": PathRule("l1", 1e-4, 1e-8, 8, up=4)}


def auto_penalty(params: Any) -> str | None:
    """The name of the penalty ``params`` sets to ``auto``, or None."""
    for name in PATHS:
        if getattr(params, name, None) == "auto":
            return name
    return None


def path_passes(params: Any) -> int:
    """The most passes a run with ``params`` may make (a path: every step's budget)."""
    name = auto_penalty(params)
    return params.passes * (PATHS[name].max_steps() if name else 1)


def effective_penalty(meta: dict, name: str) -> float:
    """The value of penalty ``name`` (``l2``, ``l1``) a model directory's metadata was fitted
    with: the path's choice, else the configured number (0 for ``l1`` in models from before it)."""
    reg = meta.get("regularization") or {}
    if reg.get("penalty") == name:
        return float(reg["value"])
    return float(meta["config"]["train"].get(name, 0.0))


def effective_l2(meta: dict) -> float:
    """The λ of a model directory's metadata: the path's choice, else the configured number."""
    return effective_penalty(meta, "l2")


def step_params(params: Any, penalty: str, step: int, value: float) -> Any:
    """The concrete parameters of step ``step``: the penalty set to ``value``, no early stopping
    (a step runs to its tolerance); after step 0 the warm-started solver (:data:`WARM_SOLVER`)."""
    changes: dict[str, Any] = {penalty: value, "early_stop_passes": 0}
    if step > 0:
        changes["solver"] = WARM_SOLVER.get(params.solver, params.solver)
    return dataclasses.replace(params, **changes)


def step_holdout(history: list[dict], early_stopping: bool) -> tuple[float | None, int]:
    """(held-out loss of the weights a step returned, their pass in ``history``): the best
    pass's (the first minimum) under early stopping, else the last one's; (None, 0) without."""
    if not history or history[-1].get("holdout_loss") is None:
        return None, 0
    if not early_stopping:
        return float(history[-1]["holdout_loss"]), int(history[-1]["pass"])
    best = min(range(len(history)), key=lambda i: (history[i]["holdout_loss"], i))
    return float(history[best]["holdout_loss"]), int(history[best]["pass"])


def choose(records: list[dict]) -> int:
    """Index of the record with the smallest held-out loss (ties: the earliest, larger λ; 0 if
    none has one)."""
    best = None
    for i, r in enumerate(records):
        h = r.get("holdout_loss")
        if h is not None and (best is None or h < records[best]["holdout_loss"]):
            best = i
    return 0 if best is None else best


def _global(e: dict, penalty: str, step: int, value: float, pass_off: int, time_off: float) -> dict:
    out = dict(e)
    out.update({"pass": e["pass"] + pass_off, "elapsed_s": e["elapsed_s"] + time_off,
                "elapsed_all_s": e["elapsed_all_s"] + time_off, "path_step": step, penalty: value,
                "step_pass": e["pass"], "step_elapsed_s": e["elapsed_s"], "step_elapsed_all_s": e["elapsed_all_s"]})
    return out


def _local(e: dict, penalty: str) -> dict:
    out = {k: v for k, v in e.items() if k not in ("path_step", penalty, "step_pass", "step_elapsed_s",
                                                    "step_elapsed_all_s")}
    out.update({"pass": e["step_pass"], "elapsed_s": e["step_elapsed_s"], "elapsed_all_s": e["step_elapsed_all_s"]})
    return out


@dataclass
class _Path:
    """The path's progress: what a checkpoint keeps besides the step's own state."""

    penalty: str
    values: list[float]
    step: int = 0
    records: list[dict] = dataclasses.field(default_factory=list)
    history: list[dict] = dataclasses.field(default_factory=list)  # the steps done, global numbering
    pass_offset: int = 0
    time_offset: float = 0.0
    best_weights: np.ndarray | None = None  # float32, the best step's so far
    best_intercept: float = 0.0

    def keys(self) -> dict[str, Any]:
        return {"path_step": self.step, "path_values": list(self.values),
                "path_records": [dict(r) for r in self.records], "path_pass_offset": self.pass_offset,
                "path_time_offset": self.time_offset, "path_best_weights": self.best_weights,
                "path_best_intercept": self.best_intercept}

    @classmethod
    def restore(cls, penalty: str, values: list[float], saved: dict) -> tuple[_Path, dict]:
        """(the path, the step's own state) of a checkpoint written by a path."""
        if "path_step" not in saved:
            raise ValueError(f"resume state: written by a run with one {penalty}, not a path ({penalty} = auto)")
        if [float(v) for v in saved["path_values"]] != values:
            raise ValueError(f"resume state: path_values = {saved['path_values']} differ from this run's {values}")
        step = int(saved["path_step"])
        best = take(saved, "path_best_weights") if "path_best_weights" in saved else None
        path = cls(penalty, values, step, [dict(r) for r in saved["path_records"]],
                   [dict(e) for e in saved["history"] if e["path_step"] < step], int(saved["path_pass_offset"]),
                   float(saved["path_time_offset"]),
                   None if best is None else np.asarray(best, dtype=np.float32), float(saved["path_best_intercept"]))
        history = [_local(e, penalty) for e in saved["history"] if e["path_step"] == step]
        # a handed-over state hands its arrays on to the step's (the outer dict keeps none)
        inner = type(saved)((k, take(saved, k)) for k in list(saved) if not k.startswith("path_"))
        inner["history"] = history
        inner["pass"] = len(inner["history"])
        inner["elapsed_s"] = inner["history"][-1]["elapsed_s"] if inner["history"] else 0.0
        inner["stop_reason"] = saved["path_step_stop"]
        return path, inner


def train_path(penalty: str, fit: Callable[..., TrainResult], inputs: Any, comm: Any, params: Any,
               on_pass_end: Callable[[dict], Any] | None, resume: dict | None,
               progress: Callable[[int, int], Any] | None, theta0: np.ndarray | None,
               groups: np.ndarray | None, rows: int = 0) -> TrainResult:
    """The path of ``penalty`` (module docstring). ``fit(inputs, comm, params, on_pass_end,
    resume, progress, theta0, groups) -> TrainResult`` is one fit (``solvers.api.solve``) over the
    validated ``inputs``; ``rows``: the data's rows N over all ranks, the same on every rank (0:
    not known); the rest are :func:`solvers.api.train`'s arguments."""
    rule = PATHS[penalty]
    values = rule.values(rows)
    if resume is not None:
        path, inner = _Path.restore(penalty, values, resume)
    else:
        path, inner = _Path(penalty, values), None
    init = theta0
    while True:
        k, value = path.step, rule.next_value(path.records, rows)
        p_k = step_params(params, penalty, k, value)
        res = fit(inputs, comm, p_k, _checkpointer(path, rule, rows, value, params, inputs, on_pass_end),
                  inner, _progress(progress, path.pass_offset), init, groups)
        inner = None
        local = res.history  # the step's own passes, numbered from 1
        holdout, best_pass = step_holdout(local, early_stopping=False)  # step_params: none in a step
        path.records.append({
            "step": k, penalty: value, "objective": res.objective, "holdout_loss": holdout,
            "passes": len(local), "seconds": local[-1]["elapsed_s"] if local else 0.0,
            "stop_reason": res.stop_reason, "best_pass": best_pass + path.pass_offset,
            "nonzeros": int(np.count_nonzero(res.weights)),
        })
        path.history += [_global(e, penalty, k, value, path.pass_offset, path.time_offset) for e in local]
        if choose(path.records) == k:
            path.best_weights, path.best_intercept = res.weights, res.intercept
        stop = rule.over(path.records, rows)
        if stop is not None:
            return _result(path, rule, stop, rows)
        path.pass_offset += len(local)
        path.time_offset = path.history[-1]["elapsed_s"] if path.history else path.time_offset
        path.step += 1
        if rule.next_value(path.records, rows) in rule.up_values(rows):  # up: from the best so far (the turn: step 0's)
            init = np.append(path.best_weights.astype(np.float64), path.best_intercept)
        else:
            init = np.append(res.weights.astype(np.float64), res.intercept)


def _result(path: _Path, rule: PathRule, stop: str, rows: int) -> TrainResult:
    chosen = choose(path.records)
    best = path.records[chosen]
    record = {"penalty": path.penalty, "value": best[path.penalty], "chosen_step": chosen,
              "rule": rule.describe(rows), "rows": rows, "stop": stop, "steps": [dict(r) for r in path.records]}
    return TrainResult(weights=np.asarray(path.best_weights, dtype=np.float32).copy(),
                       intercept=float(path.best_intercept), history=[dict(e) for e in path.history],
                       objective=float(best["objective"]), stop_reason=best["stop_reason"],
                       passes=len(path.history), path=record)


def _progress(progress: Callable[[int, int], Any] | None, offset: int) -> Callable[[int, int], Any] | None:
    if progress is None:
        return None
    return lambda pass_no, rows: progress(offset + pass_no, rows)


def _checkpointer(path: _Path, rule: PathRule, rows: int, value: float, params: Any, inputs: Any,
                  on_pass_end: Callable[[dict], Any] | None) -> Callable[[dict], None]:
    """The step's ``on_pass_end``: checks that held-out rows exist (after the first pass, when
    every rank knows their total), then hands the caller the state made global."""
    k, penalty = path.step, path.penalty

    def on_end(state: dict) -> None:
        if not inputs.holdout_weight > 0.0:
            raise InvalidInputError(
                f"train.{penalty} = 'auto' chooses {penalty} by the held-out loss, and no rank has held-out rows: "
                "give train() held-out data (in the train job: train.holdout_period > 1), or set "
                f"train.{penalty} to a number")
        if on_pass_end is None:
            return
        out = dict(state)
        local = state["history"]
        out["params"] = params.to_json()
        out["history"] = path.history + [_global(e, penalty, k, value, path.pass_offset, path.time_offset)
                                         for e in local]
        out["pass"] = len(out["history"])
        out["elapsed_s"] = out["history"][-1]["elapsed_s"] if local else path.time_offset
        out.update(path.keys())
        out["path_step_stop"] = state["stop_reason"]
        out["stop_reason"] = None
        if state["stop_reason"] is not None:  # the step's last pass: is it the path's?
            holdout, _ = step_holdout(local, early_stopping=False)
            done = rule.over([*path.records, {penalty: value, "holdout_loss": holdout}], rows)
            if done is not None:
                out["stop_reason"] = state["stop_reason"]
        on_pass_end(out)

    return on_end
