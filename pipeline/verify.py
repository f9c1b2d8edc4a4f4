"""Checks of a dataset's Parquet files against its manifest, and reads that name the bad file.

On the driver, :func:`check_footers` reads every file's footer (what shard planning reads
anyway: a few KB per file, no data pages) and compares it with the manifest:

- a file the manifest lists must exist and end in a readable Parquet footer (a truncated file
  does not) with the ``label`` and ``indices`` columns;
- its rows (the sum of its row groups' ``num_rows``) must equal the manifest's ``rows``;
- its non-zeros must equal the manifest's ``nnz``: a row group's non-zeros are the ``indices``
  leaf column's ``num_values − null_count`` (an empty or null list is one null level entry),
  exact whenever the writer recorded the column statistics (pyarrow and Spark do; without
  them this one check is skipped);
- the manifest's totals (``rows``, ``nnz``) must equal the sums over its files.

Featurize writes a CRC-32 with every page and readers verify it, so a flipped byte in a page
is an error instead of silently wrong data. A corrupt data page is found only when a task
decodes it: :func:`read_row_groups` turns a
decode error into :class:`DataFileError` naming the file and the row groups. An error that
could be transient (an I/O error of a remote filesystem) is told apart from corrupt bytes by
reading once more: the same error again means the bytes are bad; a second read that succeeds is
used (the first error was transient). Jobs list
``DataFileError`` among the errors a new attempt would only repeat (no retry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from terascale.pipeline import fsutil
from terascale.pipeline.manifest import DatasetError

REQUIRED_COLUMNS = ("label", "indices")
ERROR_KEY = "__terascale_data_file_error__"  # a scoring task's result that reports a bad file


class DataFileError(DatasetError, fsutil.InputError):
    """A file of a dataset is missing, unreadable, corrupt or disagrees with the manifest."""


@dataclass(frozen=True)
class Footer:
    """What a file's footer says: rows per row group, and non-zeros per row group (None per
    group where the writer kept no statistics of the ``indices`` column)."""

    path: str
    rows: tuple[int, ...]
    nnz: tuple[int | None, ...]


def _indices_column(md: pq.FileMetaData) -> int | None:
    for i in range(md.num_columns):
        if md.schema.column(i).path.split(".")[0] == "indices":
            return i
    return None


def read_footer(path: str, entry: dict) -> Footer:
    """The footer of one dataset file (``entry``: its manifest record); raises DataFileError."""
    fs, inner = fsutil.resolve(path)
    listed = f"the manifest lists it with {entry.get('rows')} rows, {entry.get('nnz')} non-zeros, {entry.get('bytes')} bytes"
    size = "?"
    try:
        with fs.open_input_file(inner) as f:
            size = f.size()
            pfile = pq.ParquetFile(f)
            md = pfile.metadata
            names = pfile.schema_arrow.names
    except FileNotFoundError:
        raise DataFileError(f"{path}: missing ({listed})") from None
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(f"{path}: not a readable Parquet file, {size} bytes ({listed}): {e}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataFileError(f"{path}: no column {', '.join(missing)} (columns: {', '.join(names)})")
    col = _indices_column(md)
    rows, nnz = [], []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        rows.append(rg.num_rows)
        st = rg.column(col).statistics
        nnz.append(rg.column(col).num_values - st.null_count
                   if st is not None and st.has_null_count else None)
    return Footer(path, tuple(rows), tuple(nnz))


def check_footers(paths: list[str], manifest: dict, manifest_path: str = "the manifest") -> list[Footer]:
    """Every file's footer, checked against its manifest entry and the manifest's totals
    (module docstring); raises DataFileError naming the file and both counts."""
    files = manifest["files"]
    footers = []
    for entry, path in zip(files, paths, strict=True):
        ft = read_footer(path, entry)
        held = sum(ft.rows)
        if held != entry["rows"]:
            groups = f"{len(ft.rows)} row group{'' if len(ft.rows) == 1 else 's'}"
            raise DataFileError(f"{path}: holds {held} rows in {groups}, "
                                f"{manifest_path} says {entry['rows']}")
        if all(n is not None for n in ft.nnz) and sum(ft.nnz) != entry["nnz"]:
            per_group = ", ".join(f"row group {g}: {n}" for g, n in enumerate(ft.nnz))
            raise DataFileError(f"{path}: holds {sum(ft.nnz)} non-zeros ({per_group}), "
                                f"{manifest_path} says {entry['nnz']}")
        footers.append(ft)
    for key in ("rows", "nnz"):
        total = sum(f[key] for f in files)
        if key in manifest and manifest[key] != total:
            raise DataFileError(f"{manifest_path}: says {key} = {manifest[key]}, but its {len(files)} files "
                                f"hold {total} ({' + '.join(str(f[key]) for f in files) or '0'})")
    return footers


def iter_row_groups(path: str, row_groups: Iterable[int], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The rows of :func:`read_row_groups` as record batches of at most ``batch_rows`` rows,
    read page by page through a 1 MiB buffer (the memory a reader holds is about one batch, not
    a row group's decoded columns). Errors as :func:`read_row_groups`: after an I/O error the
    row groups are read again once and the rows already yielded are skipped."""
    groups = list(row_groups)
    where = f"{path}: row group{'s' if len(groups) != 1 else ''} {', '.join(map(str, groups))}"
    done = 0
    for attempt in (0, 1):
        try:
            skip = done
            for batch in _batches(path, groups, columns, batch_rows):
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                if skip:
                    batch, skip = batch.slice(skip), 0
                done += batch.num_rows
                yield batch
            return
        except (ConnectionError, TimeoutError):
            raise
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, pa.ArrowInvalid):
                raise DataFileError(f"{where}: cannot be decoded: {e}") from None
            if attempt == 1:
                raise DataFileError(f"{where}: cannot be read or decoded (twice): {e}") from None


