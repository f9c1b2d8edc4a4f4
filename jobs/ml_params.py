"""pyspark.ml Params generated from the configuration schema (``jobs.config``), never by hand.

Every ``train.*`` and ``allreduce.*`` key of the schema becomes one ``Param`` of
:class:`jobs.ml.TerascaleClassifier`, with the schema's help text as its doc and the schema's
default as its default. Names: the key without its ``train.`` section, other sections keep
theirs, then camelCase: ``train.l2`` -> ``l2``, ``train.learning_rate`` -> ``learningRate``,
``train.inject.fail_shard`` -> ``injectFailShard``, ``allreduce.io_timeout_s`` ->
``allreduceIoTimeoutS`` (:data:`PARAM_KEYS` is the whole mapping).

A value is validated when it is set, by the schema itself: ``load_config(sets=["key=value"])``,
so a bad value raises the same :class:`~jobs.config.ConfigError` as ``--set key=value``, naming
the key. Checks that involve two keys run again at ``fit`` on the whole configuration.
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.ml.param import Param, Params

from terascale.jobs.config import Config, iter_params, load_config

SECTIONS = ("train", "allreduce")  # the sections that matter for fit


def param_name(key: str) -> str:
    """The Param name of a configuration key: ``train.learning_rate`` -> ``learningRate``."""
    section, *rest = key.split(".")
    words = "_".join(rest if section == "train" else [section, *rest]).split("_")
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


def _lookup(cfg: Config, key: str) -> Any:
    v: Any = cfg
    for part in key.split("."):
        v = getattr(v, part)
    return v


def as_set(key: str, value: Any) -> str:
    """``key=value`` as the command line's ``--set`` takes it."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value)  # YAML flow syntax, as --set parses lists and mappings
    else:
        text = str(value)
    return f"{key}={text}"


# train.workers at its most permissive, so that a key whose constraint depends on it
# (train.inject.*_shard) is checked on its own here, and train.l2 a number, so that a key that
# train.l2 = auto depends on (train.solver, train.holdout_period) is too; fit checks the whole
# configuration.
_WORKERS = "train.workers"
_MAX_WORKERS = dict(iter_params())[_WORKERS].metadata["constraint"].hi
_PERMISSIVE = {_WORKERS: int(_MAX_WORKERS), "train.l2": 1.0}


def _converter(key: str):
    def convert(value: Any) -> Any:
        others = [as_set(k, v) for k, v in _PERMISSIVE.items() if k != key]
        return _lookup(load_config(sets=[*others, as_set(key, value)]), key)

    convert.__name__ = f"schema_{param_name(key)}"
    return convert


def _schema_params() -> dict[str, tuple[str, Any, Any]]:
    defaults = Config()
    out = {}
    for key, f in iter_params():
        if key.split(".")[0] not in SECTIONS:
            continue
        c = f.metadata.get("constraint")
        allowed = f"; {c.describe()}" if c is not None else ""
        doc = f"{f.metadata['help']} ({key}{allowed})"
        out[key] = (param_name(key), doc, _lookup(defaults, key))
    return out


_SCHEMA = _schema_params()
PARAM_KEYS: dict[str, str] = {name: key for key, (name, _, _) in _SCHEMA.items()}  # Param name -> key
if len(PARAM_KEYS) != len(_SCHEMA) or set(PARAM_KEYS) & set(dir(Params)):
    raise RuntimeError("jobs.config keys map to clashing pyspark Param names")  # a schema bug


def _accessors(name: str) -> dict[str, Any]:
    cap = name[0].upper() + name[1:]

    def getter(self):
        return self.getOrDefault(name)

    def setter(self, value):
        return self._set(**{name: value})

    getter.__doc__ = f"Gets the value of {name} ({PARAM_KEYS[name]}) or its default."
    setter.__doc__ = f"Sets {name} ({PARAM_KEYS[name]}); checked by the configuration schema."
    return {f"get{cap}": getter, f"set{cap}": setter}


def _make_mixin() -> type:
    attrs: dict[str, Any] = {"__doc__": "Params generated from jobs.config (train.*, allreduce.*)."}
    for key, (name, doc, _) in _SCHEMA.items():
        attrs[name] = Param(Params._dummy(), name, doc, typeConverter=_converter(key))
        attrs.update(_accessors(name))

    def _set_schema_defaults(self) -> None:
        self._setDefault(**{name: default for name, _, default in _SCHEMA.values()})

    def config_sets(self) -> list[str]:
        """The explicitly set schema params as ``--set`` items (defaults stay the schema's)."""
        return [as_set(PARAM_KEYS[p.name], v) for p, v in self._paramMap.items() if p.name in PARAM_KEYS]

    def config(self) -> Config:
        """The validated configuration these params describe (cross-key checks included)."""
        return load_config(sets=self.config_sets())

    attrs.update(_set_schema_defaults=_set_schema_defaults, config_sets=config_sets, config=config)
    return type("SchemaParams", (Params,), attrs)


SchemaParams = _make_mixin()
