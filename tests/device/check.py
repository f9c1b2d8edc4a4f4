"""``make device-check``: the whole hardware check in one run, within a time budget.

    python3 -m tests.device.check [--out DIR] [--wheels .whl] [--budget-s 480] [--rehearsal]

1. Installs the wheels of ``--wheels`` (terascale's own, checked against the working tree,
   and what the machine lacks: :mod:`tests.device.wheels`) with ``pip --no-deps --no-index``
   into a folder outside the tree, which the steps then import first.
2. Runs the steps of :mod:`tests.device.steps` in order, each in a process group of its own
   with a time limit (:data:`CAPS`; time a step leaves unused goes to the next ones, the whole
   within ``--budget-s``); a step past its limit is killed and its JSON says so.
3. Writes into ``--out`` (``$OUT`` when set, else ``bench-results/device/``): ``<step>.json``
   for each step (its figures, or why it has none, with ``status``, ``seconds`` and the exit
   code), ``summary.json`` (the machine, the installed versions, each step's status and the
   issue's targets judged from the figures) and ``device-check.log`` (everything the steps
   printed). Nothing else: the device tool brings back at most 8 files. Bulky work files go
   to a temporary folder, removed at the end.

``--rehearsal`` (``make test`` runs it): tiny sizes, numba's CUDA simulator on, no targets
judged. The exit status is 0 when every step ran to its end (a missed target is not an error:
the summary says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.device import steps as step_defs
from tests.device import wheels as device_wheels

ROOT = Path(__file__).resolve().parents[2]
#: seconds each step may use on the device (their sum, with the install, fits 8 minutes)
CAPS = {"gpu_tests": 90, "gpu_scd": 270, "allreduce": 60, "threads": 50}
REHEARSAL_CAPS = {"gpu_tests": 120, "gpu_scd": 150, "allreduce": 120, "threads": 90}
VERSIONS = ("numpy", "scipy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "pyarrow",
            "cryptography", "mmh3", "pytest", "terascale")


def _dual_targets() -> tuple:
    """For each click data set and dual: >= 40x one CPU thread, >= 10x every core, epochs <= 2x."""
    out = []
    for key, where in ((None, "click rows, 2^20 features"), ("wide", "click rows, 2^24 features")):
        for loss in ("logistic", "squared"):
            name = f"{loss}_dual"
            out += [
                ("gpu_scd", f"TPA-SCD >= 40x faster to the gap than 1 CPU thread ({loss}, dual, {where})",
                 lambda f, k=key, n=name: _speedup(_at(f, k), n, "seq"), lambda v: v >= 40),
                ("gpu_scd", f"TPA-SCD >= 10x faster to the gap than every CPU core ({loss}, dual, {where})",
                 lambda f, k=key, n=name: _speedup(_at(f, k), n, "threads"), lambda v: v >= 10),
                ("gpu_scd", f"TPA-SCD epochs to the gap <= 2x the sequential solver's ({loss}, dual, {where})",
                 lambda f, k=key, n=name: _at(f, k)["problems"][n]["gpu"]["epochs_vs_seq"], lambda v: v <= 2.0),
            ]
    return tuple(out)


#: the issue's targets on the GPU machine: (step, description, how to read the value, test)
TARGETS = _dual_targets() + (
    ("gpu_scd", "TPA-SCD >= 35x faster to the gap than 1 CPU thread (squared, dual, webspam-shaped rows)",
     lambda f: _speedup(f["webspam"], "squared_dual", "seq"), lambda v: v >= 35),
    ("allreduce", "aes-gcm K = 2 at >= 60% of raw loopback",
     lambda f: f["ciphers"]["aes-gcm"]["k2_fraction_of_loopback"], lambda v: v >= 0.6),
    ("allreduce", "aes-gcm K = 8 in <= 2x K = 2's time",
     lambda f: f["ciphers"]["aes-gcm"]["k8_over_k2_time"], lambda v: v <= 2.0),
    ("threads", "the gradient pass >= 8x at 16 threads",
     lambda f: f["per_threads"]["16"]["gradient"]["speedup"], lambda v: v >= 8),
)


def _at(fig: dict, key: str | None) -> dict:
    return fig if key is None else fig[key]


def _speedup(fig: dict, problem: str, ref: str) -> float | None:
    gpu = fig["problems"][problem]["gpu"]
    return gpu.get(f"speedup_vs_{ref}") or gpu.get(f"speedup_vs_{ref}_at_least")


class Log:
    """One log file for the whole run; progress lines also go to stdout."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "a", buffering=1, encoding="utf-8")

    def say(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        self.f.write(stamped + "\n")


def _machine() -> dict:
    out = {"python": platform.python_version(), "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            out["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        out["cpu"] = None
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
            out["gpus"] = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()] or q.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["gpus"] = f"nvidia-smi failed: {exc}"
    else:
        out["gpus"] = "nvidia-smi not found"
    return out


def _versions(env: dict) -> dict:
    code = ("import json, importlib.metadata as m\nout = {}\nfor n in " + repr(VERSIONS) + ":\n"
            "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def _numba_locators(site: Path) -> str:
    sys.path.insert(0, str(site))
    try:
        from terascale.pipeline.numba_cache import LOCATORS
    finally:
        sys.path.remove(str(site))
    return LOCATORS


def run_step(name: str, out: Path, env: dict, limit_s: float, rehearsal: bool, log: Log,
             cmd: list[str] | None = None) -> dict:
    """One step in its own process group, its output appended to the log; its JSON completed
    with status / seconds / exit code (or written here when the step left none). ``cmd``: the
    step's command line (default: ``python -m tests.device.steps NAME --out <name>.json``)."""
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    if cmd is None:
        cmd = [sys.executable, "-m", "tests.device.steps", name, "--out", str(path)]
        cmd += ["--rehearsal"] if rehearsal else []
    log.say(f"step {name}: start (limit {limit_s:.0f} s)")
    t0 = time.perf_counter()
    with open(log.path, "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(limit_s, 1.0))
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
            status = "timeout"
    seconds = time.perf_counter() - t0
    figures = json.loads(path.read_text()) if path.exists() and status == "ok" else {}
    if status == "ok" and "skipped" in figures:
        status = "skipped"
    result = {"step": name, "status": status, "seconds": seconds, "exit_code": code,
              "limit_s": limit_s, **figures}
    if status != "ok" and not figures:
        result["why"] = ("killed at its time limit" if status == "timeout"
                         else f"exited with {code}: see device-check.log")
    step_defs.write_json(path, result)
    log.say(f"step {name}: {status} in {seconds:.0f} s")
    return result


def judge(results: dict[str, dict], rehearsal: bool) -> list[dict]:
    """The issue's targets, each with its value and whether it is met (None: no figure)."""
    judged = []
    tests = results.get("gpu_tests", {})
    counts = tests.get("counts")
    judged.append({"target": "every GPU test passes on the device", "value": counts,
                   "met": None if rehearsal or not counts else
                   counts["passed"] > 0 and counts["passed"] == sum(counts.values())})
    for step, text, read, test in TARGETS:
        fig = results.get(step, {})
        try:
            value = read(fig)
        except (KeyError, TypeError):
            value = None
        judged.append({"target": text, "value": value,
                       "met": None if rehearsal or value is None else bool(test(value))})
    return judged


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.device.check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench-results" / "device"))
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--rehearsal", action="store_true", help="tiny sizes under numba's CUDA simulator")
    ap.add_argument("--steps", default=",".join(step_defs.STEPS), help="comma list (default: all)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "device-check.log")
    names = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(names) - set(step_defs.STEPS))
    if unknown:
        log.say(f"unknown step(s) {unknown}; the steps: {list(step_defs.STEPS)}")
        return 2
    caps = REHEARSAL_CAPS if args.rehearsal else CAPS
    summary: dict = {"rehearsal": args.rehearsal, "budget_s": args.budget_s, "machine": _machine(),
                     "steps": {}}
    with tempfile.TemporaryDirectory(prefix="terascale-device-") as work:
        site = Path(work) / "site"
        try:
            summary["install"] = device_wheels.install(args.wheels, site)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.say(f"install: {exc}")
            summary["install"] = {"error": str(exc)}
            step_defs.write_json(args.out / "summary.json", summary)
            return 1
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), PYTHONUNBUFFERED="1",
                   TERASCALE_BENCH_RESULTS=str(Path(work) / "bench"))
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        # numba's cache keyed on the modules' names and sources (pipeline.numba_cache), so the
        # steps, and a second run on the same machine, reuse what the first compiled
        env.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", _numba_locators(site))
        if args.rehearsal:
            env["NUMBA_ENABLE_CUDASIM"] = "1"
        summary["versions"] = _versions(env)
        log.say(f"installed {summary['install']['wheels']} into {site}; versions {summary['versions']}")
        results = {}
        for i, name in enumerate(names):
            later = sum(caps[n] for n in names[i + 1:])
            left = args.budget_s - (time.perf_counter() - start)
            limit = min(max(caps[name], left - later), left)
            if limit < 5:
                results[name] = {"step": name, "status": "not run", "why": "the time budget was spent"}
                step_defs.write_json(args.out / f"{name}.json", results[name])
                continue
            results[name] = run_step(name, args.out, env, limit, args.rehearsal, log)
    summary["steps"] = {n: {k: r.get(k) for k in ("status", "seconds", "exit_code", "limit_s", "why")}
                        for n, r in results.items()}
    summary["targets"] = judge(results, args.rehearsal)
    summary["seconds"] = time.perf_counter() - start
    step_defs.write_json(args.out / "summary.json", summary)
    for t in summary["targets"]:
        log.say(f"target: {t['target']}: {t['value']} -> {t['met']}")
    log.say(f"done in {summary['seconds']:.0f} s")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
