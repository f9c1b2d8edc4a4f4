"""Scoring with a trained model: margins and, for the logistic loss, probabilities."""

from __future__ import annotations

import numpy as np
from terascale.solvers.data import CSRData
from terascale.solvers.kernels.objective import margins
from terascale.solvers.shard import Shard


def decision_function(data: CSRData, weights: np.ndarray, intercept: float) -> np.ndarray:
    """m_i = x_i·weights + intercept (float64)."""
    s = Shard.from_csr(data)
    if weights.shape != (s.n_features,):
        raise ValueError(f"weights have shape {weights.shape}, the data {s.n_features} features")
    out = np.empty(s.n_rows, dtype=np.float64)
    margins(s.indptr, s.indices, s.values, weights, float(intercept), out)
    return out


def predict_proba(data: CSRData, weights: np.ndarray, intercept: float, logit_shift: float = 0.0) -> np.ndarray:
    """σ(m_i + logit_shift) = P(y_i = 1) under the logistic model, computed without overflow.

    ``logit_shift``: −ln r turns a model trained on negatives kept at rate r (weighted 1/r) into
    the click probability among the kept rows (``pipeline.sampling``); 0 leaves m_i untouched.
    """
    return sigmoid(decision_function(data, weights, intercept), logit_shift)


def sigmoid(m: np.ndarray, logit_shift: float = 0.0) -> np.ndarray:
    """σ(m + logit_shift) of float64 margins, without overflow (the one scoring formula)."""
    if logit_shift != 0.0:
        m = m + logit_shift
    e = np.exp(-np.abs(m))
    return np.where(m >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
