"""The dual losses: primal value, dual (conjugate) value, and the exact dual coordinate step.

Notation (one example ``i``; labels ``y`` are 0/1 for classification, real for ridge; ``s = 2y - 1``
is the +-1 label; ``z = x.beta`` is the margin). The trainer's objective is the weighted mean

    P(beta) = (1/N) sum_i c_i phi_i(x_i . beta) + (lam/2) ||beta||^2,     N = sum_i c_i,

and SDCA maximises its dual

    D(alpha) = (1/N) sum_i c_i h_i(alpha_i) - (lam/2) ||w(alpha)||^2,
    w(alpha) = (1/(lam N)) sum_i c_i alpha_i x_i,                          h_i(a) = -phi_i*(-a).

At the optimum beta* = w(alpha*) and P(beta*) = D(alpha*); the duality gap P(w(alpha)) - D(alpha) >= 0
bounds the primal suboptimality.

=========  ====================  ==============================  ========================
loss       phi(z)                h(a)                            dual domain
=========  ====================  ==============================  ========================
squared    (z - y)^2 / 2         a y - a^2 / 2                   a real
logistic   log(1 + exp(-s z))    -b log b - (1-b) log(1-b),      b = s a in [0, 1]
hinge      max(0, 1 - s z)       b                               b = s a in [0, 1]
sq. hinge  max(0, 1 - s z)^2     b - b^2 / 4                     b = s a >= 0
=========  ====================  ==============================  ========================

(Squared hinge: h(a) = inf_z phi(z) + a z; with t = s z that is inf_t (b t + max(0, 1 - t)^2),
-inf for b < 0, attained at t = 1 - b/2 for b >= 0, where it is b (1 - b/2) + b^2/4 = b - b^2/4.)

Coordinate step. With ``dot = x_i . u`` (``u`` the current, possibly locally scaled, shared vector)
and ``q = sigma c_i ||x_i||^2 / (lam N)``, the step maximises over ``a'``

    h(a') - (a' - a) dot - q (a' - a)^2 / 2,

which is SDCA's step (sigma = 1) or the CoCoA+ local-subproblem step (sigma = sigma'):

* squared:  ``a' = a + (y - a - dot) / (1 + q)``  (the paper's Eq. 4 in this scaling);
* hinge:    ``b' = clip(b + (1 - s dot) / q, 0, 1)``  (closed form, Liu & Hajewski Sec. 7.1);
* squared hinge: with ``m = s dot`` the objective in ``b'`` is ``b' - b'^2/4 - (b' - b) m -
  q (b' - b)^2 / 2``, strictly concave (second derivative ``-1/2 - q``); its stationary point
  ``1 - b'/2 - m - q (b' - b) = 0`` clipped to the domain gives
  ``b' = max(0, (1 - m + q b) / (q + 1/2))`` (also at q = 0: no division by zero);
* logistic: ``t = logit(b')`` solves ``g(t) = -t - s dot - q (sigmoid(t) - b) = 0``; g is decreasing
  with g' in [-1 - q/4, -1] and its root lies in ``(-s dot - q (1-b), -s dot + q b)``; Newton
  kept on the root's side of 0, where g is concave (mirrored if need be), converges in a few steps. ``b'`` is kept in
  ``[B_EPS, 1 - B_EPS]``, strictly inside the domain, so logs never see 0.
"""

from __future__ import annotations

import math

from numba import njit

from terascale.solvers.catalogue import HINGE, LOGISTIC, SQUARED, SQUARED_HINGE, loss_spec

__all__ = ["B_EPS", "HINGE", "LOGISTIC", "SQUARED", "SQUARED_HINGE", "clamp_dual", "dual_line_terms", "dual_lower",
           "dual_step", "dual_upper", "dual_value", "loss_code", "primal_loss", "sign_label"]

B_EPS = 1e-15  # logistic dual variables b stay in [B_EPS, 1 - B_EPS]
_NEWTON_MAX_ITER = 50
_NEWTON_TOL = 1e-11


@njit(cache=True, nogil=True)
def sigmoid(t):
    """1 / (1 + exp(-t)) without overflow."""
    if t >= 0.0:
        return 1.0 / (1.0 + math.exp(-t))
    e = math.exp(t)
    return e / (1.0 + e)


