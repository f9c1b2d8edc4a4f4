"""The local shard cache: a rank's shard in files on the executor's local disk, streamed every pass.

With ``train.data_cache = disk`` a train task reads its shard once (``pipeline.dataset.read_shard``)
into a :class:`DiskSink` per split (training and held-out rows) instead of numpy arrays in memory.
Each array goes to its own file, raw, in the dtype and layout the kernels take (native byte
order: the files live and die with the task on one machine)::

    <local dir>/terascale-cache/<run id>/shard-<k>-<attempt id>/
        _terascale_shard_cache.json       the marker: run, shard, attempt, attempt id, host, pid
        <read>-<split>.indptr             int64, rows + 1
        <read>-<split>.indices            int32, one per non-zero
        <read>-<split>.labels / .weights  float32, one per row
        <read>-<split>.vpos / .values     the value layout of ``solvers.kernels.values``: nothing
                                          (binary), the exceptions (int64 positions, float32
                                          values) or dense float32 values

``<split>`` is 0 for the training rows and 1 for the held-out rows, ``<read>`` counts the task's
reads (a resume restart reads the shard again, into new files). :meth:`DiskSink.finish` maps the
files (``np.memmap``, shared and writable: L-BFGS renumbers ``indices`` in place, and the writes
go to the task's own file) and returns them as a :class:`~solvers.data.CSRData` whose ``release``
drops a range of rows from the process's memory (``madvise(MADV_DONTNEED)`` on the pages of
every array the rows use, widened to whole page-cache folios; the exceptions' two arrays whole,
as a block's first row finds its first exception by bisection over them) and whose
``chunk_rows`` is the number of rows that fit the budget: a thread's share ``budget_bytes / threads``, less what a block may map
beyond its rows (a fault maps the whole page-cache folio holding the page, up to 2 MiB with
Linux's large folios: one per edge of each array, :func:`edge_bytes`), over the largest row's
bytes (8 for indptr, 8 for its label and weight, 4 per non-zero, plus 4 per non-zero for dense
values or 12 per exception).
Every pass walks the shard through ``solvers.shard.Shard.chunks``, which releases each range
after it, so a pass holds one block of rows per thread: the pages stay in the page cache (a
warm pass reads memory, not the disk), but not in the process's resident set. Releasing a
block also starts the kernel's readahead of the next two (``MADV_WILLNEED``), so a pass from a
cold page cache reads the disk while it computes.

The arrays hold the numbers :class:`~pipeline.shard_sink.MemorySink` would hold, in the same order
and the same value layout (the same rule picks it), so every kernel sees the same values and a
model trained from the cache is the in-memory model bit for bit.

Budget: besides one block of rows per thread, a whole column is mapped for a moment where a sum
must not depend on chunking (Σ weights, 4 bytes per row; the all-zero model's loss, labels and
weights, 8 bytes per row), and L-BFGS's coarse preconditioner, which must see its sample of
rows in one kernel call, gathers it into memory first (``solvers.shard.Shard.sampled``: about
2^15 rows, at most 2^16). CoCoA is not bounded: its local solver densifies the values and
renumbers the indices into memory, and its epochs visit rows in random order; it works from the
cache, with the same model, but its resident set grows to the shard's size. A shuffled online pass
(``train.shuffle``) is refused: it reads rows at random.

Cleanup (:class:`ShardCache`): the task's directory is removed when the task ends, whether it
succeeded or failed. A task killed outright leaves its directory behind: the next attempt's
tasks remove the directories of earlier attempts of the same run, and only those with the
marker, and in them only the files named as above (a directory holding anything else loses our
files and keeps the rest).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass

import numpy as np

from terascale.solvers.constraints import ConfigError
from terascale.solvers.data import CSRData
from terascale.solvers.errors import InvalidInputError
from terascale.solvers.kernels.values import dense_is_smaller, exceptions

log = logging.getLogger("terascale.shard_cache")

MIB = 1 << 20
#: The smallest block of rows a pass may walk per thread: below a few MiB the work per block
#: (a kernel call, a madvise per array, a progress call) starts to show against its rows.
MIN_BLOCK_BYTES = 4 * MIB
#: A fault maps the whole page-cache folio that holds the page (Linux's large folios: up to
#: 2 MiB, the PMD size, whatever madvise says), so a block's resident bytes may exceed its rows'
#: by up to one folio at each edge of each array it reads.
FOLIO_BYTES = 2 * MIB
MAX_ARRAYS = 6  # indptr, indices, labels, weights and the values' two arrays
ROOT = "terascale-cache"
MARKER = "_terascale_shard_cache.json"
_ARRAYS = ("indptr", "indices", "labels", "weights", "vpos", "values")
_OWN_FILE = re.compile(r"^\d+-[01]\.(" + "|".join(_ARRAYS) + r")(\.exc)?$")
_DTYPES = {"indptr": np.int64, "indices": np.int32, "labels": np.float32, "weights": np.float32,
           "vpos": np.int64, "values": np.float32}
_COPY_BLOCK = 1 << 20  # elements per block while densifying


@dataclass(frozen=True)
class CacheBudget:
    """What one rank may hold of its shard: ``bytes`` at once, shared by ``threads`` threads that
    each walk a block of rows; ``key`` and ``value`` name the setting in errors."""

    bytes: int
    threads: int = 1
    key: str = "train.memory_budget_mb"
    value: object = None

    def block_bytes(self, arrays: int) -> int:
        """The bytes of one thread's block of rows: its share less the folios at the edges of
        the ``arrays`` arrays it reads."""
        return self.bytes // max(self.threads, 1) - edge_bytes(arrays)


def edge_bytes(arrays: int) -> int:
    """What a block of rows over ``arrays`` arrays may hold beyond its rows: a folio per edge."""
    return arrays * 2 * FOLIO_BYTES


def minimum_budget_mb(threads: int, largest_row_bytes: int = MIN_BLOCK_BYTES, arrays: int = MAX_ARRAYS) -> int:
    """The smallest budget (MiB) that holds a block per thread: its rows (at least
    :data:`MIN_BLOCK_BYTES`, or the largest row) and the folios at its edges."""
    return -(-(edge_bytes(arrays) + largest_row_bytes) * max(threads, 1) // MIB)


def budget_error(budget_mb: int, threads: int, mode: str, note: str = "") -> ConfigError:
    """The error of a budget below :func:`minimum_budget_mb` (naming the key, the value, the minimum)."""
    return ConfigError(f"train.memory_budget_mb = {budget_mb}: must be at least {minimum_budget_mb(threads)} with "
                       f"train.data_cache = {mode!r} (for each of train.threads = {threads}, a block of rows of "
                       f"{MIN_BLOCK_BYTES >> 20} MiB and the page cache's folios at its edges, "
                       f"{edge_bytes(MAX_ARRAYS) >> 20} MiB){note}")


def _folio_span(start: int, stop: int, size: int) -> tuple[int, int]:
    """[start, stop) bytes widened outwards to whole folios (:data:`FOLIO_BYTES`: every folio a
    fault in the range may have mapped whole), clipped to ``size``."""
    lo = start // FOLIO_BYTES * FOLIO_BYTES
    hi = min(-(-stop // FOLIO_BYTES) * FOLIO_BYTES, size)
    return lo, hi


class _Mapped:
    """The mapped arrays of one split and the release of rows from the process's memory."""

    def __init__(self, arrays: dict[str, np.ndarray], indptr_path: str):
        self.arrays = arrays
        self._maps = {k: a._mmap for k, a in arrays.items() if isinstance(a, np.memmap) and a._mmap is not None}
        self._indptr_path = indptr_path

    def _advise(self, name: str, first: int, last: int, advice: int) -> None:
        m = self._maps.get(name)
        if m is None or last <= first:
            return
        item = self.arrays[name].itemsize
        lo, hi = _folio_span(first * item, last * item, len(m))
        if lo < hi:
            m.madvise(advice, lo, hi - lo)

    def _drop(self, name: str, first: int, last: int) -> None:
        self._advise(name, first, last, mmap.MADV_DONTNEED)

    def _prefetch(self, a: int, b: int) -> None:
        """Start reading rows a..b-1 into the page cache (``MADV_WILLNEED``: the kernel's
        readahead, asynchronous; nothing is mapped). Their positions come from the file with
        ``pread``, not the mapping, so no folio of indptr is mapped ahead of its block."""
        n = self.arrays["indptr"].shape[0] - 1
        b = min(b, n)
        if b <= a:
            return
        try:
            fd = os.open(self._indptr_path, os.O_RDONLY)
            try:
                z0, z1 = (int(np.frombuffer(os.pread(fd, 8, 8 * r), np.int64)[0]) for r in (a, b))
            finally:
                os.close(fd)
        except (OSError, IndexError):  # advice only: a file already removed (an earlier read's)
            return
        for name, lo, hi in (("indptr", a, b + 1), ("labels", a, b), ("weights", a, b), ("indices", z0, z1)):
            self._advise(name, lo, hi, mmap.MADV_WILLNEED)
        if self.arrays["vpos"].shape[0] == 0:
            self._advise("values", z0, z1, mmap.MADV_WILLNEED)

    def release(self, a: int, b: int) -> None:
        """Drop rows a..b-1 (every array's entries they use, widened to whole folios) from the
        resident set; all rows when the range covers the shard. The exceptions' arrays go whole:
        a bisection over them (a block's first row) touches folios far from the block's."""
        ip = self.arrays["indptr"]
        n = ip.shape[0] - 1
        if a <= 0 and b >= n:
            for m in self._maps.values():
                m.madvise(mmap.MADV_DONTNEED)
            return
        if b <= a:
            return
        z0, z1 = int(ip[a]), int(ip[b])
        self._drop("indptr", a, b + 1)
        self._drop("labels", a, b)
        self._drop("weights", a, b)
        self._drop("indices", z0, z1)
        if self.arrays["vpos"].shape[0] > 0:
            for name in ("vpos", "values"):
                self._maps[name].madvise(mmap.MADV_DONTNEED)
        else:
            self._drop("values", z0, z1)
        self._prefetch(b, b + 2 * (b - a))  # the next two blocks of a pass, from a cold page cache


