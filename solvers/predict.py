"""Scoring with a trained model: margins, probabilities (for a loss whose catalogue link is the
sigmoid), and the terms of the catalogue's objective f(β, b) on scored rows."""

from __future__ import annotations

import numpy as np

from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.objective import margin_loss_sum, margins
from terascale.solvers.shard import Shard


def decision_function(data: CSRData, weights: np.ndarray, intercept: float) -> np.ndarray:
    """m_i = x_i·weights + intercept (float64)."""
    s = Shard.from_csr(data)
    if weights.shape != (s.n_features,):
        raise ValueError(f"weights have shape {weights.shape}, the data {s.n_features} features")
    out = np.empty(s.n_rows, dtype=np.float64)
    margins(s.indptr, s.indices, s.values, s.vpos, weights, float(intercept), out)
    return out


def predict_proba(data: CSRData, weights: np.ndarray, intercept: float, logit_shift: float = 0.0) -> np.ndarray:
    """σ(m_i + logit_shift) = P(y_i = 1) under the logistic model, computed without overflow.

    ``logit_shift``: −ln r turns a model trained on negatives kept at rate r (weighted 1/r) into
    the click probability among the kept rows (``pipeline.sampling``); 0 leaves m_i untouched.
    """
    return sigmoid(decision_function(data, weights, intercept), logit_shift)


def sigmoid(m: np.ndarray, logit_shift: float = 0.0, slope: float = 1.0) -> np.ndarray:
    """σ(slope·m + logit_shift) of float64 margins, without overflow (the one scoring formula;
    slope 1 and shift 0 leave m as it is, so such scores are σ(m) bit for bit)."""
    if slope != 1.0:
        m = m * slope
    if logit_shift != 0.0:
        m = m + logit_shift
    e = np.exp(-np.abs(m))
    return np.where(m >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def loss_terms(m: np.ndarray, labels: np.ndarray, weights: np.ndarray, loss: str) -> tuple[float, float]:
    """(Σᵢ wᵢ·ℓ(yᵢ, mᵢ), Σᵢ wᵢ) over rows with margins ``m`` (:func:`decision_function`): the data
    part of the objective, exact (no probability clipping); sums from several parts add up."""
    return float(margin_loss_sum(m, labels, weights, loss_spec(loss).id)), float(weights.sum(dtype=np.float64))


def objective(loss_sum: float, weight_sum: float, weights: np.ndarray, l2: float, l1: float = 0.0) -> float:
    """f(β, b) = loss_sum / weight_sum + λ₁·‖β‖₁ + (λ/2)·‖β‖², the catalogue's one definition."""
    beta = np.asarray(weights, dtype=np.float64)
    if weight_sum <= 0:
        return float("nan")
    return loss_sum / weight_sum + l1 * float(np.abs(beta).sum()) + 0.5 * l2 * float(beta @ beta)
