"""The feature specification over named columns (``featurize.format = table``), in plain Python.

A table spec says how a record of any table (Parquet, ORC, JSON lines, CSV, a catalog table)
becomes hashed features. This module is its definition: the declarations, their validation
(every error names the key, ``featurize.columns[2].kind`` say), and a slow, obvious reference
(:func:`record_tokens`, :func:`record_row`) that the bulk kernel (``pipeline.table_kernel``)
must match bit for bit.

Tokens (``F`` is the field's name):

- **categorical**: ``F={v}`` with v the value's canonical text: a string as it is (UTF-8), an
  integer in decimal (``-12``), a boolean ``true`` / ``false``, a date ``YYYY-MM-DD``; value 1.
  A null or empty string is missing.
- **numeric**, ``bucketing: none``: the token ``F`` with the value x (as float32); x = 0 adds no
  token; a value beyond float32's range is a bad row (``bad_numeric``), as is a cross's
  product or a row's summed value beyond it. ``log``: ``F={b}``, b = floor(x) if x <= 2 else floor(ln(x)^2) (Criteo's integer
  buckets; for integers b = x when x <= 2); ``boundaries`` (sorted, ascending): ``F={b}``, b the
  number of boundaries <= x; ``quantile``: the same with boundaries learned by the featurize
  job and written into the spec. NaN or +-inf is a bad row (``bad_numeric``).
- **multi** (``array<string|long|int|boolean>``): ``F={v}`` per non-null, non-empty element, in
  array order, each with value 1; more than ``max_values`` (when > 0) is a bad row
  (``too_many_features``) or, with ``overflow: truncate``, the first ``max_values``.
- **map** (``map<string, number>``): ``F={key}`` with the entry's value, in map order; an entry
  with a null, empty key or a null or 0 value adds nothing; NaN or +-inf is ``bad_numeric``.
- **missing** (no token from a field): ``missing: skip`` (default) adds nothing,
  ``missing: token`` adds ``F#missing`` (value 1), which crosses then use like any token.
- **crosses** of 2 or 3 fields: ``{t1}^{t2}[^{t3}]`` for every combination of the fields'
  tokens (in field order, then token order), value the product of the tokens' values.
- index = ``mmh3.hash(token_utf8, seed, signed=False) mod 2^bits``; seed is the spec's, or for a
  field with a ``namespace`` ``mmh3.hash(namespace, spec seed, signed=False)`` (its tokens then
  never share buckets with the same text elsewhere except by hash collision). Crosses use the
  spec's seed.
- A row: the fields' tokens in field order, then the crosses in declaration order; indices
  sorted ascending and unique, a repeated index's value the float64 sum of its tokens' float32
  values in token order, rounded to float32. More than ``max_row_features`` tokens (the fields'
  and the crosses', counted before the crosses are built) is a bad row, checked before the crosses'
  values.
- The label: a boolean (true = 1) or a number, 1 when > 0, 0 when 0 or -1 (so 0/1, -1/+1 and click
  counts all work); anything else (null, NaN, another negative) is ``bad_label``. The weight
  (optional): a finite number >= 0, else ``bad_weight``.

Field names (token prefixes) are ``[A-Za-z0-9_.-]+``, so ``=``, ``^`` and ``#`` never occur in
them and a token names its field unambiguously.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import mmh3
import numpy as np

from terascale.solvers.constraints import ConfigError

TABLE_SPEC_VERSION = 2
KINDS = ("categorical", "numeric", "multi", "map")
BUCKETINGS = ("none", "log", "boundaries", "quantile")
MISSING = ("skip", "token")
OVERFLOW = ("quarantine", "truncate")
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
MISSING_SUFFIX = "#missing"
MAX_QUANTILES = 1000
MAX_BOUNDARIES = 10000


class BadRow(ValueError):
    """A record the spec cannot take; ``reason`` is the public quarantine reason."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class Field:
    """One feature field. ``column`` names the input column (default: ``name``); ``expr`` is a
    Spark SQL expression over the columns instead (evaluated by Spark before hashing)."""

    name: str
    kind: str = "categorical"
    column: str = ""
    expr: str = ""
    bucketing: str = "none"
    boundaries: tuple[float, ...] = ()
    quantiles: int = 0
    missing: str = "skip"
    max_values: int = 0
    overflow: str = "quarantine"
    namespace: str = ""

    @property
    def source(self) -> str:
        """The input column this field reads (for an ``expr`` field, the name Spark gives its result)."""
        return self.column or self.name

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        for f in fields(self)[2:]:
            v = getattr(self, f.name)
            if v != f.default:
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