def _map(path: str, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r+", shape=(count,))


class DiskSink:
    """A :class:`~pipeline.shard_sink.ShardSink` into files of ``directory`` named ``prefix``.NAME
    (see the module docstring). ``rows``: exact number of rows to come; ``nnz_hint`` is not
    needed (files grow); ``budget``: sets the returned data's ``chunk_rows``."""

    def __init__(self, directory: str, prefix: str, rows: int, nnz_hint: int, budget: CacheBudget):
        self.base = os.path.join(directory, prefix)
        self.rows, self.budget = rows, budget
        self.r = self.z = self.ne = 0
        self.max_len = 0  # the most non-zeros of a row
        self.max_exc_bytes = 0  # the most bytes a row's indices and exceptions take (4·len + 12·exc)
        self._files = {k: open(self._path(k), "wb") for k in ("indptr", "indices", "labels", "weights")}
        self._files["vpos"] = open(self._path("vpos") + ".exc", "wb")
        self._files["values"] = open(self._path("values") + ".exc", "wb")
        self._write("indptr", np.zeros(1, np.int64))

    def _path(self, name: str) -> str:
        return f"{self.base}.{name}"

    def _write(self, name: str, a: np.ndarray) -> None:
        self._files[name].write(np.ascontiguousarray(a, dtype=_DTYPES[name]).data)

    def append(self, lengths, indices, values, labels, weights) -> None:
        m, span = lengths.shape[0], indices.shape[0]
        if self.r + m > self.rows:
            raise ValueError(f"DiskSink: {self.r + m} rows appended, {self.rows} planned")
        ends = np.cumsum(lengths, dtype=np.int64)
        self._write("indptr", ends + self.z)
        self._write("indices", indices)
        row_bytes = 4 * np.asarray(lengths, np.int64)
        if values is not None:
            val, ex = exceptions(values)
            if ex.size:
                self._write("vpos", ex + self.z)
                self._write("values", val)
                self.ne += ex.size
                row_bytes += 12 * np.bincount(np.searchsorted(ends, ex, side="right"), minlength=m)[:m]
        self._write("labels", labels)
        self._write("weights", weights)
        if m:
            self.max_len = max(self.max_len, int(lengths.max()))
            self.max_exc_bytes = max(self.max_exc_bytes, int(row_bytes.max()))
        self.r, self.z = self.r + m, self.z + span

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def _densify(self) -> None:
        """The dense values file from the exceptions' files (the rest are 1), block by block."""
        with open(self._path("vpos") + ".exc", "rb") as fp, open(self._path("values") + ".exc", "rb") as fv, \
                open(self._path("values"), "wb") as out:
            pos, val = np.zeros(0, np.int64), np.zeros(0, np.float32)
            for p0 in range(0, self.z, _COPY_BLOCK):
                p1 = min(p0 + _COPY_BLOCK, self.z)
                buf = np.ones(p1 - p0, np.float32)
                while True:
                    if pos.shape[0] == 0:
                        pos, val = np.fromfile(fp, np.int64, _COPY_BLOCK), np.fromfile(fv, np.float32, _COPY_BLOCK)
                        if pos.shape[0] == 0:
                            break
                    k = int(np.searchsorted(pos, p1))
                    buf[pos[:k] - p0] = val[:k]
                    pos, val = pos[k:], val[k:]
                    if pos.shape[0]:
                        break
                out.write(buf.data)
        os.unlink(self._path("vpos") + ".exc")
        os.unlink(self._path("values") + ".exc")

    def finish(self, n_features: int) -> CSRData:
        """The rows as file-backed arrays: binary, with exceptions, or dense by the rule of
        :meth:`MemorySink.finish <pipeline.shard_sink.MemorySink.finish>`."""
        if self.r != self.rows:
            raise ValueError(f"DiskSink: {self.r} rows appended, {self.rows} planned")
        self._close_files()
        dense = dense_is_smaller(self.ne, self.z)
        if dense:
            self._densify()
            n_values, n_vpos = self.z, 0
            row_bytes = 8 * self.max_len
        else:
            for name in ("vpos", "values"):
                os.replace(self._path(name) + ".exc", self._path(name))
            n_values = n_vpos = self.ne
            row_bytes = self.max_exc_bytes
        row_bytes += 16
        counts = {"indptr": self.r + 1, "indices": self.z, "labels": self.r, "weights": self.r,
                  "vpos": n_vpos, "values": n_values}
        arrays = {k: _map(self._path(k), _DTYPES[k], counts[k]) for k in _ARRAYS}
        mapped = _Mapped(arrays, self._path("indptr"))
        used = 4 + (n_values > 0) + (n_vpos > 0)
        chunk_rows = self.budget.block_bytes(used) // row_bytes
        if self.r and chunk_rows < 1:
            mb = minimum_budget_mb(self.budget.threads, row_bytes, used)
            raise InvalidInputError(
                f"{self.budget.key} = {self.budget.value}: must be at least {mb} (MiB): a row of this shard "
                f"takes {row_bytes} bytes, and each of {self.budget.threads} thread(s) holds a block of rows and "
                f"the page cache's folios at its edges ({edge_bytes(used) >> 20} MiB)")
        return CSRData(arrays["indptr"], arrays["indices"], arrays["values"], arrays["labels"], arrays["weights"],
                       n_features, arrays["vpos"], chunk_rows=int(max(chunk_rows, 1)), release=mapped.release)

    def close(self) -> None:
        """Close the files still open (a failed read); the files stay until the cache is removed."""
        self._close_files()


def cache_csr(data: CSRData, directory: str, budget: CacheBudget, prefix: str = "0-0",
              batch_rows: int = 1 << 16) -> CSRData:
    """``data`` written into a :class:`DiskSink` (``batch_rows`` rows per append) and mapped back:
    the file-backed twin of an in-memory CSR matrix (what ``read_shard`` makes from Parquet)."""
    sink = DiskSink(directory, prefix, data.n_rows, data.nnz, budget)
    try:
        values = None if data.binary else data.full_values()
        lengths = np.diff(data.indptr)
        for a in range(0, data.n_rows, batch_rows):
            b = min(a + batch_rows, data.n_rows)
            z0, z1 = int(data.indptr[a]), int(data.indptr[b])
            sink.append(lengths[a:b], data.indices[z0:z1], None if values is None else values[z0:z1],
                        data.labels[a:b], data.weights[a:b])
        return sink.finish(data.n_features)
    finally:
        sink.close()


def local_dirs(cache_dir: str = "", spark_local_dir: str = "") -> list[str]:
    """Where a task may put its cache: ``cache_dir`` (``train.cache_dir``) if set, else the
    executor's local directories (``SPARK_LOCAL_DIRS``, set by Spark for executors; YARN's
    ``LOCAL_DIRS``), else ``spark_local_dir`` (the driver's ``spark.local.dir``: local mode),
    else the system's temporary directory."""
    for v in (cache_dir, os.environ.get("SPARK_LOCAL_DIRS", ""), os.environ.get("LOCAL_DIRS", ""), spark_local_dir):
        dirs = [d.strip() for d in v.split(",") if d.strip()]
        if dirs:
            return dirs
    return [tempfile.gettempdir()]


def _marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            m = json.load(f)
        return m if isinstance(m, dict) and m.get("kind") == "shard_cache" else None
    except (OSError, ValueError):
        return None


def remove_dir(path: str) -> bool:
    """Remove a cache directory that holds our marker: its files named as ours, then the marker
    and the directory if nothing else is left (else both stay, and a warning names the rest).
    Returns whether it is gone; a directory without the marker is left alone."""
    if _marker(path) is None:
        return False
    try:
        for name in os.listdir(path):
            if _OWN_FILE.match(name) or name == MARKER + ".tmp":
                os.unlink(os.path.join(path, name))
        left = sorted(set(os.listdir(path)) - {MARKER})
        if left:
            log.warning("shard cache %s: left in place, it holds files terascale did not write: %s", path, left[:5])
            return False
        os.unlink(os.path.join(path, MARKER))
        os.rmdir(path)
    except FileNotFoundError:  # another task of the next attempt removed it first
        return not os.path.exists(path)
    return True


def remove_stale(run_dir: str, attempt: int) -> list[str]:
    """Remove the cache directories of the run's earlier attempts (tasks that died without
    cleaning up) under ``run_dir``; returns those removed."""
    try:
        names = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return []
    gone = []
    for name in names:
        path = os.path.join(run_dir, name)
        m = _marker(path)
        if m is not None and int(m.get("attempt", attempt)) < attempt and remove_dir(path):
            gone.append(path)
    return gone


@dataclass(frozen=True)
class CacheSpec:
    """Where and how a train task keeps its shard (plain values, pickled into the task).
    ``mode``: memory or disk (the driver resolved auto); ``budget_bytes`` and ``threads``: see
    :class:`CacheBudget`; ``cache_dir``: ``train.cache_dir``; ``spark_local_dir``: the driver's
    ``spark.local.dir``; ``run_id``: the run the directories belong to."""

    mode: str = "memory"
    budget_bytes: int = 0
    threads: int = 1
    budget_value: object = None
    cache_dir: str = ""
    spark_local_dir: str = ""
    run_id: str = ""


def choose(mode: str, budget_mb: int, threads: int, shuffle: bool, shard_bytes: int, available: int | None,
           available_from: str, rest_bytes: int) -> tuple[str, int, str]:
    """(memory or disk, the budget in bytes, why) for ``train.data_cache = mode`` on the driver.

    The budget is ``budget_mb`` MiB when set, else what the rank's memory ``available`` (None:
    unknown; ``available_from`` says where it came from) leaves after ``rest_bytes``, the rest of
    the rank's estimated peak (``jobs.preflight``). ``auto`` keeps the shard in memory when its
    ``shard_bytes`` (the largest shard's) fit the budget, when the budget is unknown, or with a
    shuffled order (``shuffle``); disk otherwise. Raises ConfigError when disk needs a budget
    that is unknown or below :func:`minimum_budget_mb`."""
    if mode == "memory":
        return "memory", 0, "train.data_cache = memory"
    if budget_mb > 0:
        budget, source = budget_mb * MIB, f"train.memory_budget_mb = {budget_mb}"
    elif available is not None:
        budget = available - rest_bytes
        source = (f"train.memory_budget_mb = 0: the rank's {available / MIB:.0f} MiB ({available_from}) less "
                  f"{rest_bytes / MIB:.0f} MiB for the rest of its peak = {budget / MIB:.0f} MiB")
    else:
        budget, source = None, f"the rank's memory is unknown ({available_from})"
    if mode == "auto":
        if shuffle:
            return "memory", 0, "train.data_cache = auto with train.shuffle = true: memory (a shuffled order reads rows at random)"
        if budget is None:
            return "memory", 0, f"train.data_cache = auto: memory, {source}"
        if shard_bytes <= budget:
            return "memory", budget, f"train.data_cache = auto: memory, the shard's {shard_bytes / MIB:.0f} MiB fit ({source})"
    if budget is None:
        raise ConfigError(f"train.data_cache = {mode!r}: needs train.memory_budget_mb, as {source}; set it, or "
                          "train.rank_memory_mb")
    if budget < minimum_budget_mb(threads) * MIB:
        raise budget_error(budget_mb, threads, mode, f"; here {source}")
    why = f"the shard's {shard_bytes / MIB:.0f} MiB do not fit, " if mode == "auto" else ""
    return "disk", int(budget), f"train.data_cache = {mode}: disk, {why}{source}"


class ShardCache:
    """One task's cache directory (see the module docstring): created by :meth:`open` (which
    first removes the run's stale directories), removed by :meth:`close`."""

    def __init__(self, spec: CacheSpec, shard: int, attempt: int, attempt_id: str):
        dirs = local_dirs(spec.cache_dir, spec.spark_local_dir)
        self.run_dir = os.path.join(dirs[shard % len(dirs)], ROOT, spec.run_id or "run")
        self.directory = os.path.join(self.run_dir, f"shard-{shard}-{attempt_id}")
        self.spec, self.shard, self.attempt, self.attempt_id = spec, shard, attempt, attempt_id
        self.budget = CacheBudget(spec.budget_bytes, spec.threads, value=spec.budget_value)
        self.reads = 0
        self.stale_removed: list[str] = []

    def open(self) -> ShardCache:
        self.stale_removed = remove_stale(self.run_dir, self.attempt)
        os.makedirs(self.directory, exist_ok=True)
        marker = {"kind": "shard_cache", "run": self.spec.run_id, "shard": self.shard, "attempt": self.attempt,
                  "attempt_id": self.attempt_id, "host": socket.gethostname(), "pid": os.getpid()}
        tmp = os.path.join(self.directory, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f)
        os.replace(tmp, os.path.join(self.directory, MARKER))
        return self

    def check_space(self, planned_bytes: int) -> None:
        """Raise OSError when the cache's file system has less free space than ``planned_bytes``
        (the shard's planned CSR bytes): a clear error before the read, not a full disk in it."""
        free = shutil.disk_usage(self.directory).free
        if free < planned_bytes:
            raise OSError(f"shard cache {self.directory}: shard {self.shard} needs about {planned_bytes / MIB:.0f} MiB, "
                          f"the disk has {free / MIB:.0f} MiB free; set train.cache_dir to a larger local disk, or "
                          "train.data_cache=memory")

    def sink_factory(self):
        """A ``read_shard`` sink factory for a new read: the training rows' sink first, then the
        held-out rows'. The previous read's files are removed (their mappings stay valid)."""
        self._drop_files()
        read = self.reads
        self.reads += 1
        made = [0]

        def make(rows: int, nnz_hint: int) -> DiskSink:
            split = made[0]
            made[0] += 1
            return DiskSink(self.directory, f"{read}-{split}", rows, nnz_hint, self.budget)

        return make

    def _drop_files(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if _OWN_FILE.match(name):
                os.unlink(os.path.join(self.directory, name))

    def close(self) -> None:
        """Remove the directory (and the run's directory when it is left empty)."""
        if remove_dir(self.directory):
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass  # other tasks' directories are still there

    def __enter__(self) -> ShardCache:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
