"""Driver console progress: pass-1 rows from a real tree server's heartbeats, later passes from
rank 0's progress file; a bar on a terminal, log lines otherwise; the ETA arithmetic."""

from __future__ import annotations

import io
import logging
import time

import pytest

from terascale.allreduce.client import ServerSession
from terascale.allreduce.protocol import new_key
from terascale.allreduce.server import TreeServer
from terascale.jobs.progress import (
    ProgressMonitor,
    Snapshot,
    bar,
    read_pass,
    steady_pass_s,
    write_pass,
)


def _state(pass_no: int, objective: float, holdout: float | None = None) -> dict:
    history = [{"pass": i + 1, "objective": objective + (pass_no - i - 1), "elapsed_s": float(i + 1)}
               for i in range(pass_no)]
    if holdout is not None:
        history[-1]["holdout_loss"] = holdout
    return {"pass": pass_no, "history": history}


def test_snapshot_eta_and_text():
    s = Snapshot(passes=10, rows=1000)
    s.elapsed_s = 30.0  # start-up: Spark, the shard read; no rows counted yet, no ETA
    s.note_rows(0)
    assert s.eta_s() is None
    s.elapsed_s = 32.0
    s.note_rows(100)  # the first counted rows: where the rate starts, still no ETA
    assert s.eta_s() is None
    s.elapsed_s = 36.0
    s.note_rows(500)
    # 400 rows in 4 s: 10 s a pass; 500 rows to go (5 s) and 9 more passes (90 s)
    assert s.eta_s() == pytest.approx(95.0)
    assert s.fraction() == pytest.approx(0.05)
    assert s.text() == "pass 1/10, rows 500/1,000, elapsed 0:36, ETA ≤ 1:35"
    s = Snapshot(passes=10, rows=1000, done_pass=4, objective=0.41234567, holdout_loss=0.5,
                 elapsed_s=40.0, attempt=2, pass_s=8.0)
    assert s.eta_s() == pytest.approx(48.0)  # the last pass's own seconds, not elapsed / passes
    assert s.fraction() == pytest.approx(0.4)
    assert s.text() == ("pass 4/10 done, rows 1,000/pass, objective 0.412346, held-out 0.5, elapsed 0:40, "
                        "ETA ≤ 0:48, attempt 2")
    assert Snapshot(passes=10, rows=1, done_pass=4, elapsed_s=40.0).eta_s() == pytest.approx(60.0)
    done = Snapshot(passes=3, rows=10, done_pass=3, elapsed_s=3725.0)
    assert done.text().startswith("pass 3/3 done") and "elapsed 1:02:05" in done.text()
    assert Snapshot(passes=3, rows=10).eta_s() is None
    assert bar(0.5, width=10) == "[#####-----]  50.0%"


