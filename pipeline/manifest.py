"""The dataset manifest ``_manifest.json``: the commit marker and the description of a dataset.

A featurized dataset exists only when its manifest exists; readers list files from the manifest,
never from the directory.
"""

from __future__ import annotations

import datetime as _dt
from importlib import metadata

from terascale.pipeline import artifacts, fsutil, sampling
from terascale.pipeline.spec import FeatureSpec

MANIFEST = "_manifest.json"
QUARANTINE_DIR = "_quarantine"
FORMAT_VERSION = 1


class DatasetError(ValueError):
    """A dataset directory is missing, uncommitted or of an unknown format."""


def terascale_version() -> str:
    try:
        return metadata.version("terascale")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def merge_inputs(results: list[dict], all_inputs: list[str]) -> list[dict]:
    """Per input file: lines = rows + dropped + quarantined, summed over the tasks that read parts of it.

    ``dropped``: negatives left out by downsampling (``pipeline.sampling``); ``positives`` and
    ``negatives_kept`` split the rows written.
    """
    acc = {u: {"path": u, "lines": 0, "rows": 0, "dropped": 0, "positives": 0, "negatives_kept": 0,
               "quarantined": 0, "by_reason": {}} for u in all_inputs}
    for r in results:
        for uri, s in r["inputs"].items():
            a = acc[uri]
            for k in ("lines", "rows", "dropped", "positives", "negatives_kept"):
                a[k] += s.get(k, 0)
            for reason, n in s["quarantined"].items():
                a["quarantined"] += n
                a["by_reason"][reason] = a["by_reason"].get(reason, 0) + n
    return [acc[u] for u in all_inputs]


def sampling_summary(rate: float, per_input: list[dict]) -> dict:
    """Negative downsampling in totals: r, the rows parsed (before) and written (after)."""
    pos = sum(p["positives"] for p in per_input)
    kept = sum(p["negatives_kept"] for p in per_input)
    dropped = sum(p["dropped"] for p in per_input)
    return {
        "negative_rate": rate,
        "negative_weight": float(sampling.negative_weight(rate)),
        "before": {"rows": pos + kept + dropped, "positives": pos, "negatives": kept + dropped},
        "after": {"rows": pos + kept, "positives": pos, "negatives": kept},
        "negatives_dropped": dropped,
    }


def build_manifest(spec: FeatureSpec, inputs: list[str], files: list[dict], quarantine_files: list[str],
                   per_input: list[dict], distinct: int | None, seconds: float, options: dict,
                   groups: dict | None = None) -> dict:
    """The manifest. ``groups``: the group map entry (``pipeline.groups``: path, names, buckets)
    or None when the dataset has no group map."""
    rows = sum(f["rows"] for f in files)
    positives = sum(f["positives"] for f in files)
    by_reason: dict[str, int] = {}
    for p in per_input:
        for k, n in p["by_reason"].items():
            by_reason[k] = by_reason.get(k, 0) + n
    return {
        "format_version": FORMAT_VERSION,
        "terascale_version": terascale_version(),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "spec": spec.to_json(),
        "columns": {
            "label": "float32, 0 or 1",
            "weight": "float32",
            "indices": "list<int32>, sorted ascending, unique within a row",
            "values": "list<float32> aligned with indices; null when every value of the row is 1",
        },
        "inputs": inputs,
        "files": files,
        "rows": rows,
        "nnz": sum(f["nnz"] for f in files),
        "bytes": sum(f["bytes"] for f in files),
        "positives": positives,
        "label_mean": positives / rows if rows else None,
        "weight_sum": sum(f["weight_sum"] for f in files),
        "distinct_features": distinct,
        "groups": groups,
        "lines": sum(p["lines"] for p in per_input),
        "sampling": sampling_summary(options.get("negative_rate", 1.0), per_input),
        "quarantine": {
            "rows": sum(by_reason.values()),
            "by_reason": dict(sorted(by_reason.items())),
            "files": quarantine_files,
        },
        "per_input": per_input,
        "seconds": round(seconds, 3),
        "options": options,
    }


def read_manifest(dataset_dir: str) -> dict:
    path = fsutil.join(fsutil.normalize(dataset_dir), MANIFEST)
    if not fsutil.exists(path):
        raise DatasetError(
            f"{dataset_dir}: no {MANIFEST}; not a terascale dataset, or its featurize run did not finish"
            + artifacts.missing_hint(dataset_dir)
        )
    m = fsutil.read_json(path)
    if m.get("format_version") != FORMAT_VERSION:
        raise DatasetError(f"{path}: format_version {m.get('format_version')!r} is not supported (want {FORMAT_VERSION})")
    return m


def dataset_files(dataset_dir: str, manifest: dict) -> list[str]:
    base = fsutil.normalize(dataset_dir)
    return [fsutil.join(base, f["path"]) for f in manifest["files"]]
