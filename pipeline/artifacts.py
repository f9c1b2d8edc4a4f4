"""Output artifacts: what a path holds, the guard before a job writes there, the atomic replace.

Every job knows the kind of artifact it writes and recognises it by its marker:

    dataset      ``_manifest.json`` (a manifest without ``"kind": "predictions"``)
    model        ``metadata.json`` holding a ``format_version``
    predictions  ``_terascale_predictions.json`` (older runs: ``_manifest.json`` of kind predictions)
    checkpoints  ``_terascale_checkpoints.json``, written first into the directory by the run

**Guard** (:func:`check_target`, on the driver before any Spark session): a missing path or an
empty directory is used; an artifact of the same kind is replaced only with ``overwrite``;
anything else (another kind, a file, a model pointer, a directory holding files terascale did
not write) is refused with :class:`OutputError`, naming the path and what was found. An artifact
of the right kind that also holds foreign files is refused too: replacing it would delete them.

**Replace** (:func:`replace_dir`): the new output is complete in a hidden staging sibling
(``.NAME.tmp-RUN``) and fsync'd before the old one moves::

    fsync_tree(staging) → rename target → .NAME.old-RUN (the aside) → rename staging → target
    → fsync the parent → delete the aside

A crash before the first rename leaves the old output in place; after the second, the new one.
Between the two renames the target is missing and the old output is whole at the aside name:
the next job that writes the target restores it first (:func:`recover`), and a reader that finds
no artifact names the aside in its error (:func:`missing_hint`). An ordinary error between the
renames moves the aside back before it propagates.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from terascale.pipeline import durable, fsutil

log = logging.getLogger("terascale.artifacts")

DATASET, MODEL, PREDICTIONS, CHECKPOINTS = "dataset", "model", "predictions", "checkpoints"
MANIFEST = "_manifest.json"  # pipeline.manifest.MANIFEST (not imported: no cycle)
MODEL_MARKER = "metadata.json"
PREDICTIONS_MARKER = "_terascale_predictions.json"
CHECKPOINTS_MARKER = "_terascale_checkpoints.json"
MARKER_VERSION = 1
#: the plots ``terascale report`` (jobs.report) writes beside report.html, as <name>.png
REPORT_PLOTS = ("objective_by_pass", "objective_by_time", "rank_timings", "memory", "roc", "precision_recall",
                "calibration", "regularization_path")
_REPORT = ("report.html", *(f"{p}.png" for p in REPORT_PLOTS))
# relative paths terascale writes inside each kind of artifact
OWN = {
    DATASET: (MANIFEST, "part-*.parquet", "_groups.npy", "_tokens.parquet", "_quarantine/*", "_temporary/*"),
    MODEL: ("weights.npy", "weights_sparse.npz", MODEL_MARKER, "metadata/*", "_published.json", "tokens.parquet", *_REPORT),
    PREDICTIONS: (PREDICTIONS_MARKER, MANIFEST, "part-*.parquet", "_temporary/*"),
    CHECKPOINTS: ("*",),  # the checkpoint directory belongs to the run that made it
}
_LABEL = {DATASET: "a terascale dataset", MODEL: "a terascale model", PREDICTIONS: "terascale predictions",
          CHECKPOINTS: "terascale checkpoints"}
_MARKER_OF = {DATASET: MANIFEST, MODEL: MODEL_MARKER, PREDICTIONS: PREDICTIONS_MARKER,
              CHECKPOINTS: CHECKPOINTS_MARKER}

# Test hook: called with the name of each commit step ("staged", "aside", "placed", "cleaned")
# after that step is done; a test raises from it to stop the commit there, as a crash would.
FAULT: Callable[[str], None] | None = None


class OutputError(ValueError):
    """An output target that a job must not write (the CLI exits 2)."""


@dataclass
class Found:
    """What a path holds: ``kind`` is missing, empty, file, pointer, or an artifact kind, or
    foreign (a directory that is no artifact); ``foreign`` lists files terascale did not write."""

    kind: str
    detail: str = ""
    foreign: list[str] = field(default_factory=list)


def _step(name: str) -> None:
    if FAULT is not None:
        FAULT(name)


def _files(path: str) -> list[str]:
    """Relative paths of every file under the directory ``path`` (sorted)."""
    fs, inner = fsutil.resolve(path)
    base = inner.rstrip("/") + "/"
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    return sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File)


def _read_json(path: str) -> object:
    try:
        return fsutil.read_json(path)
    except (ValueError, OSError):
        return None


def _type(path: str) -> pafs.FileType:
    fs, inner = fsutil.resolve(path)
    return fs.get_file_info(inner).type


def inspect(path: str) -> Found:
    """Classify what ``path`` holds: one listing of its top level and at most two small reads;
    only a directory holding an artifact's marker is listed recursively (a foreign one may be
    huge: its top-level entries are named, directories with a trailing /)."""
    path = fsutil.normalize(path)
    t = _type(path)
    if t == pafs.FileType.NotFound:
        return Found("missing")
    if t == pafs.FileType.File:
        doc = _read_json(path)
        if isinstance(doc, dict) and "pointer_format" in doc:
            return Found("pointer", "a model pointer; only `terascale publish` changes pointers")
        if isinstance(doc, dict) and {"logloss", "auroc"} <= doc.keys():
            return Found("metrics", "a terascale metrics file")
        return Found("file", "a file, not a directory")
    fs, inner = fsutil.resolve(path)
    top = fs.get_file_info(pafs.FileSelector(inner))
    if not top:
        return Found("empty")
    names = {posixpath.basename(i.path) for i in top if i.type == pafs.FileType.File}
    kind = None
    if PREDICTIONS_MARKER in names:
        kind = PREDICTIONS
    elif CHECKPOINTS_MARKER in names:
        kind = CHECKPOINTS
    elif MODEL_MARKER in names and isinstance(m := _read_json(fsutil.join(path, MODEL_MARKER)), dict) \
            and "format_version" in m:
        kind = MODEL
    elif MANIFEST in names and isinstance(m := _read_json(fsutil.join(path, MANIFEST)), dict):
        if m.get("kind") == PREDICTIONS:
            kind = PREDICTIONS
        elif "format_version" in m:
            kind = DATASET
    if kind is None:
        entries = sorted(posixpath.basename(i.path) + ("/" if i.type == pafs.FileType.Directory else "") for i in top)
        return Found("foreign", "", entries)
    own = OWN[kind]
    # a kind that owns everything under its marker (checkpoints) needs no recursive listing
    foreign = [] if own == ("*",) else [f for f in _files(path) if not any(fnmatch.fnmatchcase(f, p) for p in own)]
    marker = MANIFEST if kind == PREDICTIONS and PREDICTIONS_MARKER not in names else _MARKER_OF[kind]
    return Found(kind, f"{_LABEL[kind]} ({marker})", foreign)


def _list_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _plural(names: list[str]) -> str:
    n = len(names)
    if any(x.endswith("/") for x in names):
        return f"{n} entr{'ies' if n != 1 else 'y'}"
    return f"{n} file{'s' if n != 1 else ''}"


def check_target(path: str, kind: str, overwrite: bool, what: str, flag: str) -> Found:
    """Refuse ``path`` as the output of a job writing ``kind`` unless it may be (re)written.

    ``what`` names the argument (``--model``), ``flag`` how to allow a replacement
    (``--overwrite or train.overwrite: true``). Restores an aside a crashed commit left (see the
    module docstring) before looking. Returns what was found.
    """
    path = fsutil.normalize(path)
    recover(path, kind)
    f = inspect(path)
    where = f"{what} {path}"
    if f.kind in ("missing", "empty"):
        return f
    if f.kind in ("pointer", "metrics", "file"):
        raise OutputError(f"{where}: exists and is {f.detail}; refusing to replace it")
    if f.kind == "foreign":
        raise OutputError(f"{where}: holds {_plural(f.foreign)} that terascale did not write "
                          f"({_list_names(f.foreign)}); refusing to replace it: choose another path or empty it")
    if f.kind != kind:
        raise OutputError(f"{where}: exists and is {f.detail}, not {_LABEL[kind].replace('terascale ', '')}; "
                          "refusing to replace it")
    if f.foreign:
        raise OutputError(f"{where}: is {f.detail} but also holds {_plural(f.foreign)} that terascale did "
                          f"not write ({_list_names(f.foreign)}); refusing to replace it: move them away first")
    if not overwrite:
        raise OutputError(f"{where}: exists and is {f.detail}; pass {flag} to replace it")
    return f


def _norm(path: str) -> str:
    return fsutil.normalize(path).rstrip("/")


def _real(path: str) -> str:
    """``_norm`` with a local path's symbolic links resolved (``dslink/preds`` is ``ds/preds``)."""
    p = _norm(path)
    return p if "://" in p else os.path.realpath(p)


