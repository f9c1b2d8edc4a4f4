"""A training run's place in the checkpoint directory: one subdirectory per run, with a lease.

Layout::

    CKPT/_terascale_checkpoints.json   the marker: the directory is terascale's (pipeline.artifacts)
    CKPT/run-RUN/                      everything run RUN writes: jobs.checkpoint's files and
                                       fences, the progress file
    CKPT/run-RUN/_lease.json           {"run", "at": the driver's wall clock, "ended"}

Runs that share a checkpoint directory (an Airflow retry started while the first driver still
runs; two runs given one ``train.checkpoint_dir``) never read or remove each other's files: a
task resumes only from its own run's subdirectory, so one run's state can never seed another
run on other data.

The driver refreshes its lease every :data:`LEASE_EVERY_S`. A new run removes the subdirectories
of earlier runs whose lease says they ended, or is older than :data:`STALE_AFTER_S` (their
driver died; checkpoints serve the attempts of one run, so a new run starts over), with a
warning naming them, and leaves live ones alone. When it succeeds a run removes its own
subdirectory, and the checkpoint directory itself when this run created it and nothing else is
left in it (an empty directory the user made is emptied and kept). A failed run marks its lease
ended and keeps its checkpoints for inspection until the next run.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pyarrow.fs as pafs

from terascale.pipeline import artifacts, durable, fsutil

log = logging.getLogger("terascale.train")

LEASE = "_lease.json"
LEASE_EVERY_S = 30.0
STALE_AFTER_S = 600.0
_PREFIX = "run-"


def run_dir(ckpt: str, run_id: str) -> str:
    return fsutil.join(fsutil.normalize(ckpt), f"{_PREFIX}{run_id}")


def _entries(ckpt: str) -> list[pafs.FileInfo]:
    fs, inner = fsutil.resolve(ckpt)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return []
    return fs.get_file_info(pafs.FileSelector(inner))


def _lease(path: str) -> dict | None:
    try:
        return fsutil.read_json(fsutil.join(path, LEASE))
    except (FileNotFoundError, OSError, ValueError):
        return None


def _write_lease(path: str, run_id: str, ended: bool = False) -> None:
    body = {"run": run_id, "at": time.time(), "ended": ended}
    durable.write_bytes(fsutil.join(path, LEASE), json.dumps(body).encode() + b"\n")


class RunCheckpoints:
    """This run's subdirectory of the checkpoint directory ``ckpt`` (module docstring); use as a
    context manager around the training stage, then call :meth:`finish` after the commit."""

    def __init__(self, ckpt: str, run_id: str) -> None:
        self.root = fsutil.normalize(ckpt)
        self.run_id = run_id
        self.dir = run_dir(ckpt, run_id)
        self.made = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> RunCheckpoints:
        found = artifacts.inspect(self.root)
        self.made = found.kind != "empty"
        if found.kind == artifacts.CHECKPOINTS:
            self._remove_stale()
        else:
            artifacts.write_marker(self.root, artifacts.CHECKPOINTS, self.run_id)
        fsutil.makedirs(self.dir)
        _write_lease(self.dir, self.run_id)
        self._thread = threading.Thread(target=self._refresh, name="terascale-checkpoint-lease", daemon=True)
        self._thread.start()
        return self

    def _remove_stale(self) -> None:
        now = time.time()
        for info in _entries(self.root):
            name = info.path.rstrip("/").rsplit("/", 1)[-1]
            if name == artifacts.CHECKPOINTS_MARKER:
                continue
            path = fsutil.join(self.root, name)
            lease = _lease(path) if info.type == pafs.FileType.Directory and name.startswith(_PREFIX) else None
            if lease is not None and not lease.get("ended") and now - float(lease.get("at", 0)) < STALE_AFTER_S:
                log.warning("train: checkpoint directory %s is shared with run %s, active %.0f s ago; "
                            "this run keeps to %s", self.root, lease.get("run"), now - float(lease["at"]), self.dir)
                continue
            why = "ended" if lease and lease.get("ended") else "inactive" if lease else "left by an earlier version or run"
            log.warning("train: removing %s from the checkpoint directory (%s; checkpoints serve one run)", path, why)
            fsutil.delete(path)

    def _refresh(self) -> None:
        while not self._stop.wait(LEASE_EVERY_S):
            try:
                _write_lease(self.dir, self.run_id)
            except OSError as e:  # a transient filesystem error: the next refresh tries again
                log.warning("train: could not refresh the checkpoint lease %s: %s", self.dir, e)

    def __enter__(self) -> RunCheckpoints:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_type is not None:
            _write_lease(self.dir, self.run_id, ended=True)

    def finish(self) -> None:
        """After a successful commit: remove this run's checkpoints (and the directory, see above)."""
        fsutil.delete(self.dir)
        left = [i for i in _entries(self.root) if not i.path.endswith("/" + artifacts.CHECKPOINTS_MARKER)]
        if left:
            return
        if self.made:
            fsutil.delete(self.root)
        else:
            fsutil.delete(fsutil.join(self.root, artifacts.CHECKPOINTS_MARKER))