@njit(cache=True, nogil=True)
def log1pexp(x):
    """log(1 + exp(x)) without overflow."""
    if x > 0.0:
        return x + math.log1p(math.exp(-x))
    return math.log1p(math.exp(x))


@njit(cache=True, nogil=True)
def sign_label(y):
    """0/1 label -> -1/+1."""
    return 1.0 if y > 0.5 else -1.0


@njit(cache=True, nogil=True)
def primal_loss(loss, y, z):
    """phi(y, z) of one example (see the module table)."""
    if loss == SQUARED:
        r = z - y
        return 0.5 * r * r
    m = sign_label(y) * z
    if loss == LOGISTIC:
        return log1pexp(-m)
    if loss == HINGE:
        return 1.0 - m if m < 1.0 else 0.0
    if loss == SQUARED_HINGE:
        return (1.0 - m) * (1.0 - m) if m < 1.0 else 0.0
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def entropy(b):
    """-b log b - (1-b) log(1-b), with 0 log 0 = 0."""
    v = 0.0
    if b > 0.0:
        v -= b * math.log(b)
    if b < 1.0:
        v -= (1.0 - b) * math.log1p(-b)
    return v


@njit(cache=True, nogil=True)
def dual_value(loss, y, a):
    """h(a) = -phi*(-a) of one example (a feasible)."""
    if loss == SQUARED:
        return a * y - 0.5 * a * a
    b = sign_label(y) * a
    if loss == LOGISTIC:
        return entropy(b)
    if loss == HINGE:
        return b
    if loss == SQUARED_HINGE:
        return b - 0.25 * b * b
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def _concave_root(b, m, q, t):
    """(root, Newton steps) of g(t) = -t - m - q (sigmoid(t) - b) when the root is <= 0, where g
    is decreasing and concave (g'' = -q sigmoid'(t) (1 - 2 sigmoid(t)) <= 0). Newton from any
    start in [lo, 0], lo = -m - q (1 - b), kept <= 0, converges monotonically after at most one
    step (Yu, Huang and Lin's argument for the dual CD of logistic regression, in logit space).
    ``t`` is the warm start (the current point's logit)."""
    t = max(min(t, 0.0), -m - q * (1.0 - b))
    steps = 0
    for _ in range(_NEWTON_MAX_ITER):
        steps += 1
        p = sigmoid(t)
        g = -t - m - q * (p - b)
        if g == 0.0:
            break
        nt = min(t + g / (1.0 + q * p * (1.0 - p)), 0.0)
        done = abs(nt - t) <= _NEWTON_TOL * (1.0 + abs(t))
        t = nt
        if done:
            break
    return t, steps


@njit(cache=True, nogil=True)
def _logistic_root(b, m, q):
    """(t, Newton steps): t = logit of argmax_b' entropy(b') - (b' - b) m - q (b' - b)^2 / 2.

    The root of g(t) = -t - m - q (sigmoid(t) - b) lies on the side of 0 given by the sign of
    g(0) = -m - q (1/2 - b), which needs no exp. A root <= 0 is found by ``_concave_root``; a
    root > 0 by the same function on the mirrored problem (1 - b, -m; t -> -t), where g is again
    concave. Working on the small side keeps sigmoid(t) - b free of cancellation: near b = 1
    with a huge q, 1 - sigmoid(t) computed directly is rounding noise and Newton would run to
    its cap. About 4 to 6 steps at q ~ 20 (a bisection-safeguarded Newton needed 12 to 17)."""
    if q <= 0.0:  # the root is -m exactly
        return -m, 0
    if b <= 0.0:  # warm start at the current point's logit (alpha starts at 0)
        tw = -math.inf
    elif b >= 1.0:
        tw = math.inf
    else:
        tw = math.log(b) - math.log1p(-b)
    if -m - q * (0.5 - b) > 0.0:
        t, steps = _concave_root(1.0 - b, -m, q, -tw)
        return -t, steps
    return _concave_root(b, m, q, tw)


@njit(cache=True, nogil=True)
def _logistic_b(b, m, q):
    """argmax over b' of entropy(b') - (b' - b) m - q (b' - b)^2 / 2 (see ``_logistic_root``),
    kept in [B_EPS, 1 - B_EPS]."""
    t, _ = _logistic_root(b, m, q)
    return min(max(sigmoid(t), B_EPS), 1.0 - B_EPS)