def check_apart(target: str, what: str, others: dict[str, str], inside: bool = True) -> None:
    """Refuse a target that equals, contains or (``inside``) lies inside one of ``others``
    ({label: path}), compared with symbolic links resolved."""
    t = _real(target)
    for label, other in others.items():
        if not other:
            continue
        o = _real(other)
        if t == o:
            rel = "is"
        elif inside and t.startswith(o + "/"):
            rel = "is inside"
        elif o.startswith(t + "/"):
            rel = "contains"
        else:
            continue
        raise OutputError(f"{what} {target}: {rel} {label} {other}; refusing to write there")


def _sibling(path: str, infix: str, run: str) -> str:
    head, name = posixpath.split(_norm(path))
    return f"{head}/.{name}.{infix}-{run}"


def staging_path(target: str, run: str) -> str:
    """The hidden staging sibling ``.NAME.tmp-RUN`` (same filesystem: the rename is atomic)."""
    return _sibling(target, "tmp", run)


def attempts_path(target: str, run: str) -> str:
    """Where a job's task attempts write, each into a directory of its own: ``.NAME.attempts-RUN``,
    a sibling of ``target`` and of its staging directory, never inside either (:func:`retire_attempts`)."""
    return _sibling(target, "attempts", run)


def open_attempts(target: str, run: str) -> str:
    """Create (empty) and return :func:`attempts_path`; the tasks create their own directories
    in it without parents (``create_dir(..., recursive=False)``), so none can once it is retired."""
    path = attempts_path(target, run)
    fsutil.makedirs(path)
    return path


