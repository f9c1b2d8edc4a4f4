"""pipeline.durable: atomic, durable writes with unique temporary names."""

from __future__ import annotations

import os

import pytest

from terascale.pipeline import durable


def test_write_bytes_replaces_atomically_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    durable.write_bytes(str(target), b"new", tag="t1")
    assert target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["a.json"]


def test_write_bytes_file_uri(tmp_path):
    durable.write_bytes(f"file://{tmp_path}/b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


def test_write_bytes_creates_a_missing_local_parent(tmp_path):
    """evaluate --out metrics/DAY.json on a fresh local path (found by the Airflow DAG's first real run)."""
    durable.write_bytes(str(tmp_path / "metrics" / "daily" / "d.json"), b"{}")
    durable.write_bytes(f"file://{tmp_path}/other/e.json", b"[]")
    assert (tmp_path / "metrics" / "daily" / "d.json").read_bytes() == b"{}"
    assert (tmp_path / "other" / "e.json").read_bytes() == b"[]"
    assert sorted(os.listdir(tmp_path / "metrics" / "daily")) == ["d.json"]


def test_failed_write_keeps_old_file_and_removes_temporary(tmp_path):
    target = tmp_path / "c.txt"
    target.write_bytes(b"old")

    with pytest.raises(TypeError):
        durable.write_bytes(str(target), object())  # not bytes: the stream write fails
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["c.txt"]


def test_unique_tmp_names_differ_and_are_hidden_siblings(tmp_path):
    a = durable.unique_tmp(f"{tmp_path}/x.npz", "attempt-1")
    b = durable.unique_tmp(f"{tmp_path}/x.npz", "attempt-1")
    assert a != b
    assert os.path.dirname(a) == str(tmp_path)
    assert os.path.basename(a).startswith(".x.npz.tmp-attempt-1-")


def test_fsync_tree_and_rename(tmp_path):
    src = tmp_path / "staging"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_bytes(b"1")
    durable.fsync_tree(str(src))
    durable.rename(str(src), str(tmp_path / "final"))
    assert (tmp_path / "final" / "sub" / "f").read_bytes() == b"1"
    assert not src.exists()


def test_remote_paths_are_not_synced():
    assert not durable.is_local("s3://bucket/key")
    assert durable.is_local("file:///tmp/x") and durable.is_local("/tmp/x")
    durable.fsync_dir("hdfs://nn:8020/some/dir")  # a no-op, no error
