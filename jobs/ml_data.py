"""Where a DataFrame's featurized data lives, and writing one to a temporary featurized dataset.

``run_train`` trains on a dataset directory (Parquet + ``_manifest.json``), whose files the
barrier tasks read themselves. A DataFrame that is a plain read of such a directory (its
analyzed plan is the file relation itself, over exactly the manifest's files, with the files'
columns) is trained on in place. Any other DataFrame is written as a dataset: Spark writes the
Parquet files, one small task per file counts rows, non-zeros, positives and weights with
pyarrow, and the driver writes the manifest (``pipeline.manifest.build_manifest``).

The feature spec of a DataFrame comes from the ``featureSpec`` param (JSON; keys of
``pipeline.spec.FeatureSpec``, e.g. ``{"bits": 20}``) or from its lineage: the manifest of the
one dataset directory all its input files are in. When both exist they must agree.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlparse
from urllib.request import url2pathname

import pyarrow.compute as pc
import pyarrow.parquet as pq

from terascale.jobs.config import ConfigError, feature_spec, load_config
from terascale.pipeline import fsutil, spark_tasks
from terascale.pipeline.manifest import MANIFEST, DatasetError, build_manifest, read_manifest
from terascale.pipeline.modeldir import ModelError, same_spec
from terascale.pipeline.spec import FeatureSpec


def _local(uri: str) -> str:
    """``file:`` URIs (as Spark reports input files) as local paths; other URIs unchanged."""
    u = urlparse(uri)
    return url2pathname(u.path) if u.scheme == "file" else uri


def source_dataset(df) -> tuple[str, dict] | None:
    """(directory, manifest) of the one featurized dataset all of ``df``'s input files are in."""
    files = [_local(f) for f in df.inputFiles()]
    dirs = {f.rsplit("/", 1)[0] for f in files}
    if len(dirs) != 1:
        return None
    d = dirs.pop()
    try:
        return d, read_manifest(d)
    except DatasetError:
        return None


def indices_encoding(manifest: dict) -> str:
    """How a dataset's indices are encoded in Parquet: its manifest's ``options.parquet_encoding``;
    else ``spark`` for one Spark wrote (:func:`write_dataset`: what every Spark reads) and
    ``byte_stream_split`` for a featurize output from before the option was recorded."""
    options = manifest.get("options") or {}
    return options.get("parquet_encoding") or ("spark" if "source" in options else "byte_stream_split")


def is_plain_read(spark, df, directory: str, manifest: dict) -> bool:
    """True when ``df`` is the dataset itself: no filter, projection, sample or other change.

    Conservative: the analyzed plan must be the file relation (classic Spark only), its files
    the manifest's files, its schema the files' schema.
    """
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return False
    if jdf.queryExecution().analyzed().getClass().getSimpleName() != "LogicalRelation":
        return False
    names = {_local(f).rsplit("/", 1)[-1] for f in df.inputFiles()}
    if names != {f["path"] for f in manifest["files"]}:
        return False
    return df.schema == spark.read.parquet(directory).schema


def parse_spec(text: str) -> dict:
    """A feature spec from JSON: keys of the featurize section's spec (format, bits, seed, fields,
    int_bucketing, conjunctions, libsvm_index_base), validated by the configuration schema; the
    others take the featurize defaults, as ``terascale featurize`` would."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"featureSpec = {text!r}: not valid JSON ({e})") from None
    known = set(FeatureSpec.__dataclass_fields__)
    if isinstance(d, dict) and d.get("format") == "table":  # a table spec, as a manifest records it
        try:
            return FeatureSpec.from_json({**FeatureSpec(format="table").to_json(), **d}).to_json()
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"featureSpec: not a table spec ({e})") from None
    if not isinstance(d, dict) or set(d) - known - {"spec_version", "index"}:
        raise ValueError(f"featureSpec = {text!r}: must be a JSON object with keys from {sorted(known)}")
    sets = [f"featurize.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in d.items() if k in known]
    try:
        return feature_spec(load_config(sets=sets)).to_json()
    except ConfigError as e:
        raise ValueError(f"featureSpec = {text!r}: {e}") from None


def dataframe_spec(src: tuple[str, dict] | None, spec_json: str) -> dict:
    """The feature spec of a DataFrame: the featureSpec param and/or the spec of its source
    dataset ``src`` (``source_dataset(df)``: (directory, manifest), or None)."""
    given = parse_spec(spec_json) if spec_json else None
    if given is not None and src is not None:
        diff = same_spec(given, src[1]["spec"])
        if diff:
            raise ModelError(f"featureSpec differs from the spec of the DataFrame's source dataset {src[0]} "
                             f"on {', '.join(diff)}")
    if given is not None:
        return given
    if src is not None:
        return src[1]["spec"]
    raise ValueError("the DataFrame's feature spec is unknown: it was not read from one featurized dataset "
                     "directory; set featureSpec, e.g. '{\"bits\": 20}' or json.dumps(manifest['spec'])")


def file_stats(path: str) -> dict:
    """Rows, non-zeros, positives, weight sum and bytes of one Parquet file of a dataset."""
    fs, inner = fsutil.resolve(path)
    with fs.open_input_file(inner) as f:
        t = pq.ParquetFile(f).read(columns=["label", "weight", "indices", "values"])
    nnz = pc.sum(pc.list_value_length(t.column("indices"))).as_py() or 0
    return {
        "path": path.rsplit("/", 1)[-1], "rows": t.num_rows, "nnz": int(nnz),
        "bytes": int(fs.get_file_info(inner).size),
        "positives": float(pc.sum(t.column("label")).as_py() or 0.0),
        "weight_sum": float(pc.sum(t.column("weight")).as_py() or 0.0),
        "rows_with_values": t.num_rows - t.column("values").null_count,
    }


def write_dataset(spark, df, out: str, spec: dict, label_col: str, weight_col: str, compression: str) -> dict:
    """Write ``df`` (label, indices, values?, weight?) as a featurized dataset; return its manifest."""
    from pyspark.sql import functions as F

    t0 = time.perf_counter()
    cols = set(df.columns)
    if "reason" in cols:  # TerascaleFeaturizer's output: its quarantined rows carry no features
        df = df.where(F.col("reason").isNull())
    missing = [c for c in (label_col, "indices") if c not in cols]
    if missing:
        raise ValueError(f"the DataFrame has no column {missing[0]!r} (columns: {sorted(cols)})")
    weight = F.col(weight_col) if weight_col and weight_col in cols else F.lit(1.0)
    values = F.col("values") if "values" in cols else F.lit(None)
    out = fsutil.normalize(out)
    (df.select(F.col(label_col).cast("float").alias("label"), weight.cast("float").alias("weight"),
               F.col("indices").cast("array<int>").alias("indices"), values.cast("array<float>").alias("values"))
       .write.mode("overwrite").option("compression", compression).parquet(out))
    parts = sorted(p for p in fsutil.list_files(out) if p.rsplit("/", 1)[-1].startswith("part-"))
    stats = spark_tasks.run_tasks(spark, parts, lambda _, it: map(file_stats, it), "terascale: the written files' counts")
    files = [s for s in stats if s["rows"] > 0]
    inputs = [_local(f) for f in df.inputFiles()]
    manifest = build_manifest(FeatureSpec.from_json(spec), inputs, files, [], [], None, time.perf_counter() - t0,
                              {"source": "terascale.ml: a DataFrame written by TerascaleClassifier.fit",
                               "parquet_encoding": "spark"})
    fsutil.write_json_atomic(fsutil.join(out, MANIFEST), manifest)
    return manifest
