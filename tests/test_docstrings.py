"""Docstrings name things that exist.

Every dotted reference to one of terascale's modules in a docstring or comment of
pipeline/, allreduce/, solvers/ or jobs/ (``pipeline.spec``, ``terascale.solvers.lbfgs.LBFGSPhase``,
:mod:`allreduce.ciphers`, :func:`~solvers.active.agree_marks`) must import, and name an attribute of
the module it imports; a bare ``pipeline.x`` means ``terascale.pipeline.x``. A reference that is a
configuration key instead (``allreduce.cipher``: the schema has an ``allreduce`` section) counts
when the schema has that key. "invariant N" must be one of the numbered invariants of GUIDE §3.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "allreduce", "solvers", "jobs")
#: GUIDE.md §3 numbers its invariants 1..9 (checked against the guide below when it is present).
GUIDE_INVARIANTS = range(1, 11)  # GUIDE §3: 1..10 (10: cost and memory scale as the data does)
GUIDE = ROOT.parent / "shared" / "GUIDE.md"

#: References known to be broken in files that are being edited elsewhere:
#: (file, reference) -> why. Empty: every reference resolves.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}

_DOTTED = r"(?:terascale(?:\.\w+)+|(?:pipeline|allreduce|solvers|jobs)(?:\.\w+)+)"
# ``dotted`` or ``dotted()``; a Sphinx role :x:`dotted`, :x:`~dotted` or :x:`title <dotted>`
_REFERENCE = re.compile(rf"``~?({_DOTTED})(?:\(\))?``|:\w+:`(?:[^`<]*<)?~?({_DOTTED})>?`")
_INVARIANT = re.compile(r"\binvariants?\s+(\d+(?:\s*(?:,|and|or)\s*\d+)*)", re.IGNORECASE)


def _texts(source: str) -> list[str]:
    """The docstrings (module, classes, functions) and the comments of a module's source."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                texts.append(doc)
    texts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return texts


def references(text: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in _REFERENCE.finditer(text)]


def invariant_numbers(text: str) -> list[int]:
    return [int(n) for m in _INVARIANT.finditer(text) for n in re.findall(r"\d+", m.group(1))]


@functools.cache
def _config_keys() -> frozenset[str]:
    from terascale.jobs.config import all_keys

    return frozenset(all_keys())


def resolves(reference: str) -> bool:
    """The longest importable module prefix of ``reference`` has the rest as attributes, or the
    reference is a configuration key."""
    full = reference if reference.startswith("terascale.") else "terascale." + reference
    parts = full.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not (".".join(parts[:i]) + ".").startswith(e.name + "."):
                raise  # the module exists but needs a package this environment lacks: say so
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return reference in _config_keys()
            obj = getattr(obj, name)
        return True
    return reference in _config_keys()


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _all_references() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), ref) for p in _modules()
            for text in _texts(p.read_text(encoding="utf-8")) for ref in references(text)]


def test_the_checker_finds_broken_references():
    doc = ("The bulk kernels (``pipeline.kernels``), :mod:`solvers.registry`, ``terascale.jobs.nothing``"
           " and :func:`~allreduce.ciphers.no_such_function` (invariant 12).")
    assert references(doc) == ["pipeline.kernels", "solvers.registry", "terascale.jobs.nothing",
                               "allreduce.ciphers.no_such_function"]
    assert not any(resolves(r) for r in references(doc))
    assert invariant_numbers(doc) == [12]
    good = ("``pipeline.spec``, ``terascale.pipeline.spec.FeatureSpec``, :class:`~jobs.config.ConfigError`,"
            " :meth:`join <allreduce.node.TreeNode.join>`, ``solvers.api.train()``, ``allreduce.cipher``"
            " (invariants 6 and 7)")
    assert references(good) == ["pipeline.spec", "terascale.pipeline.spec.FeatureSpec", "jobs.config.ConfigError",
                                "allreduce.node.TreeNode.join", "solvers.api.train", "allreduce.cipher"]
    assert all(resolves(r) for r in references(good))
    assert invariant_numbers(good) == [6, 7]


def test_module_references_resolve():
    found = _all_references()
    assert len(found) > 100  # the scan sees the references it is meant to check
    broken = [f"{path}: {ref}" for path, ref in found
              if (path, ref) not in KNOWN_BROKEN and not resolves(ref)]
    assert not broken, "docstring references to nothing:\n" + "\n".join(broken)


def test_known_exceptions_are_still_broken():
    found = set(_all_references())
    stale = [f"{path}: {ref}" for (path, ref) in KNOWN_BROKEN if (path, ref) not in found or resolves(ref)]
    assert not stale, "fixed or gone, remove from KNOWN_BROKEN:\n" + "\n".join(stale)


def test_invariant_numbers_exist():
    bad = [f"{p.relative_to(ROOT).as_posix()}: invariant {n}" for p in _modules()
           for text in _texts(p.read_text(encoding="utf-8")) for n in invariant_numbers(text)
           if n not in GUIDE_INVARIANTS]
    assert not bad, f"GUIDE §3 has invariants {GUIDE_INVARIANTS.start}..{GUIDE_INVARIANTS.stop - 1}:\n" + "\n".join(bad)


@pytest.mark.skipif(not GUIDE.is_file(), reason="the shared GUIDE.md is not beside this checkout")
def test_guide_numbers_its_invariants_as_assumed():
    section = re.search(r"^## 3\. Invariants.*?$(.*?)^## ", GUIDE.read_text(encoding="utf-8"), re.M | re.S)
    assert section, "GUIDE.md has no section '## 3. Invariants'"
    numbers = [int(n) for n in re.findall(r"^(\d+)\. ", section.group(1), re.M)]
    assert numbers == list(GUIDE_INVARIANTS)
