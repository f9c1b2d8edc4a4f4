"""Benchmark: TPA-SCD on the GPU (``solvers.scd.gpu``) vs the CPU SCD solvers. Needs a CUDA device.

Data: the generated click logs of ``bench_scd`` (``click_data``: 39 binary hashed features per
row, 2^20 features), ``ROWS`` rows (env ``TERASCALE_BENCH_GPU_ROWS``). One rank
(``LocalCommunicator``), so CoCoA is plain SCD: one local epoch per round.

For each problem (logistic in the dual, ridge in the dual and in the primal, l2 = ``L2``), three
solvers train to a duality gap <= ``EPS`` * P(0): the CPU sequential reference (threads = 1),
the CPU multi-threaded solver (threads = all cores, Snap ML's bucketed scheme) and TPA-SCD on
the GPU (``gpu_problem``: the local variables stay on the device, only the shared vector and
a few scalars cross PCIe per round). Figures per solver: seconds to the gap (``elapsed_s`` of the first history row that
reaches it, set-up included; the GPU kernels are compiled by a warm-up run first), epochs to the
gap, the ratio of epochs to the sequential solver's (the price of asynchrony: Parnell et al.
report ~1 for TPA-SCD), the speed-up over the sequential solver, and for the GPU the bytes that
crossed PCIe each way (``pcie``).

``python -m tests.benchmarks gpu_scd`` (or ``python -m tests.benchmarks.bench_gpu_scd``). Without
a usable GPU ``main()`` prints why and returns ``{"skipped": reason}``; run as a script it exits
with status 2.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

ROWS = int(os.environ.get("TERASCALE_BENCH_GPU_ROWS", "2000000"))
L2 = 1e-4
EPS = 1e-4
MAX_ROUNDS = 300
PROBLEMS = (("logistic", "dual"), ("squared", "dual"), ("squared", "primal"))


def _time_to_gap(result, eps: float) -> tuple[float | None, int | None]:
    """(seconds, epochs) of the first history point with gap <= eps * P(0); None if never."""
    p0 = result.history[0]["primal"]
    for row in result.history:
        if row["gap"] is not None and row["gap"] <= eps * p0:
            return float(row["elapsed_s"]), int(row["round"])
    return None, None


def _run(data, loss: str, formulation: str, solver: str) -> dict[str, Any]:
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu_problem import make_gpu_problem
    from terascale.solvers.scd.params import CocoaParams

    threads = (os.cpu_count() or 1) if solver == "cpu_threads" else 1
    p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=MAX_ROUNDS, tol=EPS,
                    threads=threads, local_epochs=1, seed=1)
    made = []

    def gpu_problem(*args):  # what train_cocoa_gpu builds, kept to read its transfer counters
        made.append(make_gpu_problem(*args))
        return made[-1]

    t = time.perf_counter()
    res = train_cocoa(data, LocalCommunicator(), p,
                      make_problem=gpu_problem if solver == "gpu" else None)
    wall = time.perf_counter() - t
    seconds, epochs = _time_to_gap(res, EPS)
    out = {"threads": threads if solver != "gpu" else None, "seconds_to_gap": seconds,
           "epochs_to_gap": epochs, "wall_s": wall, "final_gap": res.gap, "rounds": res.rounds,
           "primal": res.primal}
    if made:  # host<->device bytes, set-up (the data) included; per round: 16 x shared_len + 48
        out["pcie"] = {**made[0].solver.traffic(), "shared_bytes": 8 * made[0].shared_len}
    return out


def _warm_up() -> None:
    """Compile the GPU kernels and the CPU njit kernels on tiny data (not timed)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.benchmarks.bench_scd import click_data

    small = click_data(2_000)
    for loss, formulation in PROBLEMS:
        for threads in (1, 2):
            p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2, threads=threads)
            train_cocoa(small, LocalCommunicator(), p)
        p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2)
        train_cocoa_gpu(small, LocalCommunicator(), p, fallback=False)


def main() -> dict:
    from terascale.solvers.scd.gpu import gpu_available
    from tests.benchmarks.bench_scd import click_data

    ok, reason = gpu_available()
    if not ok:
        print(f"bench_gpu_scd: skipped, no usable GPU: {reason}", file=sys.stderr)
        return {"skipped": reason}
    t0 = time.perf_counter()
    _warm_up()
    data = click_data(ROWS)
    figures: dict[str, Any] = {"device": reason, "rows": data.n_rows, "features": data.n_features,
                               "nnz": data.nnz, "cores": os.cpu_count(), "l2": L2, "eps": EPS,
                               "problems": {}}
    for loss, formulation in PROBLEMS:
        runs = {s: _run(data, loss, formulation, s) for s in ("cpu_seq", "cpu_threads", "gpu")}
        seq = runs["cpu_seq"]
        for r in runs.values():
            r["speedup_vs_seq"] = (seq["seconds_to_gap"] / r["seconds_to_gap"]
                                   if seq["seconds_to_gap"] and r["seconds_to_gap"] else None)
            r["epochs_vs_seq"] = (r["epochs_to_gap"] / seq["epochs_to_gap"]
                                  if seq["epochs_to_gap"] and r["epochs_to_gap"] else None)
        figures["problems"][f"{loss}_{formulation}"] = runs
        print(f"  {loss}/{formulation}: " + ", ".join(
            f"{s} {r['seconds_to_gap']} s / {r['epochs_to_gap']} epochs" for s, r in runs.items()),
            flush=True)
    figures["bench_seconds"] = time.perf_counter() - t0
    return figures


if __name__ == "__main__":
    out = main()
    if "skipped" in out:
        sys.exit(2)
    print(out)
