"""The token dictionary ``_tokens.parquet``: a bounded sample of the tokens that hashed to each bucket.

Hashed features have no names; with ``featurize.token_dictionary=true`` featurize keeps, for
the buckets it sees, some of the tokens (``C7=3f1a9b2c``, ``I3=5``, ``C6=..^C9=..``) that hashed
there, so that ``terascale inspect`` can name a model's heaviest features (like Vowpal
Wabbit's ``--invert_hash``). Criteo TSV only: a LibSVM feature is already named by its index.

Which tokens are kept is a function of the *set* of distinct tokens in the data, so it does not
depend on how the input is split into tasks, on retries or on block sizes:

- per bucket, the ``per_bucket`` smallest distinct tokens (in code point order);
- at most ``max_buckets`` buckets: when more are seen, those with the smallest priority
  ``mix64(bucket)`` (``pipeline.sampling``'s splitmix64 finalizer, ties by bucket), a uniform
  sample of the buckets seen.

Both rules merge exactly: a task keeps its own smallest sets, and merging tasks' dictionaries
(union, then the same two rules) gives the dictionary of the union. Memory is bounded by
``max_buckets × per_bucket`` tokens per task and in the merge (each token is at most a line long;
Criteo tokens are a few dozen bytes), whatever 2^bits is.

Tokens come from the lines the kernels accepted (quarantined lines add none), before negative
downsampling. Each token's bucket is computed here with the same murmur3 (``pipeline.hashing``),
so a name is always a token that hashes to its bucket.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from terascale.pipeline import fsutil
from terascale.pipeline.sampling import _mix64
from terascale.pipeline.spec import FeatureSpec, int_token

TOKENS_FILE = "_tokens.parquet"
TASK_TOKENS_FILE = "tokens.parquet"
SCHEMA = pa.schema([pa.field("bucket", pa.int32(), nullable=False), pa.field("token", pa.string(), nullable=False)])
REDUCE_MIN_ROWS = 1 << 16  # a task buffers at least this many new (bucket, token) pairs between reductions
_COLUMNS = ["label", *(f"I{k}" for k in range(1, 14)), *(f"C{k}" for k in range(1, 27))]


def _priority(buckets: np.ndarray) -> np.ndarray:
    return _mix64(np.asarray(buckets, dtype=np.int64).astype(np.uint64))


class TokenSample:
    """One task's dictionary, updated block by block (see the module docstring).

    Tokens are built, hashed and reduced as Arrow arrays (no Python object per token): a block's
    distinct field values become tokens with Arrow string kernels, their buckets come from the
    murmur3 kernel run over the Arrow buffers, and new (bucket, token) pairs are buffered and
    reduced with the kept ones (:func:`reduce`) whenever the buffer outgrows them, so the work
    is O(n log n) over the distinct pairs and memory stays within twice the bound plus a block.
    """

    def __init__(self, spec: FeatureSpec, per_bucket: int, max_buckets: int):
        if spec.format != "criteo":
            raise ValueError("a token dictionary is built for Criteo TSV only (LibSVM features are named by index)")
        self.spec, self.k, self.m = spec, int(per_bucket), int(max_buckets)
        self.mask = (1 << spec.bits) - 1
        self._kept = _empty()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def _columns(self, data: np.ndarray, status: np.ndarray, line_start: np.ndarray, line_len: np.ndarray) -> pa.Table | None:
        good = status == 0
        n = int(good.sum())
        if n == 0:
            return None
        if n == status.shape[0]:
            buf = data.tobytes()
        else:
            raw = data.tobytes()
            buf = b"\n".join(raw[s:s + ln] for s, ln in zip(line_start[good].tolist(), line_len[good].tolist(), strict=True))
        try:
            t = pacsv.read_csv(
                pa.py_buffer(buf),
                read_options=pacsv.ReadOptions(column_names=_COLUMNS, use_threads=False),
                parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                                 ignore_empty_lines=False),
                convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in _COLUMNS},
                                                     strings_can_be_null=False, quoted_strings_can_be_null=False,
                                                     include_columns=self._needed()),
            )
            if t.num_rows == n:
                return t
        except pa.ArrowInvalid:
            pass
        # lines Arrow's reader splits differently (a carriage return inside a field): plain Python
        rows = [line.split(b"\t") for line in buf.split(b"\n")[:n]]
        return pa.table({c: pa.array([r[_COLUMNS.index(c)].decode("utf-8", "replace") for r in rows], pa.string())
                         for c in self._needed()})

    def _needed(self) -> list[str]:
        names = list(self.spec.fields)
        for a, b in self.spec.conjunctions:
            names += [a, b]
        return list(dict.fromkeys(names))

    def _tokens(self, field: str, values: pa.Array) -> pa.Array:
        """The tokens of a field's raw values (none empty): ``Ck=value``, or ``Ik=bucket``."""
        if field[0] != "I":
            return pc.binary_join_element_wise(f"{field}=", values, "")
        uniq = pc.unique(values)  # few distinct integers: bucket each once, in Python (pipeline.spec)
        names = pa.array([int_token(field, int(v), self.spec.int_bucketing) for v in uniq.to_pylist()], pa.string())
        return pc.take(names, pc.index_in(values, value_set=uniq))

    def add_block(self, data: np.ndarray, status: np.ndarray, line_start: np.ndarray, line_len: np.ndarray) -> None:
        """Add the tokens of a parsed block's good lines (the block's bytes and the kernel's per-line
        status, starts and lengths)."""
        t = self._columns(data, status, line_start, line_len)
        if t is None:
            return
        parts = []
        for f in self.spec.fields:
            u = pc.unique(t[f])
            parts.append(self._tokens(f, u.filter(pc.not_equal(u, ""))))
        for a, b in self.spec.conjunctions:
            both = pc.and_(pc.not_equal(t[a], ""), pc.not_equal(t[b], ""))
            pairs = pc.split_pattern(pc.unique(pc.binary_join_element_wise(pc.filter(t[a], both), pc.filter(t[b], both),
                                                                           "\t")), "\t")
            ta = self._tokens(a, pc.list_element(pairs, 0))
            tb = self._tokens(b, pc.list_element(pairs, 1))
            parts.append(pc.binary_join_element_wise(ta, tb, "^"))
        self.add_tokens(pa.concat_arrays([p.cast(pa.string()) for p in parts]))

    def add_tokens(self, toks) -> None:
        """Add tokens (an Arrow string array, or a list of str)."""
        arr = pa.array(toks, pa.string()) if not isinstance(toks, pa.Array) else toks
        if len(arr) == 0:
            return
        buckets = (hash_arrow_strings(arr, self.spec.seed) & self.mask).astype(np.int32)
        self._pending.append(pa.table({"bucket": pa.array(buckets), "token": arr}, schema=SCHEMA))
        self._pending_rows += len(arr)
        if self._pending_rows >= max(self._kept.num_rows, REDUCE_MIN_ROWS):
            self._reduce()

    def _reduce(self) -> None:
        if self._pending:
            self._kept = reduce(pa.concat_tables([self._kept, *self._pending]), self.k, self.m)
            self._pending, self._pending_rows = [], 0

    def table(self) -> pa.Table:
        """The sample: (bucket, token) sorted by bucket, then token."""
        self._reduce()
        return self._kept


