"""A CPU model of a GPU dual epoch with the hot features out of the asynchronous loop (issue 41).

``concurrency_model`` shows why TPA-SCD stalls on click data: with τ rows in flight every row
reads the frequent features' coordinates τ − 1 updates late, and the ESO damping that keeps the
dual from diverging shrinks each row's step by the rows sharing its features — about 400x at the
H100's τ = 4,224 on the benchmark's rows (116 / 26 epochs against 4 / 3). This model splits the
features by how many rows hold them (ω_j, over n rows):

- **hot** H: the constant and every feature with ω_j > θ n / τ (θ = 1: fewer than τ rows hold a
  cold feature, so τ rows in flight rarely share one). On the benchmark's 2M rows at τ = 4,224
  that is 7,236 features holding 86% of the non-zeros. Their weights w_H are a primal block,
  solved exactly: after each of ``sub`` chunks of an epoch, one Newton step on the primal
  objective over w_H with the rest fixed (Hessian ``X_Hᵀ diag(c φ'') X_H / N + λI``, factored once
  for the squared loss, whose Hessian is constant, and once an epoch for the logistic), with a
  backtracking line search;
- **cold** C: SDCA on the dual as ``concurrency_model`` runs it (row t misses the updates of the
  τ − 1 rows before it), over the cold features only, each row's margin ``o_i + x_iᶜ·u`` with the
  offsets ``o = X_H w_H`` fixed during a chunk, each row's step damped by the ESO over the cold
  features alone (β_j ≤ 2 by the choice of H).

The duality gap is a certificate for any pair: ``P(w_H, u) − max(D(α), D(α̂))`` with
``α̂ = −φ'(margins)`` (the primal point's own dual) and ``D`` the full problem's dual, its
``w(α) = (1/λN) Σ c_i α_i x_i`` over every feature. θ = None: no hot block (τ = 1 is then the
sequential SDCA). One rank, the objective of ``solvers.scd`` (mean loss + λ/2 ||w||²).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
from numba import njit

from terascale.solvers.data import CSRData
from terascale.solvers.scd.losses import (
    LOGISTIC,
    SQUARED,
    dual_step,
    dual_value,
    primal_loss,
    sigmoid,
)


@njit(cache=True)
def delayed_cold_epoch(indptr, indices, values, labels, weights, sqn, alpha, u, order, tau, loss, scale, offset):
    """SDCA over ``order`` with τ rows in flight (``concurrency_model.delayed_dual_epoch``'s
    schedule), each row's margin ``offset[i] + x_i·u``; no constant feature (it is hot)."""
    n = order.shape[0]
    rows = np.empty(tau, np.int64)
    coefs = np.zeros(tau)
    for t in range(n + tau):
        slot = t % tau
        if t >= tau:  # row t - tau's update lands
            r = rows[slot]
            for k in range(indptr[r], indptr[r + 1]):
                u[indices[k]] += coefs[slot] * values[k]
        if t >= n:
            continue
        i = order[t]
        dot = offset[i]
        for k in range(indptr[i], indptr[i + 1]):
            dot += values[k] * u[indices[k]]
        a = alpha[i]
        a_new = dual_step(loss, labels[i], a, dot, scale * weights[i] * sqn[i])
        alpha[i] = a_new
        rows[slot] = i
        coefs[slot] = scale * weights[i] * (a_new - a)


@njit(cache=True)
def loss_derivs(loss, labels, z, d1, d2):
    """φ'(z_i) and φ''(z_i) of every row (squared: z − y and 1; logistic on ±1 labels)."""
    for i in range(z.shape[0]):
        if loss == SQUARED:
            d1[i] = z[i] - labels[i]
            d2[i] = 1.0
        else:
            s = 1.0 if labels[i] > 0.5 else -1.0
            p = sigmoid(-s * z[i])
            d1[i] = -s * p
            d2[i] = p * (1.0 - p)


@njit(cache=True)
def _sums(loss, labels, weights, alpha, z):
    """(Σ c φ(z_i), Σ c h(α_i))."""
    p = 0.0
    d = 0.0
    for i in range(labels.shape[0]):
        p += weights[i] * primal_loss(loss, labels[i], z[i])
        d += weights[i] * dual_value(loss, labels[i], alpha[i])
    return p, d


