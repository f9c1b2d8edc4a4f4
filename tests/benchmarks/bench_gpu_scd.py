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

Environment: ``TERASCALE_BENCH_GPU_ROWS`` (rows), ``TERASCALE_BENCH_GPU_EPS`` (the gap, relative
to P(0)), ``TERASCALE_BENCH_GPU_MAX_ROUNDS`` (rounds at
most per run), ``TERASCALE_BENCH_GPU_WARMUP_ROWS`` (the warm-up's data) and
``TERASCALE_BENCH_GPU_CPU_CAP_S``: a CPU run still short of the gap after that many seconds
stops at the end of its round and reports ``capped`` (its seconds, epochs and gap / P(0) then)
instead of a time to the gap; its speed-up figures become lower bounds (``*_at_least``). 0 (the
default): no cap. The GPU run is never capped (a cap reads its state back every round).

The dual problems also run TPA-SCD on fewer blocks, ``gpu_blocks_<n>`` for n = the blocks of the
full run's size the device holds at once (``resident_blocks``) divided by each of
``GRID_DIVISORS`` (env
``TERASCALE_BENCH_GPU_GRID_DIVISORS``, default ``4,16,64``): fewer rows in flight at once, so
smaller damping of each step (``gpu_local_solver.eso_weights``) but less of the device busy; the
trade-off between epochs and epoch time, measured. Every GPU run of a dual also reports
``epoch_s`` (its seconds per round, set-up excluded), ``gamma_median`` (the median aggregation step of the
line search: well above 1 means the epochs' steps were damped more than they needed) and
``eso_step_ratio``: the mean over rows of (λN + Σ_j β_j x_ij²) / (λN + ||x_i||²), by how much
the damping shrinks a row's quadratic coefficient at that concurrency (1 without damping).

``python -m tests.benchmarks gpu_scd`` (or ``python -m tests.benchmarks.bench_gpu_scd``). Without
a usable GPU ``main()`` prints why and returns ``{"skipped": reason}``; run as a script it exits
with status 2.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

ROWS = int(os.environ.get("TERASCALE_BENCH_GPU_ROWS", "2000000"))
L2 = 1e-4
EPS = float(os.environ.get("TERASCALE_BENCH_GPU_EPS", "1e-4"))
MAX_ROUNDS = int(os.environ.get("TERASCALE_BENCH_GPU_MAX_ROUNDS", "300"))
WARMUP_ROWS = int(os.environ.get("TERASCALE_BENCH_GPU_WARMUP_ROWS", "2000"))
CPU_CAP_S = float(os.environ.get("TERASCALE_BENCH_GPU_CPU_CAP_S", "0"))
PROBLEMS = (("logistic", "dual"), ("squared", "dual"), ("squared", "primal"))
GRID_DIVISORS = tuple(int(d) for d in os.environ.get("TERASCALE_BENCH_GPU_GRID_DIVISORS", "4,16,64").split(",") if d)


def _time_to_gap(result, eps: float) -> tuple[float | None, int | None]:
    """(seconds, epochs) of the first history point with gap <= eps * P(0); None if never."""
    p0 = result.history[0]["primal"]
    for row in result.history:
        if row["gap"] is not None and row["gap"] <= eps * p0:
            return float(row["elapsed_s"]), int(row["round"])
    return None, None


class _Capped(Exception):
    """Raised from a CPU run's round callback once it has run ``CPU_CAP_S`` seconds."""

    def __init__(self, row: dict):
        super().__init__("time cap")
        self.row = row


def _cap(seconds: float):
    def on_round_end(state) -> None:
        row = state.history[-1]
        if row["elapsed_s"] >= seconds:
            raise _Capped(row)

    return on_round_end


def _run(data, loss: str, formulation: str, solver: str, blocks: int | None = None) -> dict[str, Any]:
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu_problem import make_gpu_problem
    from terascale.solvers.scd.params import CocoaParams

    threads = (os.cpu_count() or 1) if solver == "cpu_threads" else 1
    p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=MAX_ROUNDS, tol=EPS,
                    threads=threads, local_epochs=1, seed=1)
    made = []

    def gpu_problem(*args):  # what train_cocoa_gpu builds, kept to read its transfer counters
        made.append(make_gpu_problem(*args, blocks=blocks))
        return made[-1]

    capped = solver != "gpu" and CPU_CAP_S > 0
    t = time.perf_counter()
    try:
        res = train_cocoa(data, LocalCommunicator(), p, _cap(CPU_CAP_S) if capped else None,
                          make_problem=gpu_problem if solver == "gpu" else None)
    except _Capped as stop:
        row = stop.row
        return {"threads": threads, "seconds_to_gap": None, "epochs_to_gap": None,
                "wall_s": time.perf_counter() - t,
                "capped": {"seconds": float(row["elapsed_s"]), "epochs": int(row["round"]),
                           "gap_over_p0": float(row["gap"]) / float(row["primal"] or 1.0)
                           if row["gap"] is not None else None}}
    wall = time.perf_counter() - t
    seconds, epochs = _time_to_gap(res, EPS)
    out = {"threads": threads if solver != "gpu" else None, "seconds_to_gap": seconds,
           "epochs_to_gap": epochs, "wall_s": wall, "final_gap": res.gap, "rounds": res.rounds,
           "primal": res.primal}
    if made:  # host<->device bytes, set-up (the data) included; per round: 16 x shared_len + 48
        solver = made[0].solver
        out["pcie"] = {**solver.traffic(), "shared_bytes": 8 * made[0].shared_len}
        out["blocks"], out["concurrency"] = solver.blocks, getattr(solver, "concurrency", None)
        out["threads_per_block"] = solver.tpb
        # the rounds' own time: the history's clock from the start point to the last round
        out["epoch_s"] = (res.history[-1]["elapsed_s"] - res.history[0]["elapsed_s"]) / max(res.rounds, 1)
        gammas = [row["gamma"] for row in res.history if row.get("gamma") is not None]
        out["gamma_median"] = float(np.median(gammas)) if gammas else None
        if formulation == "dual":
            out["eso_step_ratio"] = eso_step_ratio(data, solver)
    return out


def eso_step_ratio(data, solver) -> float:
    """Mean over rows of (λN + v_i) / (λN + ||x_i||²): v_i the damped quadratic coefficient the
    dual solver uses (``sqn`` on the device), ||x_i||² the undamped one (constant included)."""
    from terascale.solvers.scd.dual_kernels import row_sq_norms

    damped = np.empty(solver.sqn.shape[0])
    solver.dev.download(solver.sqn, damped)  # after the run's traffic was recorded
    plain = row_sq_norms(data.indptr, data.values, solver.bias_scale)
    return float(np.mean((solver.lam_n + damped[: data.n_rows]) / (solver.lam_n + plain))) if data.n_rows else 1.0


def ratios(run: dict, ref: dict, name: str) -> dict[str, float | None]:
    """``speedup_vs_<name>`` (ref's seconds to the gap over run's) and ``epochs_vs_<name>`` (run's
    epochs over ref's); when ref was capped and run was not, ``speedup_vs_<name>_at_least``
    (ref's capped seconds over run's): ref needs more than that. None where undefined."""
    out: dict[str, float | None] = {f"speedup_vs_{name}": None, f"epochs_vs_{name}": None}
    if run.get("seconds_to_gap") and ref.get("seconds_to_gap"):
        out[f"speedup_vs_{name}"] = ref["seconds_to_gap"] / run["seconds_to_gap"]
        out[f"epochs_vs_{name}"] = run["epochs_to_gap"] / ref["epochs_to_gap"]
    elif run.get("seconds_to_gap") and "capped" in ref:
        out[f"speedup_vs_{name}_at_least"] = ref["capped"]["seconds"] / run["seconds_to_gap"]
        out[f"epochs_vs_{name}_at_most"] = run["epochs_to_gap"] / ref["capped"]["epochs"]
    return out


def _warm_up() -> None:
    """Compile the GPU kernels and the CPU njit kernels on tiny data (not timed)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.benchmarks.bench_scd import click_data

    small = click_data(WARMUP_ROWS)
    for loss, formulation in PROBLEMS:
        for threads in (1, 2):
            p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2, threads=threads)
            train_cocoa(small, LocalCommunicator(), p)
        p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2)
        train_cocoa_gpu(small, LocalCommunicator(), p, fallback=False)


def main() -> dict:
    from terascale.solvers.scd.gpu import gpu_available
    from terascale.solvers.scd.gpu_device import resident_blocks
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
                               "max_rounds": MAX_ROUNDS, "cpu_cap_s": CPU_CAP_S, "problems": {}}
    for loss, formulation in PROBLEMS:
        runs = {s: _run(data, loss, formulation, s) for s in ("cpu_seq", "cpu_threads", "gpu")}
        if formulation == "dual":
            resident = resident_blocks(runs["gpu"]["threads_per_block"])
            for n in sorted({max(1, resident // d) for d in GRID_DIVISORS}, reverse=True):
                runs[f"gpu_blocks_{n}"] = _run(data, loss, formulation, "gpu", blocks=n)
        for name, r in runs.items():
            r.update(ratios(r, runs["cpu_seq"], "seq"))
            if name.startswith("gpu"):
                r.update(ratios(r, runs["cpu_threads"], "threads"))
        figures["problems"][f"{loss}_{formulation}"] = runs
        print(f"  {loss}/{formulation}: " + ", ".join(
            f"{s} {r['seconds_to_gap']} s / {r['epochs_to_gap']} epochs"
            + (f" (capped at {r['capped']['seconds']:.0f} s)" if "capped" in r else "")
            for s, r in runs.items()), flush=True)
    figures["bench_seconds"] = time.perf_counter() - t0
    return figures


if __name__ == "__main__":
    out = main()
    if "skipped" in out:
        sys.exit(2)
    print(out)
