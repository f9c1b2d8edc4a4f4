"""``train_cocoa``: the entry point the solver registry calls (``solver = "cocoa"``).

Every rank calls it with its own shard and the same ``params``; all ranks return the same
model (bit-identical weights). Local validation happens before the first collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.values import densified
from terascale.solvers.scd.dual_problem import DualProblem
from terascale.solvers.scd.params import CocoaParams, CocoaResult, CocoaState
from terascale.solvers.scd.primal_problem import PrimalProblem
from terascale.solvers.scd.redeal import RedealtDualProblem
from terascale.solvers.scd.rounds import Problem, RoundLoop
from terascale.solvers.scd.timing import RoundClock

FORMULATIONS = {("dual", "fixed"): DualProblem, ("dual", "redeal"): RedealtDualProblem,
                ("primal", "fixed"): PrimalProblem}


def check_shard(data: CSRData, params: CocoaParams) -> None:
    """Raise ValueError naming the problem if this shard cannot be trained on."""
    if data.nnz and (int(data.indices.min()) < 0 or int(data.indices.max()) >= data.n_features):
        raise ValueError(f"feature indices must lie in [0, {data.n_features})")
    if not np.all(np.isfinite(data.values)):
        raise ValueError("feature values must be finite")
    if not np.all(np.isfinite(data.weights)) or (data.n_rows and float(data.weights.min()) <= 0.0):
        raise ValueError("importance weights must be finite and > 0")
    if not np.all(np.isfinite(data.labels)):
        raise ValueError("labels must be finite")
    if loss_spec(params.loss).check_labels(data.labels) >= 0:
        raise ValueError(f"loss {params.loss!r} takes labels 0 or 1")


def train_cocoa(
    data: CSRData,
    comm: Communicator,
    params: CocoaParams,
    on_round_end: Callable[[CocoaState], None] | None = None,
    resume: CocoaState | None = None,
    make_problem: Callable[[CSRData, Communicator, CocoaParams, float], Problem] | None = None,
) -> CocoaResult:
    """Train ``params.loss`` with l2 penalty by (distributed) SCD / CoCoA on this rank's shard.

    Objective: ``P(beta) = (1/N) sum_i c_i phi(y_i, x_i . beta) + (l2/2) ||beta||^2`` over the
    rows of all ranks, ``N = sum_i c_i`` (c = importance weights); with ``fit_intercept`` every
    row has an extra constant feature ``intercept_scaling`` whose coefficient is regularized
    like the others (as liblinear and Snap ML do), and ``intercept = beta_bias * intercept_scaling``.
    ``on_round_end(state)`` receives a :class:`CocoaState` after every round; passing one back
    as ``resume`` (same shard, rank, size and trajectory parameters) continues exactly where it
    left off. ``make_problem(data, comm, params, n_weight)`` builds this rank's side of the
    rounds (default: ``FORMULATIONS[params.formulation, params.partition]``, on the CPU; ``train_cocoa_gpu``
    passes the GPU problems of ``gpu_problem``).
    """
    data = densified(data)  # the SCD kernels read one value per non-zero
    check_shard(data, params)
    t0 = time.perf_counter()
    clock = RoundClock(comm)
    n_weight, _ = comm.allreduce_scalars([float(np.sum(data.weights, dtype=np.float64)),
                                          float(data.n_rows)])
    if not n_weight > 0.0:
        raise ValueError("the training data is empty (total weight 0 over all ranks)")
    problem = (make_problem or FORMULATIONS[params.formulation, params.partition])(
        data, comm, params, n_weight)
    loop = RoundLoop(problem, comm, params, clock, t0, data.n_rows)
    if resume is not None:
        loop.restore(resume)
    loop.run(on_round_end)
    beta = problem.model()
    last = loop.history[-1]
    return CocoaResult(
        weights=beta[: data.n_features].astype(np.float32),
        intercept=float(beta[data.n_features]) * params.bias_scale,
        history=loop.history,
        primal=last["primal"],
        dual=last["dual"],
        gap=last["gap"],
        rounds=loop.round,
        converged=loop.converged,
    )
