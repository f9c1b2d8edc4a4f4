"""Scoring with a trained model: margins and, for the logistic loss, probabilities."""

from __future__ import annotations

import numpy as np

from solvers.data import CSRData
from solvers.kernels.objective import margins
from solvers.shard import Shard


def decision_function(data: CSRData, weights: np.ndarray, intercept: float) -> np.ndarray:
    """m_i = x_i·weights + intercept (float64)."""
    s = Shard.from_csr(data)
    if weights.shape != (s.n_features,):
        raise ValueError(f"weights have shape {weights.shape}, the data {s.n_features} features")
    out = np.empty(s.n_rows, dtype=np.float64)
    margins(s.indptr, s.indices, s.values, weights, float(intercept), out)
    return out


def predict_proba(data: CSRData, weights: np.ndarray, intercept: float) -> np.ndarray:
    """σ(m_i) = P(y_i = 1) under the logistic model, computed without overflow."""
    m = decision_function(data, weights, intercept)
    e = np.exp(-np.abs(m))
    return np.where(m >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
