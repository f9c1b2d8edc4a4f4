"""Training progress on the driver's console: pass, rows, objective, ETA.

Two sources, both already there for other reasons: during pass 1 the tree server's heartbeats
(rows done per shard, which the spares use to find stragglers); after every pass, a small
JSON record that rank 0 writes next to its checkpoints (``write_pass``). A daemon thread on the
driver (:class:`ProgressMonitor`) polls both and shows them: a one-line progress bar redrawn in
place on a terminal, plain log lines otherwise (one per pass, and every ``log_every_s`` during
pass 1), so batch logs under spark-submit or Airflow stay readable.

**The ETA** is for the pass budget (``train.passes``): tolerance or early stopping can end
training sooner, so it is an upper bound and shown as such (``ETA ≤``). Its pass time leaves
the start-up out (Spark's task launch, reading the shard): during pass 1 it is the row rate
between the first heartbeat that counted rows and now; after that, the *steady* pass time
(``steady_pass_s``, rank 0's median, the fastest while there are fewer than 3, over the passes
of the last pass's phase that are not the first of that phase in their step: a step's first
L-BFGS pass takes two evaluations and its curvature pairs, 2.5-4.6x a later pass on the scale
curve), else the last pass's own seconds.
A solver whose passes change kind (``hybrid``: online passes, then L-BFGS) shows no ETA until
it has a steady pass of its last kind: an L-BFGS pass cost 0.12x (1M rows) to 0.37x (100M) an
online pass on the scale curve, so pass 1's time foretells nothing of the rest (it put the ETA
at 3.1x the real time at 1M rows, 1.6x at 100M).

**A regularization path** (``train.l2=auto``) has a budget per step and a number of steps it
rarely runs to the end, so a bound would be n times the run's real length; its line names the
step (``λ step k/n``) and its ETA (``ETA ≈``, "the path, estimated") is an estimate, in
seconds (:meth:`Snapshot.path_seconds_left`): the rest of the current step (step 0, the cold
one: its budget, which it mostly uses, 16-20 of 20 on the scale curve, at the steady pass time;
a warm-started step: the mean seconds of the warm steps done, else ``WARM_STEP_COST`` steady
passes, less its time so far), then the steps the path's stopping rule will still run if the
best step so far stays the best (``PATIENCE`` after it), each as a warm step. A warm step's
passes are fewer but dearer than step 0's (7-11 passes costing 9.6-15.7 of step 0's on the
scale curve, 1M-10M rows: its first pass costs 2.5-4.6). Rank 0 writes the steps done (passes,
seconds, held-out loss) and whether the current step is over into the progress file; the bar's
fraction counts passes (:meth:`Snapshot.path_passes_left`).
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
from terascale.solvers.regpath import PATIENCE, choose

log = logging.getLogger("terascale.train")

FILE = "_progress.json"
#: passes of a warm-started path step before any has run (the scale curve, 1M-100M rows: 5-11)
WARM_STEP_PASSES = 7
#: ... and its seconds in steady passes of step 0 (the scale curve, 1M-10M rows: 9.6-15.7)
WARM_STEP_COST = 12.0


def steady_pass_s(history: list[dict]) -> float | None:
    """The median seconds of the passes of the last pass's phase that are not the first pass of
    that phase in their step (a path's step, else the run); None when there is none yet. Fewer
    than 3 such passes: the fastest, since what happens beside a pass (a checkpoint's write, a
    busy neighbour) only slows it: at 100M rows a checkpointed pass took 15.3 s against 8-9."""
    if not history:
        return None
    phase, seen, times, before = history[-1].get("phase"), set(), [], 0.0
    for e in history:
        t = e.get("elapsed_s")
        if t is None:
            return None
        key = (e.get("path_step"), e.get("phase"))
        if e.get("phase") == phase and key in seen:
            times.append(t - before)
        seen.add(key)
        before = t
    if not times:
        return None
    times.sort()
    if len(times) < 3:
        return times[0]
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def write_pass(directory: str, state: dict, tag: str = "") -> None:
    """Rank 0, after a pass: the pass number, its history entry's numbers, atomically (a
    temporary name unique to the writer, ``tag`` naming its attempt, so a lingering task of an
    older attempt never shares one with the new attempt's rank 0)."""
    history = state.get("history") or []
    last = history[-1] if history else {}
    before = history[-2].get("elapsed_s") if len(history) > 1 else 0.0
    fsutil.makedirs(directory)
    body = {
        "pass": int(state.get("pass", len(history))),
        "objective": last.get("objective"),
        "holdout_loss": last.get("holdout_loss"),
        "elapsed_s": last.get("elapsed_s"),
        # the last pass's own seconds (rank 0's clock): the ETA's pass time, start-up left out
        "pass_s": last["elapsed_s"] - before if last.get("elapsed_s") is not None and before is not None else None,
        "phase": last.get("phase"),
        "steady_pass_s": steady_pass_s(history),
        "step_elapsed_s": last.get("step_elapsed_s"),  # a path: the seconds of the current step so far
        "path_step": last.get("path_step"),  # a regularization path: the step, its pass, the steps
        "step_pass": last.get("step_pass"),
        "path_steps": len(state["path_values"]) if state.get("path_values") else None,
        # a path: the steps done (their passes and held-out loss), and whether this pass ended its step
        "path_records": [{"passes": r.get("passes"), "seconds": r.get("seconds"), "holdout_loss": r.get("holdout_loss")}
                         for r in state.get("path_records") or []],
        "step_over": state.get("path_step_stop") is not None,
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

    passes: int  # the pass budget (a path: every step's)
    rows: int  # training rows in one pass (all shards)
    done_pass: int = 0  # completed passes
    rows_done: int = 0  # rows of pass 1 done so far (all shards)
    objective: float | None = None
    holdout_loss: float | None = None
    elapsed_s: float = 0.0  # since training started
    attempt: int = 1
    step_passes: int = 0  # a path: each step's budget (0: no path)
    pass_s: float | None = None  # the last completed pass's seconds (rank 0's)
    path_step: int | None = None  # a path: the step of the last completed pass (0-based)
    step_pass: int | None = None  # ... and its pass within the step
    path_steps: int | None = None
    path_records: list[dict] | None = None  # a path: the steps done before the current one
    step_over: bool = False  # a path: the last completed pass ended its step
    phase: str | None = None  # the last completed pass's phase (solvers.catalogue)
    steady_pass_s: float | None = None  # see steady_pass_s()
    step_elapsed_s: float | None = None  # a path: the current step's seconds so far
    #: a solver with several phases: its first (whose passes' time says nothing of the rest)
    first_phase: str | None = None
    #: pass 1's first heartbeat that counted rows: (elapsed_s, rows_done) then, the rate's start
    rate_start: tuple[float, int] | None = None

    def note_rows(self, rows_done: int) -> None:
        """Pass 1's rows so far (from the heartbeats) at ``elapsed_s``."""
        self.rows_done = max(self.rows_done, rows_done)
        if self.rate_start is None and self.rows_done > 0:
            self.rate_start = (self.elapsed_s, self.rows_done)

    def _pass1_rate(self) -> float | None:
        """Rows per second of pass 1 since its first counted rows (start-up excluded)."""
        if self.rate_start is None:
            return None
        t0, r0 = self.rate_start
        if self.rows_done <= r0 or self.elapsed_s <= t0:
            return None
        return (self.rows_done - r0) / (self.elapsed_s - t0)

    def _passes_left(self) -> int:
        """Passes still in the run's budget (a run with one λ: the ETA's bound)."""
        return max(self.passes - self.done_pass, 0)

    def path_passes_left(self) -> float:
        """A path's passes still to run, estimated (module docstring): the current step's rest,
        then the steps its stopping rule runs after the best so far, as warm steps."""
        warm = [float(r["passes"]) for r in (self.path_records or [])[1:] if r.get("passes")]
        per_warm = sum(warm) / len(warm) if warm else float(WARM_STEP_PASSES)
        sp = self.step_pass or 0
        return self._path_left(per_warm, max(self.step_passes - sp, 0), max(per_warm - sp, 1.0))

    def _path(self) -> bool:
        return bool(self.step_passes)

    def _steps_after(self, done: list[dict], k: int) -> int:
        """Steps the stopping rule still runs after step ``k`` if the best of ``done`` stays the best."""
        best = choose(done) if done else 0
        total = min(best + PATIENCE + 1, self.path_steps or best + PATIENCE + 1)
        return max(total - (k + 1), 0)

    def path_seconds_left(self, steady: float) -> float:
        """A path's seconds still to run, estimated (module docstring); ``steady``: the steady
        pass time."""
        warm = [float(r["seconds"]) for r in (self.path_records or [])[1:] if r.get("seconds")]
        per_warm = sum(warm) / len(warm) if warm else WARM_STEP_COST * steady
        sp = self.step_pass or 0
        return self._path_left(per_warm, max(self.step_passes - sp, 0) * steady,
                               max(per_warm - (self.step_elapsed_s or 0.0), steady))

    def _path_left(self, per_warm: float, step0_rest: float, warm_rest: float) -> float:
        """What is left of a path in one unit (passes or seconds): the current step's rest
        (``step0_rest`` in step 0, ``warm_rest`` in a warm step, at least its next pass: the step
        is not over), or, when this pass ended its step, a warm step for the next one; then the
        steps the stopping rule runs after the best so far, ``per_warm`` each."""
        done = list(self.path_records or [])
        k = self.path_step or 0
        if self.step_over:  # the step ended with this pass: it is one of the steps done
            done.append({"passes": self.step_pass or 0, "holdout_loss": self.holdout_loss})
            k, this = k + 1, per_warm  # the next step, not begun
        else:
            this = step0_rest if k == 0 else warm_rest
        return this + self._steps_after(done, k) * per_warm

    def eta_s(self) -> float | None:
        steady = self.steady_pass_s
        if self.first_phase is not None and (self.done_pass == 0 or self.phase == self.first_phase or steady is None):
            return None  # no steady pass of the kind that follows has been timed yet
        if self.done_pass >= 1:
            per_pass = steady or self.pass_s or (self.elapsed_s / self.done_pass if self.elapsed_s > 0 else None)
            if per_pass is None:
                return None
            return self.path_seconds_left(per_pass) if self._path() else per_pass * self._passes_left()
        rate = self._pass1_rate()
        if rate and self.rows:  # pass 1: the rest of it, then the budget's (or the path's) other passes
            others = (self.path_passes_left() - 1) if self._path() else (self.passes - 1)
            return max(self.rows - self.rows_done, 0) / rate + max(others, 0) * self.rows / rate
        return None

    def fraction(self) -> float:
        within = 0.0 if self.done_pass or not self.rows else min(self.rows_done / self.rows, 1.0)
        if self._path():  # the passes done against those done and still to run, estimated
            done = self.done_pass + within
            return min(done / max(done + self.path_passes_left() - within, 1e-9), 1.0)
        return min((self.done_pass + within) / max(self.passes, 1), 1.0)

    def text(self) -> str:
        budget = self.step_passes or self.passes
        if self.done_pass == 0:  # pass 1 running: its rows so far
            parts = [f"pass 1/{budget}", f"rows {self.rows_done:,}/{self.rows:,}"]
        elif self.step_passes and self.path_step is not None:  # a path: the step and its pass
            parts = [f"λ step {self.path_step + 1}/{self.path_steps or '?'}",
                     f"pass {self.step_pass}/{self.step_passes} done ({self.done_pass} in all)",
                     f"rows {self.rows:,}/pass"]
        else:  # the numbers of the last completed pass
            parts = [f"pass {self.done_pass}/{budget} done", f"rows {self.rows:,}/pass"]
        if self.objective is not None:
            parts.append(f"objective {self.objective:.6g}")
        if self.holdout_loss is not None:
            parts.append(f"held-out {self.holdout_loss:.6g}")
        eta = self.eta_s()
        parts.append(f"elapsed {_duration(self.elapsed_s)}")
        if eta is not None:
            parts.append(f"ETA ≈ {_duration(eta)} (the path, estimated)" if self._path() else f"ETA ≤ {_duration(eta)}")
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
                 interval_s: float = 1.0, log_every_s: float = 30.0, tty: bool | None = None,
                 step_passes: int = 0, phases: tuple[str, ...] = ()) -> None:
        """``passes``: the run's pass budget; ``step_passes``: a regularization path's budget
        per step (0: the run is not a path); ``phases``: the solver's (``SolverSpec.phases``)."""
        self.dir = checkpoint_dir
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s, self.log_every_s = interval_s, log_every_s
        self.snap = Snapshot(passes=max(int(passes), 1), rows=int(rows), step_passes=int(step_passes),
                             first_phase=phases[0] if len(phases) > 1 else None)
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
        self.snap.rate_start = None

    def poll(self) -> Snapshot:
        s = self.snap
        rec = read_pass(self.dir) if self.dir else None
        if rec is not None and int(rec.get("pass", 0)) >= s.done_pass:
            s.done_pass = int(rec["pass"])
            s.objective, s.holdout_loss = rec.get("objective"), rec.get("holdout_loss")
            s.pass_s, s.path_step = rec.get("pass_s"), rec.get("path_step")
            s.step_pass, s.path_steps = rec.get("step_pass"), rec.get("path_steps")
            s.path_records, s.step_over = rec.get("path_records"), bool(rec.get("step_over"))
            s.phase, s.steady_pass_s, s.step_elapsed_s = rec.get("phase"), rec.get("steady_pass_s"), rec.get("step_elapsed_s")
        s.elapsed_s = time.monotonic() - self._t0
        server = self._server
        if server is not None and s.done_pass == 0:
            best: dict[int, int] = {}
            for r in server.progress():
                best[r.shard] = max(best.get(r.shard, 0), r.rows_done)
            s.note_rows(sum(best.values()))
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
