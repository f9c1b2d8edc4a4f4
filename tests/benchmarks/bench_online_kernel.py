"""Benchmark: throughput of one online pass (the hybrid's first stage) in non-zeros per second.

Data: synthetic binary CSR, 2M rows, 2^22 features, about 33 non-zeros per row, two layouts:

* ``ctr_like``: 39 fields shaped like the click-log generator's (``pipeline.generate``): the 26
  categorical fields' vocabulary sizes, power-law exponents and missing rates, 13 integer fields
  of 60 bucket values each with their missing rates; each (field, rank) hashed to a random
  index in 2^22. Frequent values keep their weights in cache, as in real click logs.
* ``uniform``: 35 fields whose values are uniform over their 2^22/35 index range: every
  non-zero is a cache miss (the worst case, bound by the random-access rate of the memory).

Labels are Bernoulli(0.25), importance weights 1. Figures per layout (best of ``repeats``):

* ``online_pass``: :func:`solvers.kernels.online.online_pass` (logistic loss, adaptive,
  normalized, importance-invariant updates, progressive loss), each repeat from a zero state.
* ``plain_adagrad``: a bare AdaGrad loop over the same CSR (separate float32 weight and G
  arrays, no normalization, no invariance, no loss): the "how fast can a loop go" yardstick.
* ``loss_grad``: :func:`solvers.kernels.objective.loss_grad_hess` (loss + gradient, one
  L-BFGS function evaluation's local work).

Run: ``python -m tests.benchmarks.bench_online_kernel [--rows N] [--repeats R]``; ``main()``
returns the figures (throughputs in non-zeros per second).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
from numba import njit

from terascale.solvers.kernels.losses import LOGISTIC
from terascale.solvers.kernels.objective import loss_grad_hess
from terascale.solvers.kernels.online import new_state, online_pass

ROWS = 2_000_000
BITS = 22
REPEATS = 3
INT_BUCKETS = 60


def _fields() -> np.ndarray:
    """(vocabulary, exponent, missing rate) per field, from the click-log generator's tables."""
    from terascale.pipeline.generate import CAT_TABLE, INT_TABLE

    rows = [(v, s, miss) for v, s, miss, _sigma in CAT_TABLE.values()]
    rows += [(INT_BUCKETS, 1.0, r[0]) for r in INT_TABLE.values()]
    return np.array(rows, dtype=np.float64)


@njit(cache=True)
def _mix64(x):
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


@njit(cache=True)
def _power_law_rank(u, vocab, s):
    """Inverse CDF of a continuous power law r^-s on [1, vocab + 1), floored."""
    if abs(s - 1.0) < 1e-9:
        r = math.exp(u * math.log(vocab + 1.0))
    else:
        a = 1.0 - s
        r = ((math.pow(vocab + 1.0, a) - 1.0) * u + 1.0) ** (1.0 / a)
    return min(max(int(r), 1), int(vocab))


@njit(cache=True)
def _generate(rows, bits, fields, uniform, seed, indptr, indices):
    np.random.seed(seed)
    mask = np.uint64((1 << bits) - 1)
    n_fields = fields.shape[0]
    block = (1 << bits) // n_fields
    buf = np.empty(n_fields, np.int64)
    nnz = 0
    for r in range(rows):
        n = 0
        for f in range(n_fields):
            if uniform:
                buf[n] = f * block + np.random.randint(0, block)
                n += 1
            elif np.random.random() >= fields[f, 2]:
                rank = _power_law_rank(np.random.random(), fields[f, 0], fields[f, 1])
                buf[n] = np.int64(_mix64(np.uint64(rank * 64 + f)) & mask)
                n += 1
        row = np.sort(buf[:n])
        for i in range(n):
            if i == 0 or row[i] != row[i - 1]:
                indices[nnz] = row[i]
                nnz += 1
        indptr[r + 1] = nnz
    return nnz


