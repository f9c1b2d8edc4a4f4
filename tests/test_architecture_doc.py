"""docs/pages/explanation/architecture.md's loss and solver tables are the catalogue's, rendered."""

from __future__ import annotations

from pathlib import Path

from terascale.solvers.catalogue import LOSSES, SOLVERS, markdown_tables

DOC = Path(__file__).resolve().parents[1] / "docs" / "pages" / "explanation" / "architecture.md"


def test_the_tables_equal_the_catalogue():
    text = DOC.read_text()
    begin = text.index("-->", text.index("<!-- catalogue:begin")) + len("-->\n")
    end = text.index("<!-- catalogue:end -->")
    assert text[begin:end] == markdown_tables(), "regenerate with terascale.solvers.catalogue.markdown_tables()"
    for name in (*LOSSES, *SOLVERS):
        assert f"`{name}`" in text[begin:end]
