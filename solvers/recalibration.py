"""Recalibration on the held-out rows: the slope a and shift c of σ(a·m + c), fitted to the rows
no pass trained on (Platt scaling of the model's own margins m).

**Why.** A model trained on negative-downsampled rows (``featurize.negative_rate`` = r, kept
negatives weighted 1/r) minimises an unbiased estimate of the population's loss, but its
probabilities are not unbiased: a rare value seen in a few clicks and in no kept negative gets a
large weight that the unsampled rows would not give it, so the model over-predicts on new data
(calibration 1.07-1.09 on the click-log benchmark at 33 negatives per click; figures in
docs/pages/explanation/design-notes.md). Rows that no pass saw measure that optimism; two parameters fitted to
them correct the level and the spread of the margins without touching the ranking.

**Objective.** L(a, c) = Σᵢ hᵢ·ℓ(yᵢ, a·mᵢ + c) / Σᵢ hᵢ over every rank's held-out rows, ℓ the
logistic loss, hᵢ the rows' weights (1/r for kept negatives: the weighted held-out loss estimates
the population's). L is convex in (a, c); (1, 0) is the model itself.

**Method.** Newton's method from (1, 0): one AllReduce of the six sums of
:func:`~solvers.kernels.calibration.platt_sums` per trial point gives L, its gradient and its
Hessian; the step solves the 2×2 system and is halved until L does not increase (at most
:data:`MAX_HALVINGS` times). When the margins barely vary (the Hessian's determinant below
:data:`SINGULAR` of the product of its diagonal) only c moves. It stops when the Newton
decrement gᵀH⁻¹g/2 falls to :data:`TOL` (mean log loss), or after :data:`MAX_ITERATIONS`. Every
rank computes the same iterates from the same summed bytes, so (a, c) has the same bits on every
rank; the sums over a rank's rows are in row order, so a given split gives the same bits on every
run.

There is nothing to fit, and :func:`fit` returns None, when the held-out rows weigh nothing or
hold one class only (L then has no finite minimum).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.calibration import SUMS, platt_sums

MAX_ITERATIONS = 50
MAX_HALVINGS = 30
TOL = 1e-15
SINGULAR = 1e-12


@dataclass(frozen=True)
class Recalibration:
    """σ(slope·m + shift) is the recalibrated probability of a row with margin m."""

    slope: float
    shift: float
    holdout_rows: int
    holdout_weight: float
    holdout_loss_before: float  # L(1, 0): the model's own held-out loss
    holdout_loss_after: float  # L(slope, shift)
    iterations: int

    def to_json(self) -> dict:
        return asdict(self)


def fit(comm: Communicator, margins: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> Recalibration | None:
    """Fit (a, c) on every rank's held-out rows (this rank's: ``margins``, float64, with their
    ``labels`` and ``weights``); see the module docstring. Every rank calls it."""
    m = np.ascontiguousarray(margins, dtype=np.float64)
    y = np.ascontiguousarray(labels, dtype=np.float32)
    h = np.ascontiguousarray(weights, dtype=np.float32)
    w64 = h.astype(np.float64)
    n_rows, total, positive = comm.allreduce(np.array([m.shape[0], w64.sum(), float(w64 @ y)], dtype=np.float64))
    if not total > 0.0 or positive <= 0.0 or positive >= total:
        return None
    local = np.empty(SUMS, dtype=np.float64)

    def sums(a: float, c: float) -> np.ndarray:
        platt_sums(m, y, h, a, c, local)
        return comm.allreduce(local) / total

    a, c = 1.0, 0.0
    cur = sums(a, c)
    before = float(cur[0])
    done = 0
    for done in range(1, MAX_ITERATIONS + 1):  # noqa: B007 - the count is reported
        step = _newton_step(cur)
        if step is None:
            break
        da, dc, decrement = step
        if decrement <= TOL:
            break
        t = 1.0
        for _ in range(MAX_HALVINGS):
            trial = sums(a - t * da, c - t * dc)
            if trial[0] <= cur[0]:
                a, c, cur = a - t * da, c - t * dc, trial
                break
            t *= 0.5
        else:  # no decrease along the Newton direction: at the optimum to rounding
            break
    return Recalibration(float(a), float(c), int(n_rows), float(total), before, float(cur[0]), done)


def _newton_step(s: np.ndarray) -> tuple[float, float, float] | None:
    """(Δa, Δc, gᵀH⁻¹g/2) of the Newton step from the mean sums ``s``; Δa = 0 when the Hessian is
    (nearly) singular; None when no step exists (no curvature at all)."""
    ga, gc, haa, hac, hcc = (float(v) for v in s[1:])
    det = haa * hcc - hac * hac
    if haa > 0.0 and det > SINGULAR * haa * hcc:
        da = (hcc * ga - hac * gc) / det
        dc = (haa * gc - hac * ga) / det
    elif hcc > 0.0:
        da, dc = 0.0, gc / hcc
    else:
        return None
    decrement = 0.5 * (ga * da + gc * dc)
    return da, dc, decrement if math.isfinite(decrement) else 0.0


def recalibrate(comm: Communicator, holdout: CSRData | None, weights: np.ndarray, intercept: float) -> Recalibration | None:
    """Score this rank's held-out rows with the model (``weights``, ``intercept``) and :func:`fit`
    (a, c) on all ranks' (a rank without held-out rows takes part with none)."""
    from terascale.solvers.predict import decision_function

    if holdout is None or holdout.n_rows == 0:
        empty = np.zeros(0, dtype=np.float32)
        return fit(comm, np.zeros(0, dtype=np.float64), empty, empty)
    return fit(comm, decision_function(holdout, weights, intercept), holdout.labels, holdout.weights)
