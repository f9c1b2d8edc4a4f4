"""What the GPU machine lacks, as wheels: the list, the install, and a freshness check.

The GPU machine has Python 3.12 with numpy, scipy, numba, numba-cuda, CuPy, pyarrow, PyYAML,
matplotlib, pytest and hypothesis (the device tool's package list), and no network. terascale's
other runtime dependencies travel as wheels in ``.whl/``: :data:`SHIPPED` (``cffi`` and
``pycparser`` are ``cryptography``'s), pinned to the versions installed here, so the device runs
what the tests here ran. pyspark stays behind: nothing the device check runs imports it.

``python -m tests.device.wheels`` prints the pinned requirements (``make device-wheels`` feeds
them to ``pip download`` for CPython 3.12 on manylinux x86-64 and adds terascale's own wheel).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: terascale's dependencies the GPU machine already has (by the device tool's package list)
DEVICE_HAS = ("numpy", "scipy", "numba", "pyarrow", "pyyaml", "matplotlib")
#: not needed there: the device check runs no Spark
LEFT_BEHIND = ("pyspark",)
#: shipped as wheels: terascale's remaining dependencies and what they need at run time
SHIPPED = ("mmh3", "cryptography", "cffi", "pycparser", "isal")


def _name(requirement: str) -> str:
    for sep in "<>=!~;[ ":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower().replace("_", "-")


def runtime_dependencies() -> list[str]:
    """The names of terascale's ``[project] dependencies`` (pyproject.toml)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [_name(d) for d in tomllib.load(f)["project"]["dependencies"]]


def requirements() -> list[str]:
    """``name==version`` of every :data:`SHIPPED` package, as installed here."""
    return [f"{name}=={metadata.version(name)}" for name in SHIPPED]


def terascale_wheel(folder: Path) -> Path:
    """The one terascale wheel in ``folder``; FileNotFoundError naming the folder otherwise."""
    found = sorted(folder.glob("terascale-*-py3-none-any.whl"))
    if len(found) != 1:
        raise FileNotFoundError(f"{folder}: expected one terascale-*.whl, found {len(found)} "
                                "(make device-wheels builds it)")
    return found[0]


def _source_of(member: str) -> Path | None:
    """The working-tree file a wheel member was built from (terascale/<pkg>/x.py -> <pkg>/x.py)."""
    parts = member.split("/")
    if len(parts) < 3 or parts[0] != "terascale" or not member.endswith(".py"):
        return None
    return ROOT.joinpath(*parts[1:])


def stale_files(wheel: Path) -> list[str]:
    """The wheel's Python files whose bytes differ from the working tree's (by its RECORD's
    sha256), and the tree's package files the wheel lacks: empty when the wheel is current."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(z.read(record).decode())))
    stale, seen = [], set()
    for member, digest, _size in rows:
        src = _source_of(member)
        if src is None:
            continue
        seen.add(src)
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(src.read_bytes()).digest()
                                                    if src.exists() else b"").rstrip(b"=").decode()
        if not src.exists() or digest != want:
            stale.append(str(src.relative_to(ROOT)))
    for pkg in ("pipeline", "allreduce", "solvers", "jobs"):
        stale += sorted(str(p.relative_to(ROOT)) for p in (ROOT / pkg).rglob("*.py") if p not in seen)
    return stale


def install(folder: Path, target: Path) -> dict:
    """``pip install --no-index --no-deps --target`` of every wheel in ``folder`` (terascale's
    own checked against the working tree first); returns what was installed."""
    wheel = terascale_wheel(folder)
    stale = stale_files(wheel)
    if stale:
        raise RuntimeError(f"{wheel.name} differs from the working tree in {stale[:5]}"
                           f"{' ...' if len(stale) > 5 else ''}: run make device-wheels again")
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *wheels]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install of {folder} failed: {proc.stderr[-2000:]}")
    return {"target": str(target), "wheels": [Path(w).name for w in wheels]}


if __name__ == "__main__":
    print(" ".join(requirements()))
