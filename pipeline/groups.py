"""The group map ``_groups.npy``: which feature field ("group") produced each hashed bucket.

Row indices alone do not say which field a bucket came from, so the featurizer records it: for
every token it hashes, the map entry of the token's bucket becomes min(entry, g), g being the
token's group number, its position in ``group_names(spec)``. Entries of buckets no row of the
dataset has stay ``NO_GROUP``. The minimum does not depend on the order of the tokens, so the
map does not depend on how the input was split into tasks.

The map is a 1-D uint8 ``.npy`` array of length 2^bits, written only for bits <= GROUPS_MAX_BITS.
Each featurize task writes its own map into its attempt directory; the commit merges the
accepted attempts' maps (``load_map`` + ``merge_maps``, run on the executors) and writes
``_groups.npy`` before the manifest, whose ``groups`` entry names it. Everything here works on
any pyarrow filesystem (``pipeline.fsutil``) and never imports pyspark.
"""

from __future__ import annotations

import uuid

import numpy as np

from terascale.pipeline import fsutil
from terascale.pipeline.manifest import DatasetError
from terascale.pipeline.spec import FeatureSpec
from terascale.solvers.data import NO_GROUP  # no row of the dataset has this bucket

GROUPS_FILE = "_groups.npy"
TASK_GROUPS_FILE = "groups.npy"  # a task's own map, inside its attempt directory
MAX_GROUPS = 255  # group numbers 0..254
GROUPS_MAX_BITS = 26  # 64 MiB map; above this no map is built
OTHER = "other"


def group_names(spec: FeatureSpec) -> list[str]:
    """Group names in group-number order.

    Criteo: the spec's fields in spec order, then one group per conjunction named ``A^B`` (a
    table spec: its fields, then its crosses, ``A^B^C``); past
    255 names, names 254.. collapse into one last group ``other``. LibSVM: ``["features"]``.
    """
    if spec.format == "libsvm":
        return ["features"]
    if spec.table is not None:
        names = spec.table.group_names()
    else:
        names = list(spec.fields) + [f"{a}^{b}" for a, b in spec.conjunctions]
    if len(names) > MAX_GROUPS:
        names = names[: MAX_GROUPS - 1] + [OTHER]
    return names


def token_groups(spec: FeatureSpec) -> tuple[np.ndarray, np.ndarray]:
    """Group numbers (uint8) of the Criteo kernel's selected fields and of its conjunctions."""
    n_fields = len(spec.fields)
    pos = np.arange(n_fields + len(spec.conjunctions), dtype=np.int64)
    g = np.minimum(pos, MAX_GROUPS - 1).astype(np.uint8)  # past 255 names: 'other' = 254
    return g[:n_fields].copy(), g[n_fields:].copy()


def new_map(bits: int) -> np.ndarray | None:
    """An empty map (every entry NO_GROUP) for 2^bits buckets, or None when bits > GROUPS_MAX_BITS."""
    if bits > GROUPS_MAX_BITS:
        return None
    return np.full(1 << bits, NO_GROUP, dtype=np.uint8)


def merge_maps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise minimum of two maps; reuses ``a`` (a map from ``load_map``) when it can."""
    if a.flags.writeable:
        return np.minimum(a, b, out=a)
    return np.minimum(a, b)


def bucket_count(groups: np.ndarray) -> int:
    """Buckets that some row has (entries other than NO_GROUP)."""
    return int(groups.shape[0] - np.count_nonzero(groups == NO_GROUP))


def write_map(path: str, groups: np.ndarray) -> None:
    """Write a map as ``.npy`` to a temporary sibling and rename it into place."""
    if groups.dtype != np.uint8 or groups.ndim != 1:
        raise ValueError(f"a group map is a 1-D uint8 array, not {groups.dtype} of shape {groups.shape}")
    fs, inner = fsutil.resolve(path)
    tmp = f"{inner}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open_output_stream(tmp) as out:
            np.lib.format.write_array(out, np.ascontiguousarray(groups), allow_pickle=False)
        fs.move(tmp, inner)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except OSError:
            pass
        raise


def load_map(path: str, n_buckets: int) -> np.ndarray:
    """Read and check a map of ``n_buckets`` entries (a writable array). Raises DatasetError."""
    fs, inner = fsutil.resolve(path)
    if not fsutil.exists(path):
        raise DatasetError(f"{path}: group map is missing")
    with fs.open_input_file(inner) as f:
        try:
            major, _ = np.lib.format.read_magic(f)
            if major == 1:
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif major in (2, 3):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {major}")
        except ValueError as e:
            raise DatasetError(f"{path}: group map is not a readable .npy file ({e})") from None
        if dtype != np.uint8:
            raise DatasetError(f"{path}: group map has dtype {dtype}, want uint8")
        if len(shape) != 1:
            raise DatasetError(f"{path}: group map has shape {shape}, want a 1-D array")
        if shape[0] != n_buckets:
            raise DatasetError(f"{path}: group map has {shape[0]} entries, want 2^bits = {n_buckets}")
        groups = np.empty(n_buckets, dtype=np.uint8)
        view, got = memoryview(groups), 0
        while got < n_buckets:  # a remote file may return less than asked before its end
            k = f.readinto(view[got:])
            if not k:
                break
            got += k
        if got != n_buckets:
            raise DatasetError(f"{path}: group map is truncated ({got} of {n_buckets} data bytes)")
        if f.read(1):
            raise DatasetError(f"{path}: group map has bytes after its {n_buckets} entries")
    return groups


def read_groups(dataset_dir: str, manifest: dict) -> np.ndarray | None:
    """The dataset's group map (uint8, length 2^bits), or None when its manifest has no groups
    entry (a dataset from before group maps, bits > GROUPS_MAX_BITS, or not featurized by
    terascale). Raises DatasetError when the file is missing or not a map of the right size."""
    entry = manifest.get("groups")
    if not entry:
        return None
    path = fsutil.join(fsutil.normalize(dataset_dir), entry["path"])
    return load_map(path, 1 << int(manifest["spec"]["bits"]))
