"""Planning: output file counts, byte-range cuts that tile each file, balanced assignment."""

from __future__ import annotations

import pytest

from terascale.pipeline.blocks import align_range
from terascale.pipeline.fsutil import InputFile
from terascale.pipeline.plan import assign, output_files, plan_ranges

MB = 1 << 20


def test_explicit_partitions_win():
    assert output_files([InputFile("a", 10 * MB, False)], "criteo", 7, 128, 2) == 7


@pytest.mark.parametrize(
    "sizes, gz, want",
    [
        ([1000], False, 1),  # tiny input: one file
        ([40 * MB], False, 2),  # small but worth both cores
        ([500 * MB], False, 4),  # ~325 MB of output at 128 MB -> 3, rounded up to a multiple of 2 cores
        ([100 * MB], True, 4),  # gzip counts as ~4x larger
    ],
)
def test_auto_partitions(sizes, gz, want):
    files = [InputFile(f"f{i}", s, gz) for i, s in enumerate(sizes)]
    assert output_files(files, "criteo", 0, 128, 2) == want


def test_ranges_tile_each_file_and_gzip_stays_whole():
    files = [InputFile("a", 1000, False), InputFile("b", 10, False), InputFile("c.gz", 5000, True)]
    ranges = plan_ranges(files, 4)
    a = [r for r in ranges if r.uri == "a"]
    assert a[0].start == 0 and a[-1].end == 1000
    assert all(x.end == y.start for x, y in zip(a, a[1:], strict=False))
    assert [r for r in ranges if r.uri == "c.gz"][0].end == 5000
    assert len([r for r in ranges if r.uri == "b"]) == 1


def test_assignment_is_balanced_and_complete():
    files = [InputFile(f"f{i}", s, False) for i, s in enumerate([100, 90, 80, 70, 60, 50, 40, 30])]
    tasks = assign(plan_ranges(files, 4), 4)
    loads = [sum(r.end - r.start for r in t) for t in tasks]
    assert sum(loads) == 520 and max(loads) - min(loads) <= 40
    assert sorted(r.uri for t in tasks for r in t) == sorted(f.uri for f in files)


@pytest.mark.parametrize("data", [b"", b"a\nbb\nccc\n", b"a\nbb\nccc", b"\n\n\n", b"x" * 50 + b"\n" + b"y" * 3])
def test_aligned_ranges_tile_lines_exactly(tmp_path, data):
    p = tmp_path / "f.txt"
    p.write_bytes(data)
    for k in range(1, 8):
        bounds = [len(data) * i // k for i in range(k + 1)]
        parts = [align_range(str(p), bounds[i], bounds[i + 1], len(data)) for i in range(k)]
        assert parts[0][0] == 0 and parts[-1][1] == len(data)
        assert all(x[1] == y[0] for x, y in zip(parts, parts[1:], strict=False))
        assert all(s in (0, len(data)) or data[s - 1:s] == b"\n" for s, _, _ in parts)
        assert sum(n for _, _, n in parts) == data.count(b"\n")
