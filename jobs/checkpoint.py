"""Per-pass training checkpoints on any pyarrow filesystem, safe against crashes and zombies.

A checkpoint is the solver's state after a completed pass, written by one driver attempt
``a``: the numpy arrays in ``pass-PPPPPP.aAA.npz``, then a manifest ``pass-PPPPPP.aAA.json``
holding the rest of the state, the sha256 and size of the ``.npz`` and the sha256 of the state
itself. The manifest lands last and is what makes the checkpoint exist; a reader verifies both
hashes before using anything (:func:`load`), so a truncated ``.npz``, a flipped byte or a
missing half is found before use.

Durability and names: every file is written under a temporary name unique to the writer (its
attempt and a random token, :func:`pipeline.durable.unique_tmp`), fsynced, renamed into place
and its directory fsynced; no two attempts ever share a file name. After each save the writer
keeps the ``keep`` (default two) newest checkpoints, so a corrupt newest one falls back to the
one before (:func:`newest`, with a WARNING naming the file).

Zombies: when the driver starts attempt ``N`` it writes a fence ``attempt-NNNN.fence`` listing
the manifests present at that moment (:func:`begin_attempt`). A checkpoint of attempt ``a`` is
usable by a later attempt only if the fence of attempt ``a + 1`` lists it (or that fence does
not exist): what attempt ``N - 1`` completed before attempt ``N`` started stays usable, whatever
a lingering task of attempt ``N - 1`` writes afterwards is ignored by every later attempt. A
writer that sees the fence of a newer attempt writes and deletes nothing
(:class:`Superseded`); a writer prunes only its own and older attempts' files, never a newer
attempt's. (A writer checks the fences before it writes and again before its manifest lands;
a fence that appears between the check and the rename still excludes that checkpoint.)

Solvers with per-rank state (CoCoA's dual variables) keep rank ``r``'s checkpoints in
``rank-RRRRR/`` (:func:`rank_dir`); the fences stay in the top directory (``root``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zipfile
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from terascale.pipeline import durable, fsutil

log = logging.getLogger("terascale.train")

FORMAT = "terascale-checkpoint"
_NAME = re.compile(r"^pass-(\d{6})\.a(\d+)\.(npz|json)$")
_FENCE = re.compile(r"^attempt-(\d{4,})\.fence$")

_READ_CHUNK = 8 << 20  # bytes per read while hashing a checkpoint


class CheckpointError(RuntimeError):
    """No usable checkpoint although the run must resume from one, or a checkpoint that does
    not fit this run (another solver, another feature count). Deterministic: not retried."""


class CorruptCheckpoint(CheckpointError):
    """One checkpoint failed verification (its name is in the message); an older one may do."""


class Superseded(RuntimeError):
    """A newer driver attempt has started: this (zombie) writer must not write or delete."""


@dataclass(frozen=True, order=True)
class Entry:
    """One checkpoint whose manifest exists: ``pass_no`` written by driver attempt ``attempt``."""

    pass_no: int
    attempt: int
    directory: str

    @property
    def stem(self) -> str:
        return f"pass-{self.pass_no:06d}.a{self.attempt:02d}"

    @property
    def manifest(self) -> str:
        return fsutil.join(self.directory, self.stem + ".json")

    @property
    def npz(self) -> str:
        return fsutil.join(self.directory, self.stem + ".npz")


def _default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _state_digest(rest: dict) -> str:
    return hashlib.sha256(json.dumps(rest, sort_keys=True, default=_default).encode()).hexdigest()


def rank_dir(directory: str, rank: int) -> str:
    """Where a solver with per-rank state (e.g. CoCoA's dual variables) keeps rank ``rank``'s."""
    return fsutil.join(directory, f"rank-{rank:05d}")


def _names(directory: str) -> list[str]:
    return [f.rsplit("/", 1)[-1] for f in fsutil.list_files(directory)]


def _fences(root: str) -> dict[int, str]:
    return {int(m.group(1)): n for n in _names(root) if (m := _FENCE.match(n))}


def _relative_manifests(root: str) -> list[str]:
    """Manifests under ``root`` and its ``rank-*`` directories, as paths relative to ``root``."""
    fs, inner = fsutil.resolve(root)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(inner, recursive=True)):
        rel = info.path[len(inner.rstrip("/")) + 1:]
        m = _NAME.match(rel.rsplit("/", 1)[-1])
        if info.type == pafs.FileType.File and m and m.group(3) == "json" and rel.count("/") <= 1:
            out.append(rel)
    return sorted(out)


def begin_attempt(root: str, attempt: int) -> None:
    """The driver, before launching attempt ``attempt``: write its fence (see the module doc)."""
    fsutil.makedirs(root)
    body = {"attempt": attempt, "manifests": _relative_manifests(root)}
    durable.write_bytes(fsutil.join(root, f"attempt-{attempt:04d}.fence"), json.dumps(body).encode(), tag=f"a{attempt}")


def _fence_list(root: str, attempt: int, fences: dict[int, str]) -> set[str] | None:
    """The manifests listed by the fence of ``attempt`` (None: no fence, or unreadable)."""
    if attempt not in fences:
        return None
    try:
        return set(fsutil.read_json(fsutil.join(root, fences[attempt]))["manifests"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("checkpoint fence %s is unreadable (%s): not used to exclude late writes", fences[attempt], e)
        return None


def _relative(root: str, entry: Entry) -> str:
    d = fsutil.normalize(entry.directory).rstrip("/")
    r = fsutil.normalize(root).rstrip("/")
    prefix = d[len(r) + 1:] + "/" if d != r else ""
    return prefix + entry.stem + ".json"


def entries(directory: str, attempt: int, root: str | None = None) -> list[Entry]:
    """Checkpoints in ``directory`` that attempt ``attempt`` may use, newest first.

    Those of older attempts that the next attempt's fence lists (or without such a fence),
    and attempt ``attempt``'s own; never a newer attempt's. Not verified yet (:func:`load`).
    """
    root = directory if root is None else root
    fences = _fences(root)
    found = []
    for n in _names(directory):
        m = _NAME.match(n)
        if m and m.group(3) == "json" and int(m.group(2)) <= attempt:
            found.append(Entry(int(m.group(1)), int(m.group(2)), directory))
    allowed: dict[int, set[str] | None] = {}
    out = []
    for e in found:
        if e.attempt < attempt:
            if e.attempt + 1 not in allowed:
                allowed[e.attempt + 1] = _fence_list(root, e.attempt + 1, fences)
            listed = allowed[e.attempt + 1]
            if listed is not None and _relative(root, e) not in listed:
                continue  # written after the next attempt had started: a zombie's late write
        out.append(e)
    return sorted(out, reverse=True)


def _check_not_superseded(root: str, attempt: int) -> None:
    newer = [a for a in _fences(root) if a > attempt]
    if newer:
        raise Superseded(f"attempt {attempt} is superseded by attempt {max(newer)}: checkpoint not written")


def save(directory: str, pass_no: int, state: dict, attempt: int = 0, keep: int = 2,
         root: str | None = None) -> str:
    """Write the state of ``pass_no`` as attempt ``attempt``; keep the ``keep`` newest.

    Returns the manifest's path. Raises :class:`Superseded` (writing nothing) when a newer
    attempt's fence exists in ``root`` (default ``directory``).
    """
    root = directory if root is None else root
    _check_not_superseded(root, attempt)
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in state.items() if k not in arrays}
    fsutil.makedirs(directory)
    e = Entry(pass_no, attempt, directory)
    tag = f"a{attempt}"
    npz = _HashingWriter()
    # streamed array by array into the file: the checkpoint never sits whole in memory (rank 0
    # writes it, and its memory budget holds the state, not a second copy of it)
    durable.write_stream(e.npz, lambda out: _write_npz(npz.into(out), arrays), tag=tag)
    manifest = {
        "format": FORMAT, "pass": pass_no, "attempt": attempt,
        "npz": {"name": e.stem + ".npz", "bytes": npz.size, "sha256": npz.sha256.hexdigest()},
        "state_sha256": _state_digest(rest), "state": rest,
    }
    data = json.dumps(manifest, default=_default).encode()
    _check_not_superseded(root, attempt)
    durable.write_bytes(e.manifest, data, tag=tag)  # lands last: the checkpoint now exists
    _prune(directory, attempt, keep, root)
    return e.manifest


def _write_npz(out, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez``'s format (one ``<name>.npy`` member per array, uncompressed, zip64), written
    front to back into ``out``, each array straight from its buffer."""
    with zipfile.ZipFile(out, "w", allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)


class _HashingWriter:
    """A write-only binary stream that passes its bytes on and counts and hashes them
    (no ``tell`` / ``seek``: zipfile then writes the ``.npz`` front to back)."""

    def __init__(self):
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.out = None

    def into(self, out) -> _HashingWriter:
        self.out = out
        return self

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += view.nbytes
        self.out.write(view)
        return view.nbytes

    def flush(self) -> None:
        pass


def _prune(directory: str, attempt: int, keep: int, root: str) -> None:
    """Keep the ``keep`` newest usable checkpoints; delete the other files of this attempt and
    older ones (late zombie writes included), manifests before their ``.npz``."""
    kept = {e.stem for e in entries(directory, attempt, root)[:keep]}
    doomed = []
    for n in _names(directory):
        m = _NAME.match(n)
        if m and int(m.group(2)) <= attempt and n.rsplit(".", 1)[0] not in kept:
            doomed.append(n)
    for n in sorted(doomed, key=lambda n: not n.endswith(".json")):
        _check_not_superseded(root, attempt)
        fsutil.delete(fsutil.join(directory, n))
    if doomed:
        durable.fsync_dir(directory)


def read_manifest(entry: Entry) -> dict:
    """The manifest of ``entry``, checked (raises :class:`CorruptCheckpoint` naming the file)."""
    try:
        with fsutil.resolve(entry.manifest)[0].open_input_stream(fsutil.resolve(entry.manifest)[1]) as f:
            m = json.loads(f.read().decode())
        ok = (isinstance(m, dict) and m.get("format") == FORMAT and m.get("pass") == entry.pass_no
              and m.get("attempt") == entry.attempt and isinstance(m.get("state"), dict)
              and isinstance(m.get("npz"), dict))
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"checkpoint {entry.manifest}: unreadable manifest ({e})") from None
    if not ok:
        raise CorruptCheckpoint(f"checkpoint {entry.manifest}: not a {FORMAT} manifest of pass {entry.pass_no}")
    if _state_digest(m["state"]) != m.get("state_sha256"):
        raise CorruptCheckpoint(f"checkpoint {entry.manifest}: the state's sha256 does not match")
    return m