class HotBlockModel:
    """The model on one shard: ``run(tau, sub, ...)`` -> epochs to the gap and what it cost."""

    def __init__(self, data: CSRData, loss: str, lam: float, bias_scale: float = 1.0):
        n = data.n_rows
        x = sp.csr_matrix((data.values.astype(np.float64), data.indices, data.indptr), shape=(n, data.n_features))
        self.x = sp.hstack([x, sp.csr_matrix(np.full((n, 1), bias_scale))]).tocsr()  # the constant: last
        self.x.sort_indices()
        self.omega = np.bincount(self.x.indices, minlength=self.x.shape[1])
        self.labels = data.labels.astype(np.float64)
        self.weights = data.weights.astype(np.float64)
        self.loss = SQUARED if loss == "squared" else LOGISTIC
        self.lam = lam
        self.n_w = float(self.weights.sum())

    def hot_set(self, tau: int, theta: float | None) -> np.ndarray:
        """The hot features' mask: ω_j > θ n / τ (the constant always, unless θ is None)."""
        if theta is None:
            return np.zeros(self.x.shape[1], np.bool_)
        hot = self.omega > theta * self.x.shape[0] / tau
        hot[-1] = True
        return hot

    def run(self, tau: int, theta: float | None = 1.0, sub: int = 4, eps: float = 1e-4, max_epochs: int = 50,
            seed: int = 1, refactor: int = 1) -> dict:
        n, lam, n_w, loss = self.x.shape[0], self.lam, self.n_w, self.loss
        hot = self.hot_set(tau, theta)
        xc = self.x[:, np.flatnonzero(~hot)].tocsr()
        xh = self.x[:, np.flatnonzero(hot)].tocsr()
        xh_t = xh.T.tocsr()
        omega_c = np.bincount(xc.indices, minlength=xc.shape[1]).astype(np.float64)
        beta = 1.0 + np.maximum(omega_c - 1.0, 0.0) * (tau - 1) / max(1, n - 1)  # ESO over C
        sq = xc.multiply(xc)
        sqn = np.asarray(sq @ beta).ravel()
        plain = np.asarray(sq.sum(axis=1)).ravel()
        cold = (xc.indptr.astype(np.int64), xc.indices.astype(np.int64), xc.data)
        alpha, u, wh = np.zeros(n), np.zeros(xc.shape[1]), np.zeros(xh.shape[1])
        off, d1, d2 = np.zeros(n), np.zeros(n), np.zeros(n)
        scale = 1.0 / (lam * n_w)
        p0 = _sums(loss, self.labels, self.weights, alpha, off)[0] / n_w
        factor = None
        newton = hot_passes = 0
        history, history_alpha = [], []
        for epoch in range(1, max_epochs + 1):
            order = np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)
            if loss != SQUARED and refactor and (epoch - 1) % refactor == 0:
                factor = None  # the logistic Hessian: every ``refactor`` epochs (0: once)
            for part in np.array_split(order, sub if wh.shape[0] else 1):
                delayed_cold_epoch(*cold, self.labels, self.weights, sqn, alpha, u, part, tau, loss, scale, off)
                if not wh.shape[0]:
                    continue
                z = off + xc @ u
                loss_derivs(loss, self.labels, z, d1, d2)
                grad = xh_t @ (self.weights * d1) / n_w + lam * wh
                if factor is None:
                    hess = (xh_t @ xh.multiply((self.weights * d2)[:, None]).tocsr()).toarray() / n_w
                    hess[np.diag_indices_from(hess)] += lam
                    factor = sla.cho_factor(hess)
                step = -sla.cho_solve(factor, grad)
                dz = xh @ step
                f0 = _sums(loss, self.labels, self.weights, alpha, z)[0] / n_w + 0.5 * lam * (wh @ wh)
                t = 1.0
                for _ in range(40):  # backtracking: a logistic Newton step from far can overshoot
                    w1 = wh + t * step
                    if _sums(loss, self.labels, self.weights, alpha, z + t * dz)[0] / n_w + 0.5 * lam * (w1 @ w1) <= f0:
                        break
                    t *= 0.5
                wh += t * step
                off += t * dz
                newton += 1
                hot_passes += 3  # margins, the gradient, the line search's margins
            z = off + xc @ u
            p, dv = _sums(loss, self.labels, self.weights, alpha, z)
            w_alpha = scale * (xh_t @ (self.weights * alpha))
            primal = p / n_w + 0.5 * lam * (u @ u + wh @ wh)
            dual = dv / n_w - 0.5 * lam * (u @ u + w_alpha @ w_alpha)
            history_alpha.append((primal - dual) / p0)
            loss_derivs(loss, self.labels, z, d1, d2)
            a_hat = -d1
            if loss == LOGISTIC:  # strictly inside the domain of the entropy
                s = np.where(self.labels > 0.5, 1.0, -1.0)
                a_hat = s * np.clip(s * a_hat, 1e-15, 1.0 - 1e-15)
            w_hat = scale * (self.x.T @ (self.weights * a_hat))
            dual = max(dual, _sums(loss, self.labels, self.weights, a_hat, z)[1] / n_w - 0.5 * lam * (w_hat @ w_hat))
            gap = (primal - dual) / p0
            history.append(gap)
            if gap <= eps:
                break
        return {"tau": tau, "theta": theta, "sub": sub, "hot_features": int(hot.sum()),
                "hot_nnz_share": xh.nnz / self.x.nnz,
                "damping": float(np.mean(np.where(plain > 0, sqn / np.where(plain > 0, plain, 1.0), 1.0))),
                "epochs_to_gap": epoch if history[-1] <= eps else None, "gaps": history,
                "gaps_alpha": history_alpha,
                "newton_steps": newton, "hot_passes": hot_passes, "primal": primal, "p0": p0}
