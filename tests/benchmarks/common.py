"""Shared benchmark helpers: a results folder, JSON output, peak-memory sampling, shared data."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

# Spark's Python workers must run this interpreter (the one with the project installed)
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("TERASCALE_BENCH_RESULTS", ROOT / "bench-results"))


def write_result(name: str, figures: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(figures, indent=2, default=float) + "\n")
    tmp.replace(path)
    return path


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
        stack.extend(_children(p))
    return total


class PeakMemory:
    """Samples the RSS of this process tree (driver, JVM, Python workers) every 50 ms."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.base = tree_rss(os.getpid())

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(os.getpid()))
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def generated_logs(rows: int, files: int, seed: int, positive_rate: float | None = None) -> Path:
    """Generated click logs shared by benchmarks (made once, kept under bench-results/data);
    ``positive_rate``: the generator's, when not its default (0.25)."""
    from terascale.pipeline.generate import generate_clicklogs

    tag = "" if positive_rate is None else f"-ctr{positive_rate:g}"
    d = RESULTS / "data" / f"criteo-{rows}-{files}-{seed}{tag}"
    if not (d / "_truth.json").exists():
        extra = {} if positive_rate is None else {"positive_rate": positive_rate}
        generate_clicklogs(d, rows, files=files, seed=seed, with_prob=True, **extra)
    return d


def terascale_cli() -> list[str]:
    """The ``terascale`` command beside this interpreter (else ``python -m terascale.jobs.cli``)."""
    exe = Path(sys.executable).with_name("terascale")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "terascale.jobs.cli"]


def train_cli(dataset_dir: str, model_dir: str, sets: list[str], what: str, log: Path | None = None) -> tuple[dict, float]:
    """One ``terascale train --overwrite`` in a fresh application (the installed command beside
    this interpreter): (the model's metadata.json, wall seconds); RuntimeError naming ``what``.
    ``log``: also write its stderr (the progress lines) there."""
    import subprocess

    t0 = time.perf_counter()
    r = subprocess.run(terascale_cli() + ["train", "--input", dataset_dir, "--model", model_dir, "--overwrite"]
                       + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if log is not None:
        log.write_text(r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"terascale train ({what}) failed: {r.stderr[-3000:]}")
    return json.loads((Path(model_dir) / "metadata.json").read_text()), wall
