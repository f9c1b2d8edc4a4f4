"""Calibration microbenchmarks for the cost model (``costmodel``, ``bench_scaling``).

- :func:`kernel_costs`: seconds per non-zero of the gradient pass (``solvers.objective.shard_sums``,
  loss and gradient, logistic) and of the online pass (``OnlineLearner._local_pass``, a fresh
  zero state each time) over one shard in this process, at T = 1 and 2 threads, interleaved;
  best and median of ``repeats``. The best is the model's c(T): the rate of a core nobody else
  wants (the machine is shared, so the median is slower).
- :class:`CorePool`: ``n`` probe processes, each holding the shard :func:`kernel_costs` timed
  (shard 0 of the 4-shard plan). :meth:`CorePool.probe` runs a gradient pass in ``k`` of them
  at once and returns the cores those ``k`` processes actually got, in units of a free core:
  their aggregate non-zeros per second times c(1), the best seconds per non-zero of one process
  (``free_s_per_nnz``: :func:`kernel_costs`' best, or a probe's solo pass if that was faster).
  Run just before a measurement with ``k`` ranks, it is the C of the model for that measurement
  (other work on the machine takes the rest).
- The AllReduce's CPU per byte (κ) and per-hop latency (ℓ) come from ``scaling_rank
  --link-only`` at K = 2 (one edge): κ = CPU seconds of both ranks (all threads: seal, send,
  receive, open, add) / (2 × vector bytes), ℓ = the mean time of a 4-scalar AllReduce / 2 hops.
  :func:`link_costs` turns the ranks' reports into (κ, ℓ); ``bench_scaling`` runs it over an
  unshaped namespace link (the path the measured runs take: veth, bridge, tbf) and over
  loopback (for comparison).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

_CTX = mp.get_context("spawn")


def _gradient_seconds(shard, threads) -> float:
    from terascale.solvers.kernels.losses import LOGISTIC
    from terascale.solvers.objective import shard_sums

    grad = np.zeros(shard.n_features + 1)
    t0 = time.perf_counter()
    _, problem = shard_sums(shard, np.zeros(shard.n_features + 1), LOGISTIC, grad, threads=threads)
    assert problem is None, problem
    return time.perf_counter() - t0


def _online_seconds(csr, threads) -> float:
    from terascale.solvers.online import OnlineLearner
    from tests.benchmarks.memory_threads import _online_run

    learner = OnlineLearner(_online_run(csr, threads))  # a fresh zero state, not timed
    t0 = time.perf_counter()
    _, _, problem = learner._local_pass(1)
    assert problem is None, problem
    return time.perf_counter() - t0


def kernel_costs(csr, threads: tuple[int, ...] = (1, 2), repeats: int = 5) -> dict[str, Any]:
    """Seconds per non-zero of the gradient and online passes over ``csr`` (a ``CSRData``) at
    each T in ``threads`` (module docstring): ``{"gradient": {T: {...}}, "online": {...}}``."""
    from terascale.solvers.shard import Shard
    from terascale.solvers.threads import RowThreads

    shard = Shard.from_csr(csr)
    nnz = int(shard.indptr[-1])
    pools = {t: RowThreads(t) for t in threads}
    times: dict[tuple[str, int], list[float]] = {(k, t): [] for k in ("gradient", "online") for t in threads}
    try:
        for t in threads:  # compile, fault in
            _gradient_seconds(shard, pools[t])
            _online_seconds(csr, pools[t])
        for _ in range(repeats):
            for t in threads:
                times[("gradient", t)].append(_gradient_seconds(shard, pools[t]))
                times[("online", t)].append(_online_seconds(csr, pools[t]))
    finally:
        for p in pools.values():
            p.close()
    out: dict[str, Any] = {"nnz": nnz, "rows": shard.n_rows}
    for kernel in ("gradient", "online"):
        out[kernel] = {
            str(t): {"best_s_per_nnz": min(v) / nnz, "median_s_per_nnz": statistics.median(v) / nnz, "times_s": v}
            for t in threads for v in [times[(kernel, t)]]
        }
    return out


# ---------------------------------------------------------------------------------------------
# Effective cores


def _probe_worker(dataset: str, conn) -> None:
    from terascale.solvers.threads import SERIAL
    from tests.benchmarks.scaling_rank import load_shard

    shard = load_shard(dataset, 4, 0)
    _gradient_seconds(shard, SERIAL)
    conn.send(int(shard.indptr[-1]))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        passes = int(msg)
        t0 = time.time()
        secs = [_gradient_seconds(shard, SERIAL) for _ in range(passes)]
        conn.send((t0, time.time(), secs))


class CorePool:
    """``n`` probe processes for :meth:`probe` (module docstring); a context manager."""

    def __init__(self, dataset: str, n: int = 8, free_s_per_nnz: float = float("inf")) -> None:
        self._conns, self._procs = [], []
        for _ in range(n):
            a, b = _CTX.Pipe()
            p = _CTX.Process(target=_probe_worker, args=(dataset, b), daemon=True)
            p.start()
            self._conns.append(a)
            self._procs.append(p)
        self.nnz = [c.recv() for c in self._conns][0]
        self.best_solo_rate = 1.0 / free_s_per_nnz  # non-zeros per second of a free core

    def __enter__(self) -> CorePool:
        return self

    def __exit__(self, *exc) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    def _run(self, k: int, passes: int) -> dict[str, Any]:
        for c in self._conns[:k]:
            c.send(passes)
        res = [c.recv() for c in self._conns[:k]]
        wall = max(r[1] for r in res) - min(r[0] for r in res)
        rate = k * passes * self.nnz / wall
        return {"k": k, "wall_s": wall, "rate_nnz_per_s": rate, "pass_s": [s for r in res for s in r[2]]}

    def probe(self, k: int, passes: int = 1) -> dict[str, Any]:
        """The cores ``k`` concurrent processes get now, in free cores (module docstring);
        also refreshes the best single-process rate (a solo pass first)."""
        solo = self._run(1, 1)
        self.best_solo_rate = max(self.best_solo_rate, self.nnz / min(solo["pass_s"]))
        many = solo if k == 1 else self._run(k, passes)
        return {**many, "solo_rate_nnz_per_s": self.nnz / min(solo["pass_s"]),
                "best_solo_rate_nnz_per_s": self.best_solo_rate,
                "cores": many["rate_nnz_per_s"] / self.best_solo_rate}


def link_costs(reports: list[dict]) -> dict[str, float]:
    """(κ, ℓ) from the two ranks' ``--link-only`` reports (module docstring), medians over the
    calls: ``cpu_s_per_byte``, ``hop_latency_s``, ``seconds`` (the slowest rank's call)."""
    if len(reports) != 2:
        raise ValueError("link costs come from a K = 2 run")
    nbytes = reports[0]["vector_bytes"]
    calls = len(reports[0]["rounds"])
    cpu = [sum(r["rounds"][i]["allreduce_cpu_s"] for r in reports) for i in range(calls)]
    wall = [max(r["rounds"][i]["allreduce_s"] for r in reports) for i in range(calls)]
    return {"cpu_s_per_byte": statistics.median(cpu) / (2 * nbytes), "hop_latency_s":
            max(r["scalar_s"] for r in reports) / 2, "seconds": statistics.median(wall), "vector_bytes": nbytes}
