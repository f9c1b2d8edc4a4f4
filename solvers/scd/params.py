"""Parameters, result and checkpoint state of the CoCoA / SCD trainer.

``CocoaParams`` is frozen and validated on construction; constraints are declared as data next
to each field and every error names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

_LOSSES = ("logistic", "hinge", "squared")
_FORMULATIONS = ("dual", "primal")
_AGGREGATIONS = ("adaptive", "avg", "add")
_PARTITIONS = ("fixed", "redeal")


def _one_of(*options: Any) -> tuple[Any, str]:
    return (lambda v: v in options), "one of " + ", ".join(repr(o) for o in options)


def _int_at_least(lo: int) -> tuple[Any, str]:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo  # noqa: E731
    return ok, f"an integer >= {lo}"


def _positive_finite() -> tuple[Any, str]:
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0  # noqa: E731
    return ok, "a finite number > 0"


def _nonneg_finite() -> tuple[Any, str]:
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0  # noqa: E731
    return ok, "a finite number >= 0"


def _boolean() -> tuple[Any, str]:
    return (lambda v: isinstance(v, bool)), "true or false"


def _p(default: Any, help: str, constraint: tuple[Any, str]) -> Any:
    return field(default=default, metadata={"help": help, "constraint": constraint})


@dataclass(frozen=True)
class CocoaParams:
    """Everything that defines a CoCoA / SCD run (see ``solvers.scd`` for the formulas)."""

    loss: str = _p("logistic", "logistic and hinge: labels 0/1; squared: ridge regression", _one_of(*_LOSSES))
    formulation: str = _p(
        "dual",
        "dual: SDCA on examples (every loss); primal: SCD on features (squared only; with K > 1 "
        "every rank gathers its block of columns over all rows once)",
        _one_of(*_FORMULATIONS),
    )
    l2: float = _p(1e-5, "lambda of (lambda/2)||beta||^2 in the mean-form objective", _positive_finite())
    local_epochs: int = _p(1, "H: local epochs per round on each worker", _int_at_least(1))
    aggregation: str = _p(
        "adaptive",
        "adaptive: exact line search for gamma (sigma' = 1); avg: gamma = 1/K (sigma' = 1); "
        "add: gamma = 1 with sigma' = K (CoCoA+)",
        _one_of(*_AGGREGATIONS),
    )
    partition: str = _p(
        "fixed",
        "fixed: each rank's local solver works on its own shard; redeal (dual only): every rank "
        "gathers all rows once (K times the memory) and the row buckets are dealt to the ranks "
        "afresh every round, which keeps the gap decaying linearly at small lambda N",
        _one_of(*_PARTITIONS),
    )
    threads: int = _p(1, "local solver partitions (numba threads); 1 = sequential SCD", _int_at_least(1))
    bucket_size: int = _p(
        8, "consecutive examples (features) per bucket of the shuffled epoch order "
        "(1: a plain permutation)", _int_at_least(1))
    max_rounds: int = _p(100, "communication rounds at most", _int_at_least(0))
    tol: float = _p(1e-6, "stop when duality gap <= tol * P(0) (P(0): the objective at beta = 0)", _nonneg_finite())
    seed: int = _p(0, "seed of the per-epoch permutations", _int_at_least(0))
    fit_intercept: bool = _p(True, "augment every row with a constant feature, regularized like the others", _boolean())
    intercept_scaling: float = _p(1.0, "value of the constant feature", _positive_finite())

    def __post_init__(self) -> None:
        for f in fields(self):
            ok, allowed = f.metadata["constraint"]
            value = getattr(self, f.name)
            if not ok(value):
                raise ValueError(f"cocoa.{f.name}: {value!r} is not allowed; expected {allowed}")
        if self.formulation == "primal" and self.loss != "squared":
            raise ValueError(
                f"cocoa.formulation: 'primal' is not allowed with loss {self.loss!r}; "
                "expected 'dual' (the primal solver is ridge regression only)"
            )
        if self.formulation == "primal" and self.partition != "fixed":
            raise ValueError(
                f"cocoa.partition: {self.partition!r} is not allowed with formulation 'primal'; "
                "expected 'fixed' (re-dealing moves examples, the primal solver owns features)"
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
