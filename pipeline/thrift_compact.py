"""The Thrift compact protocol's encoding of structs, as Parquet's page headers and file footer
use it (the Apache Thrift compact protocol specification): only what a writer needs.

A struct is a list of ``(field id, type, value)`` with increasing ids; ``None`` values are
left out (optional fields). Types: ``I32``, ``I64`` (zigzag varints), ``BIN`` (bytes or str:
varint length, then the bytes), ``BOOL``, ``STRUCT`` (a nested field list), ``LIST`` (a pair
``(element type, elements)``). Every struct ends with a stop byte.
"""

from __future__ import annotations

BOOL, I32, I64, BIN, LIST, STRUCT = "bool", "i32", "i64", "binary", "list", "struct"

#: compact type ids: true 1, false 2, byte 3, i16 4, i32 5, i64 6, double 7, binary 8, list 9, set 10, map 11, struct 12
_TYPE_ID = {I32: 5, I64: 6, BIN: 8, LIST: 9, STRUCT: 12}


def varint(n: int, out: bytearray) -> None:
    """Unsigned LEB128: 7 bits a byte, low bits first, the high bit set on all but the last."""
    if n < 0:
        raise ValueError(f"varint of a negative number {n}")
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def zigzag(n: int, bits: int) -> int:
    """Signed to unsigned: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (``bits``: 32 or 64)."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not lo <= n <= hi:
        raise ValueError(f"{n} does not fit an i{bits}")
    return ((n << 1) ^ (n >> (bits - 1))) & ((1 << bits) - 1)


def _value(kind: str, v, out: bytearray) -> None:
    if kind == I32:
        varint(zigzag(int(v), 32), out)
    elif kind == I64:
        varint(zigzag(int(v), 64), out)
    elif kind == BIN:
        b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
        varint(len(b), out)
        out += b
    elif kind == STRUCT:
        struct(v, out)
    elif kind == LIST:
        elem, items = v
        if elem == BOOL:
            raise ValueError("lists of booleans are not needed by a Parquet writer")
        n = len(items)
        out.append((n << 4 | _TYPE_ID[elem]) if n < 15 else (0xF0 | _TYPE_ID[elem]))
        if n >= 15:
            varint(n, out)
        for x in items:
            _value(elem, x, out)
    else:
        raise ValueError(f"unknown Thrift type {kind!r}")


def struct(fields: list[tuple[int, str, object]], out: bytearray | None = None) -> bytearray:
    """``fields`` encoded as a compact-protocol struct, appended to ``out`` (returned)."""
    out = bytearray() if out is None else out
    last = 0
    for fid, kind, v in fields:
        if v is None:
            continue
        if fid <= last:
            raise ValueError(f"field ids must increase: {fid} after {last}")
        tid = (1 if v else 2) if kind == BOOL else _TYPE_ID[kind]
        delta = fid - last
        if delta <= 15:
            out.append(delta << 4 | tid)
        else:
            out.append(tid)
            varint(zigzag(fid, 32), out)  # an i16 field id, zigzag varint
        if kind != BOOL:
            _value(kind, v, out)
        last = fid
    out.append(0)  # stop
    return out
