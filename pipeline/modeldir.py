"""The model directory: the weights and ``metadata.json``.

The weights (float32, length n = 2^bits) are stored one of two ways, chosen by
:func:`write_weights` (readers take either, :func:`load_weights`):

- dense: ``weights.npy``, the whole vector (as before; any model with at least n/2 non-zeros);
- sparse: ``weights_sparse.npz`` with ``indices`` (int32, or int64 when n > 2³¹, strictly
  increasing, in [0, n)), ``values`` (float32, the non-zero weights, none 0) and ``length``
  (n), when fewer than half the weights are non-zero (an L1 model, ``train.l1``): 8 bytes per
  non-zero instead of 4 per weight.

The metadata's ``weights`` entry records ``storage`` ("dense" or "sparse"), ``nonzeros`` and
``length``.

Written atomically: everything goes into a hidden staging sibling (``.NAME.tmp-RUN``) that is
fsync'd and renamed into place last, so a model directory exists only when it is complete
(GUIDE invariant 6). Only a missing path, an empty directory or (with ``overwrite``) an earlier
model is replaced, through ``pipeline.artifacts.replace_dir`` (atomically: GUIDE invariant 7). A
model never holds a non-finite weight.
"""

from __future__ import annotations

import io
import json
import uuid
import zipfile

import numpy as np

from terascale.pipeline import artifacts, fsutil
from terascale.pipeline.manifest import terascale_version
from terascale.pipeline.redact import redact

MODEL_FORMAT = 1
WEIGHTS = "weights.npy"
WEIGHTS_SPARSE = "weights_sparse.npz"  # indices + values, when fewer than half the weights are non-zero
METADATA = "metadata.json"
TOKENS = "tokens.parquet"  # the training dataset's token dictionary, when it has one (pipeline.tokendict)


class ModelError(ValueError):
    """A model directory is missing, incomplete, inconsistent or incompatible."""


def staging_dir(model_dir: str, tag: str = "") -> str:
    """A hidden temporary sibling of the model directory (same filesystem: the rename is atomic)."""
    return artifacts.staging_path(model_dir, tag or uuid.uuid4().hex[:10])


