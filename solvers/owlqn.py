"""OWL-QN: the L-BFGS phase with an L1 penalty (Andrew & Gao 2007, "Scalable training of
L1-regularized log-linear models"), used by :mod:`solvers.lbfgs` whenever ``l1`` = λ₁ > 0.

The objective f(θ) = smooth(θ) + λ₁·‖β‖₁, smooth = the loss term + (λ₂/2)·‖β‖², θ = [β, b]
with b unpenalized, is not differentiable where some β_j = 0. Per iteration, from the smooth
gradient g (one AllReduce, the same on every rank):

1. the pseudo-gradient ◇f(θ) (:func:`terascale.solvers.kernels.owlqn.pseudo_gradient`): the
   one-sided derivatives of |β_j| chosen so that −◇f is the steepest descent direction, 0 along
   a β_j = 0 that is optimal;
2. the direction p = −H·◇f by the two-loop recursion (:mod:`solvers.lbfgs_memory`, with the same
   preconditioner M⁻¹ as L-BFGS as its initial matrix), then every p_j whose sign disagrees with
   −◇_j is zeroed (:func:`~terascale.solvers.kernels.owlqn.align_direction`), the intercept too,
   so ◇f·p < 0. Should the slope not be negative (the memory lost definiteness numerically), the
   memory is cleared and p = −M⁻¹·◇f, aligned;
3. a backtracking line search (:func:`backtracking`) from the step α₀ of :mod:`solvers.lbfgs`
   (1, or the 1-D Newton step −◇f·p / pᵀ∇²smooth·p while few pairs are held), halving the step:
   each trial point x(α) = π(θ + α·p; ξ) is projected onto the orthant ξ_j = sign(β_j), or
   sign(−◇_j) where β_j = 0 (:func:`~terascale.solvers.kernels.owlqn.project_point`; a
   coordinate that would cross 0 stops at 0: this is how weights become exactly 0), and accepted
   when f(x(α)) ≤ f(θ) + c₁·◇f(θ)·(x(α) − θ), c₁ = 10⁻⁴;
4. the curvature pair s = x − θ, y = g(x) − g(θ) from the smooth gradients (the L1 term has no
   curvature), kept under L-BFGS's curvature test.

The stopping tests are L-BFGS's with ‖◇f‖₂ in place of ‖∇f‖₂ (0 exactly at the optimum).

Determinism: the pseudo-gradient, the projections and every sum run in fixed order over the
same AllReduced bytes on every rank (:mod:`solvers.kernels.owlqn`), and the line search is
scalar Python, so every rank takes the same steps, as in L-BFGS.

What stays as in L-BFGS and why it stays correct:

- **Active features** (:mod:`solvers.active`, :mod:`solvers.local_table`): a feature outside
  every rank's rows and 0 at the start has g_j = λ₂·β_j = 0, so ◇_j = 0 (|g_j| ≤ λ₁), p_j = 0 and
  β_j stays exactly 0: dropping it from the working vectors changes nothing, as for L-BFGS.
- **The preconditioner** (:mod:`solvers.preconditioner`): M⁻¹ (Jacobi, or Jacobi plus the
  field-level coarse correction) only sets the two-loop recursion's initial matrix H₀; it is
  positive definite, so p = −H·◇f is a descent direction for ◇f before the alignment, and the
  alignment keeps only descent components whatever H is. Its Hessian diagonal and coarse matrix
  are the smooth part's, which is all the curvature f has away from the kinks.
- **Checkpoints**: the state is L-BFGS's (θ, the smooth gradient, f, the pairs, M⁻¹, and the
  start's ‖◇f‖ as ``lbfgs_grad0_norm``); ◇f is recomputed from θ and g on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from terascale.solvers.kernels.owlqn import (
    align_direction,
    directional_change,
    project_point,
    pseudo_gradient,
)
from terascale.solvers.linesearch import C1, MAX_EVALS, LineSearchResult, Trial

#: the backtracking factor of the line search (Andrew & Gao's choice)
SHRINK = 0.5


def steepest(theta: np.ndarray, grad: np.ndarray, l1: float) -> np.ndarray:
    """◇f(θ) from the smooth gradient ``grad`` (a new array)."""
    out = np.empty_like(grad)
    pseudo_gradient(theta, grad, l1, out)
    return out


def direction(memory, precond, pg: np.ndarray) -> tuple[np.ndarray, float]:
    """(p, ◇f·p): the two-loop direction on ◇f, aligned with −◇f (module docstring, step 2)."""
    p = memory.direction(pg, precond)
    slope = align_direction(p, pg)
    if not slope < 0.0:  # the memory lost positive-definiteness numerically: restart
        memory.clear()
        p = np.negative(precond.apply(pg))
        slope = align_direction(p, pg)
    return p, slope


def trial_point(theta: np.ndarray, p: np.ndarray, pg: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """(x(α) = π(θ + α·p; ξ), ◇f(θ)·(x(α) − θ)): the projected trial point and its first-order change."""
    point = p * alpha
    point += theta
    project_point(point, theta, pg)
    return point, directional_change(point, theta, pg)


def backtracking(phi: Callable[[float], tuple[float, float, Any, bool]], value0: float, alpha0: float = 1.0, *,
                 c1: float = C1, shrink: float = SHRINK, max_evals: int = MAX_EVALS) -> LineSearchResult:
    """Try α = α₀, α₀·shrink, … until f(x(α)) ≤ f(θ) + c₁·◇f·(x(α) − θ) (at most ``max_evals``).

    ``phi(α) -> (f(x(α)), ◇f·(x(α) − θ), payload, finite)``. A non-finite trial counts as too far.
    The result is :mod:`solvers.linesearch`'s (``wolfe`` is always False: the test is sufficient
    decrease alone)."""
    alpha = alpha0
    any_finite = False
    for evals in range(1, max_evals + 1):
        value, change, payload, finite = phi(alpha)
        any_finite |= finite
        if finite and change < 0.0 and value <= value0 + c1 * change:
            return LineSearchResult(True, False, Trial(alpha, value, change, payload), evals, any_finite)
        alpha *= shrink
    return LineSearchResult(False, False, None, max_evals, any_finite)
