"""The distributed mean-form objective, evaluated with ONE AllReduce per evaluation.

    f(θ) = (1/W)·Σ_k Σ_{i∈k} wᵢ·ℓ(yᵢ, xᵢ·β + b) + λ₁·‖β‖₁ + (λ/2)·‖β‖²,
           θ = [β, b],  W = Σ_k Σ_{i∈k} wᵢ
    ∇f = (1/W)·Σ_k g_k + λ·[β, 0],   diag ∇²f = (1/W)·Σ_k h_k + λ·[1, …, 1, 0]

With λ₁ = ``l1`` > 0 the value includes λ₁·‖β‖₁ (:meth:`DistributedObjective.penalty`), but
``grad``, ``hess_diag`` and :meth:`DistributedObjective.curvature` stay those of the smooth part
(the loss term plus the L2 penalty): OWL-QN (:mod:`solvers.owlqn`) builds its pseudo-gradient
from them and takes its curvature pairs from the smooth gradient alone.

Each rank runs the CSR kernel on its shard (g_k, h_k: local weighted sums), then one float64
AllReduce of ``[g_k | h_k (first evaluation only) | loss_k | bad_k]`` (float64: the sums feed
curvature pairs and line-search comparisons, where float32 rounding would show). Everything
after the AllReduce is identical on every rank (deterministic kernels on identical bytes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from terascale.allreduce.communicator import Communicator
from terascale.solvers.errors import DivergenceError
from terascale.solvers.kernels import objective as K
from terascale.solvers.kernels.owlqn import l1_norm
from terascale.solvers.kernels.sampling import sample_stride
from terascale.solvers.kernels.vector import axpy, dot
from terascale.solvers.local_table import LocalTable
from terascale.solvers.setup import Inputs
from terascale.solvers.shard import Shard
from terascale.solvers.threads import SERIAL, RowThreads

EMPTY = np.zeros(0, dtype=np.float64)
_STATUS = {K.BAD_MARGIN: "non-finite margin", K.BAD_LOSS: "non-finite loss"}


def _block(shard: Shard, call, lo: int, hi: int, tick: Callable[[int], None]) -> tuple[float, str | None]:
    """Run ``call(start, stop, loss_sum) -> (loss_sum, status, row)`` over the row chunks of
    rows ``lo..hi-1`` (:meth:`Shard.chunks`; ``tick(rows of the block done)`` after each):
    (Σ wᵢℓᵢ over them, problem or None)."""
    total = 0.0
    for start, stop in shard.chunks(lo, hi):
        total, status, row = call(start, stop, total)
        if status != K.OK:
            return total, f"{_STATUS[status]} at row {row}"
        tick(stop - lo)
    return total, None


def _reduce(parts: list, outs: tuple[np.ndarray, ...] = ()) -> tuple[float, str | None]:
    """Combine the blocks' ``(loss, problem, *arrays)`` in block order: the first problem, else
    loss_0 + loss_1 + … and ``outs[k] += arrays_b[k]`` for blocks b ≥ 1 (block 0 added into
    ``outs`` itself; empty outs skipped)."""
    problem = next((p[1] for p in parts if p[1] is not None), None)
    total = parts[0][0]
    if problem is None:
        for p in parts[1:]:
            total += p[0]
            for out, mine in zip(outs, p[2:], strict=False):
                if out.shape[0] > 0:
                    out += mine
    return total, problem


def _private(out: np.ndarray, block: int) -> np.ndarray:
    """Block 0 adds into the caller's array; other blocks into zeros of their own (empty stays empty)."""
    return out if block == 0 or out.shape[0] == 0 else np.zeros_like(out)


def shard_sums(shard: Shard, theta: np.ndarray, loss_id: int, grad: np.ndarray = EMPTY,
               hess: np.ndarray = EMPTY, on_rows: Callable[[int], None] | None = None,
               threads: RowThreads = SERIAL) -> tuple[float, str | None]:
    """Local sums over a shard (see :mod:`solvers.kernels.objective`): (Σ wᵢℓᵢ, problem or None),
    gradient and Hessian-diagonal sums added into ``grad`` / ``hess`` when non-empty.

    With T = ``threads.size`` > 1 the rows are cut into T blocks (:mod:`solvers.threads`); block
    0 adds into ``grad`` / ``hess``, every other block into full-length arrays of its own
    (T − 1 extra copies of each requested array during the pass), added in block order."""
    s = shard

    def work(i: int, lo: int, hi: int, tick):
        g, h = _private(grad, i), _private(hess, i)

        def call(start: int, stop: int, total: float):
            return K.loss_grad_hess(s.indptr, s.indices, s.values, s.vpos, s.labels, s.weights, theta, loss_id,
                                    g, h, start, stop, total)

        return (*_block(s, call, lo, hi, tick), g, h)

    return _reduce(threads.run(work, threads.blocks(s.indptr), on_rows), (grad, hess))