def _batches(path: str, row_groups: list[int], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    fs, inner = fsutil.resolve(path)
    with fs.open_input_file(inner) as f:
        pf = pq.ParquetFile(f, page_checksum_verification=True, pre_buffer=False, buffer_size=1 << 20)
        names = [c for c in columns if c in pf.schema_arrow.names]
        yield from pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, columns=names, use_threads=False)


def _read(path: str, row_groups: list[int], columns: list[str] | None) -> pa.Table:
    fs, inner = fsutil.resolve(path)
    with fs.open_input_file(inner) as f:
        pf = pq.ParquetFile(f, page_checksum_verification=True)  # pages written with a CRC (featurize)
        names = pf.schema_arrow.names if columns is None else [c for c in columns if c in pf.schema_arrow.names]
        return pf.read_row_groups(row_groups, columns=names)


def read_row_groups(path: str, row_groups: Iterable[int], columns: list[str] | None = None) -> pa.Table:
    """Row groups of one file (the ``columns`` it has); a file that cannot be decoded raises
    DataFileError naming it and the row groups (module docstring: one re-read tells corrupt
    bytes from a transient I/O error; a re-read that succeeds is returned)."""
    groups = list(row_groups)
    where = f"{path}: row group{'s' if len(groups) != 1 else ''} {', '.join(map(str, groups))}"
    try:
        return _read(path, groups, columns)
    except (ConnectionError, TimeoutError):
        raise
    except (OSError, pa.ArrowException) as first:
        if isinstance(first, pa.ArrowInvalid):  # the bytes were read; they do not decode
            raise DataFileError(f"{where}: cannot be decoded: {first}") from None
        try:
            return _read(path, groups, columns)  # it worked: the first error was transient
        except type(first) as again:
            if str(again) == str(first):
                raise DataFileError(f"{where}: cannot be read or decoded (twice the same error): {first}") from None
            raise


def catching(task: Callable[[int, Iterator], Iterator]) -> Callable[[int, Iterator], Iterator]:
    """A Spark task function that reports a DataFileError as a result record instead of
    raising it, so Spark does not retry the task (a retry would read the same bytes)."""

    def wrapped(i, items):
        try:
            yield from task(i, items)
        except DataFileError as e:
            yield {ERROR_KEY: str(e)}

    return wrapped


def raise_bad_files(results: list) -> list:
    """The results of a :func:`catching` task; raises the first bad file's DataFileError."""
    for r in results:
        if isinstance(r, dict) and ERROR_KEY in r:
            raise DataFileError(r[ERROR_KEY])
    return results