_FIELD_KEYS = {f.name for f in fields(Field)}


def _key(where: str, i: int, k: str) -> str:
    return f"{where}[{i}].{k}"


def _need(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r}: must be {allowed}")


def parse_field(d: Any, where: str, i: int) -> Field:
    """One entry of ``featurize.columns`` (a mapping, or a bare name: a categorical column)."""
    if isinstance(d, Field):
        return d
    if isinstance(d, str):
        d = {"name": d}
    if isinstance(d, tuple):  # a mapping frozen into (key, value) pairs by the configuration
        d = dict(d)
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}[{i}] = {d!r}: must be a mapping like {{name: site, kind: categorical}} or a column name")
    unknown = sorted(set(map(str, d)) - _FIELD_KEYS)
    if unknown:
        raise ConfigError(f"{_key(where, i, unknown[0])}: unknown key (allowed: {', '.join(sorted(_FIELD_KEYS))})")
    name = d.get("name")
    _need(isinstance(name, str) and bool(NAME_RE.match(name)), _key(where, i, "name"), name,
          "a field name of letters, digits, '_', '.' or '-' (a column with other characters: set column:)")
    v: dict[str, Any] = {"name": name}
    for k, options in (("kind", KINDS), ("bucketing", BUCKETINGS), ("missing", MISSING), ("overflow", OVERFLOW)):
        if k in d:
            _need(d[k] in options, _key(where, i, k), d[k], "one of " + ", ".join(map(repr, options)))
            v[k] = d[k]
    for k in ("column", "expr", "namespace"):
        if k in d:
            _need(isinstance(d[k], str), _key(where, i, k), d[k], "a string")
            v[k] = d[k]
    if v.get("column") and v.get("expr"):
        raise ConfigError(f"{where}[{i}]: set column or expr, not both (field {name!r})")
    for k, hi in (("quantiles", MAX_QUANTILES), ("max_values", 1 << 20)):
        if k in d:
            x = d[k]
            _need(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= hi, _key(where, i, k), x,
                  f"an integer in [0, {hi}]")
            v[k] = x
    if "boundaries" in d:
        b = d["boundaries"]
        ok = (isinstance(b, (list, tuple)) and 0 < len(b) <= MAX_BOUNDARIES
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in b))
        _need(ok, _key(where, i, "boundaries"), b, f"a list of 1 to {MAX_BOUNDARIES} finite numbers")
        bs = tuple(float(x) for x in b)
        _need(all(a < c for a, c in zip(bs, bs[1:], strict=False)), _key(where, i, "boundaries"), b, "strictly ascending")
        v["boundaries"] = bs
    f = Field(**v)
    kind_key = _key(where, i, "bucketing")
    if f.bucketing != "none":
        _need(f.kind == "numeric", kind_key, f.bucketing, "'none' for a field of kind " + repr(f.kind))
    if f.bucketing == "boundaries":
        _need(bool(f.boundaries), _key(where, i, "boundaries"), list(f.boundaries), "set for bucketing: boundaries")
    elif f.boundaries and f.bucketing != "quantile":
        raise ConfigError(f"{_key(where, i, 'boundaries')}: only for bucketing: boundaries (field {name!r})")
    if f.bucketing == "quantile":
        _need(2 <= f.quantiles, _key(where, i, "quantiles"), f.quantiles, f"an integer in [2, {MAX_QUANTILES}] for bucketing: quantile")
    elif f.quantiles:
        raise ConfigError(f"{_key(where, i, 'quantiles')}: only for bucketing: quantile (field {name!r})")
    if f.max_values and f.kind not in ("multi", "map"):
        raise ConfigError(f"{_key(where, i, 'max_values')}: only for kind multi or map (field {name!r} is {f.kind})")
    return f


