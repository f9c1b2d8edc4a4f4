"""The feature specification: a public contract, in plain Python.

This module is the slow, obvious definition of how a raw record becomes hashed feature
indices. The bulk kernels (``pipeline.hashing`` for murmur3, ``pipeline.criteo_kernel`` for the
Criteo tokens) must agree with it bit for bit, and tests check that they do.

- Criteo integer field ``Ik`` with value v -> token ``Ik={b}``; with ``log_squared`` bucketing
  b = v if v <= 2 else floor(ln(v)^2), with ``identity`` b = v.
- Criteo categorical field ``Ck`` with value s -> token ``Ck={s}``.
- A conjunction (A, B) -> token ``{tokenA}^{tokenB}`` when both fields are present.
- index = mmh3.hash(token_utf8, seed, signed=False) mod 2^bits.
- Within a row the indices are sorted ascending and unique; a collision adds to the value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import mmh3

from terascale.pipeline.table_spec import TableSpec

SPEC_VERSION = 1

#: The largest hash space, 2^30 buckets: one limit for featurize (``featurize.bits``), the ML API
#: and train. The solvers index features with int32 (n_features <= 2^31 - 1, ``solvers.shard``).
MAX_BITS = 30


def check_bits(bits: object, what: str) -> int:
    """``bits`` as an int in [1, MAX_BITS]; else a ValueError naming ``what`` and the limit."""
    from terascale.pipeline.manifest import DatasetError

    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise DatasetError(f"{what} = {bits!r}: must be an integer in [1, {MAX_BITS}] (2^bits features, "
                           "indexed by int32 in the solvers); re-featurize with featurize.bits <= "
                           f"{MAX_BITS}")
    return bits


@dataclass(frozen=True)
class FeatureSpec:
    format: str = "criteo"
    bits: int = 24
    seed: int = 0
    fields: tuple[str, ...] = ()
    int_bucketing: str = "log_squared"
    conjunctions: tuple[tuple[str, str], ...] = ()
    libsvm_index_base: int = 1
    table: TableSpec | None = None  # format "table": the fields over named columns (pipeline.table_spec)

    def to_json(self) -> dict:
        d = {
            "spec_version": SPEC_VERSION,
            "format": self.format,
            "bits": self.bits,
            "seed": self.seed,
            "fields": list(self.fields),
            "int_bucketing": self.int_bucketing,
            "conjunctions": [list(p) for p in self.conjunctions],
            "libsvm_index_base": self.libsvm_index_base,
            "index": "mmh3.hash(token_utf8, seed, signed=False) mod 2^bits",
        }
        if self.table is not None:
            d["table"] = self.table.to_json()
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> FeatureSpec:
        return cls(
            format=d["format"],
            bits=int(d["bits"]),
            seed=int(d["seed"]),
            fields=tuple(d["fields"]),
            int_bucketing=d["int_bucketing"],
            conjunctions=tuple(tuple(p) for p in d["conjunctions"]),
            libsvm_index_base=int(d.get("libsvm_index_base", 1)),
            table=TableSpec.from_json(d["table"]) if d.get("table") is not None else None,
        )


def bucket(v: int, mode: str = "log_squared") -> int:
    """Bucket of an integer field value."""
    if mode == "identity" or v <= 2:
        return v
    return int(math.floor(math.log(v) ** 2))


def int_token(field: str, v: int, mode: str = "log_squared") -> str:
    return f"{field}={bucket(v, mode)}"


def cat_token(field: str, value: str) -> str:
    return f"{field}={value}"


def conjunction_token(token_a: str, token_b: str) -> str:
    return f"{token_a}^{token_b}"


def hash_index(token: str, bits: int, seed: int = 0) -> int:
    return mmh3.hash(token.encode("utf-8"), seed, signed=False) & ((1 << bits) - 1)


def criteo_tokens(
    record: Mapping[str, str], fields: Sequence[str], mode: str, conjunctions: Iterable[tuple[str, str]] = ()
) -> list[str]:
    """Tokens of one Criteo record given as {field name: raw text} ('' = missing)."""
    tok: dict[str, str] = {}
    for name in fields:
        raw = record.get(name, "")
        if raw == "":
            continue
        tok[name] = int_token(name, int(raw), mode) if name[0] == "I" else cat_token(name, raw)
    out = [tok[n] for n in fields if n in tok]
    for a, b in conjunctions:
        if a in tok and b in tok:
            out.append(conjunction_token(tok[a], tok[b]))
    return out


def indices_values(tokens: Iterable[str], bits: int, seed: int) -> tuple[list[int], list[float]]:
    """Sorted unique indices and summed values of a row's tokens (each token has value 1)."""
    acc: dict[int, float] = {}
    for t in tokens:
        i = hash_index(t, bits, seed)
        acc[i] = acc.get(i, 0.0) + 1.0
    idx = sorted(acc)
    return idx, [acc[i] for i in idx]