def retire_attempts(target: str, run: str) -> None:
    """Fence off and delete the attempts' directory of ``run`` (the accepted attempts' files
    already moved out of it): renamed first to ``.NAME.retired-RUN``, so that an attempt still
    running (a beaten or speculative copy that no status tracker waited for: Spark Connect) can
    neither create its directory nor reach the committed output, then deleted. A leftover (an
    attempt that wrote into the retired directory meanwhile) is logged, not fatal."""
    path = attempts_path(target, run)
    if _type(path) == pafs.FileType.NotFound:
        return
    retired = _sibling(target, "retired", run)
    try:
        durable.rename(path, retired)
        fsutil.delete(retired)
    except Exception as e:  # noqa: BLE001 - the output is committed; what remains is garbage beside it
        log.warning("%s: could not delete the task attempts' directory %s: %s", target, path, e)


def aside_path(target: str, run: str) -> str:
    """Where a commit keeps the old output between its two renames: ``.NAME.old-RUN``."""
    return _sibling(target, "old", run)


def asides(target: str) -> list[str]:
    """The asides crashed commits left beside ``target`` (oldest first)."""
    head, name = posixpath.split(_norm(target))
    fs, inner = fsutil.resolve(head)
    try:
        infos = fs.get_file_info(pafs.FileSelector(inner))
    except (FileNotFoundError, OSError):
        return []
    prefix = f".{name}.old-"
    found = [posixpath.basename(i.path) for i in infos if posixpath.basename(i.path).startswith(prefix)]
    return [fsutil.join(head, n) for n in sorted(found)]


def missing_hint(target: str) -> str:
    """For a reader's error when ``target`` holds no artifact: where a crashed commit left it."""
    left = asides(target)
    if not left:
        return ""
    return (f" (a commit that stopped between its renames left the previous version at {left[-1]}; the next "
            f"terascale job writing {target} restores it, or rename it back)")


def recover(target: str, kind: str) -> None:
    """Undo what a crashed commit left: restore the newest aside when the target is missing;
    delete asides of our own kind once the target is in place. Foreign asides are left alone."""
    left = asides(target)
    if not left:
        return
    if _type(_norm(target)) == pafs.FileType.NotFound:
        durable.rename(left[-1], _norm(target))
        log.warning("%s: restored the previous %s from %s (a commit had stopped between its renames)",
                    target, kind, left[-1])
        left = left[:-1]
    for a in left:
        if inspect(a).kind in (kind, "empty"):
            fsutil.delete(a)
            log.info("%s: removed %s, the old version a finished commit had not deleted", target, a)
        else:
            log.warning("%s: leaving %s in place (not a terascale %s)", target, a, kind)


def replace_dir(staging: str, target: str, run: str) -> None:
    """Put the complete directory ``staging`` at ``target`` atomically (module docstring)."""
    target = _norm(target)
    durable.fsync_tree(staging)
    durable.fsync_dir(durable.parent(target))
    _step("staged")
    aside = None
    if _type(target) != pafs.FileType.NotFound:
        aside = aside_path(target, run)
        durable.rename(target, aside)
        _step("aside")
    try:
        durable.rename(staging, target)
    except Exception:
        if aside is not None:
            durable.rename(aside, target)
        raise
    _step("placed")
    if aside is not None:
        fsutil.delete(aside)
        durable.fsync_dir(durable.parent(target))
    _step("cleaned")


def write_marker(directory: str, kind: str, run: str, **extra) -> None:
    """Write the marker of ``kind`` (durably) into ``directory``, creating it."""
    fsutil.makedirs(directory)
    doc = {"kind": kind, "marker_version": MARKER_VERSION, "run": run, **extra}
    durable.write_bytes(fsutil.join(directory, _MARKER_OF[kind]), json.dumps(doc, indent=2).encode() + b"\n", tag=run)


def read_marker(directory: str, kind: str) -> dict | None:
    doc = _read_json(fsutil.join(directory, _MARKER_OF[kind]))
    return doc if isinstance(doc, dict) and doc.get("kind") == kind else None
