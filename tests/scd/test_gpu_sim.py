"""TPA-SCD on the GPU with device-resident local variables: kernels and CoCoA problems under
numba's CUDA simulator, and real-device tests.

The simulator must be switched on (``NUMBA_ENABLE_CUDASIM=1``) before numba is imported, so the
simulated runs happen in one subprocess that executes this file as a script (``_sim_main``) and
prints its measurements as JSON; the tests below assert on them. Data are tiny (40 rows x 30
features for the problems): the simulator runs every GPU thread as a Python thread.

Tolerances come from the duality gap: P is lam-strongly convex, so for any beta with gap g,
``P(beta) - P* <= g`` and ``||beta - beta*||^2 <= 2 g / lam``. Two runs with gaps g1, g2 therefore
agree to ``|P1 - P2| <= max(g1, g2)`` and ``||beta1 - beta2|| <= sqrt(2 g1/lam) + sqrt(2 g2/lam)``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from terascale.solvers.catalogue import LOSSES

ROOT = Path(__file__).resolve().parents[2]
# the catalogue imports no numba: safe before the simulator is switched on in the subprocess
DUAL_LOSSES = [name for name, spec in LOSSES.items() if spec.dual]
LAM = 0.02
ROWS, COLS = 40, 30
CASES = {  # name -> (loss, formulation, lam, max_rounds, tol, gap the simulated run must reach)
    "dual_ridge": ("squared", "dual", 0.1, 40, 1e-10, 1e-9),
    "dual_hinge": ("hinge", "dual", 0.2, 60, 1e-7, 1e-6),  # non-smooth: SDCA's gap falls slowly
    "dual_logistic": ("logistic", "dual", 0.02, 30, 1e-10, 1e-9),
    "dual_squared_hinge": ("squared_hinge", "dual", 0.2, 40, 1e-9, 1e-8),  # smooth: ~16 rounds
    "primal_ridge": ("squared", "primal", 0.1, 40, 1e-10, 1e-9),
}
LAM_K = 0.1
TWO_RANKS = {  # name -> (loss, formulation, the rank with no rows or None)
    "dual_logistic": ("logistic", "dual", None),
    "primal_ridge": ("squared", "primal", None),
    "dual_logistic_empty_shard": ("logistic", "dual", 1),
}


# -- the simulated side (runs in the subprocess) ---------------------------------------------------


def _one_epoch_matches(loss: str) -> float:
    """Max |difference| between one simulated TPA-SCD epoch (one block per row, blocks run in
    order by the simulator) and the sequential CPU epoch over the same permutation."""
    from numba import cuda

    from terascale.solvers.scd import gpu_kernels as gk
    from terascale.solvers.scd.dual_kernels import dual_epoch, row_sq_norms
    from terascale.solvers.scd.losses import loss_code
    from tests.scd.helpers import make_data

    d = make_data(loss, n=60, d=20, seed=3, weighted=True)
    code = loss_code(loss)
    sqn = row_sq_norms(d.indptr, d.values, 1.0)
    scale = 1.0 / (LAM * float(d.weights.sum()))
    alpha, u = np.zeros(d.n_rows), np.zeros(d.n_features + 1)
    dev = [cuda.to_device(a) for a in (d.indptr, d.indices, d.values, d.labels, d.weights, sqn)]
    d_alpha, d_u = cuda.to_device(alpha), cuda.to_device(u)
    worst = 0.0
    for e in range(2):
        order = np.random.default_rng(e).permutation(d.n_rows)
        dual_epoch(d.indptr, d.indices, d.values, d.labels, d.weights, sqn, alpha, u, order, code,
                   scale, 1.0, d.n_features)
        gk.tpa_dual_epoch[d.n_rows, 4, 0, gk.shared_bytes(4)](
            *dev, d_alpha, d_u, cuda.to_device(order), code, scale, 1.0, d.n_features)
        worst = max(worst, float(np.abs(d_alpha.copy_to_host() - alpha).max()),
                    float(np.abs(d_u.copy_to_host() - u).max()))
    return worst


def _primal_epoch_matches() -> float:
    from numba import cuda

    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd import gpu_kernels as gk
    from terascale.solvers.scd.partition import feature_block
    from terascale.solvers.scd.primal_kernels import col_sq_norms, primal_epoch
    from tests.scd.helpers import make_data

    d = make_data("squared", n=60, d=20, seed=4, weighted=True)
    b = feature_block(d, LocalCommunicator(), 1.0)
    csq = col_sq_norms(b.colptr, b.rows, b.vals, b.weights)
    m, n = b.colptr.shape[0] - 1, b.labels.shape[0]
    lam_n = LAM * float(d.weights.sum())
    beta, u = np.zeros(m), np.zeros(n)
    dev = [cuda.to_device(a) for a in (b.colptr, b.rows, b.vals, b.labels, b.weights, csq)]
    d_beta, d_u = cuda.to_device(beta), cuda.to_device(u)
    worst = 0.0
    for e in range(2):
        order = np.random.default_rng(e).permutation(m)
        primal_epoch(b.colptr, b.rows, b.vals, b.labels, b.weights, csq, beta, u, order, lam_n, 1.0)
        gk.tpa_primal_epoch[m, 4, 0, gk.shared_bytes(4)](*dev, d_beta, d_u, cuda.to_device(order),
                                                         lam_n, 1.0)
        worst = max(worst, float(np.abs(d_beta.copy_to_host() - beta).max()),
                    float(np.abs(d_u.copy_to_host() - u).max()))
    return worst


def _permutations() -> dict:
    """The device-made epoch orders: permutations, equal to the numpy twin, keyed per epoch."""
    from numba import cuda

    from terascale.solvers.scd.gpu_shuffle import (
        domain_bits,
        epoch_keys,
        host_permutation,
        permutation_kernel,
    )

    out = {"is_permutation": True, "kernel_equals_host": True}
    for n in (1, 2, 3, 7, 40, 1000):
        keys = epoch_keys(5, 1, 2, 3)
        ref = host_permutation(n, keys)
        out["is_permutation"] &= bool(np.array_equal(np.sort(ref), np.arange(n)))
        dev = cuda.device_array(n, np.int64)
        half, mask = domain_bits(n)
        permutation_kernel[4, 4](dev, n, half, mask, *keys)
        out["kernel_equals_host"] &= bool(np.array_equal(dev.copy_to_host(), ref))
    tuples = [(0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (0, 0, 2, 0), (0, 0, 1, 1)]
    orders = [host_permutation(40, epoch_keys(*t)).tobytes() for t in tuples]
    out["distinct_per_key"] = len(set(orders)) == len(orders)
    out["repeatable"] = host_permutation(40, epoch_keys(*tuples[0])).tobytes() == orders[0]
    return out


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))  # inf == inf (gamma_max) is a match
    return float(diff.max() / max(1.0, float(np.abs(b[np.isfinite(b)]).max(initial=0.0))))


def _cpu_proposal(cpu, p, round_index: int):
    """The CPU kernels' proposal from the CPU problem's state over the device's permutations:
    (local after the epochs, u)."""
    from terascale.solvers.scd.dual_kernels import dual_epoch
    from terascale.solvers.scd.gpu_shuffle import epoch_keys, host_permutation
    from terascale.solvers.scd.primal_kernels import primal_epoch

    s = cpu.solver
    if p.formulation == "dual":
        local, u, d = cpu.alpha.copy(), cpu.w.copy(), cpu.data
    else:
        local, u, b = cpu.beta.copy(), cpu.z.copy(), cpu.block
    for e in range(p.local_epochs):
        order = host_permutation(local.shape[0], epoch_keys(p.seed, 0, round_index, e))
        if p.formulation == "dual":
            dual_epoch(d.indptr, d.indices, d.values, d.labels, d.weights, s.sqn, local, u, order,
                       cpu.loss, cpu.sigma / s.lam_n, s.bias_scale, s.bias_index)
        else:
            primal_epoch(b.colptr, b.rows, b.vals, b.labels, b.weights, s.csq, local, u, order,
                         s.lam_n, cpu.sigma)
    return local, u


def _same_state(loss: str, formulation: str, lam: float) -> dict:
    """GPU problem (one block walking the permutation: sequential SCD) and CPU problem on the
    same state, three adaptive rounds: every piece the loop reads, max relative error. The
    damped TPA-SCD dual for every loss (the hot-block dual, one rank's default for the squared
    and logistic losses, has its own tests: ``test_gpu_hot_sim``)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import FORMULATIONS
    from terascale.solvers.scd.gpu_problem import make_gpu_problem
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data

    d = make_data(loss, n=ROWS, d=COLS, seed=2, weighted=True)
    comm = LocalCommunicator()
    n_w = float(np.sum(d.weights, dtype=np.float64))
    p = CocoaParams(loss=loss, formulation=formulation, l2=lam, local_epochs=2, seed=7)
    gpu = make_gpu_problem(d, comm, p, n_w, threads_per_block=2, blocks=1, hot_block=False)
    cpu = FORMULATIONS[formulation, "fixed"](d, comm, p, n_w)
    worst: dict[str, float] = {}

    def rec(key, a, b):
        worst[key] = max(worst.get(key, 0.0), _rel(a, b))

    for r in range(1, 4):
        cpu.restore(*gpu.snapshot())
        rec("eval_pieces", gpu.eval_pieces(), cpu.eval_pieces())
        shared = cpu.w if formulation == "dual" else cpu.z
        gpu.propose(r)
        local, u = _cpu_proposal(cpu, p, r)
        dlocal = gpu.solver.x.copy_to_host() - gpu.solver.x0.copy_to_host()
        rec("proposal", dlocal, local - cpu.snapshot()[0])
        rec("shared_delta", gpu.shared_delta(), (u - shared) / cpu.sigma)
        np.copyto(cpu.dalpha if formulation == "dual" else cpu.dbeta, dlocal)  # the same proposal
        np.copyto(cpu.shared_delta(), gpu.shared_delta())
        rec("line_pieces", gpu.line_pieces(), cpu.line_pieces())
        if loss == "logistic":
            for g in (0.25, 1.0):
                rec("logistic_derivs", gpu._logistic_derivs(g), cpu._logistic_derivs(g))
        gamma = gpu.gamma(gpu.shared_delta(), gpu.line_pieces())
        rec("gamma", gamma, cpu.gamma(cpu.shared_delta(), cpu.line_pieces()))
        gpu.apply(gamma, gpu.shared_delta().copy())
        cpu.apply(gamma, cpu.shared_delta().copy())
        rec("committed_local", gpu.snapshot()[0], cpu.snapshot()[0])
        rec("shared", gpu.snapshot()[1], cpu.snapshot()[1])
    worst["moved"] = float(np.abs(gpu.snapshot()[0]).max())
    return worst