def synthetic_csr(rows: int = ROWS, bits: int = BITS, layout: str = "ctr_like", seed: int = 0):
    """(indptr, indices, values, labels, weights) of a binary synthetic CSR (see the docstring)."""
    fields = _fields() if layout == "ctr_like" else np.zeros((35, 3))
    indptr = np.zeros(rows + 1, np.int64)
    indices = np.empty(rows * fields.shape[0], np.int32)
    nnz = _generate(rows, bits, fields, layout == "uniform", seed, indptr, indices)
    rng = np.random.default_rng(seed)
    labels = (rng.random(rows) < 0.25).astype(np.float32)
    return (indptr, indices[:nnz].copy(), np.ones(nnz, np.float32), labels,
            np.ones(rows, np.float32))


@njit(cache=True)
def plain_adagrad(indptr, indices, values, labels, w, g2, eta):
    """The yardstick: logistic AdaGrad, w_j -= η·g_j/√G_j, nothing else."""
    for r in range(labels.shape[0]):
        m = 0.0
        for k in range(indptr[r], indptr[r + 1]):
            m += w[indices[k]] * values[k]
        g = 1.0 / (1.0 + math.exp(-m)) - labels[r]
        for k in range(indptr[r], indptr[r + 1]):
            j = indices[k]
            gj = g * values[k]
            g2[j] += gj * gj
            w[j] -= eta * gj / math.sqrt(g2[j] + 1e-12)


def _best_time(run, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(layout: str, rows: int, bits: int, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    indptr, indices, values, labels, weights = synthetic_csr(rows, bits, layout)
    gen_s = time.perf_counter() - t0
    d = 1 << bits
    nnz = int(indices.shape[0])
    order = np.zeros(0, np.int64)
    out: dict[str, Any] = {"rows": rows, "n_features": d, "nnz": nnz, "nnz_per_row": nnz / rows,
                           "distinct_features": int(np.unique(indices).shape[0]),
                           "generate_s": gen_s}

    result = {}

    def one_pass():
        state = new_state(d)
        result["out"] = online_pass(indptr, indices, values, labels, weights, order, state,
                                    np.zeros(2), LOGISTIC, 0.5, True, 0, rows, 0.0, 0.0)

    def plain():
        plain_adagrad(indptr, indices, values, labels, np.zeros(d, np.float32),
                      np.zeros(d, np.float32), np.float32(0.5))

    theta = np.zeros(d + 1)
    grad = np.zeros(d + 1)

    def loss_grad():
        grad[:] = 0.0
        loss_grad_hess(indptr, indices, values, labels, weights, theta, LOGISTIC, grad,
                       np.zeros(0), 0, rows, 0.0)

    for name, fn in (("online_pass", one_pass), ("plain_adagrad", plain), ("loss_grad", loss_grad)):
        seconds = _best_time(fn, repeats)
        out[name] = {"seconds": seconds, "nnz_per_s": nnz / seconds, "rows_per_s": rows / seconds}
    loss_sum, weight_sum, status, _ = result["out"]
    out["online_pass"]["progressive_loss"] = loss_sum / weight_sum
    out["online_pass"]["status"] = int(status)
    out["online_vs_plain"] = out["online_pass"]["nnz_per_s"] / out["plain_adagrad"]["nnz_per_s"]
    return out


def _warm_up() -> None:
    """Compile (or load from the numba cache) every kernel on a tiny input."""
    measure("uniform", 2_000, 10, 1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--bits", type=int, default=BITS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args(argv or [])
    _warm_up()
    figures = {layout: measure(layout, args.rows, args.bits, args.repeats)
               for layout in ("ctr_like", "uniform")}
    for layout, f in figures.items():
        print(f"{layout:9s}: online pass {f['online_pass']['nnz_per_s'] / 1e6:6.1f} M nnz/s, "
              f"plain AdaGrad {f['plain_adagrad']['nnz_per_s'] / 1e6:6.1f} M nnz/s, "
              f"loss+grad {f['loss_grad']['nnz_per_s'] / 1e6:6.1f} M nnz/s "
              f"({f['nnz_per_row']:.1f} nnz/row)", flush=True)
    return figures


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
