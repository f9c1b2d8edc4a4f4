"""Public entry point of the solvers: ``train(data, comm, params, ...) -> TrainResult``.

    from terascale.solvers.api import SolverParams, train
    result = train(shard, comm, SolverParams(solver="hybrid", l2=1e-6), holdout=held_out)

Every rank calls ``train`` with its own shard and the same parameters. The solver is looked up
in the catalogue (:data:`SOLVERS`, :mod:`terascale.solvers.catalogue`; plugins register a
:class:`SolverSpec` of their own). Before any other collective, all
ranks validate their inputs locally; they agree on them (and on the totals) in the first
collective, after the first pass (:mod:`solvers.setup`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.catalogue import SOLVERS, SolverSpec, loss_spec, register_solver, solver_spec
from terascale.solvers.data import NO_GROUP, CSRData
from terascale.solvers.errors import NonFiniteInputError
from terascale.solvers.objective import DistributedObjective
from terascale.solvers.params import SolverParams
from terascale.solvers.regpath import auto_penalty, train_path
from terascale.solvers.run import TrainResult, TrainRun, rows_reporter
from terascale.solvers.setup import AgreeingCommunicator, Inputs
from terascale.solvers.state import check_resume
from terascale.solvers.threads import RowThreads
from terascale.solvers.tracker import PassTracker

__all__ = ["SOLVERS", "SolverParams", "SolverSpec", "TrainResult", "TrainRun", "register_solver", "train"]


def train(data: CSRData, comm: Communicator, params: SolverParams | None = None,
          holdout: CSRData | None = None, on_pass_end: Callable[[dict], Any] | None = None,
          resume: dict | None = None, progress: Callable[[int, int], Any] | None = None,
          init: tuple[np.ndarray, float] | None = None, groups: np.ndarray | None = None,
          consume_data: bool = False, path_rows: int = 0) -> TrainResult:
    """Fit a linear model to the data of all ranks (see :mod:`solvers.params` for the objective).

    ``holdout``: this rank's held-out rows (scored after every pass; early stopping).
    ``on_pass_end(state)``: called after every completed pass with a checkpoint state
    (:mod:`solvers.state`); ``resume=state`` continues from one (every rank passes the same
    state). ``progress(pass_number, rows_done)``: called during every pass after each chunk of
    rows (heartbeats; it may raise to abandon the run). ``init=(weights, intercept)``: start
    from these weights instead of zeros (ignored when resuming). ``groups``: the feature group
    (field) of every feature, uint8 of length n_features with 255 for none, the same on every
    rank (a featurized dataset's group map, ``pipeline.groups``): L-BFGS then adds the
    field-level coarse correction to its preconditioner (``lbfgs_coarse``). ``consume_data``:
    the caller hands ``data`` over; L-BFGS then renumbers its index array in place for its
    working table instead of copying it (4 bytes per non-zero less at the peak; a file-backed
    shard is renumbered in its file and keeps streaming), once per call, a regularization path
    included (its steps share the table, :func:`solvers.local_table.working_table`), so
    ``data.indices`` no longer holds feature ids afterwards.

    ``params.threads`` = T: every pass runs T threads over row blocks (:mod:`solvers.threads`;
    the pool is made here and shut down when ``train`` returns); CoCoA's local solver uses its
    own T threads. T = 1 runs on the calling thread.

    ``params.l2 = "auto"``: a regularization path (:mod:`solvers.regpath`): one fit per λ of a
    decreasing path, each warm-started from the one before, and the result of the λ with the
    best held-out loss, with the path in :attr:`TrainResult.path`; it needs ``holdout``.
    ``path_rows``: the data's rows over all ranks (the same number on every rank), which the
    path's values scale with (0: the fixed values of :mod:`solvers.regpath`).

    No collective happens before the first pass over the data is done (the input agreement
    rides on the first collective). Raises InvalidInputError / NonFiniteInputError for bad
    inputs and DivergenceError for a non-finite loss or weights, on every rank.
    """
    params = params or SolverParams()
    spec = solver_spec(params.solver)
    if resume is not None:
        (spec.check_resume or check_resume)(resume, params, data.n_features)
    theta0 = None if init is None or resume is not None else _initial_theta(init, data.n_features)
    _check_groups(groups, data.n_features)
    path = auto_penalty(params)
    inputs = Inputs(comm.rank, data, holdout, params.loss, consume_data)
    solver_comm = AgreeingCommunicator(comm, inputs)
    if inputs.problem is not None:
        inputs.agree(comm)  # raises here, and on every other rank at its first collective
    if path is not None:
        return train_path(path, solve, inputs, solver_comm, params, on_pass_end, resume, progress, theta0, groups,
                          rows=path_rows)
    return solve(inputs, solver_comm, params, on_pass_end, resume, progress, theta0, groups)


def solve(inputs: Inputs, comm: AgreeingCommunicator, params: SolverParams,
          on_pass_end: Callable[[dict], Any] | None, resume: dict | None,
          progress: Callable[[int, int], Any] | None, theta0: np.ndarray | None,
          groups: np.ndarray | None) -> TrainResult:
    """One fit of the catalogue's solver over validated inputs (the second half of
    :func:`train`; a regularization path, :mod:`solvers.regpath`, calls it once per λ)."""
    loss_id = loss_spec(params.loss).id
    with RowThreads(params.threads) as threads:  # the pool lives for the run (solvers.threads)
        tracker = PassTracker(comm, inputs, loss_id, params.early_stop_passes, resume, threads)
        on_rows = rows_reporter(progress, tracker)
        objective = DistributedObjective(inputs, comm, loss_id, params.l2, on_rows, threads, params.l1)
        run = TrainRun(comm, params, inputs, loss_id, objective, tracker, on_pass_end, resume,
                       on_rows, theta0, groups, threads)
        return solver_spec(params.solver).function()(run)


def _initial_theta(init: tuple[np.ndarray, float], n_features: int) -> np.ndarray:
    weights, intercept = init
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != (n_features,):
        raise ValueError(f"init: weights have length {w.shape[0]}, the data {n_features} features")
    theta = np.append(w, float(intercept))
    if not np.isfinite(theta).all():
        raise NonFiniteInputError("init: the initial weights or intercept are not finite")
    return theta


def _check_groups(groups: np.ndarray | None, n_features: int) -> None:
    if groups is None:
        return
    if not isinstance(groups, np.ndarray) or groups.dtype != np.uint8 or groups.shape != (n_features,):
        shape = getattr(groups, "shape", None)
        dtype = getattr(groups, "dtype", type(groups).__name__)
        raise ValueError(
            f"groups: must be a uint8 array of length n_features = {n_features} ({NO_GROUP} = no group), "
            f"got {dtype} of shape {shape}"
        )