def write_weights(directory: str, weights: np.ndarray, storage: str = "auto") -> dict:
    """Write the weights dense or sparse: ``storage`` "auto" chooses by the module docstring's rule,
    "dense" or "sparse" forces one. Returns the metadata's ``weights`` entry: {"storage",
    "nonzeros", "length"}."""
    if storage not in ("auto", "dense", "sparse"):
        raise ValueError(f"storage = {storage!r}: must be 'auto', 'dense' or 'sparse'")
    w = np.ascontiguousarray(weights, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise ModelError(f"refusing to write a model with {int(np.sum(~np.isfinite(w)))} non-finite weights")
    fsutil.makedirs(directory)
    nonzeros = int(np.count_nonzero(w))
    buf = io.BytesIO()
    if storage == "sparse" or (storage == "auto" and 2 * nonzeros < w.shape[0]):
        idx = np.flatnonzero(w).astype(np.int32 if w.shape[0] <= 1 << 31 else np.int64)
        np.savez(buf, indices=idx, values=w[idx], length=np.int64(w.shape[0]))
        name, storage = WEIGHTS_SPARSE, "sparse"
    else:
        np.save(buf, w, allow_pickle=False)
        name, storage = WEIGHTS, "dense"
    fs, inner = fsutil.resolve(fsutil.join(directory, name))
    with fs.open_output_stream(inner) as out:
        out.write(buf.getvalue())
    return {"storage": storage, "nonzeros": nonzeros, "length": int(w.shape[0])}


def weights_file(model_dir: str) -> tuple[str, str]:
    """(path, storage) of the model's weights file: ``weights.npy`` ("dense") if it exists, else
    ``weights_sparse.npz`` ("sparse"); ModelError when there is neither."""
    base = fsutil.normalize(model_dir)
    for name, storage in ((WEIGHTS, "dense"), (WEIGHTS_SPARSE, "sparse")):
        path = fsutil.join(base, name)
        if fsutil.exists(path):
            return path, storage
    raise ModelError(f"{model_dir}: no {WEIGHTS} or {WEIGHTS_SPARSE}; not a complete model directory")


def _sparse_arrays(path: str, data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            idx, val, n = z["indices"], z["values"], int(z["length"])
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ModelError(f"{path}: not a sparse weights file ({e})") from None
    return idx, val, n


def sparse_weights(model_dir: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, float32 values) of a model stored sparse, checked against ``n`` (2^bits) without
    building the dense vector; ModelError for a file that does not match n or is malformed."""
    path, storage = weights_file(model_dir)
    if storage != "sparse":
        raise ModelError(f"{model_dir}: its weights are stored dense ({WEIGHTS})")
    return _checked_sparse(path, _read(path), n)


def _read(path: str) -> bytes:
    fs, inner = fsutil.resolve(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


def _checked_sparse(path: str, data: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    idx, val, length = _sparse_arrays(path, data)
    if length != n:
        raise ModelError(f"{path}: {length} weights, the spec wants {n}")
    if (idx.ndim != 1 or val.ndim != 1 or idx.shape != val.shape or idx.dtype.kind != "i"
            or val.dtype != np.float32):
        raise ModelError(f"{path}: indices {idx.dtype}{idx.shape} and values {val.dtype}{val.shape}: want integer "
                         "indices and float32 values of one length")
    if idx.size and (idx[0] < 0 or idx[-1] >= n or not np.all(idx[1:] > idx[:-1])):
        raise ModelError(f"{path}: indices must be strictly increasing in [0, {n})")
    if not np.all(np.isfinite(val)):
        raise ModelError(f"{path}: non-finite weights")
    return idx, val


def load_weights(model_dir: str, n: int) -> np.ndarray:
    """The model's weights as a dense float32 vector of length ``n`` (2^bits), from either storage;
    ModelError for a file that does not match n or is malformed."""
    path, storage = weights_file(model_dir)
    data = _read(path)
    if storage == "dense":
        try:
            w = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ModelError(f"{path}: not a valid .npy file ({e})") from None
        if w.dtype != np.float32 or w.shape != (n,):
            raise ModelError(f"{model_dir}: weights.npy is {w.dtype}{w.shape}, the spec wants float32 ({n},)")
        return w
    idx, val = _checked_sparse(path, data, n)
    w = np.zeros(n, dtype=np.float32)
    w[idx] = val
    return w


def copy_token_dictionary(data_dir: str, manifest: dict, staging: str) -> dict | None:
    """Copy the dataset's token dictionary into a model's staging directory; return the metadata
    entry (its file name and counts), or None when the dataset has none."""
    entry = manifest.get("dictionary")
    if not entry:
        return None
    src_fs, src = fsutil.resolve(fsutil.join(fsutil.normalize(data_dir), entry["path"]))
    dst_fs, dst = fsutil.resolve(fsutil.join(staging, TOKENS))
    with src_fs.open_input_stream(src) as f, dst_fs.open_output_stream(dst) as out:
        while chunk := f.read(1 << 24):
            out.write(chunk)
    return {**entry, "path": TOKENS}


def commit(staging: str, model_dir: str, metadata: dict, overwrite: bool = False, run: str = "",
           flag: str = "--overwrite (train.overwrite: true)") -> None:
    """Add metadata.json to a staging directory holding weights.npy, then put it in place.

    ``model_dir`` is checked again here (``artifacts.check_target``: it may have changed while
    the model trained): an earlier model is replaced only with ``overwrite``, atomically
    (``artifacts.replace_dir``); anything else there is refused with ``artifacts.OutputError``.
    ``metadata`` is stored redacted (``pipeline.redact``).
    """
    if not np.isfinite(metadata.get("intercept", 0.0)):
        raise ModelError("refusing to write a model with a non-finite intercept")
    meta = redact({"format_version": MODEL_FORMAT, "terascale_version": terascale_version(), **metadata})
    fs, inner = fsutil.resolve(fsutil.join(staging, METADATA))
    with fs.open_output_stream(inner) as out:
        out.write(json.dumps(meta, indent=2, default=_json_default).encode("utf-8") + b"\n")
    artifacts.check_target(model_dir, artifacts.MODEL, overwrite, "model", flag)
    artifacts.replace_dir(staging, model_dir, run or uuid.uuid4().hex[:10])


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_metadata(model_dir: str) -> dict:
    path = fsutil.join(fsutil.normalize(model_dir), METADATA)
    if not fsutil.exists(path):
        hint = artifacts.missing_hint(model_dir)
        if not hint and not fsutil.exists(fsutil.normalize(model_dir)):
            raise ModelError(f"{model_dir}: no such model directory or pointer file")
        raise ModelError(f"{model_dir}: no {METADATA}; not a terascale model directory{hint}")
    try:
        meta = fsutil.read_json(path)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{path}: not a JSON object")
    if meta.get("format_version") != MODEL_FORMAT:
        raise ModelError(f"{path}: model format {meta.get('format_version')!r} is not supported (want {MODEL_FORMAT})")
    return meta


def load_model(model_dir: str) -> tuple[np.ndarray, float, dict]:
    """(weights float32, intercept, metadata); checks the weights against the feature spec."""
    meta = load_metadata(model_dir)
    w = load_weights(model_dir, 1 << int(meta["spec"]["bits"]))
    return w, float(meta["intercept"]), meta


def same_spec(a: dict, b: dict) -> list[str]:
    """The feature-spec keys on which two specs differ (empty when compatible)."""
    keys = ("format", "bits", "seed", "fields", "int_bucketing", "conjunctions", "libsvm_index_base", "table")
    return [k for k in keys if a.get(k) != b.get(k)]
