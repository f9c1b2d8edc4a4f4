"""The solver registry: a name -> solver function table that modules add to on import.

A solver is ``fn(run: TrainRun) -> TrainResult`` (see :mod:`solvers.run`); it gets the
validated data, the communicator, the parameters, the distributed objective, the pass tracker
(history, timings, held-out loss, early stopping, checkpoints) and the resume state. Register
one with::

    from terascale.solvers.registry import register_solver

    @register_solver("cocoa")
    def train_cocoa(run): ...

``solvers.api`` imports the built-in solvers ("online", "lbfgs", "hybrid"); a plugin module
must be imported before ``train`` is called with its name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SolverFn = Callable[[Any], Any]

SOLVERS: dict[str, SolverFn] = {}
#: solvers whose checkpoint state has its own layout register how to check a resume state
RESUME_CHECKS: dict[str, Callable[..., None]] = {}


def register_solver(name: str, *, replace: bool = False,
                    check_resume: Callable[..., None] | None = None) -> Callable[[SolverFn], SolverFn]:
    """Decorator registering ``fn`` under ``name`` (a second registration needs ``replace``).

    ``check_resume(state, params, n_features)`` replaces the default check of a resume state.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"solver name must be a non-empty string, got {name!r}")

    def add(fn: SolverFn) -> SolverFn:
        if name in SOLVERS and SOLVERS[name] is not fn and not replace:
            raise ValueError(f"solver {name!r} is already registered ({SOLVERS[name]!r})")
        SOLVERS[name] = fn
        if check_resume is not None:
            RESUME_CHECKS[name] = check_resume
        return fn

    return add


def get_solver(name: str) -> SolverFn:
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(
            f"solver params: solver = {name!r}: must be one of the registered solvers "
            f"{sorted(SOLVERS)}"
        ) from None
