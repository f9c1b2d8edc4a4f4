"""Installed, terascale is one namespace: terascale.pipeline, .allreduce, .solvers and .jobs,
and nothing else at top level. The wheel is installed into a fresh venv (its dependencies come
from this venv's site-packages through a path file, so nothing is downloaded), and the
``terascale`` command and a spark-submit entry point run from it, outside the repository."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "allreduce", "solvers", "jobs")


def _wheel(tmp_path: Path) -> Path:
    dist = os.environ.get("TERASCALE_DIST")
    if dist and list(Path(dist).glob("terascale-*.whl")):
        return next(Path(dist).glob("terascale-*.whl"))
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    return next(out.glob("terascale-*.whl"))


def test_every_package_folder_is_mapped_into_the_namespace():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent.relative_to(ROOT).as_posix() for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert set(conf["packages"]) == {"terascale." + f.replace("/", ".") for f in folders}
    assert conf["package-dir"] == {f"terascale.{top}": top for top in PACKAGES}


def test_the_wheel_installs_one_namespace_and_its_entry_points_run(tmp_path):
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"terascale", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert not any(n.startswith("terascale/__init__") for n in names)  # a namespace package
    assert {n.split("/")[1] for n in names if n.startswith("terascale/")} == set(PACKAGES)

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    before = {p.name for p in Path(purelib).iterdir()}
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    installed = {p.name for p in Path(purelib).iterdir()} - before
    assert installed == {"terascale", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    # the dependencies (numpy, pyarrow, pyspark, ...) from this venv, as a plain path entry
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    run = lambda *a: subprocess.run(a, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # noqa: E731
    r = run(str(env_dir / "bin" / "terascale"), "--help")
    assert r.returncode == 0 and "featurize" in r.stdout and "train" in r.stdout, r.stderr[-2000:]
    r = run(str(py), str(ROOT / "jobs" / "submit" / "featurize.py"), "--help")
    assert r.returncode == 0 and "--input" in r.stdout, r.stderr[-2000:]
    r = run(str(py), "-c", "import terascale.jobs.cli as c, terascale.solvers.api; print(c.__file__)")
    assert r.returncode == 0 and r.stdout.strip().startswith(purelib), r.stderr[-2000:]
    for bare in PACKAGES:  # nothing installed under the bare names any more
        r = run(str(py), "-c", f"import {bare}")
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr


@pytest.mark.parametrize("top", PACKAGES)
def test_no_module_imports_a_bare_top_level_name(top):
    """Every import names the namespace (a bare ``import solvers`` works only in the source tree)."""
    import ast

    for path in (ROOT / top).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in PACKAGES, f"{path}: import {name}"
