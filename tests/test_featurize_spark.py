"""The featurize job on a real Spark session: row conservation, exact rows, quarantine, commit."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.pipeline.artifacts import OutputError
from terascale.pipeline.fsutil import InputError
from terascale.pipeline.generate import MALFORMED_KINDS, generate_clicklogs
from terascale.pipeline.groups import read_groups
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.spark_featurize import FeaturizeError, run_featurize
from terascale.pipeline.spec import FeatureSpec, criteo_tokens, indices_values

pytestmark = pytest.mark.spark

CONJ = (("C6", "C9"), ("I2", "C14"))


def _spec(**kw) -> FeatureSpec:
    base = dict(fields=CRITEO_FIELDS, bits=18, seed=5, conjunctions=CONJ)
    base.update(kw)
    return FeatureSpec(**base)


def _fconf(*sets):
    return load_config([], list(sets)).featurize


def _expected_rows(paths, spec):
    """Multiset of (label, indices, values) the reference builds from every good line."""
    out = Counter()
    for p in paths:
        opener = gzip.open if str(p).endswith(".gz") else open
        with opener(p, "rb") as f:
            for raw in f.read().split(b"\n"):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                fields = line.split("\t")
                if len(line) > 65536 or len(fields) != 40 or fields[0] not in ("0", "1"):
                    continue
                try:
                    rec = dict(zip(CRITEO_FIELDS, fields[1:], strict=True))
                    toks = criteo_tokens(rec, spec.fields, spec.int_bucketing, spec.conjunctions)
                except ValueError:
                    continue
                if any(fields[k] and not fields[k].lstrip("+-").isdigit() for k in range(1, 14)):
                    continue
                idx, val = indices_values(toks, spec.bits, spec.seed)
                out[(float(fields[0]), tuple(idx), tuple(val))] += 1
    return out


def _written_rows(out_dir):
    m = read_manifest(str(out_dir))
    got = Counter()
    for f in m["files"]:
        t = pq.read_table(os.path.join(out_dir, f["path"]))
        for lab, idx, val in zip(t["label"].to_pylist(), t["indices"].to_pylist(), t["values"].to_pylist(), strict=True):
            got[(lab, tuple(idx), tuple(val) if val is not None else (1.0,) * len(idx))] += 1
    return got


@pytest.fixture(scope="module")
def raw_logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    s = generate_clicklogs(d, 12_000, files=3, seed=4, malformed_rate=0.03, processes=1)
    assert all(s["malformed"][k] > 0 for k in MALFORMED_KINDS)
    return d, s


def test_rows_are_conserved_exact_and_quarantined_with_reasons(spark, raw_logs, tmp_path):
    raw, gen = raw_logs
    out = tmp_path / "ds"
    spec = _spec()
    m = run_featurize(spark, [str(raw / "*.tsv")], str(out), spec, _fconf())

    # invariant 1, per input file: lines in = rows written + rows quarantined
    assert len(m["per_input"]) == 3
    for p in m["per_input"]:
        with open(p["path"], "rb") as f:
            lines = f.read().count(b"\n")
        assert p["lines"] == lines == p["rows"] + p["quarantined"]
    assert m["lines"] == 12_000 and m["rows"] + m["quarantine"]["rows"] == 12_000
    assert m["quarantine"]["by_reason"] == {k: v for k, v in sorted(gen["malformed"].items()) if v}

    # every written row equals the plain-Python reference of its line
    assert _written_rows(out) == _expected_rows(sorted(raw.glob("*.tsv")), spec)

    # quarantine rows name the file, line and byte offset of the original line
    q = pq.read_table(out / m["quarantine"]["files"][0]).to_pylist()
    allq = [r for f in m["quarantine"]["files"] for r in pq.read_table(out / f).to_pylist()]
    assert len(allq) == m["quarantine"]["rows"] and q
    for r in allq:
        with open(r["source"], "rb") as f:
            data = f.read()
        line = data.split(b"\n")[r["line"] - 1]
        assert data[r["offset"]:r["offset"] + r["length"]] == line[: r["length"]]
        assert r["raw"] == line[: len(r["raw"])]
        assert r["reason"] in MALFORMED_KINDS
        assert r["truncated"] == (len(r["raw"]) < len(line))

    # manifest contents
    assert m["spec"]["bits"] == 18 and m["spec"]["conjunctions"] == [list(p) for p in CONJ]
    assert m["rows"] == sum(f["rows"] for f in m["files"])
    assert m["label_mean"] == pytest.approx(m["positives"] / m["rows"])
    assert 0.2 < m["label_mean"] < 0.3
    assert 0 < m["distinct_features"] <= 2**18
    assert m["groups"]["buckets"] == m["distinct_features"] and m["groups"]["names"] == [*CRITEO_FIELDS, "C6^C9", "I2^C14"]
    assert not (out / "_temporary").exists()
    schema = pq.read_schema(out / m["files"][0]["path"])
    assert [str(schema.field(c).type) for c in ("label", "weight", "indices", "values")] == [
        "float", "float", "list<element: int32 not null>", "list<element: float not null>"]


def test_rerun_is_idempotent_and_replaces_the_old_output(spark, raw_logs, tmp_path):
    raw, _ = raw_logs
    out = tmp_path / "ds"
    spec = _spec(conjunctions=())
    m1 = run_featurize(spark, [str(raw)], str(out), spec, _fconf("featurize.partitions=4"))
    rows1 = _written_rows(out)
    groups1 = read_groups(str(out), m1)
    (out / "part-00099.parquet").write_bytes(b"stale")  # a leftover of some older run
    with pytest.raises(OutputError, match=r"exists and is a terascale dataset \(_manifest.json\); pass --overwrite"):
        run_featurize(spark, [str(raw)], str(out), spec, _fconf("featurize.partitions=3"))
    m2 = run_featurize(spark, [str(raw)], str(out), spec, _fconf("featurize.partitions=3", "featurize.overwrite=true"))
    assert _written_rows(out) == rows1
    assert m2["rows"] == m1["rows"] and len(m2["files"]) == 3
    np.testing.assert_array_equal(read_groups(str(out), m2), groups1)  # the group map does not depend on the split
    assert m2["groups"] == m1["groups"] and m2["distinct_features"] == m1["distinct_features"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["_groups.npy", "_manifest.json", "_quarantine", "part-00000.parquet", "part-00001.parquet",
                     "part-00002.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging, no aside


def test_cut_files_gzip_and_line_numbers(spark, raw_logs, tmp_path):
    raw, _ = raw_logs
    one = tmp_path / "one.tsv"
    with open(one, "wb") as w:
        for p in sorted(raw.glob("*.tsv")):
            w.write(p.read_bytes())
    gz = tmp_path / "gz" / "one.tsv.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(one.read_bytes()))
    spec = _spec()
    a = run_featurize(spark, [str(one)], str(tmp_path / "a"), spec, _fconf("featurize.partitions=5"))
    b = run_featurize(spark, [str(gz)], str(tmp_path / "b"), spec, _fconf())
    assert _written_rows(tmp_path / "a") == _written_rows(tmp_path / "b") == _expected_rows([one], spec)
    assert len(a["files"]) == 5  # one plain file cut into 5 line-aligned ranges
    lines = one.read_bytes().split(b"\n")
    for m, d in ((a, tmp_path / "a"), (b, tmp_path / "b")):
        rows = [r for f in m["quarantine"]["files"] for r in pq.read_table(d / f).to_pylist()]
        assert rows and all(lines[r["line"] - 1].startswith(r["raw"]) for r in rows)
        assert sorted(r["line"] for r in rows) == sorted(r["line"] for r in rows)  # unique per file below
        assert len({r["line"] for r in rows}) == len(rows)


def test_on_error_fail_names_file_and_line_and_commits_nothing(spark, tmp_path):
    good = "\t".join(["1"] + ["1"] * 13 + ["ab"] * 26)
    src = tmp_path / "in.tsv"
    src.write_text(f"{good}\n{good}\n{good[:-3]}\n{good}\n")
    out = tmp_path / "ds"
    with pytest.raises(FeaturizeError, match=rf"{src}:3: malformed line \(wrong_field_count\) at byte offset {2 * (len(good) + 1)}"):
        run_featurize(spark, [str(src)], str(out), _spec(), _fconf("featurize.on_error=fail"))
    assert not (out / "_manifest.json").exists()
    assert not list(out.glob("part-*"))


def test_libsvm_end_to_end(spark, tmp_path):
    src = tmp_path / "a.svm"
    src.write_text("+1 3:1 1:0.5\n-1 2:1\n1 9999:1\nbad line\n0 4:1 4:1\n")
    spec = FeatureSpec(format="libsvm", bits=10)
    out = tmp_path / "ds"
    m = run_featurize(spark, [str(src)], str(out), spec, _fconf("featurize.format=libsvm"))
    assert (m["rows"], m["quarantine"]["by_reason"]) == (3, {"bad_label": 1, "index_out_of_range": 1})
    assert _written_rows(out) == Counter({(1.0, (0, 2), (0.5, 1.0)): 1, (0.0, (1,), (1.0,)): 1, (0.0, (3,), (2.0,)): 1})


def test_missing_inputs_are_named(spark, tmp_path):
    with pytest.raises(InputError, match="nope.tsv': no such file or directory"):
        run_featurize(spark, [str(tmp_path / "nope.tsv")], str(tmp_path / "o"), _spec(), _fconf())
    with pytest.raises(InputError, match=r"\*.csv': matches no files"):
        run_featurize(spark, [str(tmp_path / "*.csv")], str(tmp_path / "o"), _spec(), _fconf())


@pytest.mark.slow
def test_retried_task_neither_duplicates_nor_loses_rows(raw_logs, tmp_path):
    """A real retry: Spark local[2,2] re-runs a task whose first attempt died mid-write."""
    raw, _ = raw_logs
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "terascale.jobs.cli", "featurize", "--input", str(raw), "--output", str(out),
           "--set", "spark.master=local[2,2]", "--set", "featurize.partitions=3",
           "--set", "featurize.inject_fail_task=1", "--set", "featurize.bits=18", "--set", "featurize.seed=5",
           "--set", "featurize.conjunctions=[]"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "inject_fail_task: task 1 fails on purpose" in r.stderr  # Spark logged the failed attempt
    m = json.loads((out / "_manifest.json").read_text())
    assert m["rows"] + m["quarantine"]["rows"] == 12_000
    assert _written_rows(out) == _expected_rows(sorted(raw.glob("*.tsv")), _spec(conjunctions=()))
    shutil.rmtree(out)