def quick_check(entry: Entry) -> None:
    """The cheap half of :func:`load`'s verification: the manifest, and the ``.npz``'s size."""
    m = read_manifest(entry)
    fs, inner = fsutil.resolve(entry.npz)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise CorruptCheckpoint(f"checkpoint {entry.npz}: missing (its manifest {entry.manifest} exists)")
    if info.size != m["npz"].get("bytes"):
        raise CorruptCheckpoint(f"checkpoint {entry.npz}: {info.size} bytes, its manifest says {m['npz'].get('bytes')}")


def load(entry: Entry) -> dict:
    """The verified state of ``entry`` (raises :class:`CorruptCheckpoint` naming the file).

    The file is read twice: its bytes' SHA-256 first, streamed (nothing kept), then, once they
    match the manifest, the arrays, each straight into its own buffer (zipfile checks each
    member's CRC-32 as it goes). Reading the whole file into memory to hash it first held it
    beside the arrays decoded from it: twice the state, on a rank about to rebuild its solver."""
    m = read_manifest(entry)
    fs, inner = fsutil.resolve(entry.npz)
    want = m["npz"].get("bytes")
    digest, size = hashlib.sha256(), 0
    try:
        with fs.open_input_stream(inner) as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except (OSError, FileNotFoundError) as e:
        raise CorruptCheckpoint(f"checkpoint {entry.npz}: unreadable ({e}; its manifest {entry.manifest} exists)") from None
    if size != want or digest.hexdigest() != m["npz"].get("sha256"):
        raise CorruptCheckpoint(f"checkpoint {entry.npz}: {size} bytes whose sha256 does not match its "
                                f"manifest ({want} bytes)")
    state = dict(m["state"])
    try:
        with fs.open_input_file(inner) as f, np.load(f, allow_pickle=False) as z:
            state.update({k: z[k] for k in z.files})
    except (OSError, ValueError, zipfile.BadZipFile) as e:  # changed since it was hashed
        raise CorruptCheckpoint(f"checkpoint {entry.npz}: unreadable after its sha256 matched ({e})") from None
    return state


