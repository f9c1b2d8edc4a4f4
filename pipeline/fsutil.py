"""Filesystem helpers over pyarrow filesystems: local paths, file://, hdfs://, s3:// alike.

Paths travel between the driver and tasks as URI strings (or absolute local paths); each side
resolves them with ``resolve``. Globs are expanded on the driver.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
from dataclasses import dataclass

import pyarrow.fs as pafs

_GLOB_CHARS = set("*?[")
_HIDDEN_PREFIXES = ("_", ".")


class InputError(ValueError):
    """An input path does not exist or matches no files."""


def _is_uri(path: str) -> bool:
    return "://" in path


def normalize(path: str) -> str:
    """Absolute local path, or the URI unchanged (executors may have another working dir)."""
    return path if _is_uri(path) else os.path.abspath(os.path.expanduser(path))


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a local path or URI."""
    if _is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), normalize(path)


def join(base: str, *parts: str) -> str:
    if _is_uri(base):
        return base.rstrip("/") + "/" + "/".join(parts)
    return os.path.join(base, *parts)


def _with_scheme(original: str, inner: str) -> str:
    """Turn a filesystem-internal path back into the caller's form (URI or local)."""
    if not _is_uri(original):
        return inner
    scheme, rest = original.split("://", 1)
    if scheme in ("file",):
        return f"file://{inner}"
    # hdfs://host:port/path -> keep authority; s3://bucket/key -> inner is bucket/key
    if scheme == "s3" or scheme == "gs":
        return f"{scheme}://{inner}"
    authority = rest.split("/", 1)[0]
    return f"{scheme}://{authority}{inner if inner.startswith('/') else '/' + inner}"


@dataclass(frozen=True)
class InputFile:
    uri: str
    size: int
    gzip: bool


def _visible(name: str) -> bool:
    return not posixpath.basename(name).startswith(_HIDDEN_PREFIXES)


def expand_inputs(patterns: list[str]) -> list[InputFile]:
    """Expand files, directories (recursively; hidden and _-prefixed names skipped) and globs.

    The result is sorted and de-duplicated; a pattern that matches nothing is an error naming it.
    """
    found: dict[str, InputFile] = {}
    for pattern in patterns:
        norm = normalize(pattern)
        fs, inner = resolve(norm)
        matches: list[pafs.FileInfo] = []
        if _GLOB_CHARS & set(inner):
            parts = inner.split("/")
            first = next(i for i, p in enumerate(parts) if _GLOB_CHARS & set(p))
            base = "/".join(parts[:first]) or "/"
            recursive = first < len(parts) - 1
            try:
                listing = fs.get_file_info(pafs.FileSelector(base, recursive=recursive))
            except (FileNotFoundError, OSError):
                listing = []
            for info in listing:
                if info.type == pafs.FileType.File and fnmatch.fnmatchcase(info.path, inner):
                    matches.append(info)
        else:
            info = fs.get_file_info(inner)
            if info.type == pafs.FileType.File:
                matches.append(info)
            elif info.type == pafs.FileType.Directory:
                sel = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
                rel = [i for i in sel if i.type == pafs.FileType.File]
                matches.extend(
                    i for i in rel if all(_visible(p) for p in i.path[len(inner):].split("/") if p)
                )
            else:
                raise InputError(f"input {pattern!r}: no such file or directory")
        if not matches:
            raise InputError(f"input {pattern!r}: matches no files")
        for info in matches:
            uri = _with_scheme(norm, info.path)
            found[uri] = InputFile(uri=uri, size=int(info.size), gzip=info.path.endswith(".gz"))
    return [found[k] for k in sorted(found)]


def write_json_atomic(path: str, obj: dict) -> None:
    """Write JSON to a unique temporary sibling, fsync it and rename it into place
    (``pipeline.durable.write_bytes``): readers see the old file or the new one, after a crash too.
    Every JSON file a job writes goes through here and is stored redacted (``pipeline.redact``:
    secret keys and URI credentials as ``***``)."""
    from terascale.pipeline import durable  # durable builds on this module
    from terascale.pipeline.redact import redact

    obj = redact(obj)
    durable.write_bytes(path, json.dumps(obj, indent=2, sort_keys=False).encode("utf-8") + b"\n")


def read_json(path: str) -> dict:
    fs, inner = resolve(path)
    with fs.open_input_stream(inner) as f:
        return json.loads(f.read().decode("utf-8"))


def exists(path: str) -> bool:
    fs, inner = resolve(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def delete(path: str) -> None:
    """Delete a file or a directory tree; missing is fine."""
    fs, inner = resolve(path)
    t = fs.get_file_info(inner).type
    if t == pafs.FileType.Directory:
        fs.delete_dir(inner)
    elif t == pafs.FileType.File:
        fs.delete_file(inner)


def move(src: str, dst: str) -> None:
    fs, a = resolve(src)
    _, b = resolve(dst)
    fs.move(a, b)


def makedirs(path: str) -> None:
    fs, inner = resolve(path)
    fs.create_dir(inner, recursive=True)


def list_files(path: str) -> list[str]:
    fs, inner = resolve(path)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return []
    return [_with_scheme(normalize(path), i.path) for i in fs.get_file_info(pafs.FileSelector(inner)) if i.type == pafs.FileType.File]

