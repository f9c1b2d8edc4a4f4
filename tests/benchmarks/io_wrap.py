"""Run one command and write the I/O and CPU time of its whole process tree as JSON.

    python tests/benchmarks/io_wrap.py OUT.json COMMAND [ARG ...]

Linux adds a process's I/O counters (``/proc/<pid>/io``) and CPU times to its parent's when the
parent reaps it, and so on up. This wrapper makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): a descendant whose parent exits without waiting for it (a
``terascale`` process leaves its Spark JVM to exit after it; the JVM leaves its Python daemon)
is re-parented here instead of to init, and reaped here. Once the command has exited and every
descendant is reaped (for at most ``ORPHAN_WAIT_S`` after the command), this process's counters
hold those of every process of the tree, however briefly it lived, and nothing twice. (Summing
the live processes' counters instead would count a reaped child again in its parent, and miss
one that lived between two samples.) The wrapper does nothing else, so its counters after, less
those before, are the tree's, except for the children of a process that ignores SIGCHLD: the
kernel reaps those itself and drops their counters (pyspark's daemon and its Python workers;
``proc_watch.TreeWatcher.auto_reaped`` adds them from its samples).

OUT.json: ``rchar`` / ``wchar`` (bytes through read/write system calls, page cache included),
``read_bytes`` / ``write_bytes`` (bytes the tree caused to be fetched from / sent to the
storage layer: page-cache hits are not reads; a write counts when its page is dirtied),
``cpu_user_s`` / ``cpu_system_s`` (the tree's CPU time, ``getrusage(RUSAGE_CHILDREN)``),
``returncode``, ``command_s`` (until the command itself exited) and ``orphans_s`` (the wait for
its orphans after), ``reaped_pids`` (the command's and the orphans') and ``unreaped`` (pids still alive after the wait: their
counters are missing). stdin, stdout and stderr pass through. The exit status is the command's.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time

FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")
PR_SET_CHILD_SUBREAPER = 36
ORPHAN_WAIT_S = 60.0


def own_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        rows = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return {k: int(rows[k]) for k in FIELDS}


def _children() -> list[int]:
    me = os.getpid()
    out = []
    for t in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def reap_orphans(deadline: float) -> tuple[list[int], list[int]]:
    """Reap every remaining descendant until none is left or ``deadline``: (reaped, unreaped)."""
    reaped = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped, []
        if pid:
            reaped.append(pid)
        elif time.monotonic() > deadline:
            return reaped, _children()
        else:
            time.sleep(0.02)


def main(argv: list[str]) -> int:
    out, cmd = argv[0], argv[1:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    before = own_io()
    t0 = time.monotonic()
    child = subprocess.Popen(cmd)
    rc = child.wait()
    command_s = time.monotonic() - t0
    reaped, unreaped = reap_orphans(time.monotonic() + ORPHAN_WAIT_S)
    after = own_io()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    body = {k: after[k] - before[k] for k in FIELDS}
    body.update({"cpu_user_s": ru.ru_utime, "cpu_system_s": ru.ru_stime, "returncode": rc,
                 "reaped_pids": [child.pid, *reaped], "unreaped": unreaped, "command_s": command_s,
                 "orphans_s": time.monotonic() - t0 - command_s})
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, out)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