def newest(directory: str, attempt: int, root: str | None = None) -> tuple[Entry, dict, list[int]] | None:
    """(entry, verified state, passes held) of the newest checkpoint that verifies, or None if
    there is no checkpoint at all. A checkpoint that fails verification is skipped with a
    WARNING naming it; ``held`` is that pass and every older one that passes
    :func:`quick_check`. Raises :class:`CheckpointError` when checkpoints exist but none is usable.
    """
    found = entries(directory, attempt, root)
    _warn_orphans(directory, attempt, found[0].pass_no if found else -1)
    if not found:
        return None
    problems = []
    for i, e in enumerate(found):
        try:
            state = load(e)
        except CorruptCheckpoint as err:
            log.warning("%s; falling back to an older checkpoint", err)
            problems.append(str(err))
            continue
        held = [e.pass_no]
        for older in found[i + 1:]:
            try:
                quick_check(older)
            except CorruptCheckpoint:
                continue
            if older.pass_no not in held:
                held.append(older.pass_no)
        return e, state, held
    raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems)
                          + " (rerun the job to start over)")


def _warn_orphans(directory: str, attempt: int, newest_pass: int) -> None:
    """WARN about a newer ``.npz`` of this or an older attempt without its manifest (its
    manifest was lost, or its write was interrupted): it is not used."""
    for n in _names(directory):
        m = _NAME.match(n)
        if m and m.group(3) == "npz" and int(m.group(2)) <= attempt and int(m.group(1)) > newest_pass:
            log.warning("checkpoint %s has no manifest (%s): not used; falling back to an older checkpoint",
                        fsutil.join(directory, n), n.replace(".npz", ".json"))


def find(directory: str, attempt: int, pass_no: int, root: str | None = None) -> Entry:
    """The newest usable checkpoint of pass ``pass_no`` (raises CheckpointError if none)."""
    for e in entries(directory, attempt, root):
        if e.pass_no == pass_no:
            return e
    raise CheckpointError(f"checkpoint of pass {pass_no} not found in {directory}")
