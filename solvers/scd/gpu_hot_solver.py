"""The GPU dual with the hot features out of the asynchronous loop (issue 41; the design and its
figures: ``docs/design-notes``, "GPU dual: the frequent features out of the asynchronous loop").

The features are split (``hot_split``) into a small hot block H (the constant and every feature
held by more than n / τ rows, τ the rows in flight) and the cold rest C. The variables:

* α (a dual variable a row) and ``u = (1/λN) Σ c_i α_i x_iᶜ``, the cold weights, as SDCA keeps them;
* ``w_H``, the hot weights: a primal block;
* the offsets ``o = X_H w_H`` of every row.

An epoch takes the device-made permutation (``gpu_shuffle``) in ``sub`` ranges; after each range:

1. ``cold_epoch``: TPA-SCD steps for the range's rows, margins ``o_i + x_iᶜ·u``, each step damped
   by the ESO over C alone (β_j < 2 by the choice of H; ``eso_weights``' formula);
2. one Newton step on ``P`` over ``w_H`` with u fixed: margins ``z = o + X_C u``, gradient
   ``g = X_Hᵀ (c φ'(z)) / N + λ w_H``, Hessian ``X_Hᵀ diag(c φ''(z)) X_H / N + λ I`` (the squared
   loss: constant, factored once; the logistic: again at the first step of every epoch), step
   ``s = −H⁻¹ g`` (``gpu_dense``), ``w_H += t s`` and ``o += t X_H s`` with t = 1 for the squared
   loss (a Newton step on a quadratic is exact) or halved until P does not increase (logistic).

No row writes a coordinate that most rows hold: no single-address atomic per row.

The point is ``w = (u, w_H)``; any dual point certifies it, and two are at hand: the dual of
its own margins, ``α̂ = −φ'(z)``, and the iterates' α, whose hot part ``(1/λN) X_Hᵀ c α`` lags
``w_H``: ``gap = P(w) − max(D(α̂), D(α))``, ``D(a) = (1/N) Σ c h(a_i) − (λ/2) ||(1/λN) Xᵀ c a||²``
(the transpose products over every feature). On the click benchmark's 2M rows (λN = 200) D(α̂)
is the better one from the first epoch (the ridge gap after 3 epochs: 4e-5 against 0.28 with
D(α) alone); with λN small against the residuals (tiny data) D(α) is. One rank only: the Newton step needs the Hessian of all rows (K > 1 ranks keep
``gpu_local_solver.GpuDualLocalSolver``).
"""

from __future__ import annotations

import numpy as np

from terascale.solvers.data import CSRData
from terascale.solvers.kernels.values import densified
from terascale.solvers.scd.gpu_dense import Cholesky
from terascale.solvers.scd.gpu_device import (
    MAX_REDUCE_BLOCKS,
    Device,
    block_threads,
    coord_grid,
    launch_shape,
    require_gpu,
    resident_blocks,
    simulator_enabled,
)
from terascale.solvers.scd.hot_split import DEFAULT_MAX_HOT, HotPlan, plan, split
from terascale.solvers.scd.losses import LOGISTIC, SQUARED

__all__ = ["HOT_LOSSES", "DEFAULT_SUB", "GpuHotDualSolver", "device_plan", "worth_it"]

HOT_LOSSES = (SQUARED, LOGISTIC)  # a Newton step needs φ''
DEFAULT_SUB = 4  # Newton steps an epoch (the model: 3 epochs to 1e-4 at τ = 4,224, both losses)
_LINE_HALVINGS = 40
HESSIAN_SEGMENT = 256  # rows of a hot column one block of ``hessian_lower`` takes


def launch_size(data: CSRData, threads_per_block: int | None, blocks: int | None) -> tuple[int, int, int]:
    """(threads per block, grid, rows in flight) of the cold epoch on this device."""
    tpb = block_threads(threads_per_block, data.nnz, data.n_rows)
    grid = max(1, data.n_rows if blocks is None else min(int(blocks), data.n_rows))
    return tpb, grid, min(grid, resident_blocks(tpb))


def device_plan(data: CSRData, bias_scale: float, threads_per_block: int | None = None,
                blocks: int | None = None, hot_tau: int | None = None,
                max_hot: int = DEFAULT_MAX_HOT) -> HotPlan:
    """``hot_split.plan`` of this shard for ``hot_tau`` rows in flight, or the device's."""
    _, _, in_flight = launch_size(data, threads_per_block, blocks)
    return plan(data, bias_scale, in_flight if hot_tau is None else int(hot_tau), max_hot)