def _train_case(loss: str, formulation: str, lam: float, max_rounds: int, tol: float,
                _target: float) -> dict:
    """The CPU solver and the simulated GPU problem on the same objective, to a tight gap."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data, model_vector, objective

    d = make_data(loss, n=ROWS, d=COLS, seed=1, weighted=True)
    p = CocoaParams(loss=loss, formulation=formulation, l2=lam, max_rounds=max_rounds, tol=tol,
                    seed=5)
    cpu = train_cocoa(d, LocalCommunicator(), p)
    # 2 blocks looping over the permutation (not one per coordinate): the asynchronous schedule;
    # the damped dual for every loss (the hot block's training: test_gpu_hot_sim)
    gpu = train_cocoa_gpu(d, LocalCommunicator(), p, threads_per_block=2, blocks=2, fallback=False,
                          hot_block=False if formulation == "dual" else None)
    b_cpu, b_gpu = model_vector(cpu), model_vector(gpu)
    return {
        "cpu_gap": cpu.gap, "gpu_gap": gpu.gap, "gpu_rounds": gpu.rounds,
        "cpu_obj": objective(loss, d, b_cpu, lam), "gpu_obj": objective(loss, d, b_gpu, lam),
        "cpu_primal": cpu.primal, "gpu_primal": gpu.primal,
        "dist": float(np.linalg.norm(b_cpu - b_gpu)),
    }


def _train_api_blocks() -> dict:
    """``train.device = gpu`` through the train API, with ``train.gpu_blocks`` 0 (one block per
    row: the sequential order under the simulator) and 2 (2 blocks looping over the permutation:
    another order of the same steps), beside the CPU solver."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.api import train
    from terascale.solvers.params import SolverParams
    from tests.scd.helpers import make_data

    d = make_data("logistic", n=ROWS, d=COLS, seed=2)
    out = {}
    for name, kw in {"cpu": {}, "gpu_all": {"device": "gpu"}, "gpu_2": {"device": "gpu", "gpu_blocks": 2}}.items():
        res = train(d, LocalCommunicator(), SolverParams(solver="cocoa", loss="logistic", l2=LAM, tol=1e-10,
                                                         passes=40, seed=5, **kw))
        out[name] = {"stop": res.stop_reason, "gap": res.history[-1]["gap"],
                     "primal": res.history[-1]["primal"], "primal_1": res.history[1]["primal"]}
    return out