def parse_fields(value: Any, where: str = "featurize.columns") -> tuple[Field, ...]:
    """``featurize.columns`` as Fields; names unique."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: must be a list of fields, e.g. [{{name: site}}, {{name: price, kind: numeric}}]")
    out = tuple(parse_field(d, where, i) for i, d in enumerate(value))
    seen: set[str] = set()
    for i, f in enumerate(out):
        if f.name in seen:
            raise ConfigError(f"{_key(where, i, 'name')} = {f.name!r}: a second field of this name (names must be unique)")
        seen.add(f.name)
    return out


def expand_crosses(crosses: Sequence, cross_all: Sequence, names: Sequence[str],
                   where: tuple[str, str] = ("featurize.crosses", "featurize.cross_all")) -> tuple[tuple[str, ...], ...]:
    """The crosses: each of ``crosses`` (2 or 3 field names), then every pair among each list of
    ``cross_all`` (in list order), duplicates after the first dropped."""
    known = set(names)
    out: list[tuple[str, ...]] = []

    def names_ok(key: str, c: Any, sizes: tuple[int, int]) -> tuple[str, ...]:
        lo, hi = sizes
        if not (isinstance(c, (list, tuple)) and lo <= len(c) <= hi and all(isinstance(x, str) for x in c)):
            raise ConfigError(f"{key} = {_plainv(c)!r}: must be a list of {lo} to {hi} field names")
        for x in c:
            if x not in known:
                raise ConfigError(f"{key} = {_plainv(c)!r}: {x!r} is not a field of featurize.columns")
        if len(set(c)) != len(c):
            raise ConfigError(f"{key} = {_plainv(c)!r}: names a field twice")
        return tuple(c)

    for i, c in enumerate(crosses or ()):
        out.append(names_ok(f"{where[0]}[{i}]", c, (2, 3)))
    for i, group in enumerate(cross_all or ()):
        g = names_ok(f"{where[1]}[{i}]", group, (2, 64))
        out.extend((g[a], g[b]) for a in range(len(g)) for b in range(a + 1, len(g)))
    seen: set[tuple[str, ...]] = set()
    return tuple(c for c in out if not (c in seen or seen.add(c)))


def _plainv(v: Any) -> Any:
    return [_plainv(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class TableSpec:
    """The declared part of a table spec (without bits and seed, which ``FeatureSpec`` holds)."""

    fields: tuple[Field, ...]
    crosses: tuple[tuple[str, ...], ...] = ()
    label: str = "label"
    label_expr: str = ""
    weight: str = ""
    weight_expr: str = ""
    max_row_features: int = 4096

    def to_json(self) -> dict:
        return {
            "table_spec_version": TABLE_SPEC_VERSION,
            "label": self.label, "label_expr": self.label_expr,
            "weight": self.weight, "weight_expr": self.weight_expr,
            "fields": [f.to_json() for f in self.fields],
            "crosses": [list(c) for c in self.crosses],
            "max_row_features": self.max_row_features,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> TableSpec:
        v = d.get("table_spec_version")
        if v != TABLE_SPEC_VERSION:
            raise ValueError(f"table spec version {v!r} is not supported (want {TABLE_SPEC_VERSION}); "
                             "a newer terascale wrote it")
        flds = parse_fields(d["fields"], "spec.table.fields")
        return cls(fields=flds, crosses=expand_crosses(d.get("crosses", ()), (), [f.name for f in flds],
                                                       ("spec.table.crosses", "")),
                   label=d.get("label", "label"), label_expr=d.get("label_expr", ""),
                   weight=d.get("weight", ""), weight_expr=d.get("weight_expr", ""),
                   max_row_features=int(d.get("max_row_features", 4096)))

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    @property
    def has_expressions(self) -> bool:
        return bool(self.label_expr or self.weight_expr or any(f.expr for f in self.fields))

    def with_boundaries(self, learned: Mapping[str, Sequence[float]]) -> TableSpec:
        """The spec with the quantile fields' learned boundaries filled in."""
        return replace(self, fields=tuple(replace(f, boundaries=tuple(float(x) for x in learned[f.name]))
                                          if f.name in learned else f for f in self.fields))

    def group_names(self) -> list[str]:
        """One feature group per field, then one per cross (``A^B``)."""
        return [f.name for f in self.fields] + ["^".join(c) for c in self.crosses]


