"""Parameter constraints, declared as data, with one error format.

Every parameter of terascale (the configuration schema in :mod:`terascale.jobs.config`, the
solvers' declarations in :mod:`terascale.solvers.catalogue`, the SCD engine's
:class:`~terascale.solvers.scd.params.CocoaParams`) is a dataclass field made by :func:`param`:
its default, its help text and its constraint. A constraint has ``ok(value) -> bool`` and
``describe() -> str``; a value that fails is reported as::

    <key> = <value>: must be <describe()>

by :func:`check` (one field) or :func:`check_fields` (every field of a dataclass instance), as a
:class:`ConfigError`. A cross-check between keys raises the same error type, naming the keys.

This module imports nothing of terascale: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration key, value or file is not acceptable."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Interval:
    """A number in [lo, hi] (``lo_open``: (lo, hi]); ``integer``: an int; never NaN or inf."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False

    def ok(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.integer and not isinstance(v, int):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return self.hi is None or v <= self.hi

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{kind} in {'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi is None else ']'}"


@dataclass(frozen=True)
class AutoOr:
    """The word ``auto`` (the value is chosen when the job runs, e.g. ``train.l2 = auto``: a
    regularization path, :mod:`terascale.solvers.regpath`) or a value ``inner`` accepts.
    :meth:`parse` turns a raw ``--set`` string or a YAML value into ``"auto"`` or a number: an
    int when ``inner`` wants integers (a string that is not a whole number stays as it is, and the
    check names it), else a float."""

    inner: Interval
    word: str = "auto"

    def ok(self, v: Any) -> bool:
        return v == self.word or self.inner.ok(v)

    def describe(self) -> str:
        return f"{self.word!r} or {self.inner.describe()}"

    def parse(self, value: Any, raw: bool) -> Any:
        """``value`` as the field holds it (``raw``: a ``--set`` string; a YAML value otherwise);
        a value that is neither stays as it is, and the check then names it."""
        if isinstance(value, str):  # from --set, or YAML's 1e-6 (a string to YAML 1.1)
            text = value.strip()
            if text.lower() == self.word:
                return self.word
            try:
                return int(text) if self.inner.integer else float(text)
            except ValueError:
                return value
        if isinstance(value, int) and not isinstance(value, bool) and not self.inner.integer:
            return float(value)
        return value


@dataclass(frozen=True)
class OneOf:
    options: tuple[Any, ...]

    def ok(self, v: Any) -> bool:
        return v in self.options

    def describe(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)


@dataclass(frozen=True)
class OneOfLive:
    """One of the names ``options()`` returns when the check runs (a registry that plugins
    extend); ``what`` names them in the error."""

    options: Callable[[], tuple[str, ...]]
    what: str

    def ok(self, v: Any) -> bool:
        return isinstance(v, str) and v in self.options()

    def describe(self) -> str:
        return f"one of the {self.what} " + ", ".join(repr(o) for o in self.options())


@dataclass(frozen=True)
class SubsetOf:
    options: tuple[str, ...]

    def ok(self, v: Any) -> bool:
        return all(x in self.options for x in v) and len(set(v)) == len(v)

    def describe(self) -> str:
        if len(self.options) <= 6:
            return "distinct names from " + ", ".join(self.options)
        return f"distinct names from {self.options[0]}..{self.options[-1]}"


@dataclass(frozen=True)
class Pattern:
    """A free-form string; ``nonempty`` says whether '' is allowed."""

    nonempty: bool = True

    def ok(self, v: Any) -> bool:
        return isinstance(v, str) and (bool(v) or not self.nonempty)

    def describe(self) -> str:
        return "a non-empty string" if self.nonempty else "a string"


@dataclass(frozen=True)
class Flag:
    """true or false (a bool, not 0/1)."""

    def ok(self, v: Any) -> bool:
        return isinstance(v, bool)

    def describe(self) -> str:
        return "true or false"


def param(default: Any, help: str, constraint: Any = None) -> Any:
    """Declare one parameter: a dataclass field with its default, help text and constraint.
    A bool default without a constraint gets :class:`Flag`."""
    if constraint is None and isinstance(default, bool):
        constraint = Flag()
    meta = {"help": help, "constraint": constraint}
    if isinstance(default, (list, dict, tuple)):
        frozen = freeze(default)
        return field(default_factory=lambda: frozen, metadata=meta)
    return field(default=default, metadata=meta)


def freeze(v: Any) -> Any:
    """Lists to tuples and mappings to sorted (key, value) tuples, recursively (hashable)."""
    if isinstance(v, dict):
        return tuple(sorted((str(k), str(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def error(key: str, value: Any, allowed: str) -> ConfigError:
    """The one error format: ``<key> = <value>: must be <allowed>``."""
    return ConfigError(f"{key} = {value!r}: must be {allowed}")


def check(key: str, f: dataclasses.Field, value: Any, show: Callable[[str, Any], Any] | None = None) -> None:
    """Raise :func:`error` when ``value`` breaks the constraint declared on field ``f``.
    ``show(key, value)`` is what the message shows (the configuration redacts secrets)."""
    c = f.metadata.get("constraint")
    if c is not None and not c.ok(value):
        raise error(key, value if show is None else show(key, value), c.describe())


def check_fields(obj: Any, prefix: str = "") -> None:
    """:func:`check` every declared field of the dataclass instance ``obj`` (key = prefix + name)."""
    for f in dataclasses.fields(obj):
        check(prefix + f.name, f, getattr(obj, f.name))
