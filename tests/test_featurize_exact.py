"""A featurize task's decoded output equals a slow, obvious reference, row for row, in order.

``run_task`` (outside Spark: the function each Spark task runs) on generated logs with every kind
of malformed line, plus non-ASCII tokens, CRLF endings and rows whose tokens collide, read as
plain TSV and as a multi-member gzip file whose members split a line (inflated by ISA-L, and by
zlib as where isal is missing), in small blocks and row groups. The reference parses each line in Python and hashes each token with ``mmh3``
(``spec.indices_values``). Whatever the reading, inflating, Arrow building and Parquet encoding
do, the Parquet file must decode to exactly these rows.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib

import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS
from terascale.pipeline import blocks
from terascale.pipeline.blocks import Piece
from terascale.pipeline.featurize_task import DATA_FILE, QUARANTINE_FILE, TaskOptions, run_task
from terascale.pipeline.generate import MALFORMED_KINDS, generate_clicklogs
from terascale.pipeline.spec import FeatureSpec, criteo_tokens, indices_values

SPEC = FeatureSpec(fields=CRITEO_FIELDS, bits=10, seed=11, conjunctions=(("C6", "C9"), ("I2", "C14")))
MAX_LINE = 4096
_INT = re.compile(r"[+-]?[0-9]+")


def _reason(line: bytes) -> str | None:
    """featurize's reason for a malformed line (its checks in their order), None for a good one."""
    if not line:
        return "empty_line"
    if len(line) > MAX_LINE:
        return "line_too_long"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    fields = text.split("\t")
    if len(fields) != 40:
        return "wrong_field_count"
    if fields[0] not in ("0", "1"):
        return "bad_label"
    if any(f and not _INT.fullmatch(f) for f in fields[1:14]):
        return "bad_integer"
    return None


def _reference(data: bytes) -> tuple[list[tuple], list[tuple[int, str]]]:
    """(rows [(label, weight, indices, values or None)], quarantined [(line number, reason)])."""
    rows, bad = [], []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for n, line in enumerate(lines, 1):
        line = line[:-1] if line.endswith(b"\r") else line
        reason = _reason(line)
        if reason:
            bad.append((n, reason))
            continue
        fields = line.decode("utf-8").split("\t")
        rec = dict(zip(CRITEO_FIELDS, fields[1:], strict=True))
        idx, val = indices_values(criteo_tokens(rec, SPEC.fields, SPEC.int_bucketing, SPEC.conjunctions),
                                  SPEC.bits, SPEC.seed)
        rows.append((float(fields[0]), 1.0, idx, None if all(v == 1.0 for v in val) else val))
    return rows, bad


def _line(label: str, ints: list[str], cats: list[str], end: bytes = b"\n") -> bytes:
    return "\t".join([label, *ints, *cats]).encode("utf-8") + end


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("exact")
    gen = generate_clicklogs(d, 4_000, files=1, seed=21, malformed_rate=0.02, processes=1)
    assert all(gen["malformed"][k] > 0 for k in MALFORMED_KINDS)
    data = (d / "part-00000.tsv").read_bytes()
    ints = [str(v) for v in (0, 1, 2, 3, 250, -7, "", 65535, 65536, 99999999, 123456789, -1024, "+5")]
    odd = [
        _line("1", ints, ["日本ab", "é" * 4, "Ünïcödé-token", "ascii8ch", "€", ""] + ["x"] * 20),  # 8-byte UTF-8 values
        _line("0", ints, ["ab"] * 26, b"\r\n"),  # CRLF; equal values: no collision (different fields)
        _line("1", [""] * 13, [""] * 26),  # no token at all: an empty row
        _line("0", ints, ["cafécafé", "naïve", "", "😀😀"] + ["y"] * 22),
    ]
    cut = len(data) // 2
    cut = data.index(b"\n", cut) + 1
    return data[:cut] + b"".join(odd) + data[cut:] + b"".join(odd)


def _decoded(attempt: str) -> tuple[list[tuple], list[tuple[int, str]]]:
    t = pq.read_table(os.path.join(attempt, DATA_FILE))
    rows = list(zip(t["label"].to_pylist(), t["weight"].to_pylist(), t["indices"].to_pylist(),
                    t["values"].to_pylist(), strict=True))
    q = os.path.join(attempt, QUARANTINE_FILE)
    bad = [(r["line"], r["reason"]) for r in pq.read_table(q).to_pylist()] if os.path.exists(q) else []
    return rows, bad


@pytest.mark.parametrize("form", ["plain", "gzip", "gzip-zlib"])
def test_task_output_decodes_to_the_reference_rows_in_order(logs, tmp_path, form, monkeypatch):
    if form == "gzip-zlib":  # the inflater used where isal is not installed
        monkeypatch.setattr(blocks, "_inflate_lib", zlib)
    if form == "plain":
        path = tmp_path / "in.tsv"
        path.write_bytes(logs)
        piece = Piece(str(path), 0, len(logs), 1, False)
    else:  # two gzip members, the second starting inside a line
        path = tmp_path / "in.tsv.gz"
        k = len(logs) // 3 + 17
        path.write_bytes(gzip.compress(logs[:k], 1) + gzip.compress(logs[k:], 9))
        piece = Piece(str(path), 0, -1, 1, True)
    opts = TaskOptions(max_line_bytes=MAX_LINE, block_bytes=1 << 16, on_error="quarantine", compression="snappy",
                       row_group_rows=700)
    r = run_task(0, [piece], SPEC, opts, str(tmp_path / "attempt"))
    rows, bad = _decoded(str(tmp_path / "attempt"))
    want_rows, want_bad = _reference(logs)
    assert any(v is not None for *_, v in want_rows) and any(len(i) == 0 for _, _, i, _ in want_rows)
    assert rows == want_rows
    assert bad == want_bad
    assert r["rows"] == len(want_rows) and r["nnz"] == sum(len(i) for _, _, i, _ in want_rows)
    assert r["multi_rows"] == sum(v is not None for *_, v in want_rows)
    md = pq.ParquetFile(str(tmp_path / "attempt" / DATA_FILE)).metadata
    assert md.num_row_groups > 2


_NUMBERED = b"".join(b"0\t%d\n" % i for i in range(3000))


@pytest.mark.parametrize("data", [gzip.compress(_NUMBERED)[:-1000], _NUMBERED,
                                  gzip.compress(_NUMBERED) + b"\x1f\x8bjunk" * 8],
                         ids=["truncated", "not gzip", "junk after a member"])
def test_a_bad_gzip_file_is_an_error_naming_it(tmp_path, data):
    path = tmp_path / "bad.tsv.gz"
    path.write_bytes(data)
    opts = TaskOptions(max_line_bytes=MAX_LINE, block_bytes=1 << 16, on_error="quarantine", compression="snappy")
    with pytest.raises(OSError, match="bad.tsv.gz"):
        run_task(0, [Piece(str(path), 0, -1, 1, True)], SPEC, opts, str(tmp_path / "attempt"))


def test_an_empty_gzip_file_has_no_lines(tmp_path):
    path = tmp_path / "empty.tsv.gz"
    path.write_bytes(b"")
    opts = TaskOptions(max_line_bytes=MAX_LINE, block_bytes=1 << 16, on_error="quarantine", compression="snappy")
    r = run_task(0, [Piece(str(path), 0, -1, 1, True)], SPEC, opts, str(tmp_path / "attempt"))
    assert r["rows"] == 0 and r["inputs"][str(path)]["lines"] == 0
