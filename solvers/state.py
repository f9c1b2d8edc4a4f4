"""Checkpoint states: what ``on_pass_end`` receives and ``train(resume=...)`` accepts.

A state is a flat dict of numpy arrays and JSON-able values. Its arrays are *views* of the
solver's live state, valid only during the ``on_pass_end`` call (a checkpoint writer stores
them right away; copying the L-BFGS pairs on every rank every pass would cost
2·m·(d+1)·4 bytes each time): use :func:`copy_state` to keep one. It is the same on every rank: weights, accumulated squared gradients, L-BFGS pairs,
history and totals all come out of AllReduce results; the only rank-local online state, the
per-feature normalizers s_j = max |x_j|, is a function of the rank's data and is recomputed on
resume (with L1, the normalizers of features other ranks hold, agreed at the first averaging,
are in the state: ``online_scale_ids``, ``online_scale``); shuffles are seeded by (seed, rank, pass), so there is no RNG state to keep.

Keys: ``version``, ``params`` (dict), ``n_features``, ``phase`` ("online" | "lbfgs" | a
plugin's), ``pass`` (passes completed), ``stop_reason`` (None while the run should go on), ``weights``
(float32 online / float64 L-BFGS, length n_features), ``intercept``, ``history``,
``elapsed_s``, the early-stopping record ``best_theta`` / ``best_holdout_loss`` /
``best_objective`` / ``best_pass`` / ``stale_passes``, and the phase's own keys (``G``,
``online_t``, ``online_N``; ``lbfgs_*``). :func:`split_arrays` separates arrays from the rest
for storage (e.g. ``np.savez`` + JSON).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from terascale.solvers.params import SolverParams

#: 2: the L-BFGS phase's arrays (``lbfgs_S``/``lbfgs_Y``/``lbfgs_grad``/``lbfgs_inv_diag``) are
#: over its active features (``lbfgs_active``, see :mod:`solvers.active`); 1: over all features
#: in id order, still accepted. A build that knows only 1 refuses a version-2 state.
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)

#: Parameters a resumed run must share with the run that wrote the state (the others, e.g.
#: passes, tol and early_stop_passes, may change).
RESUME_INVARIANT = ("solver", "loss", "l2", "l1", "learning_rate", "online_passes", "lbfgs_memory",
                    "lbfgs_newton_steps", "lbfgs_curvature_rows", "lbfgs_coarse", "seed", "shuffle",
                    "invariant")


def build_state(params: SolverParams, n_features: int, phase: str, theta: np.ndarray,
                stop_reason: str | None, tracker_state: dict[str, Any],
                arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "params": params.to_json(),
        "n_features": int(n_features),
        "phase": phase,
        "pass": len(tracker_state["history"]),
        "stop_reason": stop_reason,
        "weights": theta[:-1],
        "intercept": float(theta[-1]),
    }
    state.update(tracker_state)
    state.update(arrays)
    state.update(scalars)
    return state


class Handover(dict):
    """A resume state handed over to the solver (a checkpoint loaded for this run alone): each
    restore takes its arrays out of it (:func:`take`) and may keep them as its own, so a resumed
    rank holds one copy of its state, not the solver's plus the dict's. At 100M rows the dict's
    copies (the L-BFGS pairs, the full weights, the gradient, the preconditioner) put a resumed
    rank 620 MB above the undisturbed run's peak. A plain dict is only read: a caller may resume
    from it again."""


def take(saved: dict[str, Any], key: str) -> Any:
    """``saved[key]``, taken out of a :class:`Handover` (its only reference then is the caller's)."""
    return saved.pop(key) if isinstance(saved, Handover) else saved[key]


def own(saved: dict[str, Any], key: str, dtype) -> np.ndarray:
    """The array ``saved[key]`` as ``dtype``, C-contiguous and writable: the handed-over array
    itself where it already is one, else a copy (the caller may modify it in place)."""
    a = take(saved, key)
    if isinstance(saved, Handover) and isinstance(a, np.ndarray) and a.dtype == dtype \
            and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=dtype)


def copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state that stays valid after ``on_pass_end`` returns."""
    out = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    out["history"] = [dict(e) for e in state["history"]]
    out["params"] = dict(state["params"])
    return out


def check_resume(state: dict[str, Any], params: SolverParams, n_features: int) -> None:
    """Raise ValueError naming the first key that makes ``state`` unusable for this run."""
    if state.get("version") not in _READABLE_VERSIONS:
        raise ValueError(f"resume state: version = {state.get('version')!r}: must be one of {_READABLE_VERSIONS}")
    if int(state["n_features"]) != n_features:
        raise ValueError(
            f"resume state: n_features = {state['n_features']}: the data has {n_features}"
        )
    saved = state["params"]
    for name in RESUME_INVARIANT:
        if saved.get(name) != getattr(params, name):
            raise ValueError(
                f"resume state: params.{name} = {saved.get(name)!r} differs from this run's "
                f"{getattr(params, name)!r}"
            )


def split_arrays(state: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(the numpy arrays, everything else) of a state; ``{**arrays, **rest}`` rebuilds it."""
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    return arrays, {k: v for k, v in state.items() if k not in arrays}