def worth_it(chosen: HotPlan) -> bool:
    """The hot block is the default when it keeps at least a quarter of the rows in flight asked
    for; on long rows (text) the Hessian's budget leaves so few hot features that τ would
    collapse, and the damped TPA-SCD dual at the device's full τ is kept instead."""
    return 4 * chosen.tau >= chosen.tau_max


def hessian_segments(colptr: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(column, CSC start) of every segment of up to ``rows`` consecutive rows of each column."""
    lengths = np.diff(colptr)
    per = -(-lengths // rows)
    col = np.repeat(np.arange(lengths.shape[0], dtype=np.int32), per)
    first = np.repeat(colptr[:-1] - rows * (np.cumsum(per) - per), per)
    start = first + rows * np.arange(col.shape[0], dtype=np.int64)
    return col, start.astype(np.int64)


class GpuHotDualSolver:
    """One shard's hot-block dual on the device (see the module docstring).

    ``hot_tau``: the rows in flight the hot set is chosen for (default: those the device runs at
    once, ``resident_blocks``; the simulator runs one, so tests pass a larger one to get a hot
    block). ``blocks``: thread blocks of the cold epoch (default: as many as run at once)."""

    def __init__(self, data: CSRData, loss: int, lam: float, n_weight: float, bias_scale: float,
                 threads_per_block: int | None = None, blocks: int | None = None,
                 sub: int = DEFAULT_SUB, hot_tau: int | None = None,
                 max_hot: int = DEFAULT_MAX_HOT, chosen: HotPlan | None = None) -> None:
        from terascale.solvers.scd import gpu_hot_kernels as hk
        from terascale.solvers.scd import gpu_reduce_kernels as rk

        if loss not in HOT_LOSSES:
            raise ValueError(f"loss id {loss!r}: the hot block's Newton step needs a twice "
                             "differentiable loss (squared or logistic)")
        if sub < 1:
            raise ValueError(f"sub = {sub}: expected >= 1 Newton steps an epoch")
        require_gpu()
        data = densified(data)  # the kernels read one value per non-zero
        self.hk, self.rk = hk, rk
        self.dev = dev = Device()
        n = data.n_rows
        self.n, self.loss, self.lam = n, int(loss), float(lam)
        self.inv_n = 1.0 / float(n_weight)
        self.scale = 1.0 / (float(lam) * float(n_weight))
        tpb, grid, in_flight = launch_size(data, threads_per_block, blocks)
        self.tpb = tpb
        tau_max = in_flight if hot_tau is None else int(hot_tau)
        s = split(data, bias_scale, tau_max, max_hot, chosen)
        self.hot_split = s
        # fewer rows in flight when the hot set was capped (choose_hot lowered tau)
        self.blocks = grid if s.tau >= tau_max else max(1, min(grid, s.tau))
        self.concurrency = min(in_flight, s.tau)
        self.sub = sub if s.n_hot else 1
        self.n_hot, self.n_cold = s.n_hot, int(s.cold.shape[0])
        put = dev.put
        self.cold_rows = [put(a) for a in (s.cold_rows.ptr, s.cold_rows.idx, s.cold_rows.val)]
        self.cold_cols = [put(a) for a in (s.cold_cols.ptr, s.cold_cols.idx, s.cold_cols.val)]
        self.hot_rows = [put(a) for a in (s.hot_rows.ptr, s.hot_rows.idx, s.hot_rows.val)]
        self.hot_cols = [put(a) for a in (s.hot_cols.ptr, s.hot_cols.idx, s.hot_cols.val)]
        seg_col, seg_start = hessian_segments(s.hot_cols.ptr, HESSIAN_SEGMENT)
        self.segments = (put(seg_col), put(seg_start), HESSIAN_SEGMENT)
        self.labels = put(data.labels.astype(np.float32))
        self.weights = put(data.weights.astype(np.float32))
        self.sqn = put(s.sqn)
        vec = lambda m: dev.put(np.zeros(max(m, 1)))[:m]  # noqa: E731 - zeroed device vectors
        self.alpha, self.off, self.z, self.dz, self.d1c, self.d2c, self.ca = (vec(n) for _ in range(7))
        self.u, self.u_hat = vec(self.n_cold), vec(self.n_cold)
        self.wh, self.g, self.step, self.wh_hat = (vec(self.n_hot) for _ in range(4))
        self.h = dev.empty((max(self.n_hot, 1), max(self.n_hot, 1)), np.float64)
        self.order = dev.empty(max(n, 1), np.int64)[:n]
        self.part = dev.empty((MAX_REDUCE_BLOCKS, 3), np.float64)
        self.out = dev.empty(3, np.float64)
        self.h_out = dev.pinned(3, np.float64)
        self.h_alpha = dev.pinned(max(n, 1), np.float64)[:n]
        self.h_u = dev.pinned(max(self.n_cold, 1), np.float64)[:self.n_cold]
        self.h_wh = dev.pinned(max(self.n_hot, 1), np.float64)[:self.n_hot]
        self.chol = Cholesky(dev, self.n_hot)
        self._factored = False
        self.stats = {"newton_steps": 0, "factorizations": 0, "line_search_halvings": 0}
        sim = simulator_enabled()
        self._col_threads = (2, 2) if sim else (32, 256)  # (cold, hot) columns: few rows, many

    # -- launches ----------------------------------------------------------------------------

    def _launch(self, kernel, grid: int, threads: int, *args, reduce: bool = False) -> None:
        shared = 8 * (threads + 1) if reduce else 0
        self.dev.launch(kernel, grid, threads, *args, shared=shared)

    def _rows(self, mat, v, base, out) -> None:
        """out = base + mat v (base None: out = mat v)."""
        grid, threads = launch_shape(out.shape[0], 256)
        self._launch(self.hk.row_dots, grid, threads, *mat, v, out if base is None else base,
                     base is not None, out)

    def _cols(self, mat, r, s: float, out, hot: bool) -> None:
        """out = s matᵀ r (a block per column)."""
        if out.shape[0]:
            threads = self._col_threads[hot]
            self._launch(self.hk.col_dots, coord_grid(out.shape[0]), threads, *mat, r, float(s), out,
                         reduce=True)

    def _reduce(self, kernel, n: int, *args, n_sum: int) -> np.ndarray:
        """A partial-sums kernel over n items, combined in block order -> n_sum scalars on the host."""
        grid, threads = launch_shape(max(n, 1), 256)
        self._launch(kernel, grid, threads, *args, self.part, reduce=True)
        self._launch(self.rk.finish_partials, 1, 3, self.part, grid, n_sum, self.out)
        self.dev.download(self.out, self.h_out)
        return self.h_out[:n_sum].copy()

    def _dot(self, a, b) -> float:
        return float(self._reduce(self.hk.dot_partials, a.shape[0], a, b, n_sum=1)[0]) if a.shape[0] else 0.0

    def _axpy(self, y, a: float, x) -> None:
        if y.shape[0]:
            grid, threads = launch_shape(y.shape[0], 256)
            self._launch(self.hk.axpy, grid, threads, y, float(a), x)

    # -- the epoch ---------------------------------------------------------------------------

    def run(self, epochs: int, seed: int, rank: int, round_index: int) -> None:
        """``epochs`` epochs from the current point (permutations keyed as ``gpu_local_solver``'s)."""
        from terascale.solvers.scd.gpu_shuffle import domain_bits, epoch_keys, permutation_kernel

        if not self.n:
            return
        half, mask = domain_bits(self.n)
        grid, threads = launch_shape(self.n, 256)
        cuts = [k * self.n // self.sub for k in range(self.sub + 1)]
        for e in range(epochs):
            self.dev.launch(permutation_kernel, grid, threads, self.order, self.n, half, mask,
                            *epoch_keys(seed, rank, round_index, e))
            if self.loss != SQUARED:
                self._factored = False  # the logistic Hessian: once an epoch
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                if b > a:
                    self._launch(self.hk.cold_epoch, max(1, min(self.blocks, b - a)), self.tpb,
                                 *self.cold_rows, self.labels, self.weights, self.sqn, self.alpha,
                                 self.u, self.order, a, b, self.loss, self.scale, self.off, reduce=True)
                if self.n_hot:
                    self._newton()

    def _newton(self) -> None:
        """One Newton step on w_H with u fixed (the module docstring's step 2)."""
        hk, n = self.hk, self.n
        self._rows(self.cold_rows, self.u, self.off, self.z)
        grid, threads = launch_shape(n, 256)
        self._launch(hk.loss_derivs, grid, threads, self.loss, self.labels, self.weights, self.z,
                     self.d1c, self.d2c)
        self._cols(self.hot_cols, self.d1c, self.inv_n, self.g, hot=True)
        self._axpy(self.g, self.lam, self.wh)
        if not self._factored:
            self._factor()
        self.chol.solve(self.g, self.step)
        self._rows(self.hot_rows, self.step, None, self.dz)
        t = 1.0
        if self.loss != SQUARED:
            t = self._line_search()
        self._axpy(self.wh, t, self.step)
        self._axpy(self.off, t, self.dz)
        self.stats["newton_steps"] += 1

    def _factor(self) -> None:
        hk, m = self.hk, self.n_hot
        grid, threads = launch_shape(m * m, 256)
        self._launch(hk.fill2d, grid, threads, self.h, 0.0)
        n_seg = self.segments[0].shape[0]
        if n_seg:
            self._launch(hk.hessian_lower, max(1, min(n_seg, 1 << 16)), self._col_threads[0],
                         *self.segments, *self.hot_cols, *self.hot_rows, self.d2c, self.h)
        self._launch(hk.hessian_finish, grid, threads, self.h, self.inv_n, self.lam)
        self.chol.factor(self.h)
        self._factored = True
        self.stats["factorizations"] += 1

    def _line_search(self) -> float:
        """The largest t in 1, 1/2, ... with P(w_H + t s) <= P(w_H) (u fixed)."""
        ww, ws, ss = self._dot(self.wh, self.wh), self._dot(self.wh, self.step), self._dot(self.step, self.step)
        args = (self.loss, self.labels, self.weights, self.z, self.dz)
        f0 = self._reduce(self.hk.loss_partials, self.n, *args, 0.0, n_sum=1)[0] * self.inv_n + 0.5 * self.lam * ww
        t = 1.0
        for _ in range(_LINE_HALVINGS):
            ft = self._reduce(self.hk.loss_partials, self.n, *args, t, n_sum=1)[0] * self.inv_n
            if ft + 0.5 * self.lam * (ww + 2.0 * t * ws + t * t * ss) <= f0:
                return t
            t *= 0.5
            self.stats["line_search_halvings"] += 1
        return 0.0  # no decrease along s (rounding at the optimum): keep w_H

    # -- the point, its gap, transfers ------------------------------------------------------

    def gap_sums(self) -> np.ndarray:
        """(Σ c φ(z_i), Σ c h(α̂_i), ||w(α̂)||², Σ c h(α_i), ||w(α)||²) at the point (u, w_H), z its
        margins (the offsets recomputed from w_H first), α̂ = −φ'(z) and α the iterates' duals:
        two dual points, each a certificate (the better one counts; ``GpuHotDualProblem``)."""
        if not self.n:
            return np.zeros(5)
        if self.n_hot:
            self._rows(self.hot_rows, self.wh, None, self.off)
        self._rows(self.cold_rows, self.u, self.off, self.z)
        sums = self._reduce(self.hk.gap_partials, self.n, self.loss, self.labels, self.weights,
                            self.z, self.ca, n_sum=2)
        hat = self._norm_of_w(self.ca)
        h_alpha = self._reduce(self.hk.dual_partials, self.n, self.loss, self.labels, self.weights,
                               self.alpha, self.ca, n_sum=1)[0]
        return np.array([sums[0], sums[1], hat, h_alpha, self._norm_of_w(self.ca)])

    def _norm_of_w(self, ca) -> float:
        """||(1/λN) Xᵀ ca||² over every feature (column products: the same bits every run)."""
        self._cols(self.cold_cols, ca, self.scale, self.u_hat, hot=False)
        self._cols(self.hot_cols, ca, self.scale, self.wh_hat, hot=True)
        return self._dot(self.u_hat, self.u_hat) + self._dot(self.wh_hat, self.wh_hat)

    def model(self, out: np.ndarray) -> None:
        """out (n_features + 1,) = the point: u on the cold ids, w_H on the hot ones."""
        s = self.hot_split
        if self.n_cold:
            self.dev.download(self.u, self.h_u)
            out[s.cold] = self.h_u
        if self.n_hot:
            self.dev.download(self.wh, self.h_wh)
            out[s.hot] = self.h_wh

    def load(self, alpha: np.ndarray, w: np.ndarray) -> None:
        """Start from (α, w): u = w on the cold ids, w_H on the hot ones, o = X_H w_H."""
        s = self.hot_split
        if alpha.shape != (self.n,):
            raise ValueError(f"local vector has shape {alpha.shape}; expected ({self.n},)")
        if self.n:
            np.copyto(self.h_alpha, alpha)
            self.dev.upload(self.alpha, self.h_alpha)
        if self.n_cold:
            np.copyto(self.h_u, w[s.cold])
            self.dev.upload(self.u, self.h_u)
        if self.n_hot:
            np.copyto(self.h_wh, w[s.hot])
            self.dev.upload(self.wh, self.h_wh)
            if self.n:
                self._rows(self.hot_rows, self.wh, None, self.off)

    def local(self) -> np.ndarray:
        """α on the host (a pinned buffer, valid until the next call)."""
        if self.n:
            self.dev.download(self.alpha, self.h_alpha)
        return self.h_alpha

    def traffic(self) -> dict[str, int]:
        return self.dev.traffic()
