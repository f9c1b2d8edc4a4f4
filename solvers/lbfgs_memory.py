"""L-BFGS memory and the two-loop recursion with a preconditioner.

With pairs sᵢ = θᵢ₊₁ − θᵢ, yᵢ = ∇fᵢ₊₁ − ∇fᵢ, ρᵢ = 1/(yᵢ·sᵢ), newest first:

    q ← g;  for i = newest … oldest:  αᵢ = ρᵢ·(sᵢ·q),  q ← q − αᵢ·yᵢ
    r ← γ·M⁻¹·q,  M⁻¹ the preconditioner (:mod:`solvers.preconditioner`: Jacobi, or Jacobi
                  plus a field-level coarse correction),
                  γ = (s·y)/(y·M⁻¹·y) of the newest pair (1 with no pair yet)
    for i = oldest … newest:  βᵢ = ρᵢ·(yᵢ·r),  r ← r + (αᵢ − βᵢ)·sᵢ
    direction = −r  (≈ −H⁻¹·g)

Pairs are stored as float32 (m·2·(d+1)·4 bytes over the d active features, see
:mod:`solvers.active`: 0.5 GB for m = 15, d = 2²² instead of 1 GB);
they only shape the search direction, while iterates and gradients stay float64. A pair is
kept only if y·s > ε·y·y (curvature), computed on the stored float32 values. All reductions
use :mod:`solvers.kernels.vector` (fixed order), so every rank computes the same direction.
"""

from __future__ import annotations

import numpy as np

from terascale.solvers.kernels.vector import axpy, dot, pair_products, store_pair
from terascale.solvers.state import own

_CURVATURE_EPS = 1e-12


class LBFGSMemory:
    def __init__(self, m: int, dim: int):
        self.m = int(m)
        self.S = np.zeros((m, dim), dtype=np.float32)
        self.Y = np.zeros((m, dim), dtype=np.float32)
        self.rho = np.zeros(m, dtype=np.float64)
        self.count = 0
        self.newest = -1

    def slots(self) -> list[int]:
        """Slot indices from the oldest pair to the newest."""
        return [(self.newest - i) % self.m for i in range(self.count - 1, -1, -1)]

    def push(self, x1: np.ndarray, x0: np.ndarray, g1: np.ndarray, g0: np.ndarray) -> bool:
        """Add the pair s = x1 − x0, y = g1 − g0 (dropping the oldest when full), rounded to
        float32 and written straight into its slot (no temporaries); False if it fails the
        curvature test, the memory then unchanged."""
        sy, yy = pair_products(x1, x0, g1, g0)
        if not sy > _CURVATURE_EPS * yy:
            return False
        slot = (self.newest + 1) % self.m
        store_pair(x1, x0, g1, g0, self.S[slot], self.Y[slot])
        self.rho[slot] = 1.0 / sy
        self.newest = slot
        self.count = min(self.count + 1, self.m)
        return True

    def clear(self) -> None:
        self.count = 0
        self.newest = -1

    def release(self) -> None:
        """Give the pairs' memory back (8·m bytes per coordinate) once the phase is over, so
        that the result's weights are not allocated on top of it; the memory is empty after."""
        self.clear()
        self.S = np.zeros((self.m, 0), dtype=np.float32)
        self.Y = np.zeros((self.m, 0), dtype=np.float32)

    def direction(self, grad: np.ndarray, precond) -> np.ndarray:
        """−H·grad by the two-loop recursion of the module docstring; ``precond`` has
        ``apply(q)`` (M⁻¹·q, a new array) and ``quad(y)`` (yᵀ·M⁻¹·y)."""
        order = self.slots()
        q = grad.copy()
        alphas = {}
        for slot in reversed(order):
            a = self.rho[slot] * dot(self.S[slot], q)
            alphas[slot] = a
            axpy(-a, self.Y[slot], q)
        gamma = 1.0
        if order:
            y = self.Y[self.newest]
            gamma = (1.0 / self.rho[self.newest]) / precond.quad(y)
        r = precond.apply(q)
        del q  # at most two vectors of the phase's length live here (a rank's peak memory)
        r *= gamma
        for slot in order:
            b = self.rho[slot] * dot(self.Y[slot], r)
            axpy(alphas[slot] - b, self.S[slot], r)
        return np.negative(r, out=r)

    def to_state(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        arrays = {"lbfgs_S": self.S, "lbfgs_Y": self.Y, "lbfgs_rho": self.rho}
        return arrays, {"lbfgs_count": self.count, "lbfgs_newest": self.newest}

    @classmethod
    def from_state(cls, saved: dict) -> LBFGSMemory:
        S = own(saved, "lbfgs_S", np.float32)
        mem = cls(0, 0)
        mem.m, mem.S, mem.Y = S.shape[0], S, own(saved, "lbfgs_Y", np.float32)
        mem.rho = own(saved, "lbfgs_rho", np.float64)
        mem.count = int(saved["lbfgs_count"])
        mem.newest = int(saved["lbfgs_newest"])
        return mem
