"""Parameters, result and checkpoint state of the CoCoA / SCD trainer.

``CocoaParams`` is frozen and validated on construction with the project's one parameter
mechanism (:mod:`terascale.solvers.constraints`): constraints declared as data next to each
field, every error ``cocoa.<key> = <value>: must be <allowed>``. The train job builds one from
its :class:`~terascale.solvers.params.SolverParams` (``terascale.solvers.cocoa_solver``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from terascale.solvers.catalogue import LOSSES
from terascale.solvers.constraints import ConfigError, Interval, OneOf, check_fields
from terascale.solvers.constraints import param as _p

_DUAL_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.dual)
_FORMULATIONS = ("dual", "primal")
_AGGREGATIONS = ("adaptive", "avg", "add")
_PARTITIONS = ("fixed", "redeal")
_POSITIVE = Interval(0, None, lo_open=True)


@dataclass(frozen=True)
class CocoaParams:
    """Everything that defines a CoCoA / SCD run (see ``solvers.scd`` for the formulas)."""

    loss: str = _p("logistic", "logistic, hinge and squared_hinge: labels 0/1; squared: ridge regression", OneOf(_DUAL_LOSSES))
    formulation: str = _p(
        "dual",
        "dual: SDCA on examples (every loss); primal: SCD on features (squared only; with K > 1 "
        "every rank gathers its block of columns over all rows once)",
        OneOf(_FORMULATIONS),
    )
    l2: float = _p(1e-5, "lambda of (lambda/2)||beta||^2 in the mean-form objective", _POSITIVE)
    local_epochs: int = _p(1, "H: local epochs per round on each worker", Interval(1, None, integer=True))
    aggregation: str = _p(
        "adaptive",
        "adaptive: exact line search for gamma (sigma' = 1); avg: gamma = 1/K (sigma' = 1); "
        "add: gamma = 1 with sigma' = K (CoCoA+)",
        OneOf(_AGGREGATIONS),
    )
    partition: str = _p(
        "fixed",
        "fixed: each rank's local solver works on its own shard; redeal (dual only): every rank "
        "gathers all rows once (K times the memory) and the row buckets are dealt to the ranks "
        "afresh every round, which keeps the gap decaying linearly at small lambda N",
        OneOf(_PARTITIONS),
    )
    threads: int = _p(1, "local solver partitions (numba threads); 1 = sequential SCD", Interval(1, None, integer=True))
    bucket_size: int = _p(
        8, "consecutive examples (features) per bucket of the shuffled epoch order "
        "(1: a plain permutation)", Interval(1, None, integer=True))
    max_rounds: int = _p(100, "communication rounds at most", Interval(0, None, integer=True))
    tol: float = _p(1e-6, "stop when duality gap <= tol * P(0) (P(0): the objective at beta = 0)", Interval(0, None))
    seed: int = _p(0, "seed of the per-epoch permutations", Interval(0, None, integer=True))
    fit_intercept: bool = _p(True, "augment every row with a constant feature, regularized like the others")
    intercept_scaling: float = _p(1.0, "value of the constant feature", _POSITIVE)

    def __post_init__(self) -> None:
        check_fields(self, "cocoa.")
        if self.formulation == "primal" and self.loss != "squared":
            raise ConfigError(
                f"cocoa.formulation = 'primal': needs cocoa.loss = 'squared' (got {self.loss!r}); "
                "use 'dual' (the primal solver is ridge regression only)"
            )
        if self.formulation == "primal" and self.partition != "fixed":
            raise ConfigError(
                f"cocoa.partition = {self.partition!r}: needs cocoa.partition = 'fixed' with formulation 'primal' "
                "(re-dealing moves examples, the primal solver owns features)"
            )

    @property
    def bias_scale(self) -> float:
        """Value of the augmented constant feature (0: no intercept)."""
        return float(self.intercept_scaling) if self.fit_intercept else 0.0

    def trajectory_key(self) -> tuple:
        """The fields that determine the iterates (a resumed run must agree on them)."""
        return tuple(
            getattr(self, f.name) for f in fields(self) if f.name not in ("max_rounds", "tol")
        )


@dataclass(frozen=True)
class CocoaResult:
    """The trained model and how it got there.

    ``weights`` float32 (n_features,); ``intercept`` = beta_bias * intercept_scaling;
    ``primal``, ``dual`` and ``gap`` of the returned (float64) iterate; ``history`` one row per
    point (round 0 = the start): round, primal, dual, gap, gamma (of the round that produced the
    point), elapsed_s, and per-rank compute_s / stall_s / transfer_s lists of that round.
    """

    weights: np.ndarray
    intercept: float
    history: list[dict]
    primal: float
    dual: float
    gap: float
    rounds: int
    converged: bool


@dataclass(frozen=True)
class CocoaState:
    """What ``on_round_end`` receives after every round, and what ``resume`` takes back.

    Arrays are copies. ``local`` is this rank's dual variables (dual formulation) or this rank's
    block of primal coefficients (primal formulation); ``shared`` is the replicated shared vector
    (w of length n_features + 1, or the margins z of all rows). ``pending`` holds the gamma,
    elapsed time and timings of the round that produced the current point, whose history row
    is completed by the next round's allreduce.
    """

    round: int
    local: np.ndarray
    shared: np.ndarray
    history: list[dict]
    pending: dict
    rank: int
    size: int
    n_rows: int
    params_key: tuple
