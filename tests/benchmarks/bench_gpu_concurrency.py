"""Benchmark (CPU only): the epochs TPA-SCD's dual needs with τ rows in flight, from the model
``tests.scd.concurrency_model``, against τ, with and without the ESO damping the GPU solver uses.

Why: an H100 holds thousands of rows in flight; the CUDA simulator (one block at a time) cannot
show what that does to convergence, and device time is scarce. The model replays each epoch with
every row missing the updates of the τ − 1 rows before it, inside CoCoA's real round loop (exact
line search, duality gap). What it says about epochs holds for any device with that τ; what an
epoch costs on the device is the device benchmark's (``bench_gpu_scd``) to say.

Data and problems as ``bench_gpu_scd``: the generated click logs (2^20 features), ``ROWS`` rows
(env ``TERASCALE_BENCH_CONC_ROWS``, default 2M), λ = 1e-4, the duality gap ``EPS`` * P(0), ridge
and logistic in the dual, one rank. τ (env ``TERASCALE_BENCH_CONC_TAUS``, default
``1,8,16,32,66,264,1056,4224``): 4224 is what an H100 holds of the 64-thread blocks this data
gets (132 SMs x 32), 1056, 264 and 66 are it / 4, / 16 and / 64 (the device benchmark's sweep),
and 8 to 32 show where the epochs part from the sequential solver's. Each τ runs
damped (the GPU solver's step) and undamped (the step of the sequential solver), the undamped
runs capped at ``UNDAMPED_ROUNDS`` rounds. Figures per run: rounds (= epochs) to the gap, the
final gap / P(0), the median line-search step, and the ratio of epochs to τ = 1's.

Beside them, the design of issue 41 (``tests.scd.hot_block_model``): the features held by more
than n / τ rows (and the constant) out of the asynchronous loop, solved as a primal block by
Newton steps (``HOT_SUB`` an epoch), the rest damped by the ESO of the cold features alone;
``*_dual_hot_block``, for τ in ``HOT_TAUS`` (env ``TERASCALE_BENCH_CONC_HOT_TAUS``), with the
sequential solver under the same gap certificate as τ = 1; each τ with the hot set ω > n / τ
and with the one of an H100's τ = 4,224 (the design's choice: it serves every τ up to it).

Where ``bench-results/device/*/gpu_scd.json`` holds a device run, its epochs to the gap at full
concurrency are set beside the model's at the same τ (``device``), as a check of the model.

``python -m tests.benchmarks gpu_concurrency``: bench-results/gpu_concurrency.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

ROWS = int(os.environ.get("TERASCALE_BENCH_CONC_ROWS", "2000000"))
TAUS = tuple(int(t) for t in os.environ.get("TERASCALE_BENCH_CONC_TAUS", "1,8,16,32,66,264,1056,4224").split(",") if t)
L2 = 1e-4
EPS = float(os.environ.get("TERASCALE_BENCH_CONC_EPS", "1e-4"))
MAX_ROUNDS = int(os.environ.get("TERASCALE_BENCH_CONC_MAX_ROUNDS", "400"))
UNDAMPED_ROUNDS = int(os.environ.get("TERASCALE_BENCH_CONC_UNDAMPED_ROUNDS", "40"))
LOSSES = ("squared", "logistic")
HOT_TAUS = tuple(int(t) for t in os.environ.get("TERASCALE_BENCH_CONC_HOT_TAUS", "264,1056,4224").split(",") if t)
HOT_SUB = int(os.environ.get("TERASCALE_BENCH_CONC_HOT_SUB", "4"))  # Newton steps on the hot block an epoch
HOT_TAU_MAX = 4224  # an H100's rows in flight: the hot set omega > n / HOT_TAU_MAX serves every tau up to it
DEVICE_RESULTS = Path(__file__).resolve().parents[2] / "bench-results" / "device"


def _run(data, loss: str, tau: int, damped: bool) -> dict[str, Any]:
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.concurrency_model import delayed_problem

    rounds = MAX_ROUNDS if damped or tau == 1 else UNDAMPED_ROUNDS
    p = CocoaParams(loss=loss, formulation="dual", l2=L2, max_rounds=rounds, tol=EPS, seed=1)
    t0 = time.perf_counter()
    try:
        res = train_cocoa(data, LocalCommunicator(), p, make_problem=delayed_problem(tau, damped))
    except FloatingPointError as exc:  # the epoch overflowed: the line search got no finite step
        return {"tau": tau, "damped": damped, "epochs_to_gap": None, "diverged": str(exc),
                "seconds": time.perf_counter() - t0}
    p0 = res.history[0]["primal"]
    reached = next((r["round"] for r in res.history if r["gap"] is not None and r["gap"] <= EPS * p0), None)
    gammas = [r["gamma"] for r in res.history if r.get("gamma") is not None]
    return {"tau": tau, "damped": damped, "epochs_to_gap": reached, "rounds": res.rounds,
            "final_gap_over_p0": res.gap / p0, "gamma_median": statistics.median(gammas) if gammas else None,
            "seconds": time.perf_counter() - t0}


def _hot_block_runs(data, loss: str) -> list[dict[str, Any]]:
    """The hot features out of the asynchronous loop (``tests.scd.hot_block_model``): the
    sequential solver (no hot block, τ = 1) under the same gap certificate, then each τ > 1 of
    ``HOT_TAUS`` with the hot set ω_j > n / τ, then with ω_j > n / HOT_TAU_MAX, the hot block
    solved by ``HOT_SUB`` Newton steps an epoch."""
    from tests.scd.hot_block_model import HotBlockModel

    model = HotBlockModel(data, loss, L2)
    runs = []
    taus = [t for t in HOT_TAUS if t > 1]
    # the hot set from each tau (theta 1), and the one of the device's HOT_TAU_MAX for every tau
    for tau, theta in [(1, None)] + [(t, 1.0) for t in taus] + [(t, t / HOT_TAU_MAX) for t in taus if t < HOT_TAU_MAX]:
        t0 = time.perf_counter()
        r = model.run(tau, theta, HOT_SUB, EPS, MAX_ROUNDS)
        r.pop("gaps")
        r["seconds"] = time.perf_counter() - t0
        runs.append(r)
        print(f"  {loss} dual, hot block, tau {tau}, theta {theta}: {r['epochs_to_gap']} epochs to the gap, "
              f"{r['hot_features']} hot features ({r['hot_nnz_share']:.0%} of the non-zeros; "
              f"{r['seconds']:.0f} s)", flush=True)
    base = runs[0]["epochs_to_gap"]
    for r in runs:
        r["epochs_vs_sequential"] = r["epochs_to_gap"] / base if r["epochs_to_gap"] and base else None
    return runs


def device_epochs() -> dict[str, Any]:
    """Epochs to the gap of the latest device run (by file time) at full concurrency, per dual
    problem."""
    runs = sorted(DEVICE_RESULTS.glob("*/gpu_scd.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(runs):
        try:
            js = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        problems = js.get("problems") or {}
        got = {}
        for loss in LOSSES:
            gpu = (problems.get(f"{loss}_dual") or {}).get("gpu") or {}
            seq = (problems.get(f"{loss}_dual") or {}).get("cpu_seq") or {}
            if gpu.get("epochs_to_gap") and seq.get("epochs_to_gap"):
                got[loss] = {"epochs_to_gap": gpu["epochs_to_gap"], "cpu_seq_epochs": seq["epochs_to_gap"],
                             "concurrency": gpu.get("concurrency")}
        if got:
            return {"run": path.parent.name, "device": js.get("device"), **got}
    return {}


def main() -> dict:
    from tests.benchmarks.bench_scd import click_data

    t0 = time.perf_counter()
    data = click_data(ROWS)
    out: dict[str, Any] = {"rows": data.n_rows, "features": data.n_features, "nnz": data.nnz,
                           "l2": L2, "eps": EPS, "taus": list(TAUS), "problems": {}}
    for loss in LOSSES:
        runs = []
        for tau in TAUS:
            for damped in ((True, False) if tau > 1 else (False,)):
                r = _run(data, loss, tau, damped)
                runs.append(r)
                print(f"  {loss} dual, tau {tau}, {'damped' if damped else 'undamped'}: "
                      f"{r['epochs_to_gap']} epochs to the gap ({r['seconds']:.0f} s)", flush=True)
        base = next((r["epochs_to_gap"] for r in runs if r["tau"] == 1), None)
        for r in runs:
            r["epochs_vs_sequential"] = r["epochs_to_gap"] / base if r["epochs_to_gap"] and base else None
        out["problems"][f"{loss}_dual"] = runs
        out["problems"][f"{loss}_dual_hot_block"] = _hot_block_runs(data, loss)
    out["device"] = device_epochs()
    out["bench_seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    print(main())