def field_seed(f: Field, seed: int) -> int:
    return mmh3.hash(f.namespace.encode("utf-8"), seed, signed=False) if f.namespace else seed


# ---------------------------------------------------------------------------------------------
# The reference: one record (a dict of Python values, as pyarrow's to_pylist gives) at a time.


def canonical(v: Any) -> str:
    """The canonical text of a categorical value (see the module docstring)."""
    if isinstance(v, bool) or isinstance(v, np.bool_):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRow("invalid_utf8", "a value is not UTF-8") from None
    if isinstance(v, _dt.date) and not isinstance(v, _dt.datetime):
        return v.isoformat()
    raise TypeError(f"no canonical text for {type(v).__name__}")


LOG_BUCKET_MIN = 2.0**62  # below minus this, floor(x) would not fit an int64: bad_numeric


def log_bucket(x: float) -> int:
    """floor(x) if x <= 2 else floor(ln(x)^2)."""
    if x < -LOG_BUCKET_MIN:
        raise BadRow("bad_numeric", f"{x} is below -2^62 (log buckets)")
    return math.floor(x) if x <= 2 else math.floor(math.log(x) ** 2)


def _finite(x: Any, what: str) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise BadRow("bad_numeric", f"{what} is {x}")
    return x


def _value32(x: float, what: str) -> float:
    """A feature's value as float32; beyond float32's range is a bad row."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.float32(x)
    if not np.isfinite(v):
        raise BadRow("bad_numeric", f"{what} = {x} is beyond float32")
    return float(v)


def field_tokens(f: Field, v: Any) -> list[tuple[str, float]]:
    """The (token, value) pairs of field ``f`` for the record's value ``v`` (None = null)."""
    out: list[tuple[str, float]] = []
    if f.kind == "categorical":
        if v is not None:
            s = canonical(v)
            if s:
                out.append((f"{f.name}={s}", 1.0))
    elif f.kind == "numeric":
        if v is not None:
            x = _finite(v, f.name)
            if f.bucketing == "none":
                if x != 0.0:
                    out.append((f.name, _value32(x, f.name)))
            else:
                b = log_bucket(x) if f.bucketing == "log" else bisect.bisect_right(f.boundaries, x)
                out.append((f"{f.name}={b}", 1.0))
    elif f.kind == "multi":
        for e in v or ():
            if e is None:
                continue
            s = canonical(e)
            if s:
                out.append((f"{f.name}={s}", 1.0))
    else:  # map
        for k, x in (v or ()):
            if k is None or k == "" or x is None:
                continue
            x = _finite(x, f"{f.name}[{k}]")
            if x != 0.0:
                out.append((f"{f.name}={canonical(k)}", _value32(x, f"{f.name}[{k}]")))
    if f.max_values and len(out) > f.max_values:
        if f.overflow == "quarantine":
            raise BadRow("too_many_features", f"{f.name} has {len(out)} tokens (max_values {f.max_values})")
        out = out[: f.max_values]
    if not out and f.missing == "token":
        out.append((f.name + MISSING_SUFFIX, 1.0))
    return out


