"""Benchmark: TPA-SCD on the GPU (``solvers.scd.gpu``) vs the CPU SCD solvers. Needs a CUDA device.

Data (each at most once in memory):

* ``click``: the generated click logs of ``bench_scd`` (``click_data``: 39 binary hashed features
  per row, 2^20 features), ``ROWS`` rows (env ``TERASCALE_BENCH_GPU_ROWS``); logistic and ridge
  in the dual, ridge in the primal (env ``TERASCALE_BENCH_GPU_PROBLEMS``, a comma list of
  ``<loss>_<formulation>``); λ = ``L2``. Its figures are ``problems`` (the device check's
  targets read them);
* ``wide``: the same rows hashed into 2^``WIDE_BITS`` features (env
  ``TERASCALE_BENCH_GPU_WIDE_BITS``, default 24; 0 skips it); the two duals;
* ``webspam``: ``webspam_like`` rows (the shape of the paper's webspam sample: long rows,
  unit norm; env ``TERASCALE_BENCH_GPU_WEBSPAM_ROWS`` / ``_FEATURES`` / ``_LENGTH``, rows 0 skips
  it); ridge in the dual, λ = ``WEBSPAM_L2`` (the paper's 1e-3).

One rank (``LocalCommunicator``), so CoCoA is plain SCD: one local epoch per round. For each
problem the solvers train to a duality gap <= ``EPS`` * P(0): the CPU sequential reference
(threads = 1), the CPU multi-threaded solver (threads = all cores, Snap ML's bucketed scheme),
``gpu`` — what ``train_cocoa_gpu`` builds by default (for the duals of the squared and logistic
losses on one rank, the hot-block dual of ``gpu_hot_solver`` where its plan keeps a quarter of
the rows in flight) — and, for the duals, ``gpu_damped``: the TPA-SCD dual with every feature in
the asynchronous loop, damped by the ESO (``gpu_local_solver``; the design before the hot block).

Figures per run: ``setup_s`` (from the call to the start point: data to the device, the split),
``seconds_to_gap`` (from the start point to the first history row at the gap: the solve, as the
paper times it; the same for the CPU solvers) and ``seconds_to_gap_with_setup``, epochs to the
gap, ``epoch_s`` (seconds a round), and the ratios ``speedup_vs_<ref>`` (the solve's seconds),
``speedup_with_setup_vs_<ref>`` and ``epochs_vs_<ref>`` against ``seq`` and ``threads``; for a
GPU run the bytes that crossed PCIe (``pcie``), ``variant`` (the problem class), the rows in
flight (``concurrency``), blocks and threads, and for the hot block ``hot`` (features, the rows in
flight it was planned for, the Hessian's products, Newton steps, factorisations) or for the
damped dual ``eso_step_ratio`` (the mean over rows of (λN + Σ_j β_j x_ij²) / (λN + ||x_i||²)).

Environment: ``TERASCALE_BENCH_GPU_EPS`` (the gap, relative to P(0)),
``TERASCALE_BENCH_GPU_MAX_ROUNDS`` (rounds at most per run), ``TERASCALE_BENCH_GPU_WARMUP_ROWS``
(the warm-up's data) and ``TERASCALE_BENCH_GPU_CPU_CAP_S``: a CPU run still short of the gap
after that many seconds stops at the end of its round and reports ``capped`` (its seconds,
epochs and gap / P(0) then) instead of a time to the gap; its speed-up figures become lower
bounds (``*_at_least``). 0 (the default): no cap. The GPU runs are never capped.
``TERASCALE_BENCH_GPU_GRID_DIVISORS`` (default none): the damped dual also on the resident
blocks divided by each divisor (fewer rows in flight, less damping).

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
PROBLEMS = tuple(tuple(name.split("_")) for name in os.environ.get(
    "TERASCALE_BENCH_GPU_PROBLEMS", "logistic_dual,squared_dual,squared_primal").split(",") if name)
DUALS = (("logistic", "dual"), ("squared", "dual"))
GRID_DIVISORS = tuple(int(d) for d in os.environ.get("TERASCALE_BENCH_GPU_GRID_DIVISORS", "").split(",") if d)
WIDE_BITS = int(os.environ.get("TERASCALE_BENCH_GPU_WIDE_BITS", "24"))
WEBSPAM_ROWS = int(os.environ.get("TERASCALE_BENCH_GPU_WEBSPAM_ROWS", "262938"))
WEBSPAM_FEATURES = int(os.environ.get("TERASCALE_BENCH_GPU_WEBSPAM_FEATURES", "680715"))
WEBSPAM_LENGTH = int(os.environ.get("TERASCALE_BENCH_GPU_WEBSPAM_LENGTH", "5000"))
WEBSPAM_L2 = 1e-3


def _time_to_gap(result, eps: float) -> tuple[float | None, int | None]:
    """(seconds from the start point, epochs) of the first history point with gap <= eps * P(0);
    None if never."""
    p0 = result.history[0]["primal"]
    for row in result.history:
        if row["gap"] is not None and row["gap"] <= eps * p0:
            return float(row["elapsed_s"]) - float(result.history[0]["elapsed_s"]), int(row["round"])
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
            raise _Capped({**row, "elapsed_s": row["elapsed_s"] - state.history[0]["elapsed_s"]})

    return on_round_end


def _run(data, loss: str, formulation: str, solver: str, l2: float = L2, blocks: int | None = None) -> dict[str, Any]:
    """One solver to the gap. ``solver``: cpu_seq, cpu_threads, gpu (``train_cocoa_gpu``'s default
    problem) or gpu_damped (the ESO-damped TPA-SCD dual)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu_problem import make_gpu_problem
    from terascale.solvers.scd.params import CocoaParams

    threads = (os.cpu_count() or 1) if solver == "cpu_threads" else 1
    p = CocoaParams(loss=loss, formulation=formulation, l2=l2, max_rounds=MAX_ROUNDS, tol=EPS,
                    threads=threads, local_epochs=1, seed=1)
    made = []
    on_gpu = solver.startswith("gpu")

    def gpu_problem(*args):  # what train_cocoa_gpu builds, kept to read its counters
        made.append(make_gpu_problem(*args, blocks=blocks, hot_block=False if solver == "gpu_damped" else None))
        return made[-1]

    capped = not on_gpu and CPU_CAP_S > 0
    t = time.perf_counter()
    try:
        res = train_cocoa(data, LocalCommunicator(), p, _cap(CPU_CAP_S) if capped else None,
                          make_problem=gpu_problem if on_gpu else None)
    except _Capped as stop:
        row = stop.row
        return {"threads": threads, "seconds_to_gap": None, "epochs_to_gap": None,
                "wall_s": time.perf_counter() - t,
                "capped": {"seconds": float(row["elapsed_s"]), "epochs": int(row["round"]),
                           "gap_over_p0": float(row["gap"]) / float(row["primal"] or 1.0)
                           if row["gap"] is not None else None}}
    wall = time.perf_counter() - t
    seconds, epochs = _time_to_gap(res, EPS)
    setup = float(res.history[0]["elapsed_s"])
    out = {"threads": None if on_gpu else threads, "setup_s": setup, "seconds_to_gap": seconds,
           "seconds_to_gap_with_setup": None if seconds is None else seconds + setup,
           "epochs_to_gap": epochs, "wall_s": wall, "final_gap": res.gap, "rounds": res.rounds,
           "primal": res.primal,
           # the rounds' own time: the history's clock from the start point to the last round
           "epoch_s": (res.history[-1]["elapsed_s"] - setup) / max(res.rounds, 1)}
    if made:  # host<->device bytes, set-up (the data) included
        pr = made[0]
        dev = pr.solver
        out["variant"] = type(pr).__name__
        out["pcie"] = {**dev.traffic(), "shared_bytes": 8 * pr.shared_len}
        out["blocks"], out["concurrency"] = dev.blocks, getattr(dev, "concurrency", None)
        out["threads_per_block"] = dev.tpb
        gammas = [row["gamma"] for row in res.history if row.get("gamma") is not None]
        out["gamma_median"] = float(np.median(gammas)) if gammas else None
        if hasattr(dev, "hot_split"):
            hs = dev.hot_split
            out["hot"] = {"features": hs.n_hot, "tau": hs.tau, "hessian_work": hs.hessian_work,
                          "hot_nnz_share": (hs.hot_rows.nnz - (data.n_rows if hs.n_hot and hs.hot[-1] == data.n_features else 0))
                          / max(data.nnz, 1), **dev.stats}
        elif formulation == "dual":
            out["eso_step_ratio"] = eso_step_ratio(data, dev)
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
        out[f"speedup_with_setup_vs_{name}"] = (ref["seconds_to_gap_with_setup"]
                                                / run["seconds_to_gap_with_setup"])
        out[f"epochs_vs_{name}"] = run["epochs_to_gap"] / ref["epochs_to_gap"]
    elif run.get("seconds_to_gap") and "capped" in ref:
        out[f"speedup_vs_{name}_at_least"] = ref["capped"]["seconds"] / run["seconds_to_gap"]
        out[f"epochs_vs_{name}_at_most"] = run["epochs_to_gap"] / ref["capped"]["epochs"]
    return out


