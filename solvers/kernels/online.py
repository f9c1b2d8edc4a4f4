"""One online pass over a CSR shard: per-coordinate adaptive, normalized, importance-invariant
updates, the default learner of Vowpal Wabbit and Algorithm 1 of the terascale paper.

State. A float32 table ``state`` of shape ``(n_features + 1, STATE_COLUMNS)``; row j holds
feature j's weight ``w_j`` (column ``W``), accumulated squared gradient ``G_j`` (``G``) and
normalizer ``s_j`` = the largest |x_j| seen so far (``S``); the last row is the intercept (a
feature whose value is always 1). The fourth column is padding: a feature's whole state is one
aligned 16-byte slot, so each non-zero costs a single cache line (the pass is bound by random
access into the table). Two float64 running totals ``totals = [t, N]``: t = Σ h (importance
weights seen) and N = Σ h·Σ_j (x_j/s_j)².

Update for an example (x, y) with importance weight h > 0 (non-zero entries j only, intercept
included with x = 1; examples of weight 0 are skipped):

1. normalize: if |x_j| > s_j: w_j ← w_j·s_j/|x_j| (when s_j > 0), s_j ← |x_j|
   (Ross, Mineiro & Langford 2013, "normalized adaptive gradient": the prediction stays
   the same whatever the scale of a feature);
2. predict: m = Σ_j w_j·x_j;  t ← t + h;  N ← N + h·Σ_j (x_j/s_j)²;
3. adapt: g = ℓ'(m);  G_j ← G_j + h·(g·x_j)²;  rate r_j = 1/(s_j·√G_j) (0 while G_j = 0 or
   s_j = 0: a stored zero x_j = 0 of a feature that has no non-zero on this rank);
4. step: η_t = η·√(t/N);  κ = η_t·Σ_j r_j·x_j²;  u = the importance-invariant update scalar
   for (ℓ, m, y, h, κ) (:func:`~solvers.kernels.losses.invariant_scalar`), or the plain
   gradient scalar h·g when ``invariant`` is off;
5. w_j ← w_j − η_t·u·r_j·x_j  (so the margin moves by exactly −u·κ).

L1 shrinkage (``l1`` = λ₁ > 0; truncated gradient, Langford, Li & Zhang 2009, applied lazily).
The fourth column ``T`` (padding when λ₁ = 0) holds the clock t at which feature j was last
shrunk. In step 5, right after a feature's gradient step (x_j ≠ 0: a stored zero is no touch),
with the rate r_j of this update:

6. shrink: a = η_t·r_j·λ₁·(t − T_j) (0 if t ≤ T_j);  w_j ← sign(w_j)·max(0, |w_j| − a);  T_j ← t

(the intercept is never shrunk). Over the examples since j's last shrink the mean-form penalty
λ₁·‖β‖₁ is λ₁·h per example of weight h in the sum form, and j's step size is η_t·r_j, so
t − T_j = the importance weight seen meanwhile makes a the whole penalty step skipped while j was
not touched: a catch-up that is exact while η_t·r_j stays the same, and approximate in that it
prices the skipped examples at the current η_t·r_j (η_t drifts slowly with √(t/N); r_j changes
only when j is touched, so only its own latest update is used). A weight that would cross 0 stops
at 0 (clipped, as in truncated gradient): the weights themselves become sparse. Rows skipped
before step 5 (g = 0) leave T_j as it is: the next shrink or :func:`l1_catch_up` pays for them.
The caller sets T = t for every feature before a pass (the clock is the pass's t) and calls
:func:`l1_catch_up` after it, so every feature pays for the whole pass. T is float32, so the
gap t − T_j is exact to float32's rounding of t. With Hogwild threads each thread's t is its own
(:mod:`solvers.online`): a gap read against another thread's stamp is approximate (0 when
negative).

While a row is processed, the table rows of the next example's features are prefetched.
The pass also sums the progressive loss Σ h·ℓ(y, m) (each example scored before its update).
Arithmetic on scalars is float64; the table is float32. The example order is the stored one,
or ``order`` when it is non-empty (a seeded permutation from the driver): deterministic.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from terascale.solvers.kernels.losses import (
    LOGISTIC,
    invariant_scalar,
    logistic_terms,
    loss_derivative,
    loss_value,
)
from terascale.solvers.kernels.prefetch import prefetch_row
from terascale.solvers.kernels.values import DENSE, ONE, PLAIN, row_start, value_at

W = 0
G = 1
S = 2
T = 3  # the clock t of the feature's last L1 shrink (padding when l1 = 0)
STATE_COLUMNS = 4

OK = 0
BAD_MARGIN = 1  # the margin of a row is not finite (weights or data overflowed)
BAD_UPDATE = 2  # the squared gradient or the update scalar of a row is not finite


def new_state(n_features: int) -> np.ndarray:
    """A zero state table for ``n_features`` features plus the intercept (its s fixed to 1)."""
    state = np.zeros((n_features + 1, STATE_COLUMNS), dtype=np.float32)
    state[n_features, S] = 1.0
    return state


@njit(cache=True)
def _max_row_nnz(indptr, order, start, stop):
    longest = 0
    shuffled = order.shape[0] > 0
    for i in range(start, stop):
        r = order[i] if shuffled else i
        longest = max(longest, indptr[r + 1] - indptr[r])
    return longest


@njit(cache=True)
def _prefetch_example(state, indptr, indices, r, top, offset):
    for k in range(indptr[r], indptr[r + 1]):
        j = indices[k]
        prefetch_row(state, j + offset if j > top else j)  # a replica: this thread's own


@njit(cache=True, nogil=True)
def online_pass(indptr, indices, values, vpos, labels, weights, order, state, totals, loss_id,
                learning_rate, invariant, start, stop, loss_sum, weight_sum, l1=0.0, n_features=-1, offset=0,
                bias=-1):
    """Process examples ``start..stop-1`` of the pass (positions in ``order`` if it is non-empty,
    else row numbers), updating ``state`` and ``totals`` in place (see the module docstring).
    A pass is one call over all rows, or consecutive calls over consecutive ranges carrying
    ``loss_sum`` and ``weight_sum`` (start a pass with 0.0): the result is the same bit for bit.

    ``l1`` > 0: the L1 shrink of step 6 after every gradient step (module docstring).

    Hot-feature replicas (:mod:`solvers.kernels.hot`; the defaults leave them off): an index
    above ``n_features`` (a relabelled hot feature) is read at that index + ``offset``, and the
    intercept at row ``bias``; by default ``n_features`` and ``bias`` are the table's last row.

    Returns ``(loss_sum, weight_sum, status, row)``: the running progressive loss Σ h·ℓ and Σ h,
    and ``status`` OK, or BAD_MARGIN / BAD_UPDATE with the (stored) index of the row where the
    pass stopped.
    """
    n_rows = labels.shape[0]
    top = state.shape[0] - 1 if n_features < 0 else n_features  # indices above it: replicas
    d = top if bias < 0 else bias  # the intercept's row
    shuffled = order.shape[0] > 0
    rate = np.empty(_max_row_nnz(indptr, order, start, stop), dtype=np.float32)
    t = totals[0]
    n_norm = totals[1]
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    for i in range(start, stop):
        r = order[i] if shuffled else i
        a = indptr[r]
        b = indptr[r + 1]
        h = float(weights[r])
        y = float(labels[r])
        if i + 1 < n_rows:
            _prefetch_example(state, indptr, indices, order[i + 1] if shuffled else i + 1, top, offset)
        if h == 0.0:  # no influence at all (not even on the normalizers)
            continue

        # 1-2: normalize, predict
        cur, mode = row_start(values, vpos, a, b, cur)
        m = float(state[d, W])
        norm_x = 1.0
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            ax = abs(x)
            if ax > 0.0:
                j = indices[k]
                if j > top:
                    j += offset
                s = state[j, S]
                if ax > s:
                    if s > 0.0:
                        state[j, W] *= s / ax
                    state[j, S] = ax
                    s = ax
                q = ax / s
                norm_x += q * q
                m += state[j, W] * x
        if not math.isfinite(m):
            totals[0] = t
            totals[1] = n_norm
            return loss_sum, weight_sum, BAD_MARGIN, r
        t += h
        n_norm += h * norm_x
        weight_sum += h
        if loss_id == LOGISTIC:
            loss, g, ez = logistic_terms(m, y)
        else:
            loss = loss_value(loss_id, m, y)
            g = loss_derivative(loss_id, m, y)
            ez = 0.0
        loss_sum += h * loss
        if g == 0.0:
            continue

        # 3: adapt
        hg2 = np.float32(h * g * g)
        if not math.isfinite(hg2):  # the squared gradient overflows float32: diverged
            totals[0] = t
            totals[1] = n_norm
            return loss_sum, weight_sum, BAD_UPDATE, r
        kappa = 0.0
        n = 0
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            j = indices[k]
            if j > top:
                j += offset
            gj = state[j, G] + hg2 * (x * x)
            state[j, G] = gj
            rj = _rate(state[j, S], gj)
            rate[n] = rj
            n += 1
            kappa += rj * (x * x)
        gb = state[d, G] + hg2
        state[d, G] = gb
        rb = np.float32(1.0) / math.sqrt(gb) if gb > 0.0 else np.float32(0.0)
        kappa += rb

        # 4-5: step
        eta_t = learning_rate * math.sqrt(t / n_norm)
        kappa *= eta_t
        if kappa <= 0.0:
            continue
        if invariant:
            u = invariant_scalar(loss_id, m, y, h, kappa, ez)
        else:
            u = h * g
        c = eta_t * u
        if not math.isfinite(c):
            totals[0] = t
            totals[1] = n_norm
            return loss_sum, weight_sum, BAD_UPDATE, r
        n = 0
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            j = indices[k]
            if j > top:
                j += offset
            state[j, W] -= np.float32(c * rate[n] * x)
            if l1 > 0.0 and x != 0.0:  # a stored zero is no touch: the catch-up pays for it
                _shrink(state, j, eta_t * rate[n] * l1, t)
            n += 1
        state[d, W] -= np.float32(c * rb)
    totals[0] = t
    totals[1] = n_norm
    return loss_sum, weight_sum, OK, -1


@njit(cache=True, nogil=True, inline="always")
def _rate(sj, gj):
    """r_j = 1/(s_j·√G_j) of step 3; 0 while G_j = 0, or s_j = 0 (no non-zero of j on this rank:
    a stored zero, whose x = 0 makes the step 0 whatever the rate, with G_j from the averaging;
    or, in the catch-up, a warm-start weight no rank's rows hold)."""
    if gj > 0.0 and sj > 0.0:
        return np.float32(1.0) / (sj * math.sqrt(gj))
    return np.float32(0.0)


@njit(cache=True, nogil=True)
def _shrink(state, j, scale, t):
    """Step 6 of the module docstring for feature j: shrink w_j by scale·(t − T_j), clipped at 0."""
    gap = t - state[j, T]
    if gap > 0.0:
        a = scale * gap
        w = state[j, W]
        if w > a:
            state[j, W] = w - np.float32(a)
        elif w < -a:
            state[j, W] = w + np.float32(a)
        else:
            state[j, W] = np.float32(0.0)
    state[j, T] = t


@njit(cache=True, nogil=True)
def l1_catch_up(state, t, eta_t, l1):
    """Shrink every feature's weight for the examples since its last shrink (step 6 of the module
    docstring at clock ``t``, step size η_t·r_j with r_j = 1/(s_j·√G_j), 0 while G_j = 0, as in
    step 3), then set T_j = t. The intercept (the last row) is not touched.

    The penalty is owed on every example, so every rank shrinks every feature it has a weight
    for, also one that only other ranks' rows hold (its w_j and G_j from the averaging): its s_j
    is then the holders' mean, agreed at the first averaging
    (:meth:`solvers.online.OnlineLearner.share_normalizers`). Shrinking only on the m holders of
    K ranks would pay about m/K of the penalty while the loss steps count in full. A feature
    with no normalizer at all (s_j = 0: a weight no rank's rows hold, from a warm start) has no
    rate and is not shrunk."""
    for j in range(state.shape[0] - 1):
        rj = _rate(state[j, S], state[j, G])
        if state[j, W] != 0.0 and rj > 0.0:
            _shrink(state, j, eta_t * rj * l1, t)
        state[j, T] = t


@njit(cache=True, nogil=True)
def zero_model_loss_sum(labels, weights, loss_id):
    """Σ h·ℓ(y, 0): the loss of the all-zero model, the yardstick of an exploding loss."""
    total = 0.0
    for r in range(labels.shape[0]):
        total += float(weights[r]) * loss_value(loss_id, 0.0, float(labels[r]))
    return total


@njit(cache=True, nogil=True)
def restore_normalizers(indptr, indices, values, vpos, weights, state):
    """Set s_j = max |x_j| over the rows of non-zero weight (what a completed pass leaves),
    intercept s = 1."""
    d = state.shape[0] - 1
    cur = 0  # the cursor into vpos (solvers.kernels.values.row_start)
    for r in range(weights.shape[0]):
        if weights[r] == 0.0:
            continue
        a = indptr[r]
        b = indptr[r + 1]
        cur, mode = row_start(values, vpos, a, b, cur)
        e = cur
        for k in range(a, b):
            if mode == PLAIN:
                x = ONE
            elif mode == DENSE:
                x = values[k]
            else:
                x, e = value_at(values, vpos, k, e)
            ax = abs(x)
            j = indices[k]
            if ax > state[j, S]:
                state[j, S] = ax
    state[d, S] = 1.0


@njit(cache=True, nogil=True)
def pack_for_average(state, ids, buf):
    """For the rows ``ids`` (feature ids) and then the intercept's (the last row), n of them:
    buf[:n] = G⊙w and buf[n:2·n] = G (float32 products, as numpy's), in one pass."""
    n = ids.shape[0] + 1
    last = state.shape[0] - 1
    for i in range(n):
        j = ids[i] if i < n - 1 else last
        g = state[j, G]
        buf[i] = g * state[j, W]
        buf[n + i] = g


@njit(cache=True, nogil=True)
def unpack_average(tot, state, ids, k):
    """For the rows of :func:`pack_for_average`: w = Σ G⊙w / Σ G (0 where Σ G = 0) and
    G = Σ G / k (float32), from its AllReduced ``tot``; the other rows are left as they are."""
    n = ids.shape[0] + 1
    last = state.shape[0] - 1
    kf = np.float32(k)
    for i in range(n):
        j = ids[i] if i < n - 1 else last
        den = tot[n + i]
        state[j, W] = tot[i] / den if den > 0 else np.float32(0.0)
        state[j, G] = den / kf


@njit(cache=True, nogil=True)
def mark_state(state, marks):
    """marks[j] = 1 where feature j's weight or accumulated squared gradient is non-zero."""
    for j in range(state.shape[0] - 1):
        if state[j, W] != 0.0 or state[j, G] != 0.0:
            marks[j] = 1
