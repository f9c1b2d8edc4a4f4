"""One featurize task: parse its pieces, write one Parquet file and its quarantine rows.

Runs inside a Spark executor but never imports pyspark; the Spark adapter passes it plain data.
Output goes to a directory private to the task attempt; the driver commits the attempt whose
result Spark accepted, so retried or speculative attempts never duplicate or lose rows. Besides
the Parquet file the attempt directory holds the task's group map (``pipeline.groups``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from terascale.pipeline import fsutil, groups, parquet_rows, sampling, time_split, tokendict
from terascale.pipeline.blocks import BlockParser, LongLine, Piece, iter_blocks
from terascale.pipeline.rowkernels import LINE_TOO_LONG, REASONS
from terascale.pipeline.spec import FeatureSpec

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("label", pa.float32(), nullable=False),
        pa.field("weight", pa.float32(), nullable=False),
        pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False)), nullable=False),
        # null: every value of the row is 1 (the common case); otherwise one value per index
        pa.field("values", pa.list_(pa.field("element", pa.float32(), nullable=False)), nullable=True),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("raw", pa.binary(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
    ]
)

#: OUTPUT_SCHEMA plus each row's time (featurize.time_column; pipeline.time_split)
TIMED_SCHEMA = OUTPUT_SCHEMA.append(pa.field("time", pa.int64(), nullable=False))

DATA_FILE = "data.parquet"
QUARANTINE_FILE = "quarantine.parquet"


class MalformedInput(ValueError):
    """A malformed line with featurize.on_error=fail; the message names file and line."""

    MARKER = "terascale-malformed-input:"

    def __init__(self, source: str, line: int, offset: int, reason: str):
        self.source, self.line, self.offset, self.reason = source, line, offset, reason
        super().__init__(
            f"{self.MARKER} {source}:{line}: malformed line ({reason}) at byte offset {offset}; "
            "set featurize.on_error=quarantine to quarantine such lines and go on"
        )


class InjectedFailure(RuntimeError):
    """Raised by the featurize.inject_fail_task chaos drill."""


@dataclass(frozen=True)
class TaskOptions:
    max_line_bytes: int
    block_bytes: int
    on_error: str
    compression: str
    parquet_encoding: str = "byte_stream_split"  # of the indices (pipeline.spark_compat.parquet_encoding)
    raw_cap: int = 1 << 20  # a quarantined line keeps at most this many bytes (plus its length)
    row_group_rows: int = 262144
    inject_fail: bool = False  # chaos drill: fail after the first row group is written
    negative_rate: float = 1.0  # keep each negative with this probability (pipeline.sampling)
    sample_seed: int = 0  # the seed of the keep decisions
    token_dictionary: bool = False  # keep a bounded sample of each bucket's tokens (pipeline.tokendict)
    dictionary_per_bucket: int = 4
    dictionary_max_buckets: int = 1 << 20


class _Quarantine:
    def __init__(self, cap: int):
        self.cap = cap
        self.rows: dict[str, list] = {f.name: [] for f in QUARANTINE_SCHEMA}

    def add(self, source: str, line: int, offset: int, reason: str, length: int, raw: bytes) -> None:
        r = self.rows
        r["source"].append(source)
        r["line"].append(line)
        r["offset"].append(offset)
        r["reason"].append(reason)
        r["length"].append(length)
        r["raw"].append(raw[: self.cap])
        r["truncated"].append(length > min(len(raw), self.cap))

    def __len__(self) -> int:
        return len(self.rows["line"])

    def table(self) -> pa.Table:
        return pa.table(self.rows, schema=QUARANTINE_SCHEMA)


def open_writer(fs, inner: str, compression: str, encoding: str = "byte_stream_split", timed: bool = False
                ) -> parquet_rows.RowsWriter:
    """The Parquet writer of a task's rows (OUTPUT_SCHEMA, or TIMED_SCHEMA when ``timed``) on
    filesystem ``fs``; ``encoding`` of the indices: ``byte_stream_split`` (the indices' bytes
    stream by stream, then the codec: it skips the near-random low bytes quickly and packs the
    high ones), ``delta_binary_packed`` (a row's sorted indices as bit-packed differences, no
    codec) or ``plain``. Hashed indices are near-random, so no dictionaries
    (docs/pages/explanation/design-notes.md).
    Every page carries a CRC-32 (a flipped byte is an error on read, not silently wrong data);
    the statistics' null count gives each row group's non-zeros, checked against the manifest
    (``pipeline.verify``)."""
    return parquet_rows.RowsWriter(fs, inner, compression, encoding, timed)


def _concat(parts: list[tuple]) -> tuple:
    """The pending batches' arrays as one row group's (``write_group``'s arguments)."""
    if len(parts) == 1:
        return parts[0]
    labels, weights, ptrs, indices, multi, mvals, times = zip(*parts, strict=True)
    starts = np.cumsum([0] + [int(p[-1]) for p in ptrs[:-1]])
    indptr = np.concatenate([ptrs[0][:1]] + [p[1:] + s for p, s in zip(ptrs, starts, strict=True)])
    return (np.concatenate(labels), np.concatenate(weights), indptr, np.concatenate(indices), np.concatenate(multi),
            np.concatenate(mvals), None if times[0] is None else np.concatenate(times))


PHASES = ("setup", "read", "parse", "rows", "write", "finish")


class TaskOutput:
    """What one task attempt writes into ``attempt_dir``, and its counts: the Parquet file of
    its rows (flushed as row groups of ``opts.row_group_rows``), the quarantine, the group map,
    and per input (``stats``) lines, rows, quarantined by reason, dropped, positives and kept
    negatives. The text and the table tasks both write through it; ``phases`` gets the write time."""

    def __init__(self, attempt_dir: str, bits: int, opts: TaskOptions, phases: dict, timed: bool = False):
        self.opts, self.phases, self.attempt_dir = opts, phases, attempt_dir
        self.timed = timed  # rows carry their time (TIMED_SCHEMA): add(..., times=...)
        self._times: list[tuple[list[int], int]] = []  # each batch's order statistics (not its rows)
        self.fs, inner = fsutil.resolve(attempt_dir)
        self.fs.create_dir(inner, recursive=False)  # inside the driver's attempts directory, while it is open
        self.data_path = fsutil.join(attempt_dir, DATA_FILE)
        _, self._data_inner = fsutil.resolve(self.data_path)
        self.group_map = groups.new_map(bits)  # None above GROUPS_MAX_BITS
        self.quarantine = _Quarantine(opts.raw_cap)
        self.per_input: dict[str, dict] = {}
        self.totals = {"rows": 0, "nnz": 0, "positives": 0.0, "weight_sum": 0.0, "multi_rows": 0}
        self._pending: list[tuple] = []  # (labels, weights, indptr, indices, multi, multi values, times)
        self._pending_rows = 0
        self._writer = open_writer(self.fs, self._data_inner, opts.compression, opts.parquet_encoding, timed)

    def stats(self, src: str) -> dict:
        return self.per_input.setdefault(src, {"lines": 0, "rows": 0, "quarantined": {}, "dropped": 0,
                                               "positives": 0, "negatives_kept": 0})

    def bad(self, src: str, line: int, offset: int, reason: str, length: int, raw: bytes, stats: dict) -> None:
        """A bad line or record: MalformedInput with ``on_error=fail``, else quarantined and counted."""
        if self.opts.on_error == "fail":
            raise MalformedInput(src, line, offset, reason)
        self.quarantine.add(src, line, offset, reason, length, raw)
        stats["quarantined"][reason] = stats["quarantined"].get(reason, 0) + 1

    def add(self, stats: dict, labels, indptr, indices, values, multi, weights, times=None, owned: bool = False) -> None:
        """Count and keep rows (arrays the batch may keep: ``labels``, ``indices``, ``weights``,
        ``times``: int64, given exactly when the output is ``timed``; with ``owned`` all of them,
        none a buffer the caller reuses); ``flush(full_only=True)`` writes them once they fill a
        row group."""
        if (times is not None) != self.timed:
            raise ValueError("rows' times are given exactly when the output is timed")
        n_rows = labels.shape[0]
        stats["rows"] += n_rows
        if n_rows == 0:
            return
        n_pos = int(np.count_nonzero(labels))
        stats["positives"] += n_pos
        stats["negatives_kept"] += n_rows - n_pos
        t = self.totals
        t["rows"] += n_rows
        t["nnz"] += int(indices.shape[0])
        t["positives"] += float(labels.sum(dtype=np.float64))
        t["weight_sum"] += float(weights.sum(dtype=np.float64))
        t["multi_rows"] += int(multi.sum())
        keep = np.asarray if owned else np.array  # copies: the text parsers reuse their buffers
        m, ptr = keep(multi, np.bool_), keep(indptr, np.int64)
        mvals = parquet_rows.multi_values_of(ptr, values, m, copy=not owned)
        self._pending.append((labels, weights, ptr, indices, m, mvals, times))
        if times is not None:
            self._times.append(time_split.task_points(times))
        self._pending_rows += n_rows

    def flush(self, full_only: bool = False) -> None:
        """Write the kept rows as a row group (``full_only``: only once they fill one)."""
        if full_only and self._pending_rows < self.opts.row_group_rows:
            return
        if self._pending:
            c = time.process_time()
            self._writer.write_group(*_concat(self._pending))
            self.phases["write"] += time.process_time() - c
        self._pending, self._pending_rows = [], 0

    def make_room(self, n_rows: int) -> None:
        """Write the kept rows first when ``n_rows`` more would overflow a row group: batches as
        large as a row group are then written as they come, not concatenated."""
        if self._pending and self._pending_rows + n_rows > self.opts.row_group_rows:
            self.flush()

    def fail_if_drilled(self, task_index: int) -> None:
        """The featurize.inject_fail_task drill: fail once part of the output is written."""
        if self.opts.inject_fail and self.totals["rows"] > 0:
            self.flush()
            raise InjectedFailure(f"featurize.inject_fail_task: task {task_index} fails on purpose")

    def close(self) -> None:
        c = time.process_time()
        self._writer.close()
        self.phases["write"] += time.process_time() - c

    def finish(self, task_index: int, t0: float, c0: float, c: float, dictionary_path: str | None = None) -> dict:
        """Write the quarantine and the group map; the task's result (``c``: when finishing began)."""
        q_path = None
        if len(self.quarantine):
            q_path = fsutil.join(self.attempt_dir, QUARANTINE_FILE)
            _, q_inner = fsutil.resolve(q_path)
            pq.write_table(self.quarantine.table(), q_inner, filesystem=self.fs)
        g_path = None
        if self.group_map is not None and self.totals["rows"] > 0:  # a task without rows adds nothing to the map
            g_path = fsutil.join(self.attempt_dir, groups.TASK_GROUPS_FILE)
            groups.write_map(g_path, self.group_map)
        clock = time.process_time
        return {
            "task": task_index,
            "dictionary_path": dictionary_path,  # the task's token dictionary (pipeline.tokendict), merged by the driver
            "data_path": self.data_path,
            "quarantine_path": q_path,
            "bytes": int(self.fs.get_file_info(self._data_inner).size),
            "inputs": self.per_input,
            "groups_path": g_path,  # the task's group map; the driver merges them, never collects them
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": clock() - c0,
            "phases": {**self.phases, "finish": clock() - c},
            # order statistics of the rows' times, merged by the driver into the manifest (pipeline.time_split)
            "time_points": time_split.merge_summaries(self._times),
            **self.totals,
        }


def run_task(task_index: int, pieces: list[Piece], spec: FeatureSpec, opts: TaskOptions, attempt_dir: str) -> dict:
    """Featurize ``pieces`` into ``attempt_dir``; return the task's counts and output paths.

    ``cpu_seconds`` is the task's CPU time (this process's) and ``phases`` its split over
    :data:`PHASES`: setup (parser, writer), read (reading and decompressing blocks), parse (the
    kernel: validate, tokenize, hash, sort rows), rows (bad lines, sampling, counts, the
    rows kept for the writer), write (``pipeline.parquet_rows``: Parquet encoding, compression
    and output), finish (quarantine, group map, token dictionary). The driver logs them; they
    are not part of the manifest."""
    t0 = time.perf_counter()
    clock = time.process_time
    c0 = clock()
    phases = dict.fromkeys(PHASES, 0.0)
    out = TaskOutput(attempt_dir, spec.bits, opts, phases)
    parser = BlockParser(spec, opts.max_line_bytes, groups=out.group_map)  # the kernels update the map
    tokens = (tokendict.TokenSample(spec, opts.dictionary_per_bucket, opts.dictionary_max_buckets)
              if opts.token_dictionary else None)
    phases["setup"] = clock() - c0
    try:
        for piece in pieces:
            stats = out.stats(piece.uri)
            line_no = piece.first_line
            key = sampling.file_key(piece.uri, opts.sample_seed) if opts.negative_rate < 1.0 else 0
            blocks = iter_blocks(piece, opts.block_bytes, opts.max_line_bytes, opts.raw_cap)
            while True:
                c = clock()
                item = next(blocks, None)
                phases["read"] += clock() - c
                if item is None:
                    break
                if isinstance(item, LongLine):
                    out.bad(piece.uri, line_no, item.offset, REASONS[LINE_TOO_LONG], item.length, item.head, stats)
                    line_no += 1
                    stats["lines"] += 1
                    continue
                c = clock()
                pb = parser.parse(item.data)
                c1 = clock()
                phases["parse"] += c1 - c
                if pb.n_lines and pb.status.any():
                    for i in np.flatnonzero(pb.status):
                        s, ln = int(pb.line_start[i]), int(pb.line_len[i])
                        raw = item.data[s : s + min(ln, opts.raw_cap)].tobytes()
                        out.bad(piece.uri, line_no + int(i), item.offset + s, REASONS[int(pb.status[i])], ln, raw, stats)
                if tokens is not None:
                    tokens.add_block(item.data, pb.status, pb.line_start, pb.line_len)
                labels, indptr, indices, values, multi = pb.labels, pb.indptr, pb.indices, pb.values, pb.row_multi
                stats["lines"] += pb.n_lines
                owned = False  # views of the parser's reused buffers until sampling makes new arrays
                if opts.negative_rate < 1.0 and labels.shape[0]:
                    # row j is the j-th good line of the block: its file line number is line_no + that line's index
                    row_lines = line_no + np.flatnonzero(pb.status == 0)
                    keep = sampling.keep_mask(key, opts.sample_seed, row_lines, labels, opts.negative_rate)
                    stats["dropped"] += int(keep.shape[0] - keep.sum())
                    indptr, indices, values = sampling.take_rows(indptr, indices, values, keep)
                    labels, multi = labels[keep], multi[keep]
                    owned = True
                line_no += pb.n_lines
                if labels.shape[0] and not owned:  # what the batch keeps as it is; indptr, values, multi are copied
                    labels, indices = labels.copy(), indices.copy()
                out.add(stats, labels, indptr, indices, values, multi, sampling.row_weights(labels, opts.negative_rate))
                phases["rows"] += clock() - c1
                out.flush(full_only=True)
                out.fail_if_drilled(task_index)
        out.flush()
    finally:
        out.close()
    c = clock()
    t_path = None
    if tokens is not None and tokens.table().num_rows:
        t_path = fsutil.join(attempt_dir, tokendict.TASK_TOKENS_FILE)
        tokendict.write_table(t_path, tokens.table())
    return out.finish(task_index, t0, c0, c, t_path)


def task_times(results: list[dict]) -> dict:
    """The accepted task attempts' rows, CPU seconds, and CPU seconds per million rows in all
    and per phase (``run_task``'s ``phases``)."""
    rows = sum(r["rows"] for r in results)
    cpu = sum(r.get("cpu_seconds", 0.0) for r in results)
    per_m = 1e6 / max(rows, 1)
    phases: dict[str, float] = {}
    for r in results:
        for k, v in r.get("phases", {}).items():
            phases[k] = phases.get(k, 0.0) + v
    return {"tasks": len(results), "rows": rows, "cpu_seconds": cpu, "cpu_s_per_m_rows": cpu * per_m,
            "phases_cpu_s_per_m_rows": {k: v * per_m for k, v in phases.items()}}


def format_task_times(t: dict) -> str:
    split = ", ".join(f"{k} {v:.3f}" for k, v in t["phases_cpu_s_per_m_rows"].items())
    return (f"{t['tasks']} tasks, {t['rows']} rows, {t['cpu_seconds']:.2f} task CPU s "
            f"({t['rows'] / max(t['cpu_seconds'], 1e-9):,.0f} rows per CPU second); CPU s per million rows: {split}")
