"""The L-BFGS memory: pairs rounded to float32 and written straight into their slot, the
curvature test on exactly the stored values, and the two-loop recursion against a dense
reference."""

from __future__ import annotations

import numpy as np

from terascale.solvers.kernels.vector import dot, pair_products
from terascale.solvers.lbfgs_memory import LBFGSMemory
from terascale.solvers.preconditioner import Jacobi, TwoLevel


def _pair(rng, n):
    x0, x1 = rng.normal(size=n), rng.normal(size=n)
    g0 = rng.normal(size=n)
    g1 = g0 + 0.7 * (x1 - x0) + 0.01 * rng.normal(size=n)  # positive curvature
    return x1, x0, g1, g0


def test_pair_products_equal_the_dot_products_of_the_stored_float32_pair():
    rng = np.random.default_rng(0)
    for n in (0, 1, 3, 4, 7, 1001):
        x1, x0, g1, g0 = _pair(rng, n)
        s32, y32 = (x1 - x0).astype(np.float32), (g1 - g0).astype(np.float32)
        assert pair_products(x1, x0, g1, g0) == (dot(s32, y32), dot(y32, y32))


def test_push_stores_the_rounded_pair_and_keeps_the_memory_on_a_rejected_one():
    rng = np.random.default_rng(1)
    mem = LBFGSMemory(2, 50)
    pairs = [_pair(rng, 50) for _ in range(3)]
    for x1, x0, g1, g0 in pairs:
        assert mem.push(x1, x0, g1, g0)
    assert mem.count == 2 and mem.slots() == [1, 0]  # the first pair was dropped
    x1, x0, g1, g0 = pairs[2]
    np.testing.assert_array_equal(mem.S[0], (x1 - x0).astype(np.float32))
    np.testing.assert_array_equal(mem.Y[0], (g1 - g0).astype(np.float32))
    s32, y32 = mem.S[0], mem.Y[0]
    assert mem.rho[0] == 1.0 / dot(s32, y32)
    before = (mem.S.copy(), mem.Y.copy(), mem.rho.copy(), mem.newest, mem.count)
    x1, x0, g1, g0 = _pair(rng, 50)
    assert not mem.push(x1, x0, 2 * g0 - g1, g0)  # y = −(g1 − g0): negative curvature
    after = (mem.S, mem.Y, mem.rho, mem.newest, mem.count)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def _preconditioners(n: int, hess: np.ndarray):
    """(preconditioner, its dense M⁻¹): Jacobi, and Jacobi plus a coarse correction over two
    groups (coordinates 0-2, 3-5; 6 in none; the last one is the intercept's column)."""
    inv_diag = 1.0 / np.diag(hess)
    group = np.array([0, 0, 0, 1, 1, 1, -1])
    S = np.zeros((n, 3))
    S[np.arange(n - 1)[group >= 0], group[group >= 0]] = 1.0
    S[n - 1, 2] = 1.0
    E = S.T @ hess @ S
    yield Jacobi(inv_diag), np.diag(inv_diag)
    yield TwoLevel(inv_diag, group, E), np.diag(inv_diag) + S @ np.linalg.solve(E, S.T)


def test_direction_matches_the_dense_bfgs_update():
    """With float32-exact pairs, the two-loop recursion equals −H·g for the inverse Hessian
    approximation built by the dense BFGS update from H0 = γ·M⁻¹, γ = s·y / yᵀM⁻¹y."""
    rng = np.random.default_rng(2)
    n = 8
    a = rng.normal(size=(n, n))
    hess = a @ a.T + n * np.eye(n)
    mem = LBFGSMemory(3, n)
    pairs = []
    for _ in range(3):
        s = rng.normal(size=n).astype(np.float32).astype(np.float64)
        y = (hess @ s).astype(np.float32).astype(np.float64)
        assert mem.push(s, np.zeros(n), y, np.zeros(n))
        pairs.append((s, y))
    g = rng.normal(size=n)
    for precond, dense in _preconditioners(n, hess):
        s, y = pairs[-1]
        h = (s @ y) / (y @ dense @ y) * dense
        for s, y in pairs:
            rho = 1.0 / (s @ y)
            v = np.eye(n) - rho * np.outer(y, s)
            h = v.T @ h @ v + rho * np.outer(s, s)
        np.testing.assert_allclose(mem.direction(g, precond), -h @ g, rtol=1e-10, atol=1e-12)


def test_float32_products_are_widened_before_multiplying():
    """numba types ``float(x)`` of a float32 as float32: the kernels widen with np.float64, so
    s·y of float32 pairs carries float64 products (the L-BFGS ρ and curvature test)."""
    from terascale.solvers.kernels.vector import weighted_dot

    rng = np.random.default_rng(3)
    a, b = rng.normal(size=4).astype(np.float32), rng.normal(size=4).astype(np.float32)
    wide = a.astype(np.float64) * b.astype(np.float64)
    assert dot(a, b) == (wide[0] + wide[1]) + (wide[2] + wide[3])
    w = np.ones(4, dtype=np.float32)
    assert weighted_dot(a, w, b) == dot(a, b)
