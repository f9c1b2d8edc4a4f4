"""docs/pages/explanation/reliability.md names, for every fault, the test that proves it: each named test exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def _references() -> list[tuple[str, str | None]]:
    rows = [line for line in (ROOT / "docs" / "pages" / "explanation" / "reliability.md").read_text().splitlines() if line.startswith("| ")]
    refs = []
    for row in rows[1:]:
        cell = row.rstrip(" |").rsplit("|", 1)[-1]
        refs.extend(REF.findall(cell))
    return refs


def test_every_row_names_a_test():
    rows = [line for line in (ROOT / "docs" / "pages" / "explanation" / "reliability.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| fault")]
    untested = [r[:80] for r in rows if not REF.search(r.rstrip(" |").rsplit("|", 1)[-1])]
    assert not untested, untested


def test_every_named_test_exists():
    refs = _references()
    assert len(refs) > 50
    missing = []
    for path, name in refs:
        f = ROOT / path
        if not f.is_file():
            missing.append(path)
        elif name and not re.search(rf"^\s*def {name}\(", f.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, missing
