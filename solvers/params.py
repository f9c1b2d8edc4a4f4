"""The solver parameters: one frozen dataclass, each field with its default and meaning.

The configuration schema mirrors these names under ``train.*``. Constraints are declared as
data (:data:`CONSTRAINTS`) and checked on construction with one error format:
``solver params: <name> = <value>: must be <constraint>``.

Objective (mean form), for every solver:
    f(β, b) = (1/Σᵢwᵢ)·Σᵢ wᵢ·ℓ(yᵢ, xᵢ·β + b) + (λ/2)·‖β‖²,  λ = ``l2``, intercept b unpenalized.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from terascale.solvers.kernels.losses import LOSS_IDS


@dataclass(frozen=True)
class SolverParams:
    #: Registered solver: "hybrid" (one online pass, weighted average, then L-BFGS warm-started
    #: from it), "online" (online passes with weighted averaging after each), "lbfgs" (L-BFGS
    #: from zero), or one registered by a plugin module (e.g. "cocoa"). Checked by ``train``.
    solver: str = "hybrid"
    #: "logistic" (labels 0/1), "squared" (real labels), "hinge" (labels 0/1 as -1/+1).
    loss: str = "logistic"
    #: λ ≥ 0 in the mean-form objective. 1e-6 keeps the optimum finite for hashed features
    #: that occur in one class only (their unregularized logistic weight is infinite) while
    #: shrinking features seen in fewer than ~1e-5 of the rows; tune it on held-out data.
    l2: float = 1e-6
    #: Maximum passes over the data, online passes included. An online pass is one pass over
    #: the data; an L-BFGS pass is one iteration (a line search, usually one function
    #: evaluation; the history records ``evaluations``).
    passes: int = 20
    #: Hybrid only: online passes before L-BFGS starts (≤ passes).
    online_passes: int = 1
    #: η of the online update (Vowpal Wabbit's -l, default 0.5).
    learning_rate: float = 0.5
    #: L-BFGS memory m: correction pairs kept.
    lbfgs_memory: int = 15
    #: L-BFGS: while the memory holds fewer than this many curvature pairs (the first
    #: iterations, and after a restart), the line search starts at the 1-D Newton step along the
    #: direction, from one curvature pass (a gather over the rows, no scatter), instead of at
    #: step 1, whose scale the few pairs do not yet fix; 0: always step 1. Not for the hinge
    #: loss (no curvature). A value above ``lbfgs_memory`` means a curvature pass every pass.
    lbfgs_newton_steps: int = 2
    #: The curvature pass of a Newton step passes over about this many rows per rank (evenly
    #: spread runs of 512 rows, their sum scaled by the rank's weight over theirs) instead of all
    #: of them: the step only sets where the line search starts, and on the 2M-row click
    #: benchmark 2¹⁶ rows of a 1M-row rank estimated the curvature within 0.1%, 15x faster.
    #: 0: every row.
    lbfgs_curvature_rows: int = 1 << 16
    #: L-BFGS: add the field-level coarse correction to the Jacobi preconditioner when the data
    #: come with a group map (the feature field of each hashed bucket; the featurizer writes
    #: one): exact curvature along "shift a field's weights, compensate with the intercept",
    #: directions the data barely constrain (:mod:`solvers.preconditioner`). Off: Jacobi only.
    lbfgs_coarse: bool = True
    #: Relative tolerance of L-BFGS: stop when ‖∇f‖ ≤ tol·‖∇f at the L-BFGS start‖ or when
    #: the objective changes by at most tol·|f| in a pass.
    tol: float = 1e-7
    #: With held-out data: stop after this many consecutive passes without a lower held-out
    #: loss and return the best weights seen; 0 turns early stopping off.
    early_stop_passes: int = 3
    #: Seed of the example shuffle (used only with ``shuffle``).
    seed: int = 0
    #: Shuffle the examples of each online pass (order seeded by seed, rank and pass number);
    #: off = the stored order, like Vowpal Wabbit.
    shuffle: bool = False
    #: Importance-invariant online updates (Karampatziakis & Langford); off = plain adaptive,
    #: normalized gradient steps, which can diverge with a large learning rate.
    invariant: bool = True
    #: CoCoA only (solver "cocoa"): local epochs H per round, the aggregation ("adaptive": the
    #: optimal step; "avg": 1/K; "add": CoCoA+), local solver threads, and the formulation
    #: ("dual"; "primal" for the squared loss only). ``passes`` bounds the rounds, and ``tol``
    #: is the relative duality gap that stops them.
    local_epochs: int = 1
    aggregation: str = "adaptive"
    threads: int = 1
    formulation: str = "dual"
    #: CoCoA only: "fixed" shards, or "redeal" (dual only): every worker gathers all rows once
    #: and the rows are dealt to the workers afresh every round (see ``solvers.scd.redeal``).
    partition: str = "fixed"
    #: CoCoA only: the local solver runs on "cpu", on a "gpu" (TPA-SCD; an error without one),
    #: or on the GPU when there is one ("auto", else the CPU with a warning naming the reason).
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name, (check, allowed) in CONSTRAINTS.items():
            value = getattr(self, name)
            if not check(value):
                raise ValueError(f"solver params: {name} = {value!r}: must be {allowed}")
        if self.online_passes > self.passes:
            raise ValueError(
                f"solver params: online_passes = {self.online_passes}: must be <= passes "
                f"({self.passes})"
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SolverParams:
        return cls(**d)


def _int_in(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _finite_float(lo: float, lo_open: bool):
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return v > lo if lo_open else v >= lo

    return check


CONSTRAINTS = {
    "solver": (lambda v: isinstance(v, str) and v != "", "a non-empty solver name"),
    "loss": (lambda v: v in LOSS_IDS, f"one of {sorted(LOSS_IDS)}"),
    "l2": (_finite_float(0.0, False), "a finite number >= 0"),
    "passes": (_int_in(1, 1_000_000), "an integer in [1, 1000000]"),
    "online_passes": (_int_in(0, 1_000_000), "an integer in [0, 1000000]"),
    "learning_rate": (_finite_float(0.0, True), "a finite number > 0"),
    "lbfgs_memory": (_int_in(1, 1000), "an integer in [1, 1000]"),
    "lbfgs_newton_steps": (_int_in(0, 1000), "an integer in [0, 1000]"),
    "lbfgs_curvature_rows": (_int_in(0, 1_000_000_000), "an integer in [0, 1000000000]"),
    "lbfgs_coarse": (lambda v: isinstance(v, bool), "true or false"),
    "tol": (_finite_float(0.0, False), "a finite number >= 0"),
    "early_stop_passes": (_int_in(0, 1_000_000), "an integer in [0, 1000000]"),
    "seed": (_int_in(0, 2**63 - 1), "an integer in [0, 2^63 - 1]"),
    "shuffle": (lambda v: isinstance(v, bool), "true or false"),
    "invariant": (lambda v: isinstance(v, bool), "true or false"),
    "local_epochs": (_int_in(1, 1_000_000), "an integer in [1, 1000000]"),
    "aggregation": (lambda v: v in ("adaptive", "avg", "add"), "one of 'adaptive', 'avg', 'add'"),
    "threads": (_int_in(1, 1024), "an integer in [1, 1024]"),
    "formulation": (lambda v: v in ("dual", "primal"), "one of 'dual', 'primal'"),
    "partition": (lambda v: v in ("fixed", "redeal"), "one of 'fixed', 'redeal'"),
    "device": (lambda v: v in ("cpu", "gpu", "auto"), "one of 'cpu', 'gpu', 'auto'"),
}
