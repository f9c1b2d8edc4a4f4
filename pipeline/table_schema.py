"""The columns a table spec reads: which Arrow types each kind of field (and the label and the
weight) can take, checked on the driver before any Spark job (``check_schema``)."""

from __future__ import annotations

import pyarrow as pa

from terascale.pipeline.table_spec import TableSpec
from terascale.pipeline.time_split import unit_of
from terascale.solvers.constraints import ConfigError


class SchemaError(ConfigError):
    """A column the spec names is missing, or of a type its field cannot take (a usage error:
    the job stops before any Spark work, exit code 2)."""


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _categorical_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _categorical_type(t.value_type)
    return _is_text(t) or pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_date(t)


def type_problem(kind: str, t: pa.DataType) -> str | None:
    """Why a column of Arrow type ``t`` cannot feed a field of ``kind`` (or the label /
    weight: kind ``label`` / ``weight``); None when it can."""
    if kind == "label":
        ok = _is_number(t) or pa.types.is_boolean(t)
        want = "a boolean or a number (0/1, -1/+1 or a click count)"
    elif kind == "weight":
        ok = _is_number(t)
        want = "a number"
    elif kind == "categorical":
        ok = _categorical_type(t)
        want = ("a string, an integer, a boolean or a date (a double or a timestamp: make it numeric with bucketing, "
                "or cast it in an expr)")
    elif kind == "numeric":
        ok = _is_number(t) or pa.types.is_boolean(t)
        want = "a number (a string: cast it in an expr, e.g. expr: cast(price as double))"
    elif kind == "time":
        ok = unit_of(t) is not None
        want = "a timestamp, a date or an integer"
    elif kind == "multi":
        ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and _categorical_type(t.value_type)
        want = "an array of strings, integers, booleans or dates"
    else:
        ok = pa.types.is_map(t) and (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)) and (_is_number(t.item_type) or pa.types.is_boolean(t.item_type))
        want = "a map<string, number>"
    return None if ok else f"must be {want}"


def check_schema(spec: TableSpec, schema: pa.Schema, columns: list[tuple[str, str, str]], where: str) -> None:
    """Every (what, column, kind) of ``columns`` is in ``schema`` with a type its kind takes;
    else SchemaError naming the column, its type and ``where`` (the file or table)."""
    for what, col, kind in columns:
        if col not in schema.names:
            close = [n for n in schema.names if n.lower() == col.lower()]
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it has {', '.join(schema.names[:20])}" + (
                ", ..." if len(schema.names) > 20 else "")
            raise SchemaError(f"{what}: column {col!r} is not in {where}{hint}")
        t = schema.field(col).type
        problem = type_problem(kind, t)
        if problem:
            raise SchemaError(f"{what}: column {col!r} of {where} is {t}, which {problem}")
