"""The scale benchmark's fault drill (issue 32 item 5, ``--fault``): SIGKILL one training rank
in the middle of a late pass, and check the job's recovery against the undisturbed run.

:class:`Killer` watches the fault run's progress file (``CKPT/run-*/_progress.json``, rank 0
writes it after every pass, with the pass's own seconds) from a thread of the benchmark. Once
it shows pass ``at_pass`` done, it waits half a pass (the middle of the next one) and sends
SIGKILL to the training rank's Python process: the pyspark worker under this benchmark's
process tree with the largest resident set (a rank holds its shard and the model; the idle
workers hold neither). The driver then runs a new barrier attempt, which resumes from the last
checkpoint (``jobs.checkpoint``); the run must end with the undisturbed run's model, bit for bit.

:func:`compare` gives the figures: where the kill landed, the attempts, whether the weights
files and the intercept are the same bytes, and the time lost (fault run's ``train_seconds``
minus the undisturbed run's) in seconds and in passes of the undisturbed run (its median pass).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from tests.benchmarks.proc_watch import classify, descendants, scan, status


def _worker_rss(root: int) -> list[tuple[int, int]]:
    """(rss bytes, pid) of every pyspark Python worker under ``root``."""
    ppid = {pid: parent for pid, (parent, _) in scan().items()}
    out, kinds = [], {}
    for pid in descendants(root, ppid):  # parents before children: a parent's kind is known
        try:
            cmd = [c.decode(errors="replace") for c in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if c]
        except OSError:
            continue
        kinds[pid] = classify(cmd, kinds.get(ppid.get(pid)))
        st = status(pid)
        if kinds[pid] == "python_worker" and st is not None:
            out.append((st["rss"], pid))
    return out


class Killer:
    """Kills the largest training rank once pass ``at_pass`` is done (see the module docstring)."""

    def __init__(self, checkpoint_dir: Path, at_pass: int, root: int | None = None, poll_s: float = 0.2):
        self.dir, self.at_pass, self.root, self.poll_s = checkpoint_dir, at_pass, root or os.getpid(), poll_s
        self.record: dict = {"at_pass": at_pass, "killed": False}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="scale-fault", daemon=True)
        self._t0 = time.perf_counter()

    def __enter__(self) -> Killer:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(30)

    def _progress(self) -> dict | None:
        for f in self.dir.glob("run-*/_progress.json"):
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            rec = self._progress()
            if rec is None or int(rec.get("pass") or 0) < self.at_pass:
                continue
            half = 0.5 * float(rec.get("pass_s") or 0.0)
            if self._stop.wait(half):
                return
            workers = sorted(_worker_rss(self.root), reverse=True)
            if not workers:
                self.record["why_not"] = "no pyspark worker found under the benchmark"
                return
            rss, pid = workers[0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                self.record["why_not"] = f"worker {pid} had already exited"
                return
            self.record.update(killed=True, pid=pid, rss_bytes=rss, pass_done=int(rec["pass"]),
                               waited_s=half, at_s=time.perf_counter() - self._t0)
            return


def _digest(model: Path) -> dict:
    """sha256 of the model's weights files, and its intercept."""
    files = sorted(p for p in model.iterdir() if p.name.startswith("weights"))
    meta = json.loads((model / "metadata.json").read_text())
    return {"files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
            "intercept": meta.get("intercept")}


def compare(undisturbed: Path, faulted: Path, killer: dict) -> dict:
    """The drill's figures (module docstring)."""
    a, b = (json.loads((m / "metadata.json").read_text()) for m in (undisturbed, faulted))
    passes = [float(y["elapsed_s"]) - float(x["elapsed_s"]) for x, y in zip(a["history"], a["history"][1:], strict=False)]
    pass_s = statistics.median(passes) if passes else None
    lost = float(b["train_seconds"]) - float(a["train_seconds"])
    return {
        **killer,
        "attempts": len(b.get("attempts", [])),
        "same_bits": _digest(undisturbed) == _digest(faulted),
        "same_history_length": len(a["history"]) == len(b["history"]),
        "objective": [a.get("objective"), b.get("objective")],
        "train_seconds": [float(a["train_seconds"]), float(b["train_seconds"])],
        "time_lost_s": lost,
        "median_pass_s": pass_s,
        "time_lost_passes": lost / pass_s if pass_s else None,
    }
