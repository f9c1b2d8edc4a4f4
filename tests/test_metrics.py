"""Metrics against scikit-learn, and the aggregator laws (merge order, empty merge)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, log_loss, roc_auc_score

from terascale.solvers.metrics import BinaryMetrics


def _data(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.normal(-1.2, 1.5, n)
    p_true = 1 / (1 + np.exp(-m))
    y = (rng.random(n) < p_true).astype(np.float64)
    p = 1 / (1 + np.exp(-(m + rng.normal(0, 0.7, n))))
    w = rng.uniform(0.5, 2.0, n)
    return p, y, w


def test_against_sklearn_weighted():
    p, y, w = _data()
    r = BinaryMetrics().add(p, y, w).finalize()
    assert r["logloss"] == pytest.approx(log_loss(y, p, sample_weight=w), rel=1e-12)
    assert r["auroc"] == pytest.approx(roc_auc_score(y, p, sample_weight=w), abs=2e-5)
    assert r["auprc"] == pytest.approx(average_precision_score(y, p, sample_weight=w), abs=2e-4)
    q = np.sum(w * y) / np.sum(w)
    assert r["normalized_entropy"] == pytest.approx(r["logloss"] / -(q * math.log(q) + (1 - q) * math.log(1 - q)))
    assert r["calibration"] == pytest.approx(np.sum(w * p) / np.sum(w * y))
    assert r["rows"] == len(p)


def test_merge_is_order_free_and_empty_is_neutral():
    p, y, w = _data(5000, 1)
    whole = BinaryMetrics().add(p, y, w).finalize()
    parts = [BinaryMetrics().add(p[i::3], y[i::3], w[i::3]) for i in range(3)]
    merged = BinaryMetrics()
    for part in reversed(parts):
        merged.merge(BinaryMetrics.from_state(part.to_state()))
    merged.merge(BinaryMetrics())
    got = merged.finalize()
    for k in ("logloss", "auroc", "auprc", "calibration", "rows"):
        assert got[k] == pytest.approx(whole[k], rel=1e-12), k


def test_perfect_and_constant_scores():
    y = np.array([0, 0, 1, 1.0])
    assert BinaryMetrics().add(np.array([0.1, 0.2, 0.8, 0.9]), y).finalize()["auroc"] == 1.0
    assert BinaryMetrics().add(np.full(4, 0.5), y).finalize()["auroc"] == 0.5
    with pytest.raises(ValueError, match="no rows"):
        BinaryMetrics().finalize()
    with pytest.raises(ValueError, match="finite and in"):
        BinaryMetrics().add(np.array([np.nan]), np.array([1.0]))


def test_curves_are_consistent_with_the_areas():
    p, y, w = _data(20000, 2)
    r = BinaryMetrics().add(p, y, w).finalize()
    roc, pr, cal = r["curves"]["roc"], r["curves"]["pr"], r["curves"]["calibration"]
    assert roc["fpr"][0] == 0.0 and roc["fpr"][-1] == pytest.approx(1.0) and roc["tpr"][-1] == pytest.approx(1.0)
    assert np.all(np.diff(roc["fpr"]) >= 0) and np.all(np.diff(roc["tpr"]) >= 0)
    assert np.trapezoid(roc["tpr"], roc["fpr"]) == pytest.approx(r["auroc"], abs=5e-3)
    assert pr["recall"][-1] == pytest.approx(1.0) and min(pr["precision"]) >= 0
    assert sum(cal["weight"]) == pytest.approx(np.sum(w))
    # calibration groups: the weighted mean prediction over groups is the overall mean prediction
    assert np.average(cal["mean_prediction"], weights=cal["weight"]) == pytest.approx(r["mean_prediction"], rel=2e-3)
    assert np.average(cal["positive_rate"], weights=cal["weight"]) == pytest.approx(r["positive_rate"], rel=1e-9)
