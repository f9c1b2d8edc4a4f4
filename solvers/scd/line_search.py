"""The aggregation parameter gamma: fixed (avg, add) or the exact line search (adaptive).

After a round, worker k proposes ``dalpha_k`` (disjoint coordinates) and the allreduce gives
``dw = sum_k dw_k``. The new point is ``alpha + gamma dalpha``, ``w + gamma dw``.

Adaptive aggregation maximises the dual along that line (Parnell et al., Sec. IV-B):

    phi(gamma) = D(alpha + gamma dalpha)
               = (1/N) sum_i c_i h_i(alpha_i + gamma dalpha_i) - (lam/2) ||w + gamma dw||^2.

The quadratic part needs ``<w, dw>`` and ``||dw||^2``, computed on every rank from the replicated
``w`` and the allreduced ``dw`` by a sequential kernel (same bytes in, same bytes out on every
rank). The separable part is reduced with the allreduce:

* squared (ridge dual, the paper's dual form of Eq. 7 in this scaling)::

      gamma* = [ (1/N) sum c dalpha (y - alpha) - lam <w, dw> ] / [ (1/N) sum c dalpha^2 + lam ||dw||^2 ]

* hinge: h is linear on the box, so phi is a concave quadratic on ``[0, gamma_max]``::

      gamma* = clip( [ (1/N) sum c s dalpha - lam <w, dw> ] / (lam ||dw||^2), 0, gamma_max )

* squared hinge: h(b) = b - b^2/4 is a concave quadratic, so phi is one too on ``[0, gamma_max]``
  (``b = s alpha``, ``db = s dalpha``; only ``db < 0`` bounds the step, by ``b >= 0``)::

      gamma* = clip( [ (1/N) sum c db (1 - b/2) - lam <w, dw> ]
                     / [ (1/N) sum c db^2 / 2 + lam ||dw||^2 ], 0, gamma_max )

* logistic: phi is strictly concave and smooth on ``(0, gamma_max)``; a bracketed Newton
  iteration on ``phi'(gamma) = (1/N) sum c db log((1 - b)/b) - lam (<w, dw> + gamma ||dw||^2)``
  with ``phi'' = -(1/N) sum c db^2 / (b (1 - b)) - lam ||dw||^2`` (``b = s (alpha + gamma dalpha)``,
  ``db = s dalpha``), each iteration one ``allreduce_scalars`` of the two sums, so every rank
  takes the same branches and ends with the same gamma.

``gamma_max`` is the largest step keeping every coordinate feasible (``b`` in ``[0, 1]``, or
``b >= 0`` for squared hinge). It is
at least 1 because every worker's proposal is feasible (logistic's derivative is infinite at the
boundary, so its maximiser lies strictly inside; the evaluation clamps ``b`` to
``[B_EPS, 1 - B_EPS]`` as a numerical guard); each rank puts its local minimum into its own slot of a size-K vector inside the
round's allreduce, and every rank takes the minimum of the K slots.

Primal ridge (data by feature, Eq. 7 with the labels restored: the paper's ``w`` is the margin
vector and its residual is ``w - y``) minimises ``P(beta + gamma dbeta)`` with ``z + gamma dz``::

    gamma* = - [ (1/N) sum c (z - y) dz + lam <beta, dbeta> ] / [ (1/N) sum c dz^2 + lam ||dbeta||^2 ]

where ``<beta, dbeta>`` and ``||dbeta||^2`` are sums of per-worker pieces (disjoint blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numba import njit

from terascale.solvers.scd.losses import B_EPS, dual_line_terms, sign_label

_NEWTON_MAX_ITER = 60
_NEWTON_TOL = 1e-12


@njit(cache=True, nogil=True)
def seq_dot(a, b):
    """sum_j a_j b_j in index order (identical on every machine: no reassociation)."""
    acc = 0.0
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, nogil=True)
def dual_line_sums(loss, labels, weights, alpha, dalpha):
    """Local pieces of the dual line search: (p0, p1, gamma_max), the sums of
    ``losses.dual_line_terms`` over the moved coordinates: squared: p0 = sum c dalpha (y - alpha),
    p1 = sum c dalpha^2; hinge: p0 = sum c s dalpha; squared hinge: p0 = sum c db (1 - b/2),
    p1 = sum c db^2 / 2; logistic: nothing (0, 0). gamma_max = the largest feasible step (inf if
    unbounded)."""
    p0 = 0.0
    p1 = 0.0
    gmax = math.inf
    for i in range(alpha.shape[0]):
        d = dalpha[i]
        if d == 0.0:
            continue
        t0, t1, bound = dual_line_terms(loss, np.float64(labels[i]), np.float64(weights[i]),
                                        alpha[i], d)
        p0 += t0
        p1 += t1
        if bound < gmax:
            gmax = bound
    return p0, p1, gmax


@njit(cache=True, nogil=True)
def logistic_line_derivs(labels, weights, alpha, dalpha, gamma):
    """(sum c db log((1-b)/b), sum c db^2 / (b (1-b))) at b = s (alpha + gamma dalpha)."""
    s1 = 0.0
    s2 = 0.0
    for i in range(alpha.shape[0]):
        d = dalpha[i]
        if d == 0.0:
            continue
        c = np.float64(weights[i])
        s = sign_label(np.float64(labels[i]))
        b = s * (alpha[i] + gamma * d)
        b = min(max(b, B_EPS), 1.0 - B_EPS)
        db = s * d
        s1 += c * db * (math.log1p(-b) - math.log(b))
        s2 += c * db * db / (b * (1.0 - b))
    return s1, s2


def fixed_gamma(aggregation: str, size: int) -> float:
    """avg: 1/K (sigma' = 1); add: 1 (sigma' = K, CoCoA+)."""
    return 1.0 if aggregation == "add" else 1.0 / size


def local_sigma(aggregation: str, size: int) -> float:
    """sigma' of the workers' local subproblems: K for add (CoCoA+), 1 otherwise."""
    return float(size) if aggregation == "add" else 1.0


def _finite_or(value: float, fallback: float) -> float:
    return value if math.isfinite(value) else fallback


def ridge_dual_gamma(p0: float, p1: float, wd: float, dd: float, lam: float, n_w: float) -> float:
    """Closed-form gamma* for the ridge dual (see module docstring)."""
    den = p1 / n_w + lam * dd
    if den <= 0.0:
        return 1.0
    return (p0 / n_w - lam * wd) / den


def hinge_gamma(p0: float, wd: float, dd: float, lam: float, n_w: float, gmax: float) -> float:
    """Exact gamma* for the hinge dual: a concave quadratic on [0, gamma_max]."""
    slope = p0 / n_w - lam * wd
    curv = lam * dd
    if curv > 0.0:
        g = slope / curv
    else:
        g = math.inf if slope > 0.0 else 0.0
    return _finite_or(min(max(g, 0.0), gmax), 1.0)


def squared_hinge_gamma(p0: float, p1: float, wd: float, dd: float, lam: float, n_w: float,
                        gmax: float) -> float:
    """Exact gamma* for the squared-hinge dual: phi'(gamma) = (p0 - gamma p1)/N - lam (<w, dw> +
    gamma ||dw||^2) is affine and decreasing, so the maximiser of the concave quadratic phi on
    [0, gamma_max] is its root clipped to that interval (1 when nothing moved)."""
    den = p1 / n_w + lam * dd
    if den <= 0.0:
        return 1.0
    return _finite_or(min(max((p0 / n_w - lam * wd) / den, 0.0), gmax), 1.0)


def logistic_gamma(
    derivs: Callable[[float], tuple[float, float]],
    wd: float,
    dd: float,
    lam: float,
    n_w: float,
    gmax: float,
    start: float,
) -> float:
    """Exact gamma* for the logistic dual by bracketed Newton on [0, gamma_max].

    ``derivs(gamma)`` returns the *allreduced* (s1, s2) of :func:`logistic_line_derivs`; every
    branch below depends only on those, so all ranks compute the same gamma.
    """
    if not math.isfinite(gmax):  # no coordinate moved
        return 1.0
    lo, hi = 0.0, gmax
    g = min(max(start, 0.0), gmax)
    end_checked = g == gmax
    for _ in range(_NEWTON_MAX_ITER):
        s1, s2 = derivs(g)
        d1 = s1 / n_w - lam * (wd + g * dd)
        d2 = -s2 / n_w - lam * dd
        if d1 > 0.0:
            lo = g
        else:
            hi = g
        if d1 == 0.0 or hi - lo <= _NEWTON_TOL * max(1.0, g):
            break
        ng = g - d1 / d2 if d2 < 0.0 else math.nan
        if not end_checked and hi == gmax and not (lo < ng < g + 0.5 * (hi - g)):
            # Newton heads for the feasibility limit: test it. The coordinate that sets gamma_max
            # has typically b ~ B_EPS and a tiny step, so phi' stays positive up to the limit and
            # Newton would only halve the distance every step (about 40 passes per round).
            ng = gmax
            end_checked = True
        elif not (lo < ng < hi) or g == gmax:  # (Newton from the singular end crawls)
            ng = 0.5 * (lo + hi)
        if abs(ng - g) <= _NEWTON_TOL * max(1.0, g):
            g = ng
            break
        g = ng
    return g


def ridge_primal_gamma(a: float, b: float, bd: float, dd: float, lam: float, n_w: float) -> float:
    """Eq. 7 (labels restored): a = sum c (z - y) dz, b = sum c dz^2, bd = <beta, dbeta>,
    dd = ||dbeta||^2 (global sums)."""
    den = b / n_w + lam * dd
    if den <= 0.0:
        return 1.0
    return -(a / n_w + lam * bd) / den