def _two_ranks(loss: str, formulation: str, empty: int | None) -> dict:
    """K = 2 ranks (TreeNodes in threads), each with its simulated GPU problem, vs K = 1 (CPU)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data, run_ranks, split_rows

    d = make_data(loss, n=ROWS, d=COLS, seed=3)
    p = CocoaParams(loss=loss, formulation=formulation, l2=LAM_K, max_rounds=60, tol=1e-9, seed=2)
    ref = train_cocoa(d, LocalCommunicator(), p)
    res = run_ranks(split_rows(d, 2, empty=empty), lambda shard, node: train_cocoa_gpu(
        shard, node, p, threads_per_block=2, blocks=2, fallback=False), timeout=280.0)
    trace = [[(h["primal"], h["dual"], h["gamma"]) for h in r.history] for r in res]
    return {
        "identical": all(r.weights.tobytes() == res[0].weights.tobytes() and
                         r.intercept == res[0].intercept for r in res) and trace[0] == trace[1],
        "converged": bool(res[0].converged), "gap": res[0].gap, "ref_gap": ref.gap,
        "primal": res[0].primal, "ref_primal": ref.primal,
        "dist": float(np.abs(res[0].weights - ref.weights).max()),
    }


def _resume(loss: str, formulation: str) -> dict:
    """Checkpoint (snapshot: the local vector comes down) and resume (restore: it goes up)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data

    d = make_data(loss, n=ROWS, d=COLS, seed=4, weighted=True)
    p = CocoaParams(loss=loss, formulation=formulation, l2=0.05, max_rounds=8, tol=0.0, seed=3)
    kw = {"threads_per_block": 2, "blocks": 4, "fallback": False}
    states = []
    full = train_cocoa_gpu(d, LocalCommunicator(), p, on_round_end=states.append, **kw)
    resumed = train_cocoa_gpu(d, LocalCommunicator(), p, resume=states[3], **kw)
    trace = [[(h["round"], h["primal"], h["dual"], h["gamma"]) for h in r.history]
             for r in (full, resumed)]
    return {"same_weights": full.weights.tobytes() == resumed.weights.tobytes(),
            "same_trace": trace[0] == trace[1], "rounds": [full.rounds, resumed.rounds],
            "local_moved": float(np.abs(states[-1].local).max())}


