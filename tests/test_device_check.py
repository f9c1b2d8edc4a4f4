"""The hardware check (tests/device) rehearsed here: tiny sizes, numba's CUDA simulator, no GPU.

The rehearsal runs ``python -m tests.device.check --rehearsal`` as the GPU machine will run it
(wheels installed with ``pip --no-deps --no-index`` into a folder the steps import first), and
checks every file it must bring back; the pieces that judge the device's figures are checked on
figures made up here, where the answer is known.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.device import check, steps, wheels
from tests.test_packaging import _wheel

ROOT = Path(__file__).resolve().parents[1]
FILES = {"summary.json", "gpu_tests.json", "gpu_scd.json", "allreduce.json", "threads.json",
         "device-check.log"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device")
    folder = tmp / "wheels"
    folder.mkdir()
    shutil.copy(_wheel(tmp), folder)
    out = tmp / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "tests.device.check", "--rehearsal", "--wheels",
                           str(folder), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, {f: json.loads((out / f).read_text()) for f in FILES if f.endswith(".json")}


@pytest.mark.slow
def test_the_rehearsal_writes_every_file_and_nothing_else(rehearsal):
    out, js = rehearsal
    assert {p.name for p in out.iterdir()} == FILES  # the device tool brings back at most 8
    summary = js["summary.json"]
    assert summary["rehearsal"] is True
    assert {n: s["status"] for n, s in summary["steps"].items()} == dict.fromkeys(steps.STEPS, "ok")
    [wheel] = summary["install"]["wheels"]  # the folder holds terascale's wheel only
    assert wheel.startswith("terascale-") and wheel.endswith("-py3-none-any.whl")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert summary["versions"]["terascale"] == version
    assert all(t["met"] is None for t in summary["targets"])  # nothing judged in a rehearsal
    log = (out / "device-check.log").read_text()
    for name in steps.STEPS:
        assert f"step {name}: ok" in log


@pytest.mark.slow
def test_the_steps_import_the_installed_wheel_not_the_tree(rehearsal):
    _, js = rehearsal
    for name in ("gpu_scd", "allreduce", "threads"):
        where = Path(js[f"{name}.json"]["terascale_from"])
        assert not where.is_relative_to(ROOT) and where.parts[-2:] == ("terascale", "solvers"), where


@pytest.mark.slow
def test_the_gpu_tests_step_runs_every_gpu_test_and_the_simulator_skips_them(rehearsal):
    _, js = rehearsal
    t = js["gpu_tests.json"]
    assert t["files"] == ["tests/scd/test_gpu_hot_sim.py", "tests/scd/test_gpu_sim.py"]
    assert t["counts"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 6}
    assert all("simulator is not one" in c["message"] for c in t["cases"])


@pytest.mark.slow
def test_the_gpu_benchmark_ran_every_solver_on_the_simulated_device(rehearsal):
    _, js = rehearsal
    g = js["gpu_scd.json"]
    assert "simulator" in g["device"] and g["rows"] == 160 and g["features"] == 256
    assert set(g["problems"]) == {"logistic_dual", "squared_dual", "squared_primal"}
    assert set(g["wide"]["problems"]) == {"logistic_dual", "squared_dual"} and g["wide"]["features"] == 1024
    assert set(g["webspam"]["problems"]) == {"squared_dual"} and g["webspam"]["rows"] == 40
    sets = [g["problems"], g["wide"]["problems"], g["webspam"]["problems"]]
    for name, runs in [item for problems in sets for item in problems.items()]:
        dual = name.endswith("dual")
        assert set(runs) == {"cpu_seq", "cpu_threads", "gpu"} | ({"gpu_damped"} if dual else set())
        assert runs["cpu_seq"]["threads"] == 1 and runs["cpu_threads"]["threads"] == os.cpu_count()
        for gpu in [runs["gpu"]] + ([runs["gpu_damped"]] if dual else []):
            assert 1 <= gpu["rounds"] <= 3 and gpu["pcie"]["bytes_up"] > 0 and gpu["pcie"]["bytes_down"] > 0
            assert gpu["epoch_s"] > 0 and gpu["setup_s"] > 0
        if dual:  # the hot block by default (one block at a time: the constant alone is hot)
            hot, damped = runs["gpu"], runs["gpu_damped"]
            assert hot["variant"] == "GpuHotDualProblem" and damped["variant"] == "GpuDualProblem"
            assert hot["hot"]["features"] == 1 and hot["hot"]["tau"] == 1 and hot["concurrency"] == 1
            assert hot["hot"]["newton_steps"] in (4 * hot["rounds"], 4 * hot["rounds"] + 4)  # + a discarded last
            assert damped["concurrency"] == 1
            # one block at a time: no damping, each row's coefficient exactly its own
            assert damped["eso_step_ratio"] == pytest.approx(1.0, rel=1e-12)
        for r in runs.values():
            assert (r["epochs_to_gap"] is None) == (r["seconds_to_gap"] is None)
    reached = [r for problems in sets for runs in problems.values() for r in runs.values() if r["epochs_to_gap"]]
    assert reached  # at the rehearsal's gap (2e-2) some runs get there within 3 rounds


@pytest.mark.slow
def test_the_allreduce_and_thread_steps_measured_something(rehearsal):
    _, js = rehearsal
    a = js["allreduce.json"]
    assert a["raw_loopback_gbps"] > 0 and a["ks"] == [2, 4]
    for cipher in ("aes-gcm", "aes-gmac", "hmac-sha256"):
        e = a["ciphers"][cipher]
        assert e["k2_gbps"] > 0 and e["k4_gbps"] > 0 and 0 < e["k2_fraction_of_loopback"]
        assert len(e["k4_perf_per_rank"]) == 4
    t = js["threads.json"]
    assert t["threads"] == [1, 2] and set(t["per_threads"]) == {"1", "2"}
    one, two = t["per_threads"]["1"], t["per_threads"]["2"]
    for kind in ("online", "gradient", "gradient_by_columns", "gather"):
        assert one[kind]["median_per_s"] > 0 and two[kind]["speedup"] > 0
    assert t["gradient_by_columns_same_bits"] and t["csc_build_s"] > 0
    # one pass over the same rows: the Hogwild pass's progressive loss stays near the sequential one
    assert abs(one["online"]["progressive_loss"][0] - two["online"]["progressive_loss"][0]) < 0.05
    assert two["online"]["hot_features"] > 0


def test_a_step_past_its_limit_is_killed_and_says_so(tmp_path):
    log = check.Log(tmp_path / "device-check.log")
    slow = [sys.executable, "-c", "import time; time.sleep(120)"]
    r = check.run_step("threads", tmp_path, dict(os.environ), 1.0, True, log, cmd=slow)
    assert r["status"] == "timeout" and r["why"] == "killed at its time limit" and r["seconds"] < 60
    assert json.loads((tmp_path / "threads.json").read_text())["status"] == "timeout"


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    shutil.copy(_wheel(tmp_path), folder)
    out = tmp_path / "out"
    assert check.main(["--rehearsal", "--wheels", str(folder), "--out", str(out), "--budget-s", "0",
                       "--steps", "threads"]) == 1
    assert json.loads((out / "threads.json").read_text()) == {
        "step": "threads", "status": "not run", "why": "the time budget was spent"}


def test_a_stale_terascale_wheel_is_refused(tmp_path):
    wheel = _wheel(tmp_path)
    assert wheels.stale_files(wheel) == []
    # the same wheel with one file's recorded hash changed: as if built before an edit
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("RECORD"):
                data = data.replace(b"terascale/solvers/lbfgs.py,sha256=", b"terascale/solvers/lbfgs.py,sha256=x")
            dst.writestr(info, data)
    assert wheels.stale_files(bad) == ["solvers/lbfgs.py"]
    with pytest.raises(RuntimeError, match=r"differs from the working tree in \['solvers/lbfgs.py'\]"):
        wheels.install(bad.parent, tmp_path / "site")
    with pytest.raises(FileNotFoundError, match="make device-wheels"):
        wheels.install(tmp_path, tmp_path / "site")


def test_the_shipped_wheels_cover_what_the_device_lacks():
    deps = set(wheels.runtime_dependencies())
    assert deps == set(wheels.DEVICE_HAS) | set(wheels.LEFT_BEHIND) | (deps & set(wheels.SHIPPED))
    # every shipped package's own run-time needs on the device (CPython 3.12, no extras) are
    # there or shipped too
    from packaging.requirements import Requirement

    device = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": "",
              "platform_python_implementation": "CPython", "implementation_name": "cpython"}
    for name in wheels.SHIPPED:
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(device):
                assert wheels._name(req.name) in set(wheels.SHIPPED) | set(wheels.DEVICE_HAS), (name, text)
    assert wheels.requirements() == [f"{n}=={metadata.version(n)}" for n in wheels.SHIPPED]


def test_the_gpu_extras_serve_cuda_12_and_13():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("cupy-cuda12x") for r in extras["gpu-cuda12"])
    assert any(r.startswith("cupy-cuda13x") for r in extras["gpu-cuda13"])
    assert "numba-cuda[cu12]>=0.30" in extras["gpu-cuda12"] and "numba-cuda[cu13]>=0.30" in extras["gpu-cuda13"]
    assert extras["gpu"] == ["terascale[gpu-cuda12]"]


def test_junit_results_read_every_outcome(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="a" name="ok" time="1.5"/>'
                   '<testcase classname="a" name="bad" time="2"><failure message="boom">x</failure></testcase>'
                   '<testcase classname="a" name="err" time="0"><error message="setup">x</error></testcase>'
                   '<testcase classname="a" name="skip" time="0"><skipped message="no GPU"/></testcase>'
                   "</testsuite></testsuites>")
    r = steps.junit_results(xml)
    assert r["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    assert [(c["test"], c["outcome"], c["seconds"], c["message"]) for c in r["cases"]] == [
        ("a::ok", "passed", 1.5, None), ("a::bad", "failed", 2.0, "boom"),
        ("a::err", "error", 0.0, "setup"), ("a::skip", "skipped", 0.0, "no GPU")]


def _run(seconds=None, epochs=None, capped=None, setup=1.0):
    r = {"seconds_to_gap": seconds, "epochs_to_gap": epochs,
         "seconds_to_gap_with_setup": None if seconds is None else seconds + setup}
    if capped:
        r["capped"] = {"seconds": capped[0], "epochs": capped[1], "gap_over_p0": 1e-3}
    return r


def test_speedups_against_a_capped_cpu_run_are_lower_bounds():
    from tests.benchmarks.bench_gpu_scd import ratios

    gpu = _run(2.0, 10, setup=2.0)
    assert ratios(gpu, _run(80.0, 8, setup=0.0), "seq") == {
        "speedup_vs_seq": 40.0, "speedup_with_setup_vs_seq": 20.0, "epochs_vs_seq": 1.25}
    assert ratios(gpu, _run(capped=(40.0, 5)), "seq") == {
        "speedup_vs_seq": None, "epochs_vs_seq": None, "speedup_vs_seq_at_least": 20.0,
        "epochs_vs_seq_at_most": 2.0}
    assert ratios(_run(), _run(80.0, 8), "seq") == {"speedup_vs_seq": None, "epochs_vs_seq": None}


def test_the_targets_are_judged_from_the_figures():
    def duals(seq, threads, epochs):
        run = {"gpu": {"speedup_vs_seq": seq, "speedup_vs_threads": threads, "epochs_vs_seq": epochs}}
        return {"problems": {"squared_dual": run, "logistic_dual": run}}

    def gpu_scd(seq, threads, epochs, webspam):
        return {**duals(seq, threads, epochs), "wide": duals(seq, threads, epochs),
                "webspam": {"problems": {"squared_dual": {"gpu": {"speedup_vs_seq": webspam}}}}}

    def allreduce(frac, k8):
        return {"ciphers": {"aes-gcm": {"k2_fraction_of_loopback": frac, "k8_over_k2_time": k8}}}

    def threads(speedup):
        return {"per_threads": {"16": {"gradient": {"speedup": speedup}}}}

    n = 1 + 12 + 1 + 2 + 1  # the GPU tests, 2 data sets x 2 duals x 3, webspam, AllReduce, threads
    counts = {"passed": 4, "failed": 0, "error": 0, "skipped": 0}
    good = check.judge({"gpu_tests": {"counts": counts}, "gpu_scd": gpu_scd(40, 12, 2.0, 35),
                        "allreduce": allreduce(0.7, 1.5), "threads": threads(8.5)}, rehearsal=False)
    assert [t["met"] for t in good] == [True] * n
    bad = check.judge({"gpu_tests": {"counts": {**counts, "skipped": 1}}, "gpu_scd": gpu_scd(20, 5, 2.1, 30),
                       "allreduce": allreduce(0.5, 2.5), "threads": threads(4.5)}, rehearsal=False)
    assert [t["met"] for t in bad] == [False] * n
    # a capped CPU run: the lower bound is judged
    capped = {"problems": {"logistic_dual": {"gpu": {"speedup_vs_seq": None, "speedup_vs_seq_at_least": 50}}}}
    assert check.judge({"gpu_scd": capped}, rehearsal=False)[1] == {
        "target": check.TARGETS[0][1], "value": 50, "met": True}
    # a step without figures: no value, nothing judged
    assert [t["met"] for t in check.judge({}, rehearsal=False)] == [None] * n