@njit(cache=True, nogil=True)
def _hinge_b(b, m, q):
    """argmax over b' in [0, 1] of b' - (b' - b) m - q (b' - b)^2 / 2 (closed form)."""
    if q > 0.0:
        return min(max(b + (1.0 - m) / q, 0.0), 1.0)
    if m < 1.0:
        return 1.0
    if m > 1.0:
        return 0.0
    return b


@njit(cache=True, nogil=True)
def _squared_hinge_b(b, m, q):
    """argmax over b' >= 0 of b' - b'^2/4 - (b' - b) m - q (b' - b)^2 / 2 (closed form)."""
    return max((1.0 - m + q * b) / (q + 0.5), 0.0)


@njit(cache=True, nogil=True)
def dual_step(loss, y, a, dot, q):
    """The new value of one dual coordinate (see the module docstring)."""
    if loss == SQUARED:
        return a + (y - a - dot) / (1.0 + q)
    s = sign_label(y)
    b = s * a
    m = s * dot
    if loss == LOGISTIC:
        return s * _logistic_b(b, m, q)
    if loss == HINGE:
        return s * _hinge_b(b, m, q)
    if loss == SQUARED_HINGE:
        return s * _squared_hinge_b(b, m, q)
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def dual_lower(loss):
    """Smallest feasible b = s a (no bound for squared: -inf)."""
    if loss == LOGISTIC:
        return B_EPS
    if loss == HINGE or loss == SQUARED_HINGE:
        return 0.0
    if loss == SQUARED:
        return -math.inf
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def dual_upper(loss):
    """Largest feasible b = s a (no bound for squared and squared hinge: +inf)."""
    if loss == LOGISTIC:
        return 1.0 - B_EPS
    if loss == HINGE:
        return 1.0
    if loss == SQUARED or loss == SQUARED_HINGE:
        return math.inf
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def clamp_dual(loss, y, a):
    """a after a line step ``alpha + gamma dalpha``, with b = s a put back into the closed
    domain (round-off only: gamma never exceeds the feasible step): [0, 1] for hinge and
    logistic (whose steps keep b inside [B_EPS, 1 - B_EPS] themselves), b >= 0 for squared
    hinge, unchanged for squared."""
    if loss == SQUARED:
        return a
    s = sign_label(y)
    if loss == LOGISTIC or loss == HINGE:
        return s * min(max(s * a, 0.0), 1.0)
    if loss == SQUARED_HINGE:
        return s * max(s * a, 0.0)
    raise ValueError("unknown loss id")


@njit(cache=True, nogil=True)
def dual_line_terms(loss, y, c, a, d):
    """One coordinate's share of the dual line search along ``a + gamma d`` (``d != 0``, weight
    ``c``): (p0, p1, bound), where ``p0 - gamma p1`` is its term of N (phi'(gamma) + lam
    (<w, dw> + gamma ||dw||^2)) for the closed-form losses (see ``line_search``) and ``bound`` is
    the largest feasible gamma (inf if there is none). With b = s a and db = s d:

    * squared:       h(a + g d) = h(a) + g d (y - a) - g^2 d^2 / 2:  (c d (y - a), c d^2, inf)
    * hinge:         h linear in b on [0, 1]:                       (c db, 0, box bound)
    * squared hinge: h(b + g db) = h(b) + g db (1 - b/2) - g^2 db^2 / 4:
                     (c db (1 - b/2), c db^2 / 2, -b/db if db < 0 else inf)
    * logistic:      no closed form (Newton on ``logistic_line_derivs``): (0, 0, box bound)
    """
    if loss == SQUARED:
        return c * d * (y - a), c * d * d, math.inf
    s = sign_label(y)
    b = s * a
    db = s * d
    if loss == SQUARED_HINGE:
        return c * db * (1.0 - 0.5 * b), 0.5 * c * db * db, (-b / db if db < 0.0 else math.inf)
    bound = (1.0 - b) / db if db > 0.0 else -b / db
    if loss == HINGE:
        return c * db, 0.0, bound
    if loss == LOGISTIC:
        return 0.0, 0.0, bound
    raise ValueError("unknown loss id")


def loss_code(name: str) -> int:
    """The catalogue id of loss ``name`` (the same id the primal and GPU kernels use)."""
    return loss_spec(name).id
