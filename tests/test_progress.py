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
from terascale.jobs.progress import ProgressMonitor, Snapshot, bar, read_pass, write_pass


def _state(pass_no: int, objective: float, holdout: float | None = None) -> dict:
    history = [{"pass": i + 1, "objective": objective + (pass_no - i - 1), "elapsed_s": float(i + 1)}
               for i in range(pass_no)]
    if holdout is not None:
        history[-1]["holdout_loss"] = holdout
    return {"pass": pass_no, "history": history}


def test_snapshot_eta_and_text():
    s = Snapshot(passes=10, rows=1000, rows_done=250, elapsed_s=5.0)
    # pass 1 at 250 rows in 5 s: 20 s per pass, 10 passes -> 200 s in all, 195 s to go
    assert s.eta_s() == pytest.approx(195.0)
    assert s.fraction() == pytest.approx(0.025)
    assert s.text() == "pass 1/10, rows 250/1,000, elapsed 0:05, ETA ≤ 3:15"
    s = Snapshot(passes=10, rows=1000, done_pass=4, objective=0.41234567, holdout_loss=0.5,
                 elapsed_s=40.0, attempt=2)
    assert s.eta_s() == pytest.approx(60.0)
    assert s.fraction() == pytest.approx(0.4)
    assert s.text() == ("pass 4/10 done, rows 1,000/pass, objective 0.412346, held-out 0.5, elapsed 0:40, "
                        "ETA ≤ 1:00, attempt 2")
    done = Snapshot(passes=3, rows=10, done_pass=3, elapsed_s=3725.0)
    assert done.text().startswith("pass 3/3 done") and "elapsed 1:02:05" in done.text()
    assert Snapshot(passes=3, rows=10).eta_s() is None
    assert bar(0.5, width=10) == "[#####-----]  50.0%"


def test_progress_file_roundtrip(tmp_path):
    d = str(tmp_path / "ckpt")
    assert read_pass(d) is None
    write_pass(d, _state(3, 0.25, holdout=0.3))
    rec = read_pass(d)
    assert (rec["pass"], rec["objective"], rec["holdout_loss"], rec["elapsed_s"]) == (3, 0.25, 0.3, 3.0)


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
