"""One command, measured: wall time, its tree's peak RSS per process kind, I/O, CPU, lowest disk.

:func:`run_measured` starts ``io_wrap.py`` (the tree's I/O and CPU, exact for every process
that an ancestor reaps: see its docstring) around the command, and a
:class:`~tests.benchmarks.proc_watch.TreeWatcher` on the wrapper's tree (peak RSS per process,
the lowest free disk of ``disk_path``, and the last seen I/O and CPU of the processes whose
counters the kernel drops: pyspark's Python workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmarks.proc_watch import IO_FIELDS, TreeWatcher

IO_WRAP = Path(__file__).with_name("io_wrap.py")


def run_measured(cmd: list[str], *, disk_path: str, io_json: Path, stdout, stderr, stdin=None,
                 cwd: str | None = None, env: dict | None = None, interval: float = 0.2) -> dict:
    """Run ``cmd`` to its end; its figures: ``returncode``, ``wall_s`` (until every process of the
    tree exited), ``command_s`` (until the command itself did), ``cpu_s`` (user + system of the
    whole tree), ``io`` (``rchar``, ``wchar``, ``read_bytes``, ``write_bytes``), both exact from
    the wrapper plus, from the samples, those of processes the kernel reaped (``auto_reaped``),
    ``orphans_s`` / ``orphans_reaped`` / ``unreaped`` (see ``io_wrap.py``), ``rss_peak_bytes`` by process kind
    (and ``processes``, the largest), ``tree_rss_peak_bytes``, ``min_free_disk_bytes`` (the
    lowest over the samples and the start) and ``free_disk_before_bytes``."""
    st = os.statvfs(disk_path)
    free_before = st.f_bavail * st.f_frsize
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(IO_WRAP), str(io_json), *cmd], stdin=stdin, stdout=stdout,
                            stderr=stderr, cwd=cwd, env=env)
    watcher = TreeWatcher(proc.pid, disk_path, interval).start()
    try:
        rc = proc.wait()
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.perf_counter() - t0
    io = json.loads(io_json.read_text())
    io_json.unlink()
    lost = watcher.auto_reaped(set(io["reaped_pids"]))
    return {
        "returncode": rc,
        "wall_s": wall,
        "cpu_s": io["cpu_user_s"] + io["cpu_system_s"] + lost["cpu_s"],
        "io": {k: io[k] + lost[k] for k in IO_FIELDS},
        "auto_reaped": lost,
        "command_s": io["command_s"], "orphans_s": io["orphans_s"],
        "orphans_reaped": len(io["reaped_pids"]) - 1, "unreaped": io["unreaped"],
        "load_avg_after": list(os.getloadavg()),
        "free_disk_before_bytes": free_before,
        **watcher.summary(),
    }