def _warm_up() -> None:
    """Compile the GPU kernels and the CPU njit kernels on tiny data (not timed)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu import simulator_enabled, train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.benchmarks.bench_scd import click_data

    small = click_data(WARMUP_ROWS)
    for loss, formulation in PROBLEMS:
        for threads in (1, 2):
            p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2, threads=threads)
            train_cocoa(small, LocalCommunicator(), p)
        if simulator_enabled():
            continue  # nothing to compile: the simulator runs the kernels' Python
        p = CocoaParams(loss=loss, formulation=formulation, l2=L2, max_rounds=2)
        for hot_block in ((None, False) if formulation == "dual" else (None,)):
            train_cocoa_gpu(small, LocalCommunicator(), p, fallback=False, hot_block=hot_block)


def _problem(data, loss: str, formulation: str, l2: float) -> dict[str, dict]:
    from terascale.solvers.scd.gpu_device import resident_blocks

    solvers = ("cpu_seq", "cpu_threads", "gpu") + (("gpu_damped",) if formulation == "dual" else ())
    runs = {s: _run(data, loss, formulation, s, l2) for s in solvers}
    if formulation == "dual" and GRID_DIVISORS:
        resident = resident_blocks(runs["gpu_damped"]["threads_per_block"])
        for n in sorted({max(1, resident // d) for d in GRID_DIVISORS}, reverse=True):
            runs[f"gpu_damped_blocks_{n}"] = _run(data, loss, formulation, "gpu_damped", l2, blocks=n)
    if runs.get("gpu_damped", {}).get("variant") == runs["gpu"].get("variant"):
        runs["gpu_damped"] = {"same_as": "gpu"}  # the default was the damped dual already
    for name, r in runs.items():
        if "same_as" in r:
            continue
        r.update(ratios(r, runs["cpu_seq"], "seq"))
        if name.startswith("gpu"):
            r.update(ratios(r, runs["cpu_threads"], "threads"))
    print(f"  {loss}/{formulation}: " + ", ".join(
        f"{s} {r.get('seconds_to_gap')} s / {r.get('epochs_to_gap')} epochs"
        + (f" (capped at {r['capped']['seconds']:.0f} s)" if "capped" in r else "")
        for s, r in runs.items()), flush=True)
    return runs


def _describe(data) -> dict[str, Any]:
    return {"rows": data.n_rows, "features": data.n_features, "nnz": data.nnz}


def main() -> dict:
    from terascale.solvers.scd.gpu import gpu_available
    from tests.benchmarks.bench_scd import click_data
    from tests.benchmarks.webspam_like import webspam_like

    ok, reason = gpu_available()
    if not ok:
        print(f"bench_gpu_scd: skipped, no usable GPU: {reason}", file=sys.stderr)
        return {"skipped": reason}
    t0 = time.perf_counter()
    _warm_up()
    data = click_data(ROWS)
    figures: dict[str, Any] = {"device": reason, **_describe(data), "cores": os.cpu_count(), "l2": L2,
                               "eps": EPS, "max_rounds": MAX_ROUNDS, "cpu_cap_s": CPU_CAP_S, "problems": {}}
    print(f"click rows, 2^{int(np.log2(data.n_features))} features:", flush=True)
    for loss, formulation in PROBLEMS:
        figures["problems"][f"{loss}_{formulation}"] = _problem(data, loss, formulation, L2)
    if WIDE_BITS:
        del data
        data = click_data(ROWS, bits=WIDE_BITS)
        print(f"click rows, 2^{WIDE_BITS} features:", flush=True)
        figures["wide"] = {**_describe(data), "l2": L2, "problems": {
            f"{loss}_{f}": _problem(data, loss, f, L2) for loss, f in DUALS}}
    if WEBSPAM_ROWS:
        del data
        t = time.perf_counter()
        data = webspam_like(WEBSPAM_ROWS, WEBSPAM_FEATURES, WEBSPAM_LENGTH)
        print(f"webspam-shaped rows ({time.perf_counter() - t:.1f} s to generate):", flush=True)
        figures["webspam"] = {**_describe(data), "l2": WEBSPAM_L2, "length": WEBSPAM_LENGTH, "problems": {
            "squared_dual": _problem(data, "squared", "dual", WEBSPAM_L2)}}
    figures["bench_seconds"] = time.perf_counter() - t0
    return figures


if __name__ == "__main__":
    out = main()
    if "skipped" in out:
        sys.exit(2)
    print(out)