def _traffic(loss: str, formulation: str, rows: int) -> dict:
    """Host<->device bytes and copies of every round (between two ``apply`` calls)."""
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.gpu_problem import make_gpu_problem
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data

    d = make_data(loss, n=rows, d=COLS, seed=5)
    p = CocoaParams(loss=loss, formulation=formulation, l2=0.05, max_rounds=4, tol=0.0,
                    local_epochs=2)
    made, marks = [], []

    def factory(*args):
        pr = make_gpu_problem(*args, threads_per_block=2, blocks=2, hot_block=False)
        apply = pr.apply

        def counted_apply(gamma, delta):
            apply(gamma, delta)
            marks.append(pr.solver.traffic())

        pr.apply = counted_apply
        made.append(pr)
        return pr

    train_cocoa(d, LocalCommunicator(), p, make_problem=factory)
    rounds = [{k: b[k] - a[k] for k in a} for a, b in zip(marks[:-1], marks[1:], strict=True)]
    return {"shared_len": made[0].shared_len, "n_local": made[0].solver.n, "rounds": rounds}


def _sim_main() -> None:
    import sys as _sys

    _sys.setswitchinterval(1e-5)  # the simulator polls its threads; a short GIL slice is ~20x faster
    from terascale.solvers.scd.gpu import gpu_available

    out = {"available": gpu_available(), "seconds": {}}

    def timed(key, fn):
        t = time.perf_counter()
        out[key] = fn()
        out["seconds"][key] = time.perf_counter() - t

    timed("epoch", lambda: {**{loss: _one_epoch_matches(loss) for loss in DUAL_LOSSES},
                            "primal": _primal_epoch_matches()})
    timed("permutations", _permutations)
    timed("same_state", lambda: {name: _same_state(c[0], c[1], c[2]) for name, c in CASES.items()})
    timed("train", lambda: {name: _train_case(*case) for name, case in CASES.items()})
    timed("two_ranks", lambda: {name: _two_ranks(*c) for name, c in TWO_RANKS.items()})
    timed("train_api_blocks", _train_api_blocks)
    timed("resume", lambda: {"dual_hinge": _resume("hinge", "dual"),
                             "primal_ridge": _resume("squared", "primal")})
    timed("traffic", lambda: {"dual_hinge_40": _traffic("hinge", "dual", 40),
                              "dual_hinge_80": _traffic("hinge", "dual", 80),
                              "dual_logistic": _traffic("logistic", "dual", 40),
                              "primal_ridge": _traffic("squared", "primal", 40)})
    print("RESULT " + json.dumps(out))


