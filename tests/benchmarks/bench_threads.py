"""Benchmark: how a rank's passes scale with its threads (``train.threads`` = T).

Data: the synthetic click-like CSR of :mod:`tests.benchmarks.bench_online_kernel` (``ctr_like``:
39 fields with the generator's vocabularies and power laws, hashed into 2^``BITS``), ``ROWS``
rows, handed to the solvers as ``solvers.api.train`` hands them a shard. For each T in
``THREADS`` (default: 1, 2, 4, … up to the machine's cores), interleaved over ``REPEATS``
rounds (T = 1, 2, 4, … then again; this machine's speed drifts):

* ``online``: one Hogwild online pass (``OnlineLearner._local_pass`` from a zero state, T > 1
  with the per-thread hot replicas of :mod:`solvers.hot`; their relabelling and its undoing
  are timed apart, as :func:`tests.benchmarks.memory_threads.online_rates` does);
* ``gradient``: one loss + gradient evaluation as L-BFGS runs it (the rank's working table in
  compact numbering, :class:`solvers.lbfgs.LBFGSPhase`'s objective): T blocks of rows, block
  b > 0 into a table of its own, merged in block order;
* ``gradient_by_columns``: the same loss and gradient made of gathers only (rows, then columns
  of a CSC copy; :mod:`tests.benchmarks.gradient_by_columns`, a prototype), the copy's making
  timed apart (``csc_build_s``), and whether every T gave the features' gradient bits of T = 1;
* ``gather``: a yardstick, T threads each summing ``w[j]`` over its block's indices (a float64
  weight per hashed bucket, no arithmetic to speak of): the machine's random-read rate for this
  index stream in hashed ids, as the online pass reads its table. (The gradient pass reads a
  table numbered by first use in the shard, with better locality, so it can beat this rate.)

Throughputs count work as the train job's progress does: non-zeros plus one per row (the
intercept), per second, the median over rounds (and the best). ``speedup`` is T's median rate
over T = 1's; ``efficiency`` that over T. Run: ``python -m tests.benchmarks threads [--rows N]
[--threads 1,2,4] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numba import njit

ROWS = 2_000_000
BITS = 22
REPEATS = 3


def default_threads(cores: int | None = None) -> tuple[int, ...]:
    """1, 2, 4, … up to ``cores`` (the machine's), and ``cores`` itself if not a power of 2."""
    cores = cores or os.cpu_count() or 1
    out, t = [], 1
    while t <= cores:
        out.append(t)
        t *= 2
    if out[-1] != cores:
        out.append(cores)
    return tuple(out)


@njit(nogil=True, cache=True)
def _gather(indices, lo, hi, w):
    s = 0.0
    for k in range(lo, hi):
        s += w[indices[k]]
    return s


def _gather_seconds(csr, t: int, pool: ThreadPoolExecutor, w: np.ndarray) -> float:
    from terascale.solvers.threads import split_rows

    cuts = split_rows(csr.indptr, t)
    spans = [(int(csr.indptr[cuts[i]]), int(csr.indptr[cuts[i + 1]])) for i in range(t)]
    t0 = time.perf_counter()
    list(pool.map(lambda s: _gather(csr.indices, s[0], s[1], w), spans))
    return time.perf_counter() - t0


def _gradient_phases(csr, counts: tuple[int, ...]) -> dict:
    """Per T, an L-BFGS phase started on its own run (its working table: a copy of the indices)."""
    from terascale.solvers.lbfgs import LBFGSPhase
    from terascale.solvers.threads import RowThreads
    from tests.benchmarks.memory_threads import _online_run

    phases = {}
    for t in counts:
        run = _online_run(csr, RowThreads(t), consume=False)
        phases[t] = LBFGSPhase.start(run, run.initial_theta())
    return phases


def _rates(seconds: list[float], work: int, base: float | None, t: int) -> dict[str, Any]:
    med = statistics.median(seconds)
    out = {"seconds": seconds, "median_per_s": work / med, "best_per_s": work / min(seconds)}
    if base is not None:
        out["speedup"] = base / med
        out["efficiency"] = base / med / t
    return out


def measure(rows: int, bits: int, counts: tuple[int, ...], repeats: int) -> dict[str, Any]:
    from terascale.solvers.data import CSRData
    from tests.benchmarks.bench_online_kernel import synthetic_csr
    from tests.benchmarks.gradient_by_columns import ColumnGradient
    from tests.benchmarks.memory_threads import online_rates

    t0 = time.perf_counter()
    indptr, indices, _values, labels, weights = synthetic_csr(rows, bits, "ctr_like")
    csr = CSRData(indptr, indices, np.zeros(0, np.float32), labels, weights, 1 << bits)
    work = int(csr.nnz) + int(csr.n_rows)
    out: dict[str, Any] = {"rows": rows, "bits": bits, "nnz": int(csr.nnz), "work_per_pass": work,
                           "threads": list(counts), "repeats": repeats, "cores": os.cpu_count(),
                           "generate_s": time.perf_counter() - t0}
    online = online_rates(csr, counts, repeats)
    phases = _gradient_phases(csr, counts)
    grad_s: dict[int, list[float]] = {t: [] for t in counts}
    cols_s: dict[int, list[float]] = {t: [] for t in counts}
    gather_s: dict[int, list[float]] = {t: [] for t in counts}
    w = np.random.default_rng(0).random(1 << bits)
    t1 = time.perf_counter()
    by_cols = ColumnGradient(indptr, indices, labels, weights)
    out["csc_build_s"] = time.perf_counter() - t1
    theta = 0.01 * np.random.default_rng(1).standard_normal(by_cols.dim)
    with ThreadPoolExecutor(max(counts)) as pool:
        bits_of = {}
        for t in counts:  # warm: thread tables, the kernels
            phases[t].objective.evaluate(phases[t].theta)
            bits_of[t] = by_cols.evaluate(theta, pool, t)[1][1:].tobytes()  # [0]: block order
            _gather_seconds(csr, t, pool, w)
        out["gradient_by_columns_same_bits"] = len(set(bits_of.values())) == 1
        for _ in range(repeats):
            for t in counts:
                t1 = time.perf_counter()
                ev = phases[t].objective.evaluate(phases[t].theta)
                grad_s[t].append(time.perf_counter() - t1)
                assert ev.finite
                t1 = time.perf_counter()
                by_cols.evaluate(theta, pool, t)
                cols_s[t].append(time.perf_counter() - t1)
                gather_s[t].append(_gather_seconds(csr, t, pool, w))
    for p in phases.values():
        p.run.threads.close()
    base = {"online": statistics.median(online[1]["seconds"]) if 1 in online else None,
            "gradient": statistics.median(grad_s[1]) if 1 in grad_s else None,
            "gradient_by_columns": statistics.median(cols_s[1]) if 1 in cols_s else None,
            "gather": statistics.median(gather_s[1]) if 1 in gather_s else None}
    per_t = {}
    for t in counts:
        o = online[t]
        per_t[str(t)] = {
            "online": {**_rates(o["seconds"], work, base["online"], t),
                       "progressive_loss": o["progressive_loss"], "hot_features": o["hot_features"],
                       "relabel_seconds": o["relabel_seconds"], "unlabel_seconds": o["unlabel_seconds"]},
            "gradient": _rates(grad_s[t], work, base["gradient"], t),
            "gradient_by_columns": _rates(cols_s[t], work, base["gradient_by_columns"], t),
            "gather": _rates(gather_s[t], int(csr.nnz), base["gather"], t),
        }
    out["per_threads"] = per_t
    out["bench_seconds"] = time.perf_counter() - t0
    return out


def _print(fig: dict) -> None:
    print(f"{fig['rows']} rows, {fig['nnz']} non-zeros, 2^{fig['bits']} buckets, {fig['cores']} cores")
    for t, f in fig["per_threads"].items():
        cells = [f"{k} {f[k]['median_per_s'] / 1e6:7.1f} M/s" + (f" ({f[k]['speedup']:.2f}x)" if "speedup" in f[k] else "")
                 for k in ("online", "gradient", "gradient_by_columns", "gather")]
        print(f"  T={t:>2}: " + ", ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="bench threads", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--bits", type=int, default=BITS)
    ap.add_argument("--threads", default=",".join(map(str, default_threads())),
                    help="comma list of thread counts (the first is the baseline: use 1)")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args(argv or [])
    counts = tuple(int(x) for x in args.threads.split(","))
    fig = measure(args.rows, args.bits, counts, args.repeats)
    _print(fig)
    return fig


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
