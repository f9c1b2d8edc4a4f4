"""The published-model pointer: a small JSON file that names the model directory in service.

    {"pointer_format": 1, "model": "hdfs:///models/ctr/dt=2024-03-05", "published_at": "...Z",
     "metrics": {...the model's evaluation...} or null, "previous": "<the model it replaced>" or null}

``publish`` is the only writer of a pointer: every job that writes a directory refuses a pointer
as its output (``pipeline.artifacts``), and ``publish`` itself refuses to replace anything at the
pointer path that is not a pointer (a directory, a user's file, unparsable JSON). It writes the
new pointer to a unique temporary sibling, fsyncs it and renames it over the old one
(``fsutil.write_json_atomic``). On a local or POSIX filesystem rename(2) replaces the file
atomically: a reader sees the old pointer or the new one, never a partial file and never none. On
S3 the rename is a single-object copy, so readers also see old or new. On HDFS pyarrow replaces an
existing file by delete + rename: for milliseconds there is no pointer. Only a complete model
directory is ever published, and never a path with credentials in it (``s3a://KEY:SECRET@bucket/``:
refused, as the pointer must resolve and must not store them). Wherever terascale takes a model path (evaluate, predict, train's
warm start) a pointer file is followed to the model it names.
"""

from __future__ import annotations

import datetime as dt

import numpy as np

from terascale.pipeline import fsutil, modeldir
from terascale.pipeline.redact import redact_text

POINTER_FORMAT = 1


class PointerError(ValueError):
    """A pointer file is unreadable or is not a terascale pointer."""


def is_file(path: str) -> bool:
    import pyarrow.fs as pafs

    fs, inner = fsutil.resolve(fsutil.normalize(path))
    return fs.get_file_info(inner).type == pafs.FileType.File


def read_pointer(path: str) -> dict:
    """The pointer's content; PointerError when it is not valid pointer JSON."""
    try:
        p = fsutil.read_json(fsutil.normalize(path))
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise PointerError(f"pointer {path}: not valid JSON ({e})") from None
    if not isinstance(p, dict) or p.get("pointer_format") != POINTER_FORMAT or not isinstance(p.get("model"), str):
        raise PointerError(f"pointer {path}: not a terascale model pointer (want a JSON object with "
                           f"pointer_format {POINTER_FORMAT} and a 'model' path)")
    return p


def resolve_model(path: str) -> str:
    """A model directory unchanged; a pointer file -> the model directory it names."""
    return read_pointer(path)["model"] if is_file(path) else path


def check_complete(model_dir: str) -> dict:
    """The model's metadata, after checking that the directory is a complete terascale model.

    Reads metadata.json and only the header of weights.npy (its dtype and length must match the
    feature spec), so the check stays cheap for a 2^31-weight model; a sparse model
    (``weights_sparse.npz``, :mod:`pipeline.modeldir`) is read whole and checked, without
    building its dense vector.
    """
    try:
        meta = modeldir.load_metadata(model_dir)
        n = 1 << int(meta["spec"]["bits"])
    except modeldir.ModelError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # unparsable metadata.json, no spec
        raise modeldir.ModelError(f"{model_dir}: unreadable {modeldir.METADATA} ({e!r})") from None
    path, storage = modeldir.weights_file(model_dir)
    if storage == "sparse":
        modeldir.sparse_weights(model_dir, n)
        return meta
    fs, inner = fsutil.resolve(path)
    try:
        with fs.open_input_stream(inner) as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
    except ValueError as e:
        raise modeldir.ModelError(f"{path}: not a valid .npy file ({e})") from None
    if dtype != np.float32 or shape != (n,):
        raise modeldir.ModelError(f"{path}: weights are {dtype}{shape}, the spec wants float32 ({n},)")
    return meta


def _refuse_credentials(path: str) -> None:
    """A pointer is read back to find the model: a redacted path would not resolve, and the real
    one would store the credentials in a file every job reads."""
    if redact_text(path) != path:
        raise PointerError(f"refusing to publish {redact_text(path)}: the path carries credentials; give them "
                           "through the filesystem's configuration (spark.hadoop.fs.s3a.*, the environment) "
                           "and publish the path without them")


def publish(model_dir: str, pointer: str, metrics: dict | None = None) -> dict:
    """Point ``pointer`` at the complete model ``model_dir`` (atomically); returns the new pointer."""
    _refuse_credentials(model_dir)
    model = fsutil.normalize(resolve_model(model_dir))
    _refuse_credentials(model)
    try:
        check_complete(model)
    except modeldir.ModelError as e:
        raise modeldir.ModelError(f"refusing to publish: {e}") from None
    previous = None
    if fsutil.exists(pointer):
        from terascale.pipeline.artifacts import OutputError

        if not is_file(pointer):
            raise OutputError(f"--pointer {pointer}: exists and is a directory, not a model pointer; refusing to replace it")
        try:
            old = read_pointer(pointer)
        except PointerError as e:
            raise OutputError(f"--pointer {pointer}: exists and is not a terascale pointer ({e}); "
                              "refusing to replace it: remove it or choose another path") from None
        # a re-run publishing the same model keeps the model it replaced as the previous one
        previous = old.get("previous") if old.get("model") == model else old.get("model")
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    content = {"pointer_format": POINTER_FORMAT, "model": model, "published_at": now,
               "metrics": metrics, "previous": previous}
    fsutil.write_json_atomic(fsutil.normalize(pointer), content)
    _record_publication(model, fsutil.normalize(pointer))
    return content


PUBLISHED = "_published.json"


def _record_publication(model: str, pointer: str) -> None:
    """Note in the model directory which pointers were made to serve it (``served_by`` reads it)."""
    path = fsutil.join(model, PUBLISHED)
    known = fsutil.read_json(path).get("pointers", []) if fsutil.exists(path) else []
    fsutil.write_json_atomic(path, {"pointers": sorted({*known, pointer})})


def served_by(model_dir: str) -> list[str]:
    """The pointers, among those ``publish`` made for this model, that still point at it."""
    model = fsutil.normalize(model_dir).rstrip("/")
    path = fsutil.join(model, PUBLISHED)
    if not fsutil.exists(path):
        return []
    serving = []
    for p in fsutil.read_json(path).get("pointers", []):
        try:
            if fsutil.normalize(read_pointer(p)["model"]).rstrip("/") == model:
                serving.append(p)
        except (PointerError, FileNotFoundError, OSError, KeyError):
            continue  # gone or replaced by something else: it serves nothing
    return serving