def record_label(v: Any) -> float:
    if v is None:
        raise BadRow("bad_label", "null")
    if isinstance(v, (bool, np.bool_)):
        return 1.0 if v else 0.0
    x = float(v)
    if x > 0:
        return 1.0
    if x == 0 or x == -1:
        return 0.0
    raise BadRow("bad_label", f"{v!r}")


def record_weight(v: Any) -> float:
    if v is None:
        raise BadRow("bad_weight", "null")
    x = float(v)
    with np.errstate(over="ignore"):
        w = np.float32(x)
    if not (np.isfinite(w) and x >= 0):
        raise BadRow("bad_weight", f"{v!r}")
    return float(w)


def record_tokens(spec: TableSpec, record: Mapping[str, Any]) -> list[tuple[str, float, int]]:
    """(token, value, seed-owner) of one record: the fields' tokens, then the crosses'. The
    third item is the field's index for a field token and -1 for a cross (spec seed)."""
    per: dict[str, list[tuple[str, float]]] = {}
    out: list[tuple[str, float, int]] = []
    for i, f in enumerate(spec.fields):
        toks = field_tokens(f, record.get(f.name))
        per[f.name] = toks
        out.extend((t, x, i) for t, x in toks)
    total = len(out) + sum(math.prod(len(per[name]) for name in c) for c in spec.crosses)
    if total > spec.max_row_features:  # counted before the crosses are built
        raise BadRow("too_many_features", f"{total} tokens in the row (max_row_features {spec.max_row_features})")
    for c in spec.crosses:
        combos: list[tuple[str, float]] = [("", 1.0)]
        for name in c:
            with np.errstate(over="ignore"):
                combos = [(f"{a}^{t}" if a else t, float(np.float32(np.float32(x) * np.float32(y))))
                          for a, x in combos for t, y in per[name]]
        if any(not math.isfinite(x) for _, x in combos):
            raise BadRow("bad_numeric", f"a value of the cross {'^'.join(c)} is beyond float32")
        out.extend((t, x, -1) for t, x in combos)
    return out


def record_row(spec: TableSpec, bits: int, seed: int, record: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """The sorted unique indices and float32 values of one record (values summed per index in
    float64, in token order). Raises BadRow for a record the featurizer quarantines."""
    seeds = [field_seed(f, seed) for f in spec.fields]
    mask = (1 << bits) - 1
    acc: dict[int, float] = {}
    for t, x, owner in record_tokens(spec, record):
        s = seed if owner < 0 else seeds[owner]
        i = mmh3.hash(t.encode("utf-8"), s, signed=False) & mask
        acc[i] = acc.get(i, 0.0) + x
    idx = sorted(acc)
    with np.errstate(over="ignore"):
        vals = [float(np.float32(acc[i])) for i in idx]
    if any(not math.isfinite(v) for v in vals):
        raise BadRow("bad_numeric", "a feature's summed value is beyond float32")
    return idx, vals


def criteo_preset(fields: Sequence[str], int_bucketing: str = "log_squared",
                  conjunctions: Sequence[tuple[str, str]] = ()) -> TableSpec:
    """Criteo's TSV spec as a table spec over columns ``label, I1..I13, C1..C26`` (integers as
    int64, categorical values as strings): it gives the Criteo parser's indices bit for bit.
    ``I`` fields are numeric with log buckets (``log_squared``) or categorical (``identity``:
    the integer's decimal text), ``C`` fields categorical, conjunctions 2-field crosses."""
    flds = []
    for name in fields:
        if name.startswith("I"):
            flds.append(Field(name, kind="numeric", bucketing="log") if int_bucketing == "log_squared"
                        else Field(name))
        else:
            flds.append(Field(name))
    return TableSpec(fields=tuple(flds), crosses=tuple(tuple(c) for c in conjunctions), label="label",
                     max_row_features=1 << 20)
