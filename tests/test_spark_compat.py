"""The supported Spark versions (pipeline/spark_compat.py): 3.5.x and 4.x pass, anything else is an
error naming the version found and the ones supported, before any JVM starts; a Java too old for
the Spark line is named likewise (a stand-in ``java`` that prints a version, as Java does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from terascale.pipeline.spark_compat import (
    BSS_SINCE,
    SparkVersionError,
    check_java,
    check_readable,
    check_version,
    java_major,
    parquet_encoding,
    parse_version,
)


@pytest.mark.parametrize("v, line", [("3.5.0", (3, 5)), ("3.5.9", (3, 5)), ("3.5.2-amzn-1", (3, 5)),
                                     ("4.0.0", (4, 0)), ("4.3.0", (4, 3)), ("4.9.1-SNAPSHOT", (4, 9))])
def test_supported_versions(v, line):
    assert parse_version(v) == line
    assert check_version(v) == line


@pytest.mark.parametrize("v", ["3.4.4", "3.3.0", "2.4.8", "5.0.0", "10.1"])
def test_unsupported_versions_name_the_version_and_the_supported_lines(v):
    with pytest.raises(SparkVersionError) as e:
        check_version(v, "pyspark")
    assert f"pyspark {v} is not supported" in str(e.value)
    assert "3.5.x and 4.x" in str(e.value) and "pyspark>=3.5,<5" in str(e.value)


def test_an_unreadable_version():
    with pytest.raises(SparkVersionError, match="cannot read the Spark version 'dev'"):
        check_version("dev")


def _fake_java(tmp_path: Path, banner: str) -> Path:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    java.chmod(0o755)
    return home


@pytest.mark.parametrize("banner, major", [
    ('openjdk version "17.0.9" 2023-10-17', 17),
    ('openjdk version "21" 2023-09-19', 21),
    ('java version "1.8.0_392"', 8),
    ('openjdk version "11.0.21" 2023-10-17', 11),
    ("no version here", None),
])
def test_java_major(tmp_path, banner, major):
    assert java_major(str(_fake_java(tmp_path, banner) / "bin" / "java")) == major


def test_java_major_of_a_missing_java(tmp_path):
    assert java_major(str(tmp_path / "nowhere" / "java")) is None


def test_spark4_needs_java17_and_spark35_runs_on_java11(tmp_path):
    java = str(_fake_java(tmp_path, 'openjdk version "11.0.21" 2023-10-17') / "bin" / "java")
    with pytest.raises(SparkVersionError) as e:
        check_java((4, 0), java)
    assert "Spark 4.0 needs Java 17 or later" in str(e.value) and "is Java 11" in str(e.value)
    assert "JAVA_HOME" in str(e.value)
    check_java((3, 5), java)  # Spark 3.5 runs on Java 8, 11 and 17


# a CLI job in a fresh process whose pyspark claims another version: the error comes before any
# JVM starts (pyspark's gateway stays None)
_CLI = """
import sys, pyspark
pyspark.__version__ = sys.argv[1]
from pyspark import SparkContext
from terascale.jobs.cli import main
rc = main(sys.argv[2:])
print("rc", rc, "gateway", SparkContext._gateway)
"""


def _cli(version: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CLI, version, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_refuses_an_older_pyspark_before_spark_starts(tmp_path):
    from terascale.pipeline.generate import generate_clicklogs

    generate_clicklogs(str(tmp_path / "raw"), 200, files=1, seed=1)
    r = _cli("3.4.1", ["featurize", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out")])
    assert "rc 2 gateway None" in r.stdout, r.stdout + r.stderr
    assert "terascale featurize: error: pyspark 3.4.1 is not supported: terascale supports Spark 3.5.x and 4.x" \
        in r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_names_a_java_too_old_for_spark4(tmp_path):
    from terascale.pipeline.generate import generate_clicklogs

    generate_clicklogs(str(tmp_path / "raw"), 200, files=1, seed=1)
    home = _fake_java(tmp_path, 'openjdk version "11.0.21" 2023-10-17')
    r = _cli("4.3.0", ["featurize", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out")],
             env={"JAVA_HOME": str(home)})
    assert "rc 2 gateway None" in r.stdout, r.stdout + r.stderr
    assert "Spark 4.3 needs Java 17 or later" in r.stderr and "is Java 11" in r.stderr


def test_the_parquet_encoding_follows_the_sessions_spark():
    for version in ("3.5.9", "4.0.5", "4.1.4", "4.2.1"):
        assert parquet_encoding("auto", version) == "delta_binary_packed"
    assert parquet_encoding("auto", "4.3.0") == parquet_encoding("auto", "4.9.0") == "byte_stream_split"
    assert parquet_encoding("plain", "4.3.0") == "plain"
    assert parquet_encoding("delta_binary_packed", "4.3.0") == "delta_binary_packed"
    assert parquet_encoding("byte_stream_split", "3.5.9") == "byte_stream_split"  # asked for: written as asked
    check_readable("byte_stream_split", "4.3.0", "d")
    check_readable("plain", "3.5.9", "d")
    check_readable("spark", "3.5.9", "d")
    with pytest.raises(SparkVersionError, match=r"Spark 3\.5\.9 cannot read the dataset d: its indices are encoded "
                                                r"BYTE_STREAM_SPLIT, which Spark reads from 4\.3"):
        check_readable(None, "3.5.9", "the dataset d")  # a manifest from before the option: byte_stream_split


def _encodings(dataset: Path) -> set[str]:
    import pyarrow.parquet as pq

    out = set()
    for f in sorted(dataset.glob("part-*.parquet")):
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            col = next(md.row_group(g).column(c) for c in range(md.num_columns)
                       if md.row_group(g).column(c).path_in_schema == "indices.list.element")
            out |= set(col.encodings)
    return out


@pytest.mark.spark
@pytest.mark.parametrize("setting", ["auto", "plain", "byte_stream_split", "delta_binary_packed"])
def test_featurize_writes_the_encoding_it_records_and_spark_reads_what_auto_picks(spark, tmp_path, setting):
    from terascale.jobs.config import CRITEO_FIELDS, load_config
    from terascale.jobs.ml_data import indices_encoding
    from terascale.pipeline.generate import generate_clicklogs
    from terascale.pipeline.manifest import read_manifest
    from terascale.pipeline.spark_featurize import run_featurize
    from terascale.pipeline.spec import FeatureSpec

    generate_clicklogs(str(tmp_path / "raw"), 500, files=1, seed=3, processes=1)
    out = tmp_path / "ds"
    fconf = load_config([], ["featurize.partitions=2", f"featurize.parquet_encoding={setting}"]).featurize
    run_featurize(spark, [str(tmp_path / "raw")], str(out), FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0), fconf)
    want = parquet_encoding(setting, spark.version)
    assert indices_encoding(read_manifest(str(out))) == want
    assert _encodings(out) - {"RLE"} == {want.upper()}
    if setting == "auto":  # what auto picks, this Spark reads: every row, every index
        import pyarrow.parquet as pq

        rows = spark.read.parquet(str(out)).select("indices").collect()
        mine = pq.read_table(out, columns=["indices"]).column("indices").to_pylist()
        assert sorted(list(r["indices"]) for r in rows) == sorted(mine)


@pytest.mark.spark
def test_transform_of_a_dataset_this_spark_cannot_read_is_named(spark, tmp_path):
    """Before BSS_SINCE: a dataset featurized with byte_stream_split (on a newer Spark) is refused
    by name before Spark fails on it; from BSS_SINCE Spark scores it."""
    import json

    from terascale.jobs.config import CRITEO_FIELDS, load_config
    from terascale.jobs.ml import TerascaleModel
    from terascale.pipeline.generate import generate_clicklogs
    from terascale.pipeline.spark_featurize import run_featurize
    from terascale.pipeline.spec import FeatureSpec

    generate_clicklogs(str(tmp_path / "raw"), 300, files=1, seed=4, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=12, seed=0)
    fconf = load_config([], ["featurize.partitions=1", "featurize.parquet_encoding=byte_stream_split"]).featurize
    run_featurize(spark, [str(tmp_path / "raw")], str(tmp_path / "ds"), spec, fconf)
    import numpy as np

    model = TerascaleModel(np.zeros(1 << 12, np.float32), 0.0,
                           {"spec": json.loads(json.dumps(spec.to_json())), "config": {"train": {"loss": "logistic"}}})
    df = spark.read.parquet(str(tmp_path / "ds"))
    if parse_version(spark.version) < BSS_SINCE:
        with pytest.raises(SparkVersionError, match="cannot read the dataset .*BYTE_STREAM_SPLIT"):
            model.transform(df)
    else:
        probs = [r["probability"] for r in model.transform(df).select("probability").collect()]
        assert len(probs) == 300 - _quarantined(tmp_path / "ds") and set(probs) == {0.5}


def _quarantined(ds: Path) -> int:
    from terascale.pipeline.manifest import read_manifest

    return read_manifest(str(ds))["quarantine"]["rows"]


@pytest.mark.parametrize("version, error", [("3.5.9", True), ("4.0.0", False)])
def test_pandas_is_asked_for_by_name_on_spark35_only(version, error):
    """pyspark 3.5 checks for pandas on the driver before any Arrow stage: without it, the error
    says what to install (a process where ``import pandas`` fails, as where it is not installed)."""
    code = ("import sys, pyspark; sys.modules['pandas'] = None; pyspark.__version__ = sys.argv[1]\n"
            "from terascale.pipeline.spark_compat import require_pandas\n"
            "try:\n    require_pandas('featurize through Spark')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "else:\n    print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, version], capture_output=True, text=True, timeout=60)
    if error:
        assert r.stdout.strip() == ("SparkVersionError featurize through Spark on pyspark 3.5.9 needs pandas on the "
                                    "driver (pyspark 3.5 checks for it before any Arrow stage): pip install 'pandas>=2.2'")
    else:
        assert r.stdout.strip() == "ok"
