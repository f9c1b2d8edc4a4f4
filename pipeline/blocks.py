"""Read an input piece as blocks of whole lines and parse each block with a format kernel.

A piece is a byte range of a plain file whose ends the driver aligned to line starts, or a
whole gzip file. Blocks always end at a newline (or at the end of the piece). A line longer
than ``max_line_bytes`` that does not fit a block is not buffered whole: it is reported as a
``LongLine`` with its offset, true length and first ``raw_cap`` bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

try:
    from isal import isal_zlib as _inflate_lib  # ISA-L's inflate, about 2x zlib's on these logs
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same bytes, slower
    import zlib as _inflate_lib

from terascale.pipeline import fsutil
from terascale.pipeline.criteo_kernel import (
    build_int_table,
    count_separators,
    field_id,
    field_prefixes,
    parse_criteo_block,
    prefix_words,
)
from terascale.pipeline.groups import token_groups
from terascale.pipeline.libsvm_kernel import parse_libsvm_block
from terascale.pipeline.rowkernels import POW10, count_lines
from terascale.pipeline.spec import FeatureSpec


@dataclass(frozen=True)
class Piece:
    uri: str
    start: int  # byte offset (0 for gzip)
    end: int  # exclusive byte offset; -1 = to the end (gzip)
    first_line: int  # 1-based number of the piece's first line in its file
    gzip: bool = False

    def to_json(self) -> list:
        return [self.uri, self.start, self.end, self.first_line, self.gzip]

    @classmethod
    def from_json(cls, v: list) -> Piece:
        return cls(v[0], int(v[1]), int(v[2]), int(v[3]), bool(v[4]))


@dataclass
class Block:
    data: np.ndarray  # uint8, whole lines
    offset: int  # byte offset of data[0] in the (decompressed) file


@dataclass
class LongLine:
    offset: int
    length: int
    head: bytes


INFLATE_INPUT_BYTES = 1 << 20  # compressed bytes handed to the inflater at a time


class _GzipReader:
    """The decompressed bytes of a gzip stream, read into caller's buffers.

    Inflates with ISA-L (``isal.isal_zlib``, about twice zlib's speed here) when it is
    installed, else with zlib: the same bytes either way (DEFLATE is lossless). Concatenated
    members are read one after another, as ``gzip`` does; a stream cut inside a member, or bytes
    (after a member, or from the start) that are not a gzip member, are an OSError naming the file."""

    def __init__(self, raw, uri: str):
        self.raw, self.uri = raw, uri
        self.inflater = _new_inflater()
        self.in_member = False  # inside a member: its end must come before the stream's
        self.tail = b""  # compressed bytes read but not inflated yet
        self.pending = memoryview(b"")  # inflated bytes not handed out yet

    def _inflate(self) -> bytes | None:
        while True:
            data, self.tail = (self.tail, b"") if self.tail else (self.raw.read(INFLATE_INPUT_BYTES), b"")
            if not data:
                if self.in_member:
                    raise OSError(f"{self.uri}: truncated or not gzip data (the stream ends inside a gzip member)")
                return None
            try:
                out = self.inflater.decompress(data)
            except Exception as e:  # noqa: BLE001 - zlib.error / isal's IsalError
                raise OSError(f"{self.uri}: not a valid gzip stream: {e}") from None
            self.in_member = True
            if self.inflater.eof:  # the member ended: what follows starts another one
                self.tail, self.in_member = self.inflater.unused_data, False
                self.inflater = _new_inflater()
            if out:
                return out

    def readinto(self, view: memoryview) -> int:
        n = 0
        while n < len(view):
            if not self.pending:
                out = self._inflate()
                if out is None:
                    break
                self.pending = memoryview(out)
            k = min(len(self.pending), len(view) - n)
            view[n : n + k] = self.pending[:k]
            self.pending = self.pending[k:]
            n += k
        return n


def _new_inflater():
    return _inflate_lib.decompressobj(31)  # 31: a gzip header and trailer


class _RangeReader:
    """The bytes of a plain file from ``start`` to ``end``, read into caller's buffers."""

    def __init__(self, f, start: int, end: int):
        f.seek(start)
        self.f, self.remaining = f, end - start

    def readinto(self, view: memoryview) -> int:
        n = 0
        want = min(len(view), self.remaining)
        while n < want:
            k = self.f.readinto(view[n:want])
            if not k:
                break
            n += k
        self.remaining -= n
        return n


def iter_blocks(piece: Piece, block_bytes: int, max_line: int, raw_cap: int) -> Iterator[Block | LongLine]:
    """The piece's lines as blocks of about ``block_bytes`` (and over-long lines as LongLine).

    A block's ``data`` is a view of a buffer that the next block reuses: use it (or copy what
    must outlive it) before asking for the next item. Bytes are read straight into that buffer
    (plain files) or inflated into it (gzip); only a block's unfinished last line moves, to the
    buffer's front."""
    fs, inner = fsutil.resolve(piece.uri)
    if piece.gzip:
        stream = fs.open_input_stream(inner, compression=None)
        src = _GzipReader(stream, piece.uri)
    else:
        stream = fs.open_input_file(inner)
        src = _RangeReader(stream, piece.start, piece.end)
    with stream:
        buf = bytearray(block_bytes)
        carry = 0  # bytes of an unfinished line at buf[:carry]
        offset = piece.start

        def fill(at: int) -> int:
            """Read up to block_bytes new bytes at buf[at:], growing (a new) buf when needed."""
            nonlocal buf
            if len(buf) < at + block_bytes:
                grown = bytearray(at + block_bytes)
                grown[:at] = buf[:at]
                buf = grown
            with memoryview(buf) as v:
                return src.readinto(v[at : at + block_bytes])

        while True:
            n = fill(carry)
            if not n:
                if carry:
                    yield Block(np.frombuffer(buf, dtype=np.uint8, count=carry), offset)
                return
            total = carry + n
            cut = buf.rfind(b"\n", 0, total)  # from the end: a newline is found near it
            if cut >= 0:
                yield Block(np.frombuffer(buf, dtype=np.uint8, count=cut + 1), offset)
                offset += cut + 1
                carry = total - cut - 1
                buf[:carry] = buf[cut + 1 : total]
                continue
            if total <= max_line:
                carry = total
                continue
            # An over-long line without a newline in sight: skip to its end, keep its head.
            head = bytes(buf[: min(raw_cap, total)])
            length = total
            while True:
                n = fill(0)
                if not n:
                    yield LongLine(offset, length, head)
                    return
                nl = buf.find(b"\n", 0, n)
                if nl < 0:
                    length += n
                    continue
                length += nl
                yield LongLine(offset, length, head)
                offset += length + 1
                carry = n - nl - 1
                buf[:carry] = buf[nl + 1 : n]
                break


@functools.lru_cache(maxsize=4)
def _int_table(int_mode: int, mask: int, seed: int) -> np.ndarray:
    """``build_int_table`` for a spec, built once per process (a Python worker runs many tasks).
    Shared by the parsers of that spec, which only read it."""
    pdata, poff = field_prefixes()
    return build_int_table(int_mode, pdata, poff, mask, seed)


@dataclass
class ParsedBlock:
    n_lines: int
    labels: np.ndarray  # float32 (n_rows,)
    indptr: np.ndarray  # int64 (n_rows + 1,)
    indices: np.ndarray  # int32 (nnz,)
    values: np.ndarray  # float32 (nnz,)
    row_multi: np.ndarray  # bool (n_rows,): values of this row are not all 1
    status: np.ndarray  # int8 (n_lines,)
    line_start: np.ndarray  # int64 (n_lines,), offsets inside the block
    line_len: np.ndarray  # int64 (n_lines,)


class BlockParser:
    """Parses blocks of one format with one spec, reusing its output buffers.

    ``groups``: an optional group map (uint8, 2^bits entries, ``pipeline.groups``) that every
    parsed block updates in place: each bucket a good line hashes a token to gets the smallest
    group number seen for it.
    """

    def __init__(self, spec: FeatureSpec, max_line: int, groups: np.ndarray | None = None):
        self.spec = spec
        self.max_line = max_line
        self.mask = (1 << spec.bits) - 1
        if groups is not None and (groups.dtype != np.uint8 or groups.shape != (1 << spec.bits,)
                                   or not groups.flags.c_contiguous or not groups.flags.writeable):
            raise ValueError(f"groups must be a writable contiguous uint8 array of 2^bits = {1 << spec.bits} "
                             f"entries, not {groups.dtype} of shape {groups.shape}")
        self.groups = groups if groups is not None else np.zeros(0, np.uint8)  # empty: no map
        if spec.format == "criteo":
            self.sel_group, self.conj_group = token_groups(spec)
            self.sel = np.array([field_id(f) for f in spec.fields], dtype=np.int64)
            self.conj = np.array([[field_id(a), field_id(b)] for a, b in spec.conjunctions], dtype=np.int64).reshape(-1, 2)
            self.pdata, self.poff = field_prefixes()
            self.pword = prefix_words(self.pdata, self.poff)
            self.int_mode = 0 if spec.int_bucketing == "log_squared" else 1
            self.scratch = np.zeros(2 * max_line + 64, dtype=np.uint8)
            self.int_table = _int_table(self.int_mode, self.mask, spec.seed)
            self._seps = np.zeros(0, np.int64)
            self._tmp = np.zeros(128, np.int64)  # scratch of the row sort (RANK_SORT_MAX = 64)
        self._cap_lines = 0
        self._cap_nnz = 0

    def _ensure(self, lines: int, nnz: int) -> None:
        if lines > self._cap_lines:
            self._cap_lines = max(lines, int(self._cap_lines * 1.5))
            n = self._cap_lines
            self.status = np.zeros(n, np.int8)
            self.line_start = np.zeros(n, np.int64)
            self.line_len = np.zeros(n, np.int64)
            self.labels = np.zeros(n, np.float32)
            self.indptr = np.zeros(n + 1, np.int64)
            self.row_multi = np.zeros(n, np.bool_)
        if nnz > self._cap_nnz:
            self._cap_nnz = max(nnz, int(self._cap_nnz * 1.5))
            self.indices = np.zeros(self._cap_nnz, np.int32)
            self.values = np.zeros(self._cap_nnz, np.float32)
            self.entry_group = np.zeros(self._cap_nnz, np.uint8)  # LibSVM: stays 0, its one group

    def parse(self, data: np.ndarray) -> ParsedBlock:
        n_bytes = data.shape[0]
        max_lines = count_lines(data, n_bytes) + 1
        if self.spec.format == "criteo":
            per_row = self.sel.shape[0] + self.conj.shape[0]
            self._ensure(max_lines, max_lines * per_row)
            n_seps = count_separators(data, n_bytes) + 1
            if self._seps.shape[0] < n_seps:
                self._seps = np.zeros(max(n_seps, int(self._seps.shape[0] * 1.5)), np.int64)
            n_lines, n_rows, nnz = parse_criteo_block(
                data, n_bytes, self.max_line, self.sel, self.int_mode, self.conj, self.pdata, self.poff, self.pword,
                self.mask, self.spec.seed, self.int_table, self._seps, self._tmp, self.status, self.line_start, self.line_len, self.labels,
                self.indptr, self.indices, self.values, self.row_multi, self.scratch,
                self.groups, self.sel_group, self.conj_group, self.entry_group,
            )
        else:
            colons = int(np.count_nonzero(data == 58))
            self._ensure(max_lines, colons + 1)
            n_lines, n_rows, nnz = parse_libsvm_block(
                data, n_bytes, self.max_line, self.spec.libsvm_index_base, 1 << self.spec.bits, POW10,
                self.status, self.line_start, self.line_len, self.labels, self.indptr, self.indices,
                self.values, self.row_multi, self.groups, self.entry_group,
            )
        return ParsedBlock(
            n_lines=n_lines,
            labels=self.labels[:n_rows],
            indptr=self.indptr[: n_rows + 1],
            indices=self.indices[:nnz],
            values=self.values[:nnz],
            row_multi=self.row_multi[:n_rows],
            status=self.status[:n_lines],
            line_start=self.line_start[:n_lines],
            line_len=self.line_len[:n_lines],
        )


def _next_line_start(f, pos: int, size: int, step: int = 1 << 16) -> int:
    """Smallest line start >= pos in an open random-access file (0 and size are line starts)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    at = pos - 1
    while at < size:
        chunk = f.read(min(step, size - at))
        if not chunk:
            break
        nl = chunk.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(chunk)
    return size


def align_range(uri: str, start: int, end: int, size: int, block_bytes: int = 16 << 20) -> tuple[int, int, int]:
    """Move a nominal byte range to line starts and count the newlines inside it.

    Returns (start, end, newlines). Ranges cut from one file at the same nominal bounds align
    to the same line starts, so they still tile the file exactly.
    """
    fs, inner = fsutil.resolve(uri)
    with fs.open_input_file(inner) as f:
        a = _next_line_start(f, start, size)
        b = _next_line_start(f, end, size)
        n = 0
        f.seek(a)
        left = b - a
        while left > 0:
            chunk = f.read(min(block_bytes, left))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return a, b, n
