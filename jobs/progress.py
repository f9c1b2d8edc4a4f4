"""Training progress on the driver's console: pass, rows, objective, ETA.

Two sources, both already there for other reasons: during pass 1 the tree server's heartbeats
(rows done per shard, which the spares use to find stragglers); after every pass, a small
JSON record that rank 0 writes next to its checkpoints (``write_pass``). A daemon thread on the
driver (:class:`ProgressMonitor`) polls both and shows them: a one-line progress bar redrawn in
place on a terminal, plain log lines otherwise (one per pass, and every ``log_every_s`` during
pass 1), so batch logs under spark-submit or Airflow stay readable.

The ETA is for the pass budget (``train.passes``): tolerance or early stopping can end
training sooner, so it is an upper bound and shown as such.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from terascale.pipeline import durable, fsutil

log = logging.getLogger("terascale.train")

FILE = "_progress.json"


def write_pass(directory: str, state: dict, tag: str = "") -> None:
    """Rank 0, after a pass: the pass number, its history entry's numbers, atomically (a
    temporary name unique to the writer, ``tag`` naming its attempt, so a lingering task of an
    older attempt never shares one with the new attempt's rank 0)."""
    history = state.get("history") or []
    last = history[-1] if history else {}
    fsutil.makedirs(directory)
    body = {
        "pass": int(state.get("pass", len(history))),
        "objective": last.get("objective"),
        "holdout_loss": last.get("holdout_loss"),
        "elapsed_s": last.get("elapsed_s"),
        "written": time.time(),
    }
    durable.write_bytes(fsutil.join(directory, FILE), json.dumps(body, indent=2).encode() + b"\n", tag=tag)


def read_pass(directory: str) -> dict | None:
    try:
        return fsutil.read_json(fsutil.join(directory, FILE))
    except (OSError, ValueError):
        return None  # not written yet, or being replaced


@dataclass
class Snapshot:
    """What the console shows at one moment."""

    passes: int  # the pass budget
    rows: int  # training rows in one pass (all shards)
    done_pass: int = 0  # completed passes
    rows_done: int = 0  # rows of pass 1 done so far (all shards)
    objective: float | None = None
    holdout_loss: float | None = None
    elapsed_s: float = 0.0  # since training started
    attempt: int = 1

    def eta_s(self) -> float | None:
        if self.done_pass >= 1 and self.elapsed_s > 0:
            return self.elapsed_s / self.done_pass * max(self.passes - self.done_pass, 0)
        if self.rows_done > 0 and self.rows and self.elapsed_s > 0:  # pass 1: its row rate
            per_pass = self.elapsed_s * self.rows / self.rows_done
            return per_pass * self.passes - self.elapsed_s
        return None

    def fraction(self) -> float:
        within = 0.0 if self.done_pass or not self.rows else min(self.rows_done / self.rows, 1.0)
        return min((self.done_pass + within) / max(self.passes, 1), 1.0)

    def text(self) -> str:
        if self.done_pass == 0:  # pass 1 running: its rows so far
            parts = [f"pass 1/{self.passes}", f"rows {self.rows_done:,}/{self.rows:,}"]
        else:  # the numbers of the last completed pass
            parts = [f"pass {self.done_pass}/{self.passes} done", f"rows {self.rows:,}/pass"]
        if self.objective is not None:
            parts.append(f"objective {self.objective:.6g}")
        if self.holdout_loss is not None:
            parts.append(f"held-out {self.holdout_loss:.6g}")
        eta = self.eta_s()
        parts.append(f"elapsed {_duration(self.elapsed_s)}")
        if eta is not None:
            parts.append(f"ETA ≤ {_duration(eta)}")
        if self.attempt > 1:
            parts.append(f"attempt {self.attempt}")
        return ", ".join(parts)


def _duration(s: float) -> str:
    s = max(int(round(s)), 0)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def bar(fraction: float, width: int = 24) -> str:
    full = int(round(fraction * width))
    return "[" + "#" * full + "-" * (width - full) + f"] {fraction * 100:5.1f}%"


class ProgressMonitor:
    """Polls the tree server (pass 1) and rank 0's progress file; renders to ``stream``."""

    def __init__(self, checkpoint_dir: str, passes: int, rows: int, stream: TextIO | None = None,
                 interval_s: float = 1.0, log_every_s: float = 30.0, tty: bool | None = None) -> None:
        self.dir = checkpoint_dir
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s, self.log_every_s = interval_s, log_every_s
        self.snap = Snapshot(passes=max(int(passes), 1), rows=int(rows))
        self._server = None
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terascale-progress", daemon=True)
        self._last_text = ""
        self._last_log = 0.0
        self._logged_pass = 0

    def __enter__(self) -> ProgressMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # one last look, never in place of the real outcome
            self._safe_poll()
        if self.tty and self._last_text:
            self.stream.write("\n")
            self.stream.flush()

    def attach(self, server, attempt: int) -> None:
        """A new barrier attempt started with this tree server."""
        self._server = server
        self.snap.attempt = attempt + 1
        self.snap.rows_done = 0

    def poll(self) -> Snapshot:
        s = self.snap
        rec = read_pass(self.dir) if self.dir else None
        if rec is not None and int(rec.get("pass", 0)) >= s.done_pass:
            s.done_pass = int(rec["pass"])
            s.objective, s.holdout_loss = rec.get("objective"), rec.get("holdout_loss")
        server = self._server
        if server is not None and s.done_pass == 0:
            best: dict[int, int] = {}
            for r in server.progress():
                best[r.shard] = max(best.get(r.shard, 0), r.rows_done)
            s.rows_done = max(s.rows_done, sum(best.values()))
        s.elapsed_s = time.monotonic() - self._t0
        self._render()
        return s

    def _render(self) -> None:
        s = self.snap
        text = s.text()
        if self.tty:
            line = f"\r{bar(s.fraction())} {text}"
            pad = max(len(self._last_text) - len(line), 0)
            self.stream.write(line + " " * pad)
            self.stream.flush()
            self._last_text = line
            return
        now = time.monotonic()
        if s.done_pass > self._logged_pass or (s.done_pass == 0 and s.rows_done and now - self._last_log >= self.log_every_s):
            self._logged_pass = s.done_pass
            self._last_log = now
            log.info("progress: %s", text)

    def _safe_poll(self) -> None:
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001 - progress display must never kill training
            log.debug("progress: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_poll()
