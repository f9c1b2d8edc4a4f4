"""Per-pass training checkpoints on any pyarrow filesystem (rank 0 writes, every rank reads).

A checkpoint is the solver's state after a completed pass: numpy arrays go into one ``.npz``,
everything else into JSON beside it. Files are written under a temporary name and renamed, and
only the newest complete checkpoint is kept; a retried attempt resumes from it.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np

from pipeline import fsutil

_NAME = re.compile(r"^pass-(\d{6})\.npz$")


def _split(state: dict) -> tuple[dict, dict]:
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    return arrays, rest


def save(directory: str, pass_no: int, state: dict, keep: int = 1) -> str:
    """Write the state of ``pass_no``; keep the ``keep`` newest checkpoints."""
    arrays, rest = _split(state)
    fsutil.makedirs(directory)
    fs, inner = fsutil.resolve(directory)
    stem = f"pass-{pass_no:06d}"
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    for suffix, data in ((".json", json.dumps(rest, default=_default).encode()), (".npz", buf.getvalue())):
        tmp = f"{inner}/.{stem}{suffix}.tmp"
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        fs.move(tmp, f"{inner}/{stem}{suffix}")  # the .npz lands last: it marks the checkpoint complete
    kept = sorted(passes(directory))[-keep:]
    for old in fsutil.list_files(directory):
        m = _NAME.match(old.rsplit("/", 1)[-1].replace(".json", ".npz"))
        if m and int(m.group(1)) not in kept:
            fsutil.delete(old)
    return f"{directory}/{stem}.npz"


def passes(directory: str) -> list[int]:
    """Passes with a complete checkpoint (their .npz landed) in ``directory``."""
    return sorted(int(m.group(1)) for f in fsutil.list_files(directory) if (m := _NAME.match(f.rsplit("/", 1)[-1])))


def rank_dir(directory: str, rank: int) -> str:
    """Where a solver with per-rank state (e.g. CoCoA's dual variables) keeps rank ``rank``'s."""
    return fsutil.join(directory, f"rank-{rank:05d}")


def common_latest(directory: str, rank: int, size: int) -> tuple[int, dict] | None:
    """(pass, state of ``rank``) at the newest pass checkpointed by every one of ``size`` ranks."""
    sets = [set(passes(rank_dir(directory, r))) for r in range(size)]
    common = set.intersection(*sets) if sets else set()
    if not common:
        return None
    p = max(common)
    return p, load(rank_dir(directory, rank), p)


def _default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def latest(directory: str) -> tuple[int, dict] | None:
    """(pass, state) of the newest complete checkpoint, or None."""
    found = passes(directory)
    return None if not found else (found[-1], load(directory, found[-1]))


def load(directory: str, p: int) -> dict:
    fs, inner = fsutil.resolve(directory)
    with fs.open_input_stream(f"{inner}/pass-{p:06d}.json") as f:
        state = json.loads(f.read().decode())
    with fs.open_input_stream(f"{inner}/pass-{p:06d}.npz") as f:
        with np.load(io.BytesIO(f.read()), allow_pickle=False) as z:
            state.update({k: z[k] for k in z.files})
    return state
