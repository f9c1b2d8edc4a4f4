"""The device check's steps, each run in a process of its own by :mod:`tests.device.check`:

    python -m tests.device.steps NAME --out FILE.json [--rehearsal]

* ``gpu_tests``: pytest ``-m gpu`` over the test files that hold ``gpu`` tests; per test its
  outcome and seconds (from pytest's JUnit XML), and the counts;
* ``gpu_scd``: :mod:`tests.benchmarks.bench_gpu_scd` (TPA-SCD, the hot-block dual and the damped
  one, against the CPU solvers with 1 thread and with every core: logistic and ridge in the dual
  on the click rows at 2^20 and 2^24 features, ridge on webspam-shaped rows; the rehearsal adds
  ridge in the primal);
* ``allreduce``: :func:`tests.benchmarks.bench_allreduce.measure` at K = 2, 4, 8, every
  cipher, against raw loopback TCP (no Spark there: no treeAggregate);
* ``threads``: :mod:`tests.benchmarks.bench_threads` at 1, 2, 4, … threads up to the cores.

:data:`SIZES` holds each step's sizes on the device and in the rehearsal (tiny, under numba's
CUDA simulator: every step runs and writes its JSON, nothing is judged). The JSON is written
atomically, so a step killed at its time limit leaves none (the caller then writes why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpu_scd": {
        # the duals the targets read (the primal's CPU runs would spend a minute at their caps)
        "device": {"TERASCALE_BENCH_GPU_ROWS": "2000000", "TERASCALE_BENCH_GPU_CPU_CAP_S": "30",
                   "TERASCALE_BENCH_GPU_PROBLEMS": "logistic_dual,squared_dual"},
        # 2^8 buckets: the primal solver launches a thread block per column, and every simulated
        # thread is a Python thread
        "rehearsal": {"TERASCALE_BENCH_GPU_ROWS": "160", "TERASCALE_BENCH_GPU_WARMUP_ROWS": "40",
                      "TERASCALE_BENCH_GPU_MAX_ROUNDS": "3", "TERASCALE_BENCH_GPU_EPS": "2e-2",
                      "TERASCALE_BENCH_GPU_CPU_CAP_S": "5",
                      "TERASCALE_BENCH_SCD_BITS": "8", "TERASCALE_BENCH_GPU_WIDE_BITS": "10",
                      "TERASCALE_BENCH_GPU_WEBSPAM_ROWS": "40",
                      "TERASCALE_BENCH_GPU_WEBSPAM_FEATURES": "400",
                      "TERASCALE_BENCH_GPU_WEBSPAM_LENGTH": "30"},
    },
    "allreduce": {
        "device": {"ks": (2, 4, 8), "rounds": 2, "n": 1 << 24, "no_overlap_ks": (2,)},
        "rehearsal": {"ks": (2, 4), "rounds": 1, "n": 1 << 12, "no_overlap_ks": ()},
    },
    "threads": {
        "device": {"rows": 2_000_000, "bits": 22, "counts": None, "repeats": 3},
        "rehearsal": {"rows": 3_000, "bits": 12, "counts": (1, 2), "repeats": 1},
    },
}


def gpu_test_files() -> list[str]:
    """The test files that hold ``gpu``-marked tests (relative to the repository root)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(encoding="utf-8"))


def junit_results(path: Path) -> dict[str, Any]:
    """Per test case of a JUnit XML file: outcome (passed / failed / error / skipped), seconds
    and, unless passed, pytest's message; and the counts per outcome."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (el.get("message") or "")[:2000]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "cases": cases}


def gpu_tests(rehearsal: bool) -> dict[str, Any]:
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *files]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, timeout=3600)
        out = {"files": files, "pytest_exit": proc.returncode, "seconds": time.perf_counter() - t0}
        if xml.exists():
            out.update(junit_results(xml))
    return out


def gpu_scd(rehearsal: bool) -> dict[str, Any]:
    from tests.benchmarks import bench_gpu_scd  # reads its sizes from the environment

    return bench_gpu_scd.main()


def allreduce(rehearsal: bool) -> dict[str, Any]:
    from tests.benchmarks.bench_allreduce import measure

    return measure(**SIZES["allreduce"]["rehearsal" if rehearsal else "device"])


def threads(rehearsal: bool) -> dict[str, Any]:
    from tests.benchmarks import bench_threads

    size = dict(SIZES["threads"]["rehearsal" if rehearsal else "device"])
    counts = size.pop("counts") or bench_threads.default_threads()
    fig = bench_threads.measure(counts=counts, **size)
    bench_threads._print(fig)
    return fig


STEPS = {"gpu_tests": gpu_tests, "gpu_scd": gpu_scd, "allreduce": allreduce, "threads": threads}


def environment(name: str, rehearsal: bool) -> dict[str, str]:
    """The environment variables a step's sizes set (``SIZES`` entries named ``TERASCALE_*``)."""
    size = SIZES.get(name, {}).get("rehearsal" if rehearsal else "device", {})
    return {k: str(v) for k, v in size.items() if k.startswith("TERASCALE_")}


def write_json(path: Path, figures: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1, default=float) + "\n")
    tmp.replace(path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.device.steps")
    ap.add_argument("name", choices=sorted(STEPS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rehearsal", action="store_true")
    args = ap.parse_args(argv)
    os.environ.update(environment(args.name, args.rehearsal))
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.setswitchinterval(1e-5)  # the simulator polls its threads: a short GIL slice is ~20x faster
    figures = STEPS[args.name](args.rehearsal)
    import terascale.solvers

    figures["terascale_from"] = str(Path(terascale.solvers.__file__).parent)  # the installed copy?
    write_json(args.out, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
