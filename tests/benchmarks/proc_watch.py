"""Watch a process tree from /proc: every process's peak RSS, by kind, and the lowest free disk.

:class:`TreeWatcher` samples every ``interval`` seconds (0.2 s) in a daemon thread. Each sample
lists every process of the machine (``/proc/<pid>/stat``: its parent) and keeps the descendants
of the root, so children started by any thread are found (``/proc/<pid>/task/<pid>/children``
lists only the main thread's: a JVM starts its Python workers from other threads). For each
process it keeps the largest of its sampled ``VmRSS`` and its ``VmHWM`` (the kernel's own peak,
so a peak between two samples still counts, unless the process exits within one interval), and
classifies it once by its command line and its parent's kind (:func:`classify`):

``python_driver``
    a ``terascale`` command (the CLI process; with Spark it holds the Py4J gateway);
``jvm``
    a ``java`` process (Spark's driver JVM; in local mode the executors live in it);
``python_daemon``
    ``pyspark.daemon``, child of the JVM (forks the Python workers);
``python_worker``
    a Python worker: a child of the daemon (the same command line), or ``pyspark.worker``;
``python_pool``
    a ``multiprocessing`` child (the generator's spawned writers) or another Python process;
``other``
    anything else (spark-submit's shell and its launcher ``java ... launcher.Main``, ``gzip``);
``wrapper``
    ``python .../io_wrap.py``, the measuring wrapper (``tests/benchmarks/io_wrap.py``; not
    counted in the peaks).

It also keeps the largest sum of RSS over the tree at one sample, and the lowest
``os.statvfs(path)`` free space (bytes available to an unprivileged user) over the samples.
"""

from __future__ import annotations

import os
import signal
import threading

TICKS = os.sysconf("SC_CLK_TCK")
IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")
KINDS = ("python_driver", "jvm", "python_daemon", "python_worker", "python_pool", "other")


def classify(cmdline: list[str], parent_kind: str | None) -> str:
    """The kind of a process from its argv (``/proc/<pid>/cmdline``) and its parent's kind."""
    if not cmdline:
        return "other"
    exe = os.path.basename(cmdline[0])
    text = " ".join(cmdline)
    if len(cmdline) > 1 and os.path.basename(cmdline[1]) == "io_wrap.py":
        return "wrapper"
    if exe == "java":  # Spark's launcher (a short-lived java that prints the command) is not the JVM
        return "other" if "org.apache.spark.launcher.Main" in text else "jvm"
    if "pyspark.daemon" in text or "pyspark/daemon.py" in text:
        return "python_worker" if parent_kind in ("python_daemon", "python_worker") else "python_daemon"
    if "pyspark.worker" in text or "pyspark/worker.py" in text:
        return "python_worker"
    if exe == "terascale" or any(os.path.basename(a) == "terascale" for a in cmdline[:2]) or "terascale.jobs.cli" in text:
        return "python_driver"
    if exe.startswith("python") or "multiprocessing" in text:
        return "python_pool"
    return "other"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def scan() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far: user + system) for every process in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is None:
            continue
        try:  # the command name in parentheses may hold spaces and parentheses: split after the last ')'
            f = stat[stat.rindex(")") + 2:].split()
            out[int(name)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICKS)
        except (ValueError, IndexError):
            continue
    return out


def descendants(root: int, ppid: dict[int, int]) -> list[int]:
    """``root`` and every process below it, parents before children."""
    kids: dict[int, list[int]] = {}
    for pid, parent in ppid.items():
        kids.setdefault(parent, []).append(pid)
    order, stack = [], [root]
    while stack:
        p = stack.pop()
        if p in ppid or p == root:
            order.append(p)
            stack.extend(sorted(kids.get(p, ())))
    return order


def status(pid: int) -> dict | None:
    """``rss``, ``hwm`` (bytes) and ``ignores_sigchld`` of a live process; None when it is gone
    (or a zombie)."""
    text = _read(f"/proc/{pid}/status")
    if text is None:
        return None
    vals = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            vals[key] = int(rest.split()[0]) * 1024
        elif key == "SigIgn":
            vals[key] = int(rest.strip(), 16)
    if "VmRSS" not in vals:
        return None
    return {"rss": vals["VmRSS"], "hwm": vals.get("VmHWM", vals["VmRSS"]),
            "ignores_sigchld": bool(vals.get("SigIgn", 0) >> (signal.SIGCHLD - 1) & 1)}