def table_sums(table: LocalTable, theta: np.ndarray, loss_id: int, grad: np.ndarray = EMPTY,
               hess: np.ndarray = EMPTY, on_rows: Callable[[int], None] | None = None,
               threads: RowThreads = SERIAL) -> tuple[float, str | None]:
    """:func:`shard_sums` over a rank's :class:`~solvers.local_table.LocalTable` (θ, ``grad``
    and ``hess`` in compact numbering; ``grad`` / ``hess`` zero on entry): the same bits. With
    T > 1 threads, block b > 0 accumulates into a table of its own (θ copied;
    :meth:`~solvers.local_table.LocalTable.thread_table`), added into block 0's in block order."""
    want_grad, want_hess = grad.shape[0] > 0, hess.shape[0] > 0
    table.load(theta, want_hess)
    cuts = threads.blocks(table.shard.indptr)
    table.prepare_threads(cuts.shape[0] - 1)

    def work(i: int, lo: int, hi: int, tick):
        t = table.thread_table(i)

        def call(start: int, stop: int, total: float):
            return table.pass_rows(loss_id, want_grad, want_hess, start, stop, total, t)

        return _block(table.shard, call, lo, hi, tick)

    parts = threads.run(work, cuts, on_rows)
    out = _reduce(parts)
    if out[1] is None:
        table.merge_threads(len(parts), want_grad, want_hess)
        table.unload(grad, hess)
    return out


@dataclass
class Evaluation:
    value: float  # f(θ)
    grad: np.ndarray  # ∇f(θ), float64 (d + 1,)
    hess_diag: np.ndarray | None  # diag ∇²f(θ) when asked for
    finite: bool  # False if any rank hit a non-finite margin/loss, or f / ∇f are not finite
    local_problem: str | None  # this rank's own problem, for error messages
    loss_term: float  # (1/W)·Σ wᵢℓᵢ: f(θ) without the penalty

    def raise_if_not_finite(self, where: str) -> None:
        if not self.finite:
            raise DivergenceError(
                f"non-finite training objective {where}: "
                + (self.local_problem or "reported by another rank (see its error)")
            )


