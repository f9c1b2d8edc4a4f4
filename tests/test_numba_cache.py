"""pipeline.numba_cache: the same code shipped at a new path (a new application's --py-files
zip) finds the kernels the previous application compiled; a change anywhere in terascale
(the kernel's module, or a module whose kernels it may call) does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from terascale.pipeline.numba_cache import LOCATORS

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json
from terascale.pipeline import hashing
hashing.hash_tokens(["abc"], 0)
f = hashing._hash_many
print(json.dumps({"file": hashing.__file__, "hits": sum(f.stats.cache_hits.values()),
                  "misses": sum(f.stats.cache_misses.values())}))
"""


def _zip(path: Path, patch: bytes = b"", module: str = "pipeline/hashing.py") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("terascale/", b"")  # zipimport finds a namespace package by its directory entry
        for package in ("pipeline", "allreduce", "solvers", "jobs"):
            for d in sorted({f.parent for f in (ROOT / package).rglob("*.py")}):
                z.writestr(f"terascale/{d.relative_to(ROOT).as_posix()}/", b"")
            for f in sorted((ROOT / package).rglob("*.py")):
                data = f.read_bytes()
                rel = f.relative_to(ROOT).as_posix()
                if rel == module:
                    data += patch
                z.writestr(f"terascale/{rel}", data)
    return path


def _run(code_zip: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_zip), "NUMBA_CACHE_DIR": str(cache),
           "NUMBA_CACHE_LOCATOR_CLASSES": LOCATORS}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=code_zip.parent, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_compiled_by_one_application_are_reused_by_the_next(tmp_path):
    cache = tmp_path / "cache"
    first = _run(_zip(tmp_path / "app-1" / "code.zip"), cache)
    assert first["file"].startswith(str(tmp_path / "app-1" / "code.zip"))
    assert (first["hits"], first["misses"]) == (0, 1)
    assert list((cache / "terascale" / "pipeline" / "hashing").glob("*.nbi"))
    again = _run(_zip(tmp_path / "app-2" / "code.zip"), cache)  # same code, new path
    assert (again["hits"], again["misses"]) == (1, 0)
    changed = _run(_zip(tmp_path / "app-3" / "code.zip", patch=b"\n# changed\n"), cache)
    assert (changed["hits"], changed["misses"]) == (0, 1)
    # another module of the package changed (numba inlines callees into cached callers)
    other = _run(_zip(tmp_path / "app-4" / "code.zip", patch=b"\n# changed\n", module="pipeline/rowkernels.py"), cache)
    assert (other["hits"], other["misses"]) == (0, 1)
    assert _run(_zip(tmp_path / "app-5" / "code.zip", patch=b"\n# changed\n", module="pipeline/rowkernels.py"), cache)["hits"] == 1
    # a module of another of terascale's packages changed (the scorer runs the solvers' kernels)
    solver = _run(_zip(tmp_path / "app-6" / "code.zip", patch=b"\n# changed\n", module="solvers/predict.py"), cache)
    assert (solver["hits"], solver["misses"]) == (0, 1)


def test_the_test_run_itself_uses_the_package_hash_locator():
    """conftest enables the locator before numba is imported, so an edited callee can never
    leave the tests running a caller's stale cached code."""
    from terascale.solvers.scd import dual_kernels
    from tests.conftest import NUMBA_LOCATORS

    assert NUMBA_LOCATORS == LOCATORS
    assert os.environ["NUMBA_CACHE_LOCATOR_CLASSES"] == LOCATORS
    locator = dual_kernels.dual_epoch._cache._impl._locator
    assert type(locator).__name__ == "StableLocator"


def test_only_the_stamped_packages_hold_numba_kernels():
    """The stamp covers pipeline and solvers only; a kernel anywhere else would keep stale code."""
    import re

    from terascale.pipeline.numba_cache import PACKAGES

    stamped = {p.split(".")[1] for p in PACKAGES}
    kernel = re.compile(r"^\s*@(numba\.)?(njit|jit|cuda\.jit|vectorize|guvectorize|stencil)\b", re.M)
    holders = {f.relative_to(ROOT).parts[0] for top in ("pipeline", "allreduce", "solvers", "jobs")
               for f in (ROOT / top).rglob("*.py") if kernel.search(f.read_text())}
    assert holders and holders <= stamped, holders - stamped
