"""Durable writes: data reaches the disk before the name that publishes it.

A rename is atomic but not durable by itself: after a power loss a renamed file can exist with
no data blocks (ext4, XFS with delayed allocation), or the rename itself can be lost. The order
that makes a commit crash-safe on a local filesystem is

    write the new bytes → fsync the file(s) → fsync their directory
    → rename into place → fsync the directory holding the new name.

On remote filesystems (``hdfs://``, ``s3://``, ...) a completed ``close`` of an output stream is
the durability point (HDFS acknowledges replicated blocks; S3 has no partial objects), and there
is no directory handle to sync: the helpers here are then no-ops beyond the write itself.

Temporary names carry a unique token (``unique_tmp``) so that two writers (a zombie attempt and
its successor) never share one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from terascale.pipeline import fsutil


def is_local(path: str) -> bool:
    """True for a local path or a ``file://`` URI (fsync applies), False for remote stores."""
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return fsutil.resolve(path)[1]


def unique_tmp(path: str, tag: str = "") -> str:
    """A hidden temporary sibling of ``path``: ``.NAME.tmp-TAG-RANDOM`` in the same directory."""
    head, name = path.rstrip("/").rsplit("/", 1) if "/" in path.rstrip("/") else ("", path)
    token = f"{tag}-{uuid.uuid4().hex[:12]}" if tag else uuid.uuid4().hex[:12]
    return f"{head}/.{name}.tmp-{token}" if head else f".{name}.tmp-{token}"


def _fsync(path: str, flags: int) -> None:
    if not is_local(path):
        return
    fd = os.open(_local(path), os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a local file's data and metadata to the device (no-op on remote stores)."""
    _fsync(path, 0)


def fsync_dir(path: str) -> None:
    """Flush a local directory's entries (new, renamed or removed names) to the device."""
    _fsync(path, os.O_DIRECTORY)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under a local directory, children before parents."""
    if not is_local(path):
        return
    root = _local(path)
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def parent(path: str) -> str:
    """The directory holding ``path`` (same form: local path or URI)."""
    p = path.rstrip("/")
    return p.rsplit("/", 1)[0] if "/" in p else "."


def write_bytes(path: str, data: bytes, tag: str = "") -> None:
    """Write ``data`` to ``path`` durably and atomically: unique temporary sibling, fsync, rename.

    Readers see the old file or the new one, never a partial one; after a crash either stays
    whole. The temporary file is removed when the write fails.
    """
    write_stream(path, lambda out: out.write(data), tag)


def write_stream(path: str, produce: Callable[[Any], object], tag: str = "") -> None:
    """:func:`write_bytes` for data made piece by piece: ``produce(out)`` writes into ``out``
    (a binary output stream, not seekable) and the whole never has to be in memory at once.
    A missing local parent directory is created (as HDFS and object stores do by themselves), so
    that e.g. ``evaluate --out metrics/DAY.json`` works on a fresh local path as on HDFS."""
    fs, inner = fsutil.resolve(path)
    if is_local(path):
        os.makedirs(parent(inner), exist_ok=True)
    tmp = unique_tmp(inner, tag)
    try:
        with fs.open_output_stream(tmp) as out:
            produce(out)
        if is_local(path):
            fsync_file(tmp)
        fs.move(tmp, inner)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except (FileNotFoundError, OSError):
            pass
        raise
    fsync_dir(parent(fsutil.normalize(path)))


def rename(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` and make both directory entries durable."""
    fsutil.move(src, dst)
    fsync_dir(parent(fsutil.normalize(dst)))
    if parent(fsutil.normalize(src)) != parent(fsutil.normalize(dst)):
        fsync_dir(parent(fsutil.normalize(src)))