def test_a_paths_eta_estimates_the_passes_its_stopping_rule_will_run():
    # l2=auto, 8 steps of 20 passes; step 0 (cold) runs to its budget, then warm steps
    s = Snapshot(passes=160, rows=1000, step_passes=20, done_pass=2, path_step=0, step_pass=2,
                 path_steps=8, pass_s=2.0, elapsed_s=50.0)
    # passes (the bar): the rest of step 0 (18), then PATIENCE = 2 steps after it (the best so far) of 7
    assert s.path_passes_left() == pytest.approx(18 + 2 * 7)
    assert s.fraction() == pytest.approx(2 / (2 + 32))
    # seconds (the ETA): 18 passes of 2 s, then 2 warm steps of WARM_STEP_COST = 12 passes' time
    assert s.path_seconds_left(2.0) == pytest.approx(36 + 2 * 24) and s.eta_s() == pytest.approx(84.0)
    assert s.text() == ("λ step 1/8, pass 2/20 done (2 in all), rows 1,000/pass, elapsed 0:50, "
                        "ETA ≈ 1:24 (the path, estimated)")
    s.steady_pass_s = 1.5  # a steady pass time known: it, not the last pass's
    assert s.eta_s() == pytest.approx(18 * 1.5 + 2 * 18.0)
    # step 0 over with its 20th pass: two more steps (the patience after step 0, the best so far)
    s.done_pass, s.step_pass, s.step_over, s.holdout_loss = 20, 20, True, 0.48
    assert s.path_passes_left() == pytest.approx(2 * 7) and s.eta_s() == pytest.approx(2 * 18.0)
    # inside step 2 (index 1 won: 0.47 < 0.48; it took 5 passes, 9 s): the rest of it, 1 more
    s = Snapshot(passes=160, rows=1000, step_passes=20, done_pass=28, path_step=2, step_pass=3, path_steps=8,
                 pass_s=2.0, steady_pass_s=1.0, step_elapsed_s=4.0,
                 path_records=[{"passes": 20, "seconds": 20.0, "holdout_loss": 0.48},
                               {"passes": 5, "seconds": 9.0, "holdout_loss": 0.47}])
    assert s.path_passes_left() == pytest.approx((5 - 3) + 1 * 5)
    assert s.eta_s() == pytest.approx((9.0 - 4.0) + 1 * 9.0)
    s.step_pass, s.step_elapsed_s = 9, 12.0  # past the warm mean and not over: at least one more pass
    assert s.path_passes_left() == pytest.approx(1 + 5) and s.eta_s() == pytest.approx(1.0 + 9.0)
    # the patience spent after the best (step 0): the current step is the path's last
    s.path_records = [{"passes": 20, "seconds": 20.0, "holdout_loss": 0.47},
                      {"passes": 5, "seconds": 9.0, "holdout_loss": 0.48}]
    s.step_pass, s.step_elapsed_s = 2, 3.0
    assert s.path_passes_left() == pytest.approx(5 - 2) and s.eta_s() == pytest.approx(9.0 - 3.0)
    first = Snapshot(passes=160, rows=1000, step_passes=20, elapsed_s=10.0)
    first.note_rows(100)
    first.elapsed_s = 11.0
    first.note_rows(200)  # 100 rows/s: 8 s to the end of pass 1, then 19 + 2 * 7 more passes
    assert first.eta_s() == pytest.approx(8.0 + 330.0) and first.text().startswith("pass 1/20,")


def test_the_steady_pass_time_leaves_out_each_steps_first_pass_of_a_phase():
    def hist(*entries):  # (phase, step, seconds of the pass)
        out, t = [], 0.0
        for i, (phase, step, secs) in enumerate(entries):
            t += secs
            out.append({"pass": i + 1, "phase": phase, "path_step": step, "elapsed_s": t})
        return out

    assert steady_pass_s([]) is None
    assert steady_pass_s(hist(("online", 0, 9.0))) is None
    assert steady_pass_s(hist(("online", 0, 9.0), ("lbfgs", 0, 3.0))) is None  # the first L-BFGS pass only
    assert steady_pass_s(hist(("online", 0, 9.0), ("lbfgs", 0, 3.0), ("lbfgs", 0, 1.0))) == pytest.approx(1.0)
    h = hist(("online", 0, 9.0), ("lbfgs", 0, 3.0), ("lbfgs", 0, 1.0), ("lbfgs", 0, 2.0),
             ("lbfgs", 1, 4.0), ("lbfgs", 1, 1.5))  # step 1's first pass left out too
    assert steady_pass_s(h) == pytest.approx(1.5)  # the median of 1.0, 2.0, 1.5
    # fewer than 3: the fastest (a checkpointed pass is slower, never faster)
    assert steady_pass_s(hist(("online", 0, 9.0), ("lbfgs", 0, 3.0), ("lbfgs", 0, 1.0), ("lbfgs", 0, 1.8))) == 1.0
    assert steady_pass_s(hist(("online", None, 5.0), ("online", None, 4.0), ("online", None, 2.0),
                              ("online", None, 3.0))) == pytest.approx(3.0)


