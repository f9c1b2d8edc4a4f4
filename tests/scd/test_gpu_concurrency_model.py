"""TPA-SCD's dual with τ rows in flight (``tests.scd.concurrency_model``): what the CUDA
simulator cannot show. One row in flight is the sequential solver, bit for bit; many rows in
flight break the undamped ridge dual on click-like data (a constant feature and frequent values
in every row), as an H100 did (about 4,000 rows in flight), and the ESO damping of the GPU solver
(``gpu_local_solver.eso_weights``) mends it, at a cost in epochs that grows with τ."""

from __future__ import annotations

import numpy as np
import pytest

from terascale.allreduce.communicator import LocalCommunicator
from terascale.solvers.data import CSRData
from terascale.solvers.scd.api import train_cocoa
from terascale.solvers.scd.params import CocoaParams
from tests.scd.concurrency_model import damped_row_sq_norms, delayed_problem

FIELDS, PER_FIELD = 39, 64


def click_like(n: int = 20_000, seed: int = 0) -> CSRData:
    """Binary rows of one value per field (39 fields of 64 values, Zipf-distributed: a field's
    commonest value is in about 38% of rows) and clicks from a planted logistic model."""
    rng = np.random.default_rng(seed)
    values = np.minimum(rng.zipf(1.5, size=(n, FIELDS)) - 1, PER_FIELD - 1)
    idx = (np.arange(FIELDS) * PER_FIELD + values).astype(np.int32)
    beta = rng.normal(0.0, 0.5, FIELDS * PER_FIELD)
    margin = beta[idx].sum(axis=1) - 1.0
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-margin))).astype(np.float32)
    indptr = np.arange(0, n * FIELDS + 1, FIELDS, dtype=np.int64)
    return CSRData(indptr, idx.ravel(), np.ones(n * FIELDS, np.float32), y, np.ones(n, np.float32),
                   FIELDS * PER_FIELD)


@pytest.fixture(scope="module")
def data() -> CSRData:
    return click_like()


def _params(loss: str, rounds: int) -> CocoaParams:
    # lambda N = 200, as in the device benchmark (1e-4 x 2M rows)
    return CocoaParams(loss=loss, formulation="dual", l2=1e-2, max_rounds=rounds, tol=1e-4, seed=3)


def _fit(data, loss, rounds, tau=None, damped=False):
    make = None if tau is None else delayed_problem(tau, damped)
    return train_cocoa(data, LocalCommunicator(), _params(loss, rounds), make_problem=make)


@pytest.mark.parametrize("loss", ["squared", "logistic"])
@pytest.mark.parametrize("damped", [False, True])
def test_one_row_in_flight_is_the_sequential_solver(data, loss, damped):
    """τ = 1: every row sees every update before it (and the ESO weights are all 1): the same
    iterates as the CPU's sequential SDCA, bit for bit."""
    ref = _fit(data, loss, 6)
    got = _fit(data, loss, 6, tau=1, damped=damped)
    assert got.rounds == ref.rounds
    assert got.weights.tobytes() == ref.weights.tobytes() and got.intercept == ref.intercept
    assert [r["gamma"] for r in got.history] == [r["gamma"] for r in ref.history]


def test_rows_in_flight_break_the_undamped_ridge_dual_and_the_damping_mends_it(data):
    """256 rows in flight: undamped, the steps on the shared frequent features pile up and the
    ridge dual stalls far from the optimum (or overflows); damped, it reaches the gap and the
    sequential solver's objective."""
    ref = _fit(data, "squared", 50)
    assert ref.converged
    try:
        undamped = _fit(data, "squared", 30, tau=256)
        stalled = not undamped.converged and undamped.gap > 1e-2 * undamped.history[0]["primal"]
    except FloatingPointError:
        stalled = True
    assert stalled
    damped = _fit(data, "squared", 50, tau=256, damped=True)
    assert damped.converged
    # both primal values lie within their own duality gap above the optimum
    assert abs(damped.primal - ref.primal) <= max(damped.gap, ref.gap)


@pytest.mark.parametrize("loss", ["squared", "logistic"])
def test_the_damping_costs_epochs_as_the_rows_in_flight_grow(data, loss):
    """Damped, the epochs to the gap never fall as τ grows, and 1,024 rows in flight cost more
    than one: the trade the device benchmark's sweep over resident blocks measures in seconds."""
    epochs = []
    for tau in (1, 16, 256, 1024):
        res = _fit(data, loss, 80, tau=tau, damped=True)
        assert res.converged, tau
        epochs.append(res.rounds)
    assert epochs == sorted(epochs) and epochs[-1] > epochs[0], epochs


def test_the_damped_norms_are_the_gpu_kernels_and_allow_empty_rows():
    """v_i = bias_beta s² + Σ_j beta_j x_ij² (rows 0 and 3 empty); with beta = 1 it is the CPU
    solver's ||x_i||², bit for bit."""
    from terascale.solvers.scd.dual_kernels import row_sq_norms
    from terascale.solvers.scd.gpu_local_solver import eso_weights

    indptr = np.array([0, 0, 2, 5, 5], dtype=np.int64)
    indices = np.array([0, 2, 0, 1, 2], dtype=np.int32)
    values = np.array([0.3, -1.7, 2.5, 0.1, 0.7], dtype=np.float32)
    ones = np.ones(3)
    assert damped_row_sq_norms(indptr, indices, values, ones, 1.0, 0.8).tobytes() == \
        row_sq_norms(indptr, values, 0.8).tobytes()
    beta, bias_beta = eso_weights(indices, 3, 4, 3)  # ω = 2, 1, 2 of 4 rows, τ = 3
    assert beta.tolist() == [1 + 1 * 2 / 3, 1.0, 1 + 1 * 2 / 3] and bias_beta == 3.0
    v = damped_row_sq_norms(indptr, indices, values, beta, bias_beta, 0.8)
    x = values.astype(np.float64)
    assert v[0] == v[3] == pytest.approx(3.0 * 0.64)
    assert v[1] == pytest.approx(3.0 * 0.64 + beta[0] * x[0] ** 2 + beta[2] * x[1] ** 2)
    assert v[2] == pytest.approx(3.0 * 0.64 + beta[0] * x[2] ** 2 + x[3] ** 2 + beta[2] * x[4] ** 2)
