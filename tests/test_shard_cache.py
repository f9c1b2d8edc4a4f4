"""The local shard cache (pipeline.shard_cache) without Spark: the DiskSink holds what the
MemorySink holds, array by array; release drops pages from the resident set; cache directories
are removed after use and stale ones by the next attempt, never anything that is not ours; the
driver's choice of mode and budget, and its errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import terascale.pipeline.dataset as D
from terascale.jobs.config import ConfigError, load_config
from terascale.pipeline.dataset import ShardPart, read_shard
from terascale.pipeline.shard_cache import (
    FOLIO_BYTES,
    MARKER,
    MIB,
    CacheBudget,
    CacheSpec,
    DiskSink,
    ShardCache,
    cache_csr,
    choose,
    local_dirs,
    minimum_budget_mb,
)
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError


def _write_parquet(path, rows: int, seed: int, layout: str, row_group_size: int = 700) -> ShardPart:
    """A dataset file as featurize writes it: label, weight, indices list<int32>, values
    list<float32> (null: all ones). ``layout``: binary (every value 1), exceptions (a few values
    other than 1) or dense (most values other than 1)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 12, rows)
    indices = [np.unique(rng.integers(0, 500, n)).astype(np.int32) for n in lens]
    values = []
    for idx in indices:
        if layout == "binary" or (layout == "exceptions" and rng.random() < 0.8):
            values.append(None)
        elif layout == "exceptions":
            v = np.ones(idx.size, np.float32)
            v[: idx.size // 3] = 2.0
            values.append(v.tolist())
        else:
            values.append(rng.uniform(-2, 2, idx.size).astype(np.float32).tolist())
    t = pa.table({
        "label": pa.array(rng.integers(0, 2, rows).astype(np.float32)),
        "weight": pa.array(rng.uniform(0.5, 2.0, rows).astype(np.float32)),
        "indices": pa.array([i.tolist() for i in indices], type=pa.list_(pa.int32())),
        "values": pa.array(values, type=pa.list_(pa.float32())),
    })
    pq.write_table(t, path, row_group_size=row_group_size)
    groups = pq.ParquetFile(path).metadata.num_row_groups
    return ShardPart(str(path), tuple(range(groups)), rows, int(lens.sum()), os.path.basename(path), 0)


ARRAYS = ("indptr", "indices", "values", "vpos", "labels", "weights")


@pytest.mark.parametrize("layout", ["binary", "exceptions", "dense"])
def test_disk_sink_holds_what_the_memory_sink_holds(tmp_path, monkeypatch, layout):
    parts = [_write_parquet(tmp_path / f"part-{i}.parquet", 2100 + 300 * i, seed=i, layout=layout) for i in range(2)]
    monkeypatch.setattr(D, "BATCH_ROWS", 512)  # many appends per sink
    cache = ShardCache(CacheSpec("disk", 64 * MIB, cache_dir=str(tmp_path / "c"), run_id="r"), 0, 0, "w0-a0").open()
    want = read_shard(parts, 500, holdout_period=7, seed=3)
    got = read_shard(parts, 500, holdout_period=7, seed=3, sink_factory=cache.sink_factory())
    assert got[1] is not None and got[1].n_rows > 0
    for g, w in zip(got, want, strict=True):
        for a in ARRAYS:
            assert getattr(g, a).dtype == getattr(w, a).dtype and getattr(g, a).tobytes() == getattr(w, a).tobytes(), a
        assert isinstance(g.indices, np.memmap) and g.indices.flags.writeable and g.release is not None
        # the largest row's bytes: 16 + 4 per non-zero + 4 per value (dense) or 12 per exception
        lens = np.diff(w.indptr)
        exc = np.bincount(np.searchsorted(w.indptr, w.vpos, side="right") - 1, minlength=w.n_rows)
        per = 8 * lens if w.vpos.size == 0 and w.values.size else 4 * lens + 12 * exc
        arrays = 4 + (w.values.size > 0) + (w.vpos.size > 0)  # each may map a 2 MiB folio at a block's edges
        assert g.chunk_rows == (64 * MIB - arrays * 4 * MIB) // (16 + int(per.max()))
    layouts = {"binary": (0, 0), "exceptions": (1, 1), "dense": (1, 0)}[layout]
    assert (want[0].values.size > 0, want[0].vpos.size > 0) == layouts
    names = sorted(os.listdir(cache.directory))
    assert MARKER in names and "0-0.indices" in names and "0-1.labels" in names
    cache.close()
    assert not os.path.exists(cache.directory) and not os.path.exists(cache.run_dir)


def _resident(path_prefix: str) -> int:
    """Bytes resident in this process of the mappings of files under ``path_prefix`` (smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                inside = len(head) >= 6 and head[-1].startswith(path_prefix)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_release_drops_the_rows_pages_and_keeps_the_written_numbers(tmp_path):
    rng = np.random.default_rng(5)
    n, per = 40_000, 50
    indptr = np.arange(0, (n + 1) * per, per, dtype=np.int64)
    data = CSRData(indptr, rng.integers(0, 1000, n * per).astype(np.int32), np.zeros(0, np.float32),
                   np.ones(n, np.float32), np.ones(n, np.float32), 1000)
    disk = cache_csr(data, str(tmp_path), CacheBudget(64 * MIB))
    prefix = str(tmp_path)
    assert _resident(prefix) <= 2 * FOLIO_BYTES  # the end of indptr, read by CSRData's checks
    disk.release(0, n)
    assert _resident(prefix) == 0
    for a in ("indptr", "indices", "labels", "weights"):  # read every array: every page comes in
        assert np.array_equal(getattr(disk, a), getattr(data, a))
    whole = _resident(prefix)
    assert whole >= data.nbytes - (64 << 10)
    disk.release(0, n // 2)  # the first half: its pages go, and those of the folios at its edge
    half = _resident(prefix)
    assert whole / 2 - 4 * FOLIO_BYTES <= half <= whole / 2 + (64 << 10)
    disk.indices[-5:] = 7  # a write into the shared mapping survives its release
    disk.release(0, n)
    assert _resident(prefix) == 0
    assert disk.indices[-5:].tolist() == [7] * 5 and disk.indices[:3].tolist() == data.indices[:3].tolist()


def test_a_row_larger_than_a_threads_block_is_rejected_naming_the_key_and_the_minimum(tmp_path):
    n, big = 3, 1_200_000
    indptr = np.array([0, 2, big + 2, big + 4], np.int64)  # row 1: 4.8 MB, more than one 4 MiB block
    data = CSRData(indptr, np.zeros(big + 4, np.int32), np.zeros(0, np.float32), np.zeros(n, np.float32),
                   np.ones(n, np.float32), 10)
    # binary: 4 arrays, 16 MiB of folios at a block's edges, then the row
    with pytest.raises(InvalidInputError, match=r"train.memory_budget_mb = 20: must be at least 21 \(MiB\): a row "
                                                r"of this shard takes 4800016 bytes"):
        cache_csr(data, str(tmp_path), CacheBudget(20 * MIB, threads=1, value=20))
    with pytest.raises(InvalidInputError, match="must be at least 83 "):
        cache_csr(data, str(tmp_path), CacheBudget(64 * MIB, threads=4, value=64), prefix="1-0")
    assert cache_csr(data, str(tmp_path), CacheBudget(24 * MIB, value=24), prefix="2-0").chunk_rows == 1


def test_sinks_count_their_rows(tmp_path):
    sink = DiskSink(str(tmp_path), "0-0", 2, 0, CacheBudget(MIB))
    one = np.ones(1, np.float32)
    sink.append(np.array([1]), np.array([3], np.int32), None, one, one)
    with pytest.raises(ValueError, match="1 rows appended, 2 planned"):
        sink.finish(10)
    sink.close()
    sink = DiskSink(str(tmp_path), "0-1", 0, 0, CacheBudget(MIB))
    empty = sink.finish(10)
    assert empty.n_rows == 0 and empty.indptr.tolist() == [0] and empty.release is not None


def _marked(path, run: str, attempt: int) -> None:
    os.makedirs(path)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"kind": "shard_cache", "run": run, "attempt": attempt}, f)
    for name in ("0-0.indices", "0-0.indptr", "1-1.values.exc"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"\0" * 64)


def test_a_new_attempt_removes_the_stale_directories_of_earlier_attempts_and_nothing_else(tmp_path):
    spec = CacheSpec("disk", 4 * MIB, cache_dir=str(tmp_path), run_id="run1")
    run_dir = tmp_path / "terascale-cache" / "run1"
    _marked(run_dir / "shard-0-w0-a0", "run1", 0)  # killed in attempt 0
    _marked(run_dir / "shard-1-s0-a0", "run1", 0)  # a spare of attempt 0
    _marked(run_dir / "shard-1-w1-a1", "run1", 1)  # a task of this attempt, still running
    os.makedirs(run_dir / "shard-2-w2-a0")  # not ours: no marker
    (run_dir / "shard-2-w2-a0" / "0-0.indices").write_bytes(b"x")
    _marked(run_dir / "shard-3-w3-a0", "run1", 0)
    (run_dir / "shard-3-w3-a0" / "notes.txt").write_text("someone else's")
    _marked(tmp_path / "terascale-cache" / "run0" / "shard-0-w0-a0", "run0", 0)  # another run
    cache = ShardCache(spec, 0, 1, "w0-a1").open()
    assert sorted(os.path.basename(p) for p in cache.stale_removed) == ["shard-0-w0-a0", "shard-1-s0-a0"]
    assert sorted(os.listdir(run_dir)) == ["shard-0-w0-a1", "shard-1-w1-a1", "shard-2-w2-a0", "shard-3-w3-a0"]
    assert os.listdir(run_dir / "shard-2-w2-a0") == ["0-0.indices"]
    # ours removed from a directory that also holds a foreign file; the directory and marker stay
    assert sorted(os.listdir(run_dir / "shard-3-w3-a0")) == [MARKER, "notes.txt"]
    assert os.path.exists(tmp_path / "terascale-cache" / "run0" / "shard-0-w0-a0" / "0-0.indices")
    cache.close()
    assert not os.path.exists(run_dir / "shard-0-w0-a1") and os.path.exists(run_dir)  # others remain


def test_the_cache_goes_where_it_is_told_then_to_the_executors_local_dirs(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    monkeypatch.delenv("LOCAL_DIRS", raising=False)
    assert local_dirs("", "") == [__import__("tempfile").gettempdir()]
    assert local_dirs("", "/a,/b") == ["/a", "/b"]
    monkeypatch.setenv("SPARK_LOCAL_DIRS", "/x,/y")
    assert local_dirs("", "/a") == ["/x", "/y"]
    assert local_dirs("/c", "/a") == ["/c"]
    spec = CacheSpec("disk", 4 * MIB, run_id="r")
    assert ShardCache(spec, 3, 0, "w3-a0").directory == os.path.join("/y", "terascale-cache", "r", "shard-3-w3-a0")


def test_a_full_disk_is_a_clear_error_before_the_read(tmp_path):
    cache = ShardCache(CacheSpec("disk", 4 * MIB, cache_dir=str(tmp_path), run_id="r"), 0, 0, "w0-a0").open()
    with pytest.raises(OSError, match=r"needs about \d+ MiB, the disk has \d+ MiB free; set train.cache_dir"):
        cache.check_space(1 << 60)
    cache.close()


def test_choose_resolves_auto_and_derives_the_budget():
    big, rest = 900 * MIB, 700 * MIB
    assert choose("memory", 0, 1, False, big, None, "?", rest)[:2] == ("memory", 0)
    assert choose("disk", 64, 1, False, big, None, "?", rest)[:2] == ("disk", 64 * MIB)
    mode, budget, why = choose("disk", 0, 1, False, big, 1000 * MIB, "train.rank_memory_mb", rest)
    assert (mode, budget) == ("disk", 300 * MIB) and "less 700 MiB" in why
    assert choose("auto", 0, 1, False, big, 2000 * MIB, "x", rest)[0] == "memory"  # fits: 1300 MiB left
    assert choose("auto", 0, 1, False, big, 1000 * MIB, "x", rest)[0] == "disk"
    assert choose("auto", 64, 1, False, 64 * MIB, None, "x", rest)[0] == "memory"
    assert choose("auto", 64, 1, True, big, None, "x", rest)[0] == "memory"  # shuffled passes stay in memory
    assert choose("auto", 0, 1, False, big, None, "standalone: unknown", rest)[0] == "memory"
    with pytest.raises(ConfigError, match="train.data_cache = 'disk': needs train.memory_budget_mb"):
        choose("disk", 0, 1, False, big, None, "standalone: unknown", rest)
    with pytest.raises(ConfigError, match=r"train.memory_budget_mb = 0: must be at least 56 .* here train.memory_budget_mb = 0: "
                                          r"the rank's 705 MiB"):
        choose("disk", 0, 2, False, big, 705 * MIB, "x", rest)


def test_budgets_below_one_block_per_thread_and_shuffled_disk_passes_are_refused_by_the_config():
    # a 4 MiB block and a 2 MiB folio at both edges of 6 arrays, per thread
    assert minimum_budget_mb(1) == 28 and minimum_budget_mb(3) == 84 and minimum_budget_mb(1, 5 * MIB + 1) == 30
    with pytest.raises(ConfigError, match=r"train.memory_budget_mb = 55: must be at least 56 .*train.threads = 2"):
        load_config([], ["train.data_cache=disk", "train.memory_budget_mb=55", "train.threads=2"])
    assert load_config([], ["train.data_cache=disk", "train.memory_budget_mb=56", "train.threads=2"]).train.threads == 2
    with pytest.raises(ConfigError, match="train.shuffle = true: needs train.data_cache"):
        load_config([], ["train.data_cache=disk", "train.shuffle=true"])
    assert load_config([], ["train.memory_budget_mb=1"]).train.data_cache == "memory"  # not used in memory mode