def _run_script(arg: str, sim: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, __file__, arg], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


# -- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim():
    proc = _run_script("sim", sim=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"simulator run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def test_simulator_is_available(sim):
    ok, reason = sim["available"]
    assert ok and "simulator" in reason


@pytest.mark.parametrize("kind", [*DUAL_LOSSES, "primal"])
def test_simulated_epoch_equals_sequential_cpu_epoch(sim, kind):
    # the simulator runs blocks one after another: one block per coordinate = sequential SCD,
    # up to the order of the in-block reduction
    assert sim["epoch"][kind] < 1e-10


def test_device_permutations(sim):
    assert sim["permutations"] == {"is_permutation": True, "kernel_equals_host": True,
                                   "distinct_per_key": True, "repeatable": True}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_problem_pieces_equal_cpu_problem_on_the_same_state(sim, name):
    """eval_pieces, the proposal (CPU kernels over the device's permutations), shared_delta,
    line_pieces, logistic derivatives, gamma and the committed point agree to 1e-12."""
    worst = dict(sim["same_state"][name])
    assert worst.pop("moved") > 1e-3  # the rounds did something
    assert max(worst.values()) < 1e-12, worst


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_problem_reaches_cpu_optimum(sim, name):
    r = sim["train"][name]
    lam, target = CASES[name][2], CASES[name][5]
    g_cpu, g_gpu = max(r["cpu_gap"], 0.0), max(r["gpu_gap"], 0.0)
    assert g_gpu <= target, r  # converged (the gap certifies the optimum)
    assert abs(r["cpu_primal"] - r["gpu_primal"]) <= max(g_cpu, g_gpu), r
    # objectives are recomputed from the returned float32 weights: allow their rounding (1e-7 rel.)
    f32 = 1e-7 * max(1.0, abs(r["gpu_obj"]))
    assert abs(r["cpu_obj"] - r["gpu_obj"]) <= max(g_cpu, g_gpu) + f32, r
    assert abs(r["gpu_obj"] - r["gpu_primal"]) <= f32, r  # the reported P is the objective
    bound = math.sqrt(2 * g_cpu / lam) + math.sqrt(2 * g_gpu / lam)
    assert r["dist"] <= bound + 1e-6, r


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_agree_with_one(sim, name):
    r = sim["two_ranks"][name]
    assert r["identical"] and r["converged"], r
    assert abs(r["primal"] - r["ref_primal"]) <= max(r["gap"], r["ref_gap"], 0.0) + 1e-12, r
    bound = math.sqrt(2 * max(r["gap"], 0.0) / LAM_K) + math.sqrt(2 * max(r["ref_gap"], 0.0) / LAM_K)
    assert r["dist"] <= bound + 1e-6, r


@pytest.mark.parametrize("name", ["dual_hinge", "primal_ridge"])
def test_checkpoint_and_resume(sim, name):
    r = sim["resume"][name]
    assert r["rounds"] == [8, 8] and r["local_moved"] > 1e-3, r
    assert r["same_weights"] and r["same_trace"], r


@pytest.mark.parametrize("name", ["dual_hinge_40", "dual_hinge_80", "primal_ridge"])
def test_per_round_traffic_is_the_shared_vector_and_a_few_scalars(sim, name):
    """After set-up a round moves the shared vector up once (the new point) and down once (the
    proposal), plus 3 float64s for the gap sums and 3 for the line search: no local vector, no
    permutation, whatever the shard's size."""
    t = sim["traffic"][name]
    s = 8 * t["shared_len"]
    assert len(t["rounds"]) == 3
    for row in t["rounds"]:
        assert row == {"bytes_up": s, "bytes_down": s + 48, "uploads": 1, "downloads": 3}, t


def test_per_round_traffic_does_not_grow_with_the_shard(sim):
    small, large = sim["traffic"]["dual_hinge_40"], sim["traffic"]["dual_hinge_80"]
    assert large["n_local"] == 2 * small["n_local"]
    assert large["rounds"] == small["rounds"]


def test_logistic_line_search_adds_scalars_only(sim):
    t = sim["traffic"]["dual_logistic"]
    s = 8 * t["shared_len"]
    for row in t["rounds"]:
        newton = row["bytes_down"] - s - 48  # one 3-scalar reduction per Newton step
        assert row["bytes_up"] == s and newton > 0 and newton % 24 == 0 and newton <= 24 * 60, t


def test_gpu_module_imports_and_reports_without_cuda():
    """Without the simulator and without a device: import works, gpu_available says why."""
    code = ("from terascale.solvers.scd.gpu import gpu_available; ok, why = gpu_available(); "
            "print('OK', ok, why)")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("OK ")][-1]
    assert line.startswith("OK True CUDA device") or line.startswith("OK False no usable CUDA"), line


