"""Arrow arrays to and from numpy without pandas: validity, values and filled values read from
an array's buffers, and arrays made on numpy buffers. pyarrow's ``to_numpy(zero_copy_only=False)``
and ``pa.array`` go through its pandas layer and import pandas, 0.25-0.33 s in every fresh Spark
worker that featurizes a table; these touch the buffers only.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def values(arr: pa.Array, dtype) -> np.ndarray:
    """The values buffer of a fixed-width array as numpy (not copied; a null's slot is arbitrary)."""
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(buf, dtype, count=arr.offset + len(arr))[arr.offset :]


def bitmap(buf, first: int, n: int) -> np.ndarray:
    """Bits ``first`` .. ``first + n - 1`` of an Arrow bitmap (LSB first) as booleans (a new
    array)."""
    if n == 0:
        return np.zeros(0, np.bool_)
    raw = np.frombuffer(buf, np.uint8, count=(first + n + 7) // 8)
    return np.unpackbits(raw, bitorder="little")[first : first + n].view(np.bool_)


def valid_mask(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), np.bool_)
    return bitmap(arr.buffers()[0], arr.offset, len(arr))


def numpy_type(t: pa.DataType) -> np.dtype:
    if pa.types.is_floating(t):
        return np.dtype(f"float{t.bit_width}")
    if pa.types.is_unsigned_integer(t):
        return np.dtype(f"uint{t.bit_width}")
    if pa.types.is_integer(t):
        return np.dtype(f"int{t.bit_width}")
    raise TypeError(f"no numpy type for {t}")


def filled(arr: pa.Array, fill) -> np.ndarray:
    """The values of a boolean, integer or floating array as numpy (a new array), ``fill`` at its
    nulls: what ``arr.fill_null(fill).to_numpy(zero_copy_only=False)`` gives, read from the
    buffers (that conversion imports pandas: 0.25 s in every fresh Spark worker)."""
    if len(arr) == 0:
        return np.zeros(0, np.bool_ if pa.types.is_boolean(arr.type) else numpy_type(arr.type))
    if pa.types.is_boolean(arr.type):
        x = bitmap(arr.buffers()[1], arr.offset, len(arr))
    else:
        x = values(arr, numpy_type(arr.type)).copy()
    if arr.null_count:
        x[~valid_mask(arr)] = fill
    return x


def from_numpy(x: np.ndarray, type: pa.DataType | None = None) -> pa.Array:
    """A 1-D numpy array of numbers as an Arrow array without nulls, on its buffer (not copied
    when contiguous): of ``type`` (the same width) or of the numpy dtype's."""
    x = np.ascontiguousarray(x)
    t = pa.from_numpy_dtype(x.dtype) if type is None else type
    return pa.Array.from_buffers(t, x.shape[0], [None, pa.py_buffer(x)])
