"""A pyspark.ml Transformer that featurizes a DataFrame of raw columns with a table spec, so a
``Pipeline`` on a team's own DataFrame trains and scores end to end:

    from pyspark.ml import Pipeline
    from terascale.jobs.ml import TerascaleClassifier
    from terascale.jobs.ml_featurize import TerascaleFeaturizer

    featurizer = TerascaleFeaturizer(conf=open("conf/ads.yaml").read())
    pipeline = Pipeline(stages=[featurizer, TerascaleClassifier(featureSpec=featurizer.featureSpecJson())])
    model = pipeline.fit(logs)                 # logs: the raw table as a DataFrame
    scored = model.transform(new_logs)         # + probability, prediction

``conf`` is a terascale configuration (YAML text; its ``featurize`` section, ``format: table``);
``featureSpec`` is a spec as a dataset's manifest or a model records it (JSON; learned quantile
boundaries included), which takes precedence. The transform keeps the DataFrame's columns and
adds ``label``, ``weight`` (float), ``indices`` (array<int>), ``values`` (array<float>; null when
every value is 1) and ``reason``: null for a featurized row, else the quarantine reason
(``bad_label``, ``bad_numeric``, ...), with label, weight and indices null. The same kernel as the
featurize job (``pipeline.table_kernel``), in ``mapInArrow``: a row gets the featurize job's bits.
A DataFrame without the label's column is featurized for scoring (label null). Quantile fields
need their boundaries: take the spec of a dataset ``terascale featurize`` wrote.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
from pyspark.ml import Transformer
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable

from terascale.pipeline import spark_compat
from terascale.pipeline.rowkernels import REASONS
from terascale.pipeline.spec import FeatureSpec

OUTPUT = ("label", "weight", "indices", "values", "reason")


def _spec_of(conf: str, spec_json: str) -> FeatureSpec:
    import yaml

    from terascale.jobs.config import feature_spec, load_config
    from terascale.solvers.constraints import ConfigError

    if spec_json:
        spec = FeatureSpec.from_json(json.loads(spec_json))
    elif conf:
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_load(conf)  # a YAML error names the line, before the schema reads it
            f.write(conf)
            f.flush()
            spec = feature_spec(load_config([f.name]))
    else:
        raise ConfigError("TerascaleFeaturizer: set conf (a featurize configuration) or featureSpec")
    if spec.format != "table":
        raise ConfigError(f"TerascaleFeaturizer: featurize.format = {spec.format!r}; a DataFrame of columns needs "
                          "format table")
    missing = [f.name for f in spec.table.fields if f.bucketing == "quantile" and not f.boundaries]
    if missing:
        raise ConfigError(f"TerascaleFeaturizer: {', '.join(missing)}: quantile boundaries are learned by "
                          "terascale featurize; pass featureSpec from its dataset's manifest (or use boundaries)")
    return spec


def _aligned(rows, n: int) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array, pa.Array]:
    """label, weight, indices, values, reason of every input row (nulls for a bad row)."""
    ok = rows.status == 0
    good = np.flatnonzero(ok)
    lens = np.zeros(n, np.int32)
    lens[good] = np.diff(rows.indptr).astype(np.int32)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    bad = pa.array(~ok)
    indices = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rows.indices), mask=bad)
    multi = np.zeros(n, np.bool_)
    multi[good] = rows.multi
    vlens = np.where(multi, lens, 0)
    voff = np.zeros(n + 1, np.int32)
    np.cumsum(vlens, out=voff[1:])
    vals = rows.values[np.repeat(multi[good], np.diff(rows.indptr))]
    values = pa.ListArray.from_arrays(pa.array(voff), pa.array(vals, pa.float32()), mask=pa.array(~multi))
    label = np.zeros(n, np.float32)
    label[good] = rows.labels
    weight = np.zeros(n, np.float32)
    weight[good] = rows.weights
    codes = pa.array(rows.status.astype(np.int8), mask=ok)
    reason = pa.DictionaryArray.from_arrays(codes, pa.array(REASONS)).cast(pa.string())
    return pa.array(label, mask=~ok), pa.array(weight, mask=~ok), indices, values, reason


class TerascaleFeaturizer(Transformer, DefaultParamsReadable, DefaultParamsWritable):
    """Raw columns -> terascale's hashed features (see the module docstring)."""

    conf = Param(Params._dummy(), "conf", "a terascale configuration as YAML text (featurize.format: table)",
                 TypeConverters.toString)
    featureSpec = Param(Params._dummy(), "featureSpec", "a feature spec as JSON, as a dataset's manifest or a "
                        "model records it (quantile boundaries included); takes precedence over conf",
                        TypeConverters.toString)

    def __init__(self, conf: str = "", featureSpec: str = "") -> None:  # noqa: N803 - pyspark.ml's param style
        super().__init__()
        self._setDefault(conf="", featureSpec="")
        self._set(conf=conf, featureSpec=featureSpec)

    def spec(self) -> FeatureSpec:
        return _spec_of(self.getOrDefault(self.conf), self.getOrDefault(self.featureSpec))

    def featureSpecJson(self) -> str:  # noqa: N802 - pyspark.ml's style
        """The spec as JSON: the ``featureSpec`` of a TerascaleClassifier trained on this output."""
        return json.dumps(self.spec().to_json())

    def _transform(self, dataset):
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        from terascale.pipeline.table_kernel import LABEL, WEIGHT, featurize_batch

        spark_compat.check_session(dataset.sparkSession)
        spec = self.spec()
        t = spec.table
        keep = [c for c in dataset.columns if c not in OUTPUT]
        scoring = not t.label_expr and t.label not in dataset.columns
        label = F.lit(0) if scoring else (F.expr(t.label_expr) if t.label_expr else F.col(f"`{t.label}`"))
        proj = [label.alias("__label")]
        if t.weight or t.weight_expr:
            proj.append((F.expr(t.weight_expr) if t.weight_expr else F.col(f"`{t.weight}`")).alias("__weight"))
        proj += [(F.expr(f.expr) if f.expr else F.col(f"`{f.source}`")).alias(f"__f{i}") for i, f in enumerate(t.fields)]
        df = dataset.select(*[F.col(f"`{c}`") for c in keep], *proj)
        n_keep = len(keep)
        out_arrow = pa.schema([pa.field("label", pa.float32()),
                               pa.field("weight", pa.float32()), pa.field("indices", pa.list_(pa.int32())),
                               pa.field("values", pa.list_(pa.float32())), pa.field("reason", pa.string())])
        schema = dataset.select(*[F.col(f"`{c}`") for c in keep]).schema
        for f in from_arrow_schema(out_arrow):
            schema = schema.add(f)
        names = [LABEL] + ([WEIGHT] if (t.weight or t.weight_expr) else []) + [f.name for f in t.fields]

        def fn(batches):
            for b in batches:
                view = pa.RecordBatch.from_arrays(b.columns[n_keep:], names=names)
                rows = featurize_batch(t, spec.bits, spec.seed, view)
                label_a, weight_a, idx, vals, reason = _aligned(rows, b.num_rows)
                if scoring:
                    label_a = pa.nulls(b.num_rows, pa.float32())
                yield pa.RecordBatch.from_arrays([*b.columns[:n_keep], label_a, weight_a, idx, vals, reason],
                                                 names=[*keep, *OUTPUT])

        return spark_compat.map_in_arrow(df, fn, schema, "TerascaleFeaturizer.transform")