class DistributedObjective:
    """f, ∇f (and the Hessian diagonal) over all ranks' shards; see the module docstring."""

    def __init__(self, inputs: Inputs, comm: Communicator, loss_id: int, l2: float,
                 on_rows: Callable[[int], None] | None = None, threads: RowThreads = SERIAL, l1: float = 0.0):
        self.inputs = inputs
        self.shard = inputs.train
        self.comm = comm
        self.loss_id = loss_id
        self.l2 = float(l2)
        self.l1 = float(l1)
        self.on_rows = on_rows
        self.threads = threads  # the rank's threads (solvers.threads): every pass runs on them
        self.dim = inputs.n_features + 1
        self.table: LocalTable | None = None  # set by restricted()

    def restricted(self, table: LocalTable) -> DistributedObjective:
        """The same objective over the compact numbering of ``table`` (this rank's working
        table, see :mod:`solvers.local_table`): θ then has ``table.n_compact + 1`` entries."""
        if table.size > 0 and table.n_compact == 0:
            raise ValueError("the working table is not bound to the agreed feature set (LocalTable.bind)")
        out = copy.copy(self)
        out.table = table
        out.dim = table.n_compact + 1
        return out

    def penalty(self, theta: np.ndarray) -> float:
        """λ₁·‖β‖₁ + (λ/2)·‖β‖² (the intercept excluded; the L1 term only when λ₁ > 0)."""
        beta = theta[:-1]
        value = 0.5 * self.l2 * dot(beta, beta)
        if self.l1 > 0.0:
            value += self.l1 * l1_norm(theta)
        return value

    def _local(self, theta: np.ndarray, grad: np.ndarray, hess: np.ndarray) -> tuple[float, str | None]:
        if self.table is not None:
            loss, problem = table_sums(self.table, theta, self.loss_id, grad, hess, self.on_rows, self.threads)
        else:
            loss, problem = shard_sums(self.shard, theta, self.loss_id, grad, hess, self.on_rows, self.threads)
        return loss, None if problem is None else f"rank {self.comm.rank}: {problem}"

    def evaluate(self, theta: np.ndarray, with_hessian: bool = False) -> Evaluation:
        d1 = self.dim
        n_blocks = 2 if with_hessian else 1
        buf = np.zeros(n_blocks * d1 + 2, dtype=np.float64)
        hess = buf[d1 : 2 * d1] if with_hessian else EMPTY
        loss, problem = self._local(theta, buf[:d1], hess)
        buf[-2] = loss
        buf[-1] = 0.0 if problem is None else 1.0
        tot = self.comm.allreduce(buf)
        inv_w = 1.0 / self.inputs.total_weight
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite values are reported below
            g = tot[:d1]  # the AllReduce result is this rank's own array: scaled in place
            g *= inv_w
            axpy(self.l2, theta[:-1], g[:-1])
            loss_term = float(tot[-2]) * inv_w
            value = loss_term + self.penalty(theta)
            h = None
            if with_hessian:
                h = tot[d1 : 2 * d1] * inv_w
                h[:-1] += self.l2
        finite = tot[-1] == 0.0 and np.isfinite(value) and bool(np.isfinite(g).all())
        return Evaluation(value, g, h, bool(finite), problem, loss_term)

    def curvature(self, theta: np.ndarray, p: np.ndarray, sample_rows: int = 0) -> float | None:
        """pᵀ·∇²f(θ)·p (one gather pass over the working table and one AllReduce of two
        scalars), or None if a margin was not finite on some rank. Needs :meth:`restricted`.

        With ``sample_rows`` > 0 a rank larger than that passes over about ``sample_rows`` of
        its rows only (every stride-th run, :mod:`solvers.kernels.sampling`) and scales their
        sum by its total weight over theirs: an estimate of its data part (the penalty part
        λ·‖p_β‖² is exact). Ranks no larger than ``sample_rows`` (and 0) use every row, exactly."""
        if self.table is None:
            raise RuntimeError("curvature needs the rank's working table (restricted objective)")
        table = self.table
        table.load_direction(theta, p)
        n_rows = table.shard.n_rows
        stride = sample_stride(n_rows, sample_rows)
        sums = np.zeros(2)  # the kernel adds into it: [Σ hᵢ·ℓ''ᵢ·uᵢ², Σ hᵢ] over the rows used

        def work(i: int, lo: int, hi: int, tick):
            mine = sums if i == 0 else np.zeros(2)  # the table is only read: shared by the blocks

            def call(start: int, stop: int, _: float):
                return (0.0, *table.curvature_rows(self.loss_id, start, stop, stride, mine))

            return (*_block(table.shard, call, lo, hi, tick), mine)

        problem = _reduce(self.threads.run(work, self.threads.blocks(table.shard.indptr), self.on_rows), (sums,))[1]
        acc = sums[0]
        if stride > 1 and sums[1] > 0.0:
            acc *= table.shard.weight_sum() / sums[1]
        tot = self.comm.allreduce_scalars([acc, 0.0 if problem is None else 1.0])
        if tot[1] != 0.0:
            return None
        beta = p[:-1]
        return tot[0] / self.inputs.total_weight + self.l2 * dot(beta, beta)

    def value(self, theta: np.ndarray) -> float:
        """f(θ) alone: a loss-only pass and one scalar AllReduce; raises if not finite."""
        loss, problem = self._local(theta, EMPTY, EMPTY)
        tot = self.comm.allreduce_scalars([loss, 0.0 if problem is None else 1.0])
        value = tot[0] / self.inputs.total_weight + self.penalty(theta)
        if tot[1] != 0.0 or not np.isfinite(value):
            raise DivergenceError(
                "non-finite training objective at the final weights: "
                + (problem or "reported by another rank (see its error)")
            )
        return value