def test_a_solver_whose_passes_change_kind_shows_no_eta_until_a_steady_pass_of_the_later_kind(tmp_path):
    # hybrid: an online pass's time says nothing of the L-BFGS passes after it
    d = str(tmp_path / "ckpt")
    mon = ProgressMonitor(d, passes=10, rows=1000, stream=io.StringIO(), tty=False, phases=("online", "lbfgs"))
    s = mon.snap
    s.elapsed_s = 10.0
    s.note_rows(100)
    s.elapsed_s = 11.0
    s.note_rows(200)  # pass 1 running: a rate, but of an online pass
    assert s.eta_s() is None and "ETA" not in s.text()
    phases = ["online", "lbfgs", "lbfgs"]
    for n, seen in ((1, None), (2, None), (3, 7 * 0.25)):
        state = _state(n, 0.5)
        for e, phase in zip(state["history"], phases[:n], strict=True):
            e["phase"] = phase
        if n == 3:
            state["history"][2]["elapsed_s"] = 2.25  # the second L-BFGS pass: 0.25 s, its first 1 s
        write_pass(d, state)
        assert read_pass(d)["phase"] == phases[n - 1]
        eta = mon.poll().eta_s()
        assert eta == (None if seen is None else pytest.approx(seen)), n
    # one phase (online): pass 1's own time foretells the rest
    state = _state(1, 0.3)
    state["history"][0]["phase"] = "online"
    write_pass(d, state)
    one = ProgressMonitor(d, passes=10, rows=1000, stream=io.StringIO(), tty=False, phases=("online",))
    assert one.poll().eta_s() == pytest.approx(9 * 1.0)


def test_progress_file_roundtrip(tmp_path):
    d = str(tmp_path / "ckpt")
    assert read_pass(d) is None
    write_pass(d, _state(3, 0.25, holdout=0.3))
    rec = read_pass(d)
    assert (rec["pass"], rec["objective"], rec["holdout_loss"], rec["elapsed_s"]) == (3, 0.25, 0.3, 3.0)
    assert (rec["pass_s"], rec["path_step"], rec["step_pass"], rec["path_steps"]) == (1.0, None, None, None)
    path = _state(5, 0.5)  # a path's state: global history entries carry the step and its pass
    for i, e in enumerate(path["history"]):
        e.update(path_step=i // 3, step_pass=i % 3 + 1, elapsed_s=2.0 * (i + 1))
    write_pass(d, {**path, "path_values": [1e-4, 2.7e-5, 7.2e-6]})
    rec = read_pass(d)
    assert (rec["pass"], rec["pass_s"], rec["path_step"], rec["step_pass"], rec["path_steps"]) == (5, 2.0, 1, 2, 3)


def test_monitor_shows_pass1_heartbeats_then_passes_as_log_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="terascale.train")
    d = str(tmp_path / "ckpt")
    key = new_key()
    with TreeServer(2, key, startup_timeout_s=30) as server:
        sessions = [ServerSession.connect(server.address, key, shard=s, attempt_id=f"w{s}-a0",
                                          connect_timeout_s=5) for s in (0, 1)]
        try:
            mon = ProgressMonitor(d, passes=5, rows=1000, stream=io.StringIO(), tty=False, log_every_s=0)
            mon.attach(server, 0)
            sessions[0].report_progress(300)
            sessions[1].report_progress(200)
            deadline = time.monotonic() + 10
            while mon.poll().rows_done < 500:
                assert time.monotonic() < deadline, "heartbeats never reached the monitor"
                time.sleep(0.05)
        finally:
            for s in sessions:
                s.close()
    assert "progress: pass 1/5, rows 500/1,000" in caplog.text
    write_pass(d, _state(2, 0.75))
    snap = mon.poll()
    assert (snap.done_pass, snap.objective) == (2, 0.75)
    assert "progress: pass 2/5 done, rows 1,000/pass, objective 0.75" in caplog.text
    n = caplog.text.count("progress:")
    mon.poll()  # nothing new: no new log line
    assert caplog.text.count("progress:") == n


def test_monitor_draws_a_bar_in_place_on_a_terminal(tmp_path):
    d = str(tmp_path / "ckpt")
    out = io.StringIO()
    with ProgressMonitor(d, passes=4, rows=100, stream=out, tty=True, interval_s=0.05) as mon:
        write_pass(d, _state(1, 0.5))
        deadline = time.monotonic() + 10
        while mon.snap.done_pass < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        write_pass(d, _state(4, 0.125))
    text = out.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and "\n" not in text[:-1]
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("[########################] 100.0% pass 4/4 done") and "objective 0.125" in last
