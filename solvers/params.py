"""The solver parameters, :class:`SolverParams`: one frozen dataclass derived from the
catalogue's declarations (:data:`terascale.solvers.catalogue.PARAMS`), so every parameter is
declared once, with its default, help and constraint, and ``train.<name>`` is its key.

Construction validates every field (``train.<name> = <value>: must be <allowed>``) and then the
chosen solver's cross-checks (:func:`terascale.solvers.catalogue.check_solver_params`); the
train job builds one on the driver, so a bad combination stops it before Spark starts.

Notes on the parameters whose help is short:

- ``l2``: λ ≥ 0 of the objective (see the catalogue), or ``"auto"`` (the default): a
  regularization path chooses λ on the held-out split (:mod:`terascale.solvers.regpath`). Any
  λ > 0 keeps the optimum finite for hashed features that occur in one class only (their
  unregularized logistic weight is infinite); λ shrinks features seen in fewer than about
  λ/(p(1−p)) of the rows. The former fixed default, 1e-6, overfits a few hundred thousand rows.
- ``l1``: λ₁ ≥ 0 of the L1 term λ₁·‖β‖₁ (the intercept unpenalized); with λ₁ > 0 the L-BFGS
  phase is OWL-QN (:mod:`terascale.solvers.owlqn`) and every online pass shrinks weights towards
  0 (truncated gradient, :mod:`terascale.solvers.kernels.online`); cocoa refuses it. ``"auto"``:
  a path over λ₁ chosen on the held-out split, as for ``l2`` (then ``l2`` must be a number).
- ``passes``: an online pass is one pass over the data; an L-BFGS pass is one iteration (a
  line search, usually one function evaluation; the history records ``evaluations``); a CoCoA
  pass is one round.
- ``lbfgs_newton_steps``: not used with a loss without curvature (hinge): only the penalty
  would bend the line.
- ``lbfgs_curvature_rows``: the step only sets where the line search starts, so a sample of
  rows (evenly spread runs of 512, their sum scaled by the rank's weight over theirs) is enough.
- ``lbfgs_coarse``: exact curvature along "shift a field's weights, compensate with the
  intercept", directions the data barely constrain (:mod:`terascale.solvers.preconditioner`).
- ``shuffle``: the order of an online pass is seeded by (seed, rank, pass).
- ``invariant``: importance-invariant updates (Karampatziakis & Langford); off = plain
  adaptive, normalized gradient steps, which can diverge with a large learning rate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from terascale.solvers.catalogue import PARAMS, check_solver_params
from terascale.solvers.constraints import check_fields


def _post_init(self) -> None:
    check_fields(self, "train.")
    check_solver_params(self)


def _to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _from_json(cls, d: dict[str, Any]):
    return cls(**d)


SolverParams = dataclasses.make_dataclass(
    "SolverParams",
    [(f.name, type(f.default), dataclasses.field(default=f.default, metadata=f.metadata)) for f in PARAMS],
    frozen=True,
    namespace={"__post_init__": _post_init, "to_json": _to_json, "from_json": classmethod(_from_json),
               "__module__": __name__,
               "__doc__": "Everything that defines a training run's optimisation (see the catalogue)."},
)
