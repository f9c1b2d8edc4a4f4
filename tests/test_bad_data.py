"""Bad data files: one clear error naming the file (and row group) and both counts, raised on the
driver where the footers tell, never retried; empty featurize inputs; the bits limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terascale.jobs.cli import main
from terascale.jobs.config import CRITEO_FIELDS, load_config
from terascale.jobs.scoring import evaluate, predict
from terascale.jobs.train_job import TrainError, run_train
from terascale.pipeline.generate import generate_clicklogs
from terascale.pipeline.manifest import DatasetError
from terascale.pipeline.spark_featurize import EmptyInputError, run_featurize
from terascale.pipeline.spec import MAX_BITS, FeatureSpec
from terascale.pipeline.verify import DataFileError, read_row_groups

QUICK = ["train.solver=online", "train.l2=1e-6", "train.passes=1", "train.workers=2", "train.holdout_period=0",
         "spark.master=local[2]"]


def _cfg(*sets):
    return load_config([], list(sets))


@pytest.fixture(scope="module")
def clean(spark, tmp_path_factory):
    """A 2000-row dataset in two files (one row group each), and a model trained on it."""
    d = tmp_path_factory.mktemp("bad")
    generate_clicklogs(d / "raw", 2000, files=1, seed=5, processes=1)
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=16, seed=0)
    run_featurize(spark, [str(d / "raw")], str(d / "ds"), spec, _cfg("featurize.partitions=2").featurize)
    run_train(spark, _cfg(*QUICK), str(d / "ds"), str(d / "model"))
    return d


def _copy(clean: Path, tmp_path: Path) -> tuple[Path, dict]:
    ds = tmp_path / "ds"
    shutil.copytree(clean / "ds", ds)
    return ds, json.loads((ds / "_manifest.json").read_text())


def _rewrite_manifest(ds: Path, m: dict) -> None:
    (ds / "_manifest.json").write_text(json.dumps(m))


def _indices_page(path: Path, row_group: int = 0) -> tuple[int, int]:
    """(first byte of the data pages, end) of the indices column chunk of a row group."""
    rg = pq.ParquetFile(path).metadata.row_group(row_group)
    cc = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema.startswith("indices."))
    start = cc.dictionary_page_offset or cc.data_page_offset
    return cc.data_page_offset, start + cc.total_compressed_size


def _all_jobs_refuse(spark, clean, ds, tmp_path, *needles):
    """train (through the CLI: exit 1, input error), evaluate and predict all refuse the dataset
    on the driver with the same message; no model and no predictions are written."""
    with pytest.raises(DataFileError) as e:
        run_train(spark, _cfg(*QUICK), str(ds), str(tmp_path / "m"))
    for n in needles:
        assert n in str(e.value)
    with pytest.raises(DataFileError, match=e.value.args[0].split(":")[0]):
        evaluate(spark, str(ds), str(clean / "model"))
    with pytest.raises(DataFileError, match=e.value.args[0].split(":")[0]):
        predict(spark, str(ds), str(clean / "model"), str(tmp_path / "pred"), ("label",))
    assert not (tmp_path / "m").exists() and not (tmp_path / "pred" / "_manifest.json").exists()
    return str(e.value)


def test_truncated_file_is_named_on_the_driver_with_exit_1(spark, clean, tmp_path, capsys):
    ds, m = _copy(clean, tmp_path)
    part = ds / m["files"][0]["path"]
    size = part.stat().st_size
    part.write_bytes(part.read_bytes()[: size // 2])
    msg = _all_jobs_refuse(spark, clean, ds, tmp_path, f"{part}: not a readable Parquet file, {size // 2} bytes",
                           f"{m['files'][0]['rows']} rows", f"{size} bytes")
    assert "magic bytes" in msg
    assert main(["train", "--input", str(ds), "--model", str(tmp_path / "m"), "--set", "spark.master=local[2]"]) == 1
    err = capsys.readouterr().err
    assert f"terascale train: input error: {part}: not a readable Parquet file" in err
    assert not (tmp_path / "m").exists()


def test_missing_file_is_named_with_its_manifest_counts(spark, clean, tmp_path):
    ds, m = _copy(clean, tmp_path)
    f = m["files"][1]
    (ds / f["path"]).unlink()
    _all_jobs_refuse(spark, clean, ds, tmp_path,
                     f"{ds / f['path']}: missing (the manifest lists it with {f['rows']} rows, {f['nnz']} non-zeros")


def test_manifest_claiming_more_rows_than_the_files_hold(spark, clean, tmp_path):
    ds, m = _copy(clean, tmp_path)
    held = m["files"][0]["rows"]
    assert m["rows"] == 2000
    m["rows"] = 4000  # the total only: the files' records still add up to 2000
    _rewrite_manifest(ds, m)
    _all_jobs_refuse(spark, clean, ds, tmp_path, f"{ds / '_manifest.json'}: says rows = 4000, but its 2 files "
                     f"hold 2000 ({held} + {2000 - held})")
    m["files"][0]["rows"] = held + 2000
    m["files"][1]["rows"] = 2000 - held + 0
    _rewrite_manifest(ds, m)
    _all_jobs_refuse(spark, clean, ds, tmp_path, f"{ds / m['files'][0]['path']}: holds {held} rows in 1 row group, "
                     f"{ds / '_manifest.json'} says {held + 2000}")


def test_manifest_disagreeing_on_non_zeros(spark, clean, tmp_path):
    ds, m = _copy(clean, tmp_path)
    f = m["files"][1]
    nnz = pq.read_table(ds / f["path"], columns=["indices"]).column("indices").combine_chunks().values
    assert len(nnz) == f["nnz"]
    f["nnz"] += 7
    m["nnz"] += 7
    _rewrite_manifest(ds, m)
    _all_jobs_refuse(spark, clean, ds, tmp_path, f"{ds / f['path']}: holds {f['nnz'] - 7} non-zeros "
                     f"(row group 0: {f['nnz'] - 7}), {ds / '_manifest.json'} says {f['nnz']}")


def test_corrupt_page_fails_the_train_job_once_naming_file_and_row_group(spark, clean, tmp_path, capsys):
    ds, m = _copy(clean, tmp_path)
    part = ds / m["files"][1]["path"]
    first, end = _indices_page(part)
    raw = bytearray(part.read_bytes())
    raw[(first + end) // 2] ^= 0x10  # one flipped bit inside the indices' data page
    part.write_bytes(bytes(raw))
    with pytest.raises(TrainError) as e:
        run_train(spark, _cfg(*QUICK, "train.max_attempts=3"), str(ds), str(tmp_path / "m"))
    msg = str(e.value)
    assert f"DataFileError: {part}: row group 0: cannot be read or decoded" in msg and "CRC checksum" in msg
    assert "not retried" in msg
    assert len(e.value.attempts) == 1 and e.value.attempts[0]["outcome"] == "failed"
    assert not (tmp_path / "m").exists()
    assert main(["train", "--input", str(ds), "--model", str(tmp_path / "m"), *[x for q in QUICK for x in ("--set", q)]]) == 1
    err = capsys.readouterr().err
    assert "terascale train: failed: terascale train: task " in err and ": terascale.pipeline.verify.DataFileError: " in err
    assert f"{part}: row group 0: cannot be read or decoded" in err and "(attempt 1, not retried" in err
    # scoring tasks report the file instead of failing (Spark would retry a failed task)
    with pytest.raises(DataFileError, match=f"{part}: row group 0: cannot be read or decoded"):
        evaluate(spark, str(ds), str(clean / "model"))
    with pytest.raises(DataFileError, match=f"{part}: row group 0"):
        predict(spark, str(ds), str(clean / "model"), str(tmp_path / "pred"), ("label",))
    assert not (tmp_path / "pred" / "_manifest.json").exists()
    assert not list((tmp_path / "pred").rglob("*.parquet"))


def test_corrupt_snappy_page_without_checksums_names_file_and_row_group(tmp_path):
    """A file written without page checksums (another writer): a garbled compressed page."""
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 6, 3000)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    idx = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1 << 16, offsets[-1], dtype=np.int32)))
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"label": np.zeros(3000, np.float32), "indices": idx}), path, row_group_size=1000,
                   compression="snappy")
    assert [len(read_row_groups(str(path), [g])) for g in range(3)] == [1000, 1000, 1000]
    first, end = _indices_page(path, 1)
    raw = bytearray(path.read_bytes())
    mid = first + (end - first) // 2
    raw[mid:mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))
    assert len(read_row_groups(str(path), [0])) == 1000  # the other row groups still read
    with pytest.raises(DataFileError, match=f"{path}: row group 1: cannot be read or decoded"):
        read_row_groups(str(path), [1])


def test_featurize_refuses_empty_inputs_unless_allowed(spark, tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.tsv").write_bytes(b"")
    (raw / "b.tsv").write_bytes(b"")
    spec = FeatureSpec(fields=CRITEO_FIELDS, bits=12)
    with pytest.raises(EmptyInputError, match=r"the inputs hold no line \(2 files of 0 bytes: .*a.tsv, .*b.tsv\)"):
        run_featurize(spark, [str(raw)], str(tmp_path / "o"), spec, _cfg().featurize)
    assert not (tmp_path / "o" / "_manifest.json").exists()
    assert main(["featurize", "--input", str(raw), "--output", str(tmp_path / "o"), "--set", "spark.master=local[2]"]) == 1
    assert "terascale featurize: input error: featurize: the inputs hold no line" in capsys.readouterr().err
    # every line malformed: lines but no rows
    (raw / "b.tsv").write_bytes(b"not a click log line\n")
    with pytest.raises(EmptyInputError, match=r"none of the 1 lines became a row \(.*a.tsv: 0 lines, 0 quarantined; "
                                              r".*b.tsv: 1 lines, 1 quarantined \(\w+=1\)\); nothing committed"):
        run_featurize(spark, [str(raw)], str(tmp_path / "o"), spec, _cfg().featurize)
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no staging directory left behind
    m = run_featurize(spark, [str(raw)], str(tmp_path / "o"), spec, _cfg("featurize.allow_empty=true").featurize)
    assert (m["rows"], m["lines"], m["files"]) == (0, 1, [])
    assert json.loads((tmp_path / "o" / "_manifest.json").read_text())["rows"] == 0
    with pytest.raises(DatasetError, match=r"the dataset has no rows \(featurized from 1 lines\); nothing to train on"):
        run_train(spark, _cfg(*QUICK), str(tmp_path / "o"), str(tmp_path / "m"))


def test_featurize_and_train_share_one_bits_limit(spark, clean, tmp_path, capsys):
    assert MAX_BITS == 30
    from terascale.solvers.shard import _MAX_FEATURES

    assert 1 << MAX_BITS <= _MAX_FEATURES < 1 << (MAX_BITS + 1)
    assert main(["config", "--set", "featurize.bits=31"]) == 2
    assert "featurize.bits = 31: must be an integer in [1, 30]" in capsys.readouterr().err
    assert load_config([], ["featurize.bits=30"]).featurize.bits == 30
    ds, m = _copy(clean, tmp_path)
    m["spec"]["bits"] = 31  # a dataset from a build that allowed 31
    _rewrite_manifest(ds, m)
    with pytest.raises(DatasetError, match=r"_manifest.json: spec.bits = 31: must be an integer in \[1, 30\]"):
        run_train(spark, _cfg(*QUICK), str(ds), str(tmp_path / "m"))