def test_without_a_gpu_falls_back_to_the_cpu_solver_or_raises(monkeypatch):
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd import gpu
    from terascale.solvers.scd.api import train_cocoa
    from terascale.solvers.scd.params import CocoaParams
    from tests.scd.helpers import make_data

    monkeypatch.setattr(gpu, "gpu_available", lambda: (False, "no device in this test"))
    d = make_data("logistic", n=ROWS, d=COLS, seed=6)
    p = CocoaParams(loss="logistic", l2=LAM, max_rounds=5)
    with pytest.warns(RuntimeWarning, match="no device in this test"):
        res = gpu.train_cocoa_gpu(d, LocalCommunicator(), p)
    assert res.weights.tobytes() == train_cocoa(d, LocalCommunicator(), p).weights.tobytes()
    with pytest.raises(RuntimeError, match="no device in this test"):
        gpu.train_cocoa_gpu(d, LocalCommunicator(), p, fallback=False)


# -- a real device ---------------------------------------------------------------------------------


def _big_data(loss: str, n: int = 260_000, per_row: int = 40, bits: int = 16, seed: int = 0):
    """Random sparse rows (per_row non-zeros each, >= 1e7 in all) with a planted model."""
    from terascale.solvers.data import CSRData

    rng = np.random.default_rng(seed)
    d = 1 << bits
    idx = np.sort(rng.integers(0, d, size=(n, per_row), dtype=np.int64), axis=1)
    keep = np.ones_like(idx, dtype=bool)
    keep[:, 1:] = idx[:, 1:] != idx[:, :-1]  # unique within a row
    counts = keep.sum(axis=1)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = idx[keep].astype(np.int32)
    values = (rng.standard_normal(indices.shape[0]) / math.sqrt(per_row)).astype(np.float32)
    beta = rng.standard_normal(d)
    margin = np.add.reduceat(values * beta[indices], indptr[:-1])
    if loss == "squared":
        y = margin + 0.1 * rng.standard_normal(n)
    else:
        y = (margin + 0.3 * rng.standard_normal(n) > 0).astype(np.float64)
    return CSRData(indptr, indices, values, y.astype(np.float32), np.ones(n, np.float32), d)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("formulation", ["dual", "primal"])
