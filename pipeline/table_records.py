"""Records (JSON objects, DataFrame rows) as the table kernel's batch, for scoring without Spark.

A record holds a column field's value under its column's name and an ``expr`` field's value
under the field's name (Spark SQL is not evaluated here: serving computes such a value itself).
Each value is put in the form featurize's columns give the kernel: a categorical value's
canonical text (``pipeline.table_spec.canonical``: the same text Arrow's casts give), a number as
float64, an array's elements' texts, a map's (key, float64) entries; so a record scores to the
same bits as its row in the predict job. A value a field cannot take (a float as categorical, a
string as numeric, a map that is not an object) makes the record bad (``unparsable``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from terascale.pipeline.table_kernel import LABEL
from terascale.pipeline.table_spec import BadRow, Field, TableSpec, canonical

TYPES = {"categorical": pa.string(), "numeric": pa.float64(), "multi": pa.list_(pa.string()),
         "map": pa.map_(pa.string(), pa.float64())}


class _Bad(Exception):
    pass


def _text(v: Any) -> str:
    if isinstance(v, (float, np.floating)):  # pandas' integers with gaps: an integral float is the integer
        if not (math.isfinite(v) and float(v).is_integer()):
            raise _Bad
        v = int(v)
    try:
        return canonical(v)
    except (TypeError, BadRow):
        raise _Bad from None


def _number(v: Any) -> float:
    if isinstance(v, (bool, int, float, np.integer, np.floating)):
        return float(v)
    raise _Bad


def _value(f: Field, v: Any) -> Any:
    if v is None:
        return None
    if f.kind == "categorical":
        return _text(v)
    if f.kind == "numeric":
        return _number(v)
    if f.kind == "multi":
        if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, (Sequence, np.ndarray)):
            raise _Bad
        return [None if e is None else _text(e) for e in v]
    if not isinstance(v, Mapping):
        raise _Bad
    return [(_text(k) if k is not None else None, None if x is None else _number(x)) for k, x in v.items()]


def field_key(f: Field) -> str:
    """The record key of a field's value: its column, or its name for an ``expr`` field."""
    return f.name if f.expr else f.source


def records_batch(spec: TableSpec, records: Sequence[Mapping[str, Any]]) -> tuple[pa.RecordBatch, np.ndarray]:
    """(the kernel's batch of ``records``, with label 0; a bool per record: it could not be
    read). A bad record's fields are null in the batch."""
    n = len(records)
    bad = np.zeros(n, np.bool_)
    cols: dict[str, list] = {f.name: [None] * n for f in spec.fields}
    for i, rec in enumerate(records):
        try:
            vals = [_value(f, rec.get(field_key(f))) for f in spec.fields]
        except (_Bad, OverflowError, ValueError, TypeError):
            bad[i] = True
            continue
        for f, v in zip(spec.fields, vals, strict=True):
            cols[f.name][i] = v
    arrays = [pa.array(np.zeros(n, np.int8))] + [pa.array(cols[f.name], TYPES[f.kind]) for f in spec.fields]
    return pa.RecordBatch.from_arrays(arrays, names=[LABEL] + [f.name for f in spec.fields]), bad


def frame_records(df) -> list[dict]:
    """The rows of a pandas DataFrame as records; pandas' missing values (NaN, NaT, None) are nulls."""
    import pandas as pd

    recs = df.to_dict("records")
    for r in recs:
        for k, v in r.items():
            if v is not None and not isinstance(v, (list, tuple, dict, np.ndarray)) and pd.isna(v):
                r[k] = None
    return recs


def parse_json_lines(lines: Sequence[bytes]) -> tuple[list[dict], np.ndarray]:
    """(records, a bool per line: not a JSON object); a bad line's record is empty."""
    recs: list[dict] = []
    bad = np.zeros(len(lines), np.bool_)
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict):
            bad[i] = True
            obj = {}
        recs.append(obj)
    return recs, bad