def io_counters(pid: int) -> dict[str, int] | None:
    text = _read(f"/proc/{pid}/io")
    if text is None:
        return None
    rows = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(rows[k]) for k in IO_FIELDS if k in rows}


class TreeWatcher:
    """Samples the tree under ``root`` until :meth:`stop`; ``summary()`` gives the figures."""

    def __init__(self, root: int, disk_path: str, interval: float = 0.2):
        self.root, self.disk_path, self.interval = root, disk_path, interval
        self.procs: dict[int, dict] = {}  # pid -> {"kind", "peak", "cmd", "parent"}
        self.tree_peak = 0
        self.min_free = self._free()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-watcher", daemon=True)

    def _free(self) -> int:
        st = os.statvfs(self.disk_path)
        return st.f_bavail * st.f_frsize

    def start(self) -> TreeWatcher:
        self._thread.start()
        return self

    def sample(self) -> None:
        table = scan()
        ppid = {pid: v[0] for pid, v in table.items()}
        total = 0
        for pid in descendants(self.root, ppid):
            st = status(pid)
            argv = [a for a in (_read(f"/proc/{pid}/cmdline") or "").split("\0") if a]
            if st is None or not argv:  # gone, or exiting: nothing to classify it by
                continue
            cmd = " ".join(argv)[:300]
            rec = self.procs.get(pid)
            if rec is None or rec["cmd"] != cmd:  # new, or it exec'd (spark-submit's shell -> java)
                parent = self.procs.get(ppid.get(pid, -1), {}).get("kind")
                rec = self.procs[pid] = {"kind": classify(argv, parent), "peak": 0, "cmd": cmd,
                                         "parent": ppid.get(pid), "io": None, "cpu_s": 0.0}
            rec["peak"] = max(rec["peak"], st["rss"], st["hwm"])
            rec["ignores_sigchld"] = st["ignores_sigchld"]
            rec["io"] = io_counters(pid) or rec["io"]
            rec["cpu_s"] = table[pid][1]
            if rec["kind"] != "wrapper":
                total += st["rss"]
        self.tree_peak = max(self.tree_peak, total)
        self.min_free = min(self.min_free, self._free())
        self.samples += 1

    def auto_reaped(self, reaped_elsewhere: set[int]) -> dict:
        """The last seen I/O counters and CPU seconds, summed, of the processes whose parent
        ignores SIGCHLD (pyspark's daemon does), less ``reaped_elsewhere`` (those that outlived
        that parent and were reaped by a subreaper, which counted them): the kernel discards
        such a process's counters when it exits, so no ancestor's counters hold them.
        ``processes``: how many; each may miss what it did after its last sample."""
        out = dict.fromkeys(IO_FIELDS, 0) | {"cpu_s": 0.0, "processes": 0}
        for pid, rec in self.procs.items():
            parent = self.procs.get(rec["parent"])
            if pid in reaped_elsewhere or parent is None or not parent.get("ignores_sigchld"):
                continue
            for k in IO_FIELDS:
                out[k] += (rec["io"] or {}).get(k, 0)
            out["cpu_s"] += rec["cpu_s"]
            out["processes"] += 1
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """``rss_peak_bytes`` by kind: the largest process peak, the number of processes and
        their peaks (largest first, at most 16); the tree's peak; the lowest free disk; the
        24 largest processes (pid, kind, peak, command line)."""
        by_kind: dict[str, list[int]] = {}
        for rec in self.procs.values():
            if rec["kind"] != "wrapper":
                by_kind.setdefault(rec["kind"], []).append(rec["peak"])
        return {
            "rss_peak_bytes": {k: {"max": max(v), "processes": len(v), "peaks": sorted(v, reverse=True)[:16]}
                               for k, v in sorted(by_kind.items())},
            "tree_rss_peak_bytes": self.tree_peak,
            "processes": [{"pid": pid, "kind": r["kind"], "peak_bytes": r["peak"], "cmd": r["cmd"][:160]}
                          for pid, r in sorted(self.procs.items(), key=lambda kv: -kv[1]["peak"])[:24]],
            "min_free_disk_bytes": self.min_free,
            "samples": self.samples,
        }
