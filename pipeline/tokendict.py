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

import bisect
import heapq

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline import fsutil
from pipeline.sampling import _mix64
from pipeline.spec import FeatureSpec, cat_token, conjunction_token, int_token

TOKENS_FILE = "_tokens.parquet"
TASK_TOKENS_FILE = "tokens.parquet"
SCHEMA = pa.schema([pa.field("bucket", pa.int32(), nullable=False), pa.field("token", pa.string(), nullable=False)])
_COLUMNS = ["label", *(f"I{k}" for k in range(1, 14)), *(f"C{k}" for k in range(1, 27))]


def _priority(buckets: np.ndarray) -> np.ndarray:
    return _mix64(np.asarray(buckets, dtype=np.int64).astype(np.uint64))


def _token(spec: FeatureSpec, field: str, raw: str) -> str:
    return int_token(field, int(raw), spec.int_bucketing) if field[0] == "I" else cat_token(field, raw)


class TokenSample:
    """One task's dictionary, updated block by block (see the module docstring)."""

    def __init__(self, spec: FeatureSpec, per_bucket: int, max_buckets: int):
        if spec.format != "criteo":
            raise ValueError("a token dictionary is built for Criteo TSV only (LibSVM features are named by index)")
        self.spec, self.k, self.m = spec, int(per_bucket), int(max_buckets)
        self.mask = (1 << spec.bits) - 1
        self.tokens: dict[int, list[str]] = {}
        self._heap: list[tuple[int, int]] = []  # (-priority, -bucket): the largest kept priority on top

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
        return pa.table({c: [r[_COLUMNS.index(c)].decode("utf-8", "replace") for r in rows] for c in self._needed()})

    def _needed(self) -> list[str]:
        names = list(self.spec.fields)
        for a, b in self.spec.conjunctions:
            names += [a, b]
        return list(dict.fromkeys(names))

    def add_block(self, data: np.ndarray, status: np.ndarray, line_start: np.ndarray, line_len: np.ndarray) -> None:
        """Add the tokens of a parsed block's good lines (the block's bytes and the kernel's per-line
        status, starts and lengths)."""
        t = self._columns(data, status, line_start, line_len)
        if t is None:
            return
        toks: list[str] = []
        for f in self.spec.fields:
            toks += [_token(self.spec, f, v) for v in pc.unique(t[f]).to_pylist() if v != ""]
        for a, b in self.spec.conjunctions:
            both = pc.and_(pc.not_equal(t[a], ""), pc.not_equal(t[b], ""))
            pairs = pc.unique(pc.binary_join_element_wise(pc.filter(t[a], both), pc.filter(t[b], both), "\t"))
            for p in pairs.to_pylist():
                va, vb = p.split("\t")
                toks.append(conjunction_token(_token(self.spec, a, va), _token(self.spec, b, vb)))
        self.add_tokens(toks)

    def add_tokens(self, toks: list[str]) -> None:
        from pipeline.hashing import hash_tokens

        if not toks:
            return
        buckets = (hash_tokens(toks, self.spec.seed).astype(np.int64) & self.mask).tolist()
        prio = _priority(np.array(buckets, dtype=np.int64)).tolist()
        for tok, b, p in zip(toks, buckets, prio, strict=True):
            lst = self.tokens.get(b)
            if lst is None:
                if len(self.tokens) >= self.m:
                    top_p, top_b = -self._heap[0][0], -self._heap[0][1]
                    if (p, b) > (top_p, top_b):
                        continue
                    heapq.heapreplace(self._heap, (-p, -b))
                    del self.tokens[top_b]
                else:
                    heapq.heappush(self._heap, (-p, -b))
                self.tokens[b] = [tok]
                continue
            i = bisect.bisect_left(lst, tok)
            if i < len(lst) and lst[i] == tok:
                continue
            if len(lst) < self.k:
                lst.insert(i, tok)
            elif i < self.k:
                lst.insert(i, tok)
                lst.pop()

    def table(self) -> pa.Table:
        b = sorted(self.tokens)
        return pa.table({"bucket": pa.array([x for x in b for _ in self.tokens[x]], pa.int32()),
                         "token": pa.array([t for x in b for t in self.tokens[x]], pa.string())}, schema=SCHEMA)


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
    acc = pa.table({"bucket": pa.array([], pa.int32()), "token": pa.array([], pa.string())}, schema=SCHEMA)
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
