"""Parameter validation, input checks, the history rows and the stopping rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd import CocoaParams, train_cocoa
from tests.scd.helpers import make_data


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": "poisson"}, "cocoa.loss = 'poisson': must be one of 'logistic', 'squared', 'hinge', 'squared_hinge'"),
        ({"l2": 0.0}, "cocoa.l2 = 0.0: must be a finite number in (0, inf)"),
        ({"l2": math.inf}, "cocoa.l2 = inf"),
        ({"local_epochs": 0}, "cocoa.local_epochs = 0: must be an integer in [1, inf)"),
        ({"threads": 1.5}, "cocoa.threads = 1.5"),
        ({"aggregation": "mean"}, "cocoa.aggregation = 'mean'"),
        ({"tol": -1.0}, "cocoa.tol = -1.0"),
        ({"fit_intercept": 1}, "cocoa.fit_intercept = 1: must be true or false"),
        ({"formulation": "primal"}, "cocoa.formulation = 'primal': needs cocoa.loss = 'squared' (got 'logistic')"),
    ],
)
def test_bad_params_name_key_value_and_allowed(kwargs, message):
    with pytest.raises(ValueError) as err:
        CocoaParams(**kwargs)
    assert message in str(err.value)


def test_defaults():
    p = CocoaParams()
    assert (p.loss, p.formulation, p.aggregation, p.local_epochs, p.threads) == (
        "logistic", "dual", "adaptive", 1, 1)
    assert p.fit_intercept and p.bias_scale == 1.0
    assert CocoaParams(fit_intercept=False).bias_scale == 0.0


def test_shard_checks_before_any_collective():
    data = make_data("squared", n=20, seed=51)  # real-valued labels
    with pytest.raises(ValueError, match="labels 0 or 1"):
        train_cocoa(data, LocalCommunicator(), CocoaParams(loss="hinge"))
    bad = CSRData(data.indptr, data.indices, data.values, data.labels,
                  np.zeros(data.n_rows, np.float32), data.n_features)
    with pytest.raises(ValueError, match="weights"):
        train_cocoa(bad, LocalCommunicator(), CocoaParams(loss="squared"))
    with pytest.raises(ValueError, match="empty"):
        train_cocoa(CSRData.empty(4), LocalCommunicator(), CocoaParams(loss="squared"))


def test_history_rows_and_relative_tolerance():
    data = make_data("logistic", n=200, seed=52)
    res = train_cocoa(data, LocalCommunicator(), CocoaParams(l2=1e-2, tol=1e-6, max_rounds=500))
    h = res.history
    assert [row["round"] for row in h] == list(range(len(h))) and res.rounds == len(h) - 1
    assert h[0]["primal"] == pytest.approx(math.log(2.0)) and h[0]["dual"] == 0.0
    assert h[0]["gamma"] is None and all(row["gamma"] > 0 for row in h[1:])
    assert all(row["gap"] >= -1e-12 for row in h)
    assert res.converged and h[-1]["gap"] <= 1e-6 * math.log(2.0) < h[-2]["gap"]
    assert all(set(row) == {"round", "primal", "dual", "gap", "gamma", "elapsed_s",
                            "compute_s", "stall_s", "transfer_s"} for row in h)
    assert [row["elapsed_s"] for row in h] == sorted(row["elapsed_s"] for row in h)
    duals = [row["dual"] for row in h]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(duals))  # adaptive: monotone ascent


def test_max_rounds_zero_returns_the_start():
    data = make_data("squared", n=50, seed=53)
    res = train_cocoa(data, LocalCommunicator(), CocoaParams(loss="squared", max_rounds=0))
    assert res.rounds == 0 and not res.converged and not res.weights.any()
    assert res.gap == pytest.approx(res.primal)  # D(0) = 0


def test_non_finite_data_is_refused():
    data = make_data("squared", n=20, seed=54)
    vals = data.values.copy()
    vals[0] = np.inf
    bad = CSRData(data.indptr, data.indices, vals, data.labels, data.weights, data.n_features)
    with pytest.raises(ValueError, match="finite"):
        train_cocoa(bad, LocalCommunicator(), CocoaParams(loss="squared"))