def test_gpu_converges_on_1e7_nonzeros(formulation):
    from terascale.allreduce.communicator import LocalCommunicator
    from terascale.solvers.scd.gpu import train_cocoa_gpu
    from terascale.solvers.scd.params import CocoaParams

    data = _big_data("squared")
    assert data.nnz >= 10_000_000
    p = CocoaParams(loss="squared", formulation=formulation, l2=1e-3, max_rounds=300, tol=1e-8)
    res = train_cocoa_gpu(data, LocalCommunicator(), p, fallback=False)
    assert res.converged and res.gap < 1e-6, (res.gap, res.rounds)
    assert res.primal >= res.dual - 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("loss, formulation", [("hinge", "dual"), ("squared", "primal")])
def test_round_traffic_on_a_device(loss, formulation):
    """The transfer accounting of the simulated runs holds on a device (CuPy or numba arrays)."""
    t = _traffic(loss, formulation, 400)
    s = 8 * t["shared_len"]
    for row in t["rounds"]:
        assert row == {"bytes_up": s, "bytes_down": s + 48, "uploads": 1, "downloads": 3}, t


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "sim":
    _sim_main()


def test_eso_weights_damp_shared_features_by_the_concurrency():
    """beta_j = 1 + (ω_j − 1)(τ − 1)/(n − 1): 1 at τ = 1 (the sequential step), τ for a feature
    in every row (the constant), 1 for a feature in one row; v_i = sum_j beta_j x_ij²."""
    from terascale.solvers.scd.gpu_local_solver import eso_weights

    indices = np.array([0, 1, 0, 2, 0, 0], dtype=np.int32)  # rows [0, 1], [0, 2], [0], [0]: ω = 4, 1, 1, 0
    beta, bias = eso_weights(indices, 4, 4, 1)
    assert beta.tolist() == [1.0, 1.0, 1.0, 1.0] and bias == 1.0
    beta, bias = eso_weights(indices, 4, 4, 7)
    assert beta.tolist() == [7.0, 1.0, 1.0, 1.0] and bias == 7.0
    beta, bias = eso_weights(indices, 4, 4, 3)
    assert beta.tolist() == [3.0, 1.0, 1.0, 1.0] and bias == 3.0
    beta, _ = eso_weights(np.array([0, 0, 1], dtype=np.int32), 2, 5, 5)  # ω_0 = 2 of n = 5 rows
    assert beta.tolist() == [1.0 + 1 * 4 / 4, 1.0]


def test_the_train_api_passes_gpu_blocks_to_the_device_solver(sim):
    """train.gpu_blocks reaches TPA-SCD: under the simulator, 2 blocks take the epoch's
    permutation in another order than one block per row (block 0's rows, then block 1's), so
    the first round lands elsewhere, and both reach the CPU solver's optimum."""
    r = sim["train_api_blocks"]
    assert all(v["stop"] == "converged_gap" for v in r.values()), r
    assert r["gpu_2"]["primal_1"] != pytest.approx(r["gpu_all"]["primal_1"], rel=1e-9)
    for v in (r["gpu_all"], r["gpu_2"]):  # P within its gap of P*, on both sides
        assert abs(v["primal"] - r["cpu"]["primal"]) <= max(v["gap"], r["cpu"]["gap"])