def hash_arrow_strings(arr: pa.Array, seed: int) -> np.ndarray:
    """murmur3_32 (``mmh3.hash`` semantics, unsigned) of each string of an Arrow string array, as int64."""
    from terascale.pipeline.hashing import (
        hash_buffers,  # numba: imported only where a dictionary is built
    )

    arr = pa.concat_arrays([arr.cast(pa.large_string())])  # offset 0, int64 offsets
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n + 1)
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if arr.buffers()[2] is not None else np.zeros(0, np.uint8)
    return hash_buffers(data, offsets, seed)


def _empty() -> pa.Table:
    return pa.table({"bucket": pa.array([], pa.int32()), "token": pa.array([], pa.string())}, schema=SCHEMA)


def write_table(path: str, table: pa.Table) -> None:
    fs, inner = fsutil.resolve(path)
    pq.write_table(table, inner, filesystem=fs)


def read_table(path: str) -> pa.Table:
    fs, inner = fsutil.resolve(path)
    return pq.read_table(inner, filesystem=fs).cast(SCHEMA)


def reduce(table: pa.Table, per_bucket: int, max_buckets: int) -> pa.Table:
    """The two rules on any union of dictionaries: distinct pairs, ``per_bucket`` smallest tokens
    per bucket, the ``max_buckets`` buckets of smallest (priority, bucket); sorted by (bucket, token)."""
    if table.num_rows == 0:
        return table.cast(SCHEMA)
    t = table.group_by(["bucket", "token"], use_threads=False).aggregate([])
    t = t.sort_by([("bucket", "ascending"), ("token", "ascending")])
    b = t["bucket"].to_numpy()
    starts = np.r_[0, np.flatnonzero(np.diff(b)) + 1]
    counts = np.diff(np.r_[starts, b.shape[0]])
    rank = np.arange(b.shape[0]) - np.repeat(starts, counts)
    ub = b[starts]
    if ub.shape[0] > max_buckets:
        order = np.lexsort((ub, _priority(ub)))[:max_buckets]
        kept = np.isin(b, ub[order])
    else:
        kept = np.ones(b.shape[0], dtype=np.bool_)
    return t.filter(pa.array(kept & (rank < per_bucket))).select(["bucket", "token"]).cast(SCHEMA)


def merge_files(paths: list[str], out_path: str, per_bucket: int, max_buckets: int) -> dict:
    """Merge the tasks' dictionaries one file at a time (memory: the running result plus one
    file), write ``out_path``; return the manifest entry's counts."""
    acc = _empty()
    for p in paths:
        acc = reduce(pa.concat_tables([acc, read_table(p)]), per_bucket, max_buckets)
    write_table(out_path, acc)
    n_buckets = len(pc.unique(acc["bucket"])) if acc.num_rows else 0
    return {"entries": acc.num_rows, "buckets": n_buckets, "per_bucket": per_bucket, "max_buckets": max_buckets}


def lookup(table: pa.Table, buckets: list[int]) -> dict[int, list[str]]:
    """{bucket: its tokens} for the given buckets (absent when the dictionary has none)."""
    want = pa.array(buckets, pa.int32())
    t = table.filter(pc.is_in(table["bucket"], value_set=want))
    out: dict[int, list[str]] = {}
    for b, tok in zip(t["bucket"].to_pylist(), t["token"].to_pylist(), strict=True):
        out.setdefault(b, []).append(tok)
    return out
