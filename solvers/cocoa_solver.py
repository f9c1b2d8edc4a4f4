"""Registers CoCoA (``solvers.scd``) as the solver "cocoa" of ``solvers.api.train``.

Maps ``SolverParams`` onto ``CocoaParams`` (``passes`` bounds the rounds, ``tol`` is the
relative duality gap), turns ``CocoaState`` into the checkpoint dict the train job stores and
back, and ``CocoaResult`` into a ``TrainResult``. A CoCoA checkpoint is per rank (each rank's
dual variables), which the dict says with ``per_rank: True``.

Differences from the other solvers, by the nature of the method (the catalogue's row says the
same): the intercept is an augmented constant feature of value ``train.intercept_scale``
penalized like the others (as in liblinear and Snap ML), so CoCoA minimises
f(β, b) + (λ/2)(b/s)²; held-out data and warm starts are not used. The result's ``objective``
is f itself, the catalogue's one definition (one more pass over the data), and the history's
``objective`` column is CoCoA's own primal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from terascale.solvers.errors import InvalidInputError
from terascale.solvers.params import SolverParams
from terascale.solvers.run import TrainResult, TrainRun
from terascale.solvers.scd import CocoaParams, CocoaState, train_cocoa

STATE_KIND = "cocoa"


def cocoa_params(p: SolverParams) -> CocoaParams:
    return CocoaParams(loss=p.loss, formulation=p.formulation, l2=p.l2, local_epochs=p.local_epochs,
                       aggregation=p.aggregation, partition=p.partition, threads=p.threads, max_rounds=p.passes, tol=p.tol, seed=p.seed,
                       intercept_scaling=p.intercept_scale)


def state_to_dict(s: CocoaState) -> dict[str, Any]:
    elapsed = float(s.history[-1].get("elapsed_s", 0.0)) if s.history else 0.0
    return {"kind": STATE_KIND, "per_rank": True, "pass": int(s.round), "elapsed_s": elapsed,
            "local": s.local, "shared": s.shared,
            "history": s.history, "pending": s.pending, "rank": s.rank, "size": s.size, "n_rows": s.n_rows,
            "params_key": list(s.params_key)}


def dict_to_state(d: dict[str, Any]) -> CocoaState:
    return CocoaState(round=int(d["pass"]), local=np.asarray(d["local"]), shared=np.asarray(d["shared"]),
                      history=list(d["history"]), pending=dict(d["pending"]), rank=int(d["rank"]),
                      size=int(d["size"]), n_rows=int(d["n_rows"]), params_key=_tuple(d["params_key"]))


def _tuple(v: Any) -> Any:
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


def check_cocoa_resume(state: dict[str, Any], params: SolverParams, n_features: int) -> None:
    if state.get("kind") != STATE_KIND:
        raise ValueError(f"resume state: kind = {state.get('kind')!r}: the solver 'cocoa' needs a 'cocoa' state")
    if int(state["shared"].shape[0]) not in (n_features + 1, int(state["n_rows"])) and params.formulation == "dual":
        raise ValueError(f"resume state: shared vector of length {state['shared'].shape[0]} does not fit {n_features} features")


def solve_cocoa(run: TrainRun) -> TrainResult:
    if run.init is not None:
        raise InvalidInputError("solver 'cocoa' cannot warm-start from a model (train.init_model); unset it")
    on_round = None if run.on_pass_end is None else (lambda s: run.on_pass_end(state_to_dict(s)))
    resume = None if run.resume is None else dict_to_state(run.resume)
    if run.params.device == "cpu" or run.params.partition == "redeal":
        res = train_cocoa(run.inputs.train, run.comm, cocoa_params(run.params), on_round_end=on_round, resume=resume)
    else:
        from terascale.solvers.scd.gpu import gpu_available, train_cocoa_gpu

        ok, reason = gpu_available()
        if not ok and run.params.device == "gpu":
            raise InvalidInputError(f"train.device = 'gpu' but this task has no usable GPU: {reason}; "
                                    "use train.device=auto to fall back to the CPU solver")
        res = train_cocoa_gpu(run.inputs.train, run.comm, cocoa_params(run.params), on_round_end=on_round,
                              resume=resume, fallback=True, blocks=run.params.gpu_blocks or None)
    history = [{**h, "pass": h.get("round", i + 1), "objective": h.get("primal")} for i, h in enumerate(res.history)]
    # f(β, b) of the catalogue's one definition (b unpenalized), the same on every rank
    theta = np.append(np.asarray(res.weights, np.float64), float(res.intercept))
    return TrainResult(weights=np.asarray(res.weights, np.float32), intercept=float(res.intercept), history=history,
                       objective=float(run.objective.value(theta)),
                       stop_reason="converged_gap" if res.converged else "max_passes", passes=int(res.rounds))
