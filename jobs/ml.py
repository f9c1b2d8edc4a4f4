"""terascale as a pyspark.ml Estimator and Model, for use from your own PySpark code.

    from terascale.jobs.ml import TerascaleClassifier, TerascaleModel

    clf = TerascaleClassifier(workers=2, l2=1e-6, modelDir="models/ctr")
    model = clf.fit(spark.read.parquet("data/train"))     # or clf.fit("data/train")
    scored = model.transform(spark.read.parquet("data/test"))  # + probability, prediction
    model.save("models/ctr2"); model = TerascaleModel.load("models/ctr2")

The training params are generated from the configuration schema (``jobs.ml_params``: every
``train.*`` and ``allreduce.*`` key, e.g. ``train.learning_rate`` -> ``learningRate``), checked by
the schema when set. ``fit`` takes a featurized DataFrame or the path of a featurized dataset
directory and trains with ``jobs.train_job.run_train`` (a barrier stage; see ``jobs.ml_data``
for when a DataFrame is trained on in place and when it is first written to ``tempDir``).
A model of a table spec (``featurize.format = table``) also transforms a DataFrame of the raw
columns (``jobs.ml_featurize.TerascaleFeaturizer`` first). ``transform`` scores with the vectorized predictor (``solvers.predict``) in an Arrow UDF, with
the weights broadcast once. A model saves as a model directory (``pipeline.modeldir``) plus
pyspark's params metadata (``metadata/``), so it also persists inside a ``PipelineModel``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa
import pyspark
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsWritable,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from terascale.jobs.ml_data import (
    dataframe_spec,
    indices_encoding,
    is_plain_read,
    parse_spec,
    source_dataset,
    write_dataset,
)
from terascale.jobs.ml_params import SchemaParams
from terascale.jobs.train_job import run_train
from terascale.pipeline import fsutil, modeldir, spark_compat, spark_tasks
from terascale.pipeline.manifest import read_manifest
from terascale.pipeline.redact import redact, redact_text
from terascale.pipeline.sampling import score_transform
from terascale.solvers.catalogue import loss_spec

log = logging.getLogger("terascale.ml")
PARAMS_DIR = "metadata"  # pyspark's params metadata inside a model directory (Pipeline persistence)


class _OutputParams(Params):
    probabilityCol = Param(Params._dummy(), "probabilityCol", "output column: P(y = 1) (logistic models) "
                           "or the score x.w + b (other losses)", TypeConverters.toString)
    predictionCol = Param(Params._dummy(), "predictionCol", "output column: 1.0 when probabilityCol > threshold, "
                          "else 0.0", TypeConverters.toString)
    threshold = Param(Params._dummy(), "threshold", "decision threshold on probabilityCol",
                      TypeConverters.toFloat)

    def _set_output_defaults(self) -> None:
        self._setDefault(probabilityCol="probability", predictionCol="prediction", threshold=0.5)


class TerascaleClassifier(Estimator, SchemaParams, _OutputParams, DefaultParamsReadable, DefaultParamsWritable):
    """Logistic regression (or squared / hinge loss) trained by terascale's distributed solvers."""

    labelCol = Param(Params._dummy(), "labelCol", "label column (0 or 1) of a DataFrame", TypeConverters.toString)
    weightCol = Param(Params._dummy(), "weightCol", "importance weight column of a DataFrame; "
                      "missing column or '' = all 1", TypeConverters.toString)
    featureSpec = Param(Params._dummy(), "featureSpec", "JSON feature spec of a DataFrame not read from a "
                        "featurized dataset (keys of pipeline.spec.FeatureSpec, e.g. {\"bits\": 20}); '' = "
                        "the spec of the dataset the DataFrame was read from", TypeConverters.toString)
    modelDir = Param(Params._dummy(), "modelDir", "model directory fit writes (kept); '' = a temporary one, "
                     "removed once the model is loaded", TypeConverters.toString)
    tempDir = Param(Params._dummy(), "tempDir", "where fit writes temporary datasets and models; must be "
                    "shared by the executors (e.g. hdfs://...) on a cluster; '' = the system temp dir "
                    "(local masters only)", TypeConverters.toString)

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self._set_schema_defaults()
        self._set_output_defaults()
        self._setDefault(labelCol="label", weightCol="weight", featureSpec="", modelDir="", tempDir="")
        self.setParams(**kwargs)

    def setParams(self, **kwargs) -> TerascaleClassifier:
        """Set params by name; an unknown name is an error."""
        unknown = [k for k in kwargs if not self.hasParam(k)]
        if unknown:
            raise ValueError(f"TerascaleClassifier has no param {unknown[0]!r}; "
                             f"params: {', '.join(sorted(p.name for p in self.params))}")
        return self._set(**kwargs)

    def _temp_root(self, spark) -> str:
        d = self.getOrDefault(self.tempDir)
        if d:
            return d
        if not spark_tasks.master(spark).startswith("local"):
            raise ValueError("tempDir is not set: on a cluster fit needs a directory every executor can reach "
                             "(e.g. hdfs:///tmp/terascale) for its temporary dataset and model; set tempDir")
        return tempfile.gettempdir()

    def _dataset_dir(self, spark, dataset, scratch) -> str:
        """A featurized dataset directory holding ``dataset`` (written under ``scratch()`` if needed)."""
        plain_cols = self.getOrDefault(self.labelCol) == "label" and self.getOrDefault(self.weightCol) == "weight"
        spec_json = self.getOrDefault(self.featureSpec)
        if isinstance(dataset, (str, os.PathLike)):
            path = fsutil.normalize(os.fspath(dataset))
            manifest = read_manifest(path)
            if spec_json and modeldir.same_spec(parse_spec(spec_json), manifest["spec"]):
                raise modeldir.ModelError(f"featureSpec differs from the spec of the dataset {path}")
            if plain_cols:
                return path
            dataset = spark.read.parquet(path)
        src = source_dataset(dataset)
        spec = dataframe_spec(src, spec_json)
        if plain_cols and src is not None and is_plain_read(spark, dataset, *src):
            log.info("fit: the DataFrame is the dataset %s; training on it in place", redact_text(src[0]))
            return src[0]
        if src is not None:  # Spark reads the dataset's rows to write them again
            spark_compat.check_readable(indices_encoding(src[1]), spark.version, f"the dataset {src[0]}")
        out = fsutil.join(scratch(), "data")
        log.info("fit: writing the DataFrame as a featurized dataset to %s", redact_text(out))
        m = write_dataset(spark, dataset, out, spec, self.getOrDefault(self.labelCol),
                          self.getOrDefault(self.weightCol), "snappy")
        if not m["rows"]:
            raise ValueError("the DataFrame has no rows")
        return out

    def _fit(self, dataset) -> TerascaleModel:
        from pyspark.sql import SparkSession

        cfg = self.config()  # the whole configuration, checked before any Spark job starts
        spark = SparkSession.active()
        spark_compat.check_session(spark)
        made: list[str] = []

        def scratch() -> str:  # created on first use, removed at the end
            if not made:
                made.append(fsutil.join(fsutil.normalize(self._temp_root(spark)),
                                        f"terascale-fit-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"))
            return made[0]

        try:
            data_dir = self._dataset_dir(spark, dataset, scratch)
            target = self.getOrDefault(self.modelDir) or fsutil.join(scratch(), "model")
            run_train(spark, cfg, data_dir, target)
            model = TerascaleModel.from_dir(target)
            if not self.getOrDefault(self.modelDir):
                model.modelDir = None
        finally:
            for d in made:
                fsutil.delete(d)
        self._copyValues(model)
        return model


def _score_udf(bc, n_features: int, logistic: bool):
    """An Arrow UDF (indices, values) -> float64 scoring with the broadcast (weights, intercept, slope,
    shift): σ(slope·m + shift), the model's population probabilities (``pipeline.sampling``), or m.
    (A pandas UDF before Spark 4.1: ``pipeline.spark_compat.arrow_scalar_udf``.)"""
    def score(indices: pa.Array, values: pa.Array) -> pa.Array:
        from terascale.pipeline.dataset import tables_to_csr
        from terascale.solvers.predict import decision_function, sigmoid
        from terascale.solvers.shard import Shard, find_problem

        n = len(indices)
        if not pa.types.is_int32(indices.type.value_type):
            indices = indices.cast(pa.list_(pa.int32()))  # a safe cast: out-of-range values raise
        if values.type != pa.list_(pa.float32()):
            values = values.cast(pa.list_(pa.float32()))
        table = pa.table({"label": pa.array(np.zeros(n, np.float32)), "indices": indices, "values": values})
        csr = tables_to_csr([table], n_features)
        problem = find_problem(csr, Shard.from_csr(csr), "transform", "squared")
        if problem is not None:
            raise problem
        w, b, slope, shift = bc.value
        m = decision_function(csr, w, b)
        return pa.array(sigmoid(m, shift, slope) if logistic else m)

    return spark_compat.arrow_scalar_udf(score, "double")


class _Carried:
    """A broadcast's ``.value`` without the broadcast (Spark Connect: ``TerascaleModel._broadcast``)."""

    def __init__(self, value) -> None:
        self.value = value


class TerascaleModel(Model, _OutputParams, MLReadable, MLWritable):
    """A trained terascale model: weights (float32, 2^bits), intercept and the training metadata."""

    def __init__(self, weights=None, intercept: float = 0.0, metadata: dict | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__()
        self._set_output_defaults()
        self.weights, self.intercept, self.metadata, self.modelDir = weights, float(intercept), metadata or {}, model_dir
        self._bc = None

    @property
    def spec(self) -> dict:
        return self.metadata["spec"]

    @property
    def loss(self) -> str:
        return self.metadata["config"]["train"]["loss"]

    @classmethod
    def from_dir(cls, model_dir: str) -> TerascaleModel:
        """Load a model directory (as written by ``terascale train``, ``fit`` or ``save``)."""
        w, b, meta = modeldir.load_model(model_dir)
        model = cls(w, b, meta, fsutil.normalize(model_dir))
        params = fsutil.join(fsutil.normalize(model_dir), PARAMS_DIR, "part-00000")
        if fsutil.exists(params):
            for name, v in fsutil.read_json(params)["paramMap"].items():
                if model.hasParam(name):
                    model._set(**{name: v})
        return model

    def _broadcast(self, spark):
        """(weights, intercept, slope, shift) for the scoring UDF, as ``.value``: a broadcast on a
        classic session (sent once per executor); on Spark Connect, which has no broadcast, the
        values themselves, carried in the UDF's closure (sent with every task)."""
        slope, shift = score_transform(self.metadata, "population")
        if spark_tasks.is_connect(spark):
            return _Carried((self.weights, self.intercept, slope, shift))
        sc = spark.sparkContext
        if self._bc is None or self._bc[0] is not sc:
            self._bc = (sc, sc.broadcast((self.weights, self.intercept, slope, shift)))
        return self._bc[1]

    def _transform(self, dataset):
        from pyspark.sql import functions as F

        spark_compat.check_session(dataset.sparkSession)
        if self.spec.get("format") == "table" and "indices" not in dataset.columns:  # raw columns
            from terascale.jobs.ml_featurize import TerascaleFeaturizer

            dataset = TerascaleFeaturizer(featureSpec=json.dumps(self.spec)).transform(dataset)
        src = source_dataset(dataset)
        if src is not None:
            spark_compat.check_readable(indices_encoding(src[1]), dataset.sparkSession.version, f"the dataset {src[0]}")
            diff = modeldir.same_spec(self.spec, src[1]["spec"])
            if diff:
                raise modeldir.ModelError(f"the model and the DataFrame's dataset {src[0]} were featurized "
                                          f"differently ({', '.join(diff)}); re-featurize with the model's spec")
        udf = _score_udf(self._broadcast(dataset.sparkSession), 1 << int(self.spec["bits"]),
                         loss_spec(self.loss).link == "sigmoid")
        values = F.col("values") if "values" in dataset.columns else F.lit(None).cast("array<float>")
        prob = self.getOrDefault(self.probabilityCol)
        if "reason" in dataset.columns:  # a featurizer's quarantined rows score null
            score = udf(F.coalesce(F.col("indices"), F.array().cast("array<int>")), values)
            out = dataset.withColumn(prob, F.when(F.col("reason").isNull(), score))
        else:
            out = dataset.withColumn(prob, udf(F.col("indices"), values))
        return out.withColumn(self.getOrDefault(self.predictionCol),
                              (F.col(prob) > self.getOrDefault(self.threshold)).cast("double"))

    def _params_json(self) -> str:
        def plain(m):
            return {p.name: v for p, v in m.items()}

        return json.dumps(redact({"class": f"{type(self).__module__}.{type(self).__name__}",
                                  "timestamp": int(time.time() * 1000), "sparkVersion": pyspark.__version__,
                                  "uid": self.uid, "paramMap": plain(self._paramMap),
                                  "defaultParamMap": plain(self._defaultParamMap)}))

    def save_dir(self, path: str, overwrite: bool = False) -> None:
        """Write the model directory ``path`` atomically; an existing model is replaced only with
        ``overwrite``, anything else there is refused (``pipeline.artifacts``)."""
        staging = modeldir.staging_dir(path)
        try:
            weights = modeldir.write_weights(staging, self.weights)
            fsutil.makedirs(fsutil.join(staging, PARAMS_DIR))
            fs, inner = fsutil.resolve(fsutil.join(staging, PARAMS_DIR, "part-00000"))
            with fs.open_output_stream(inner) as f:
                f.write(self._params_json().encode("utf-8") + b"\n")
            meta = {k: v for k, v in self.metadata.items() if k not in ("format_version", "terascale_version")}
            modeldir.commit(staging, path, {**meta, "intercept": self.intercept, "weights": weights}, overwrite=overwrite,
                            flag="model.write().overwrite()")
        finally:
            fsutil.delete(staging)

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader()


class _ModelWriter(MLWriter):
    def __init__(self, model: TerascaleModel) -> None:
        super().__init__()
        self.model = model

    def save(self, path: str) -> None:
        if not self.shouldOverwrite and fsutil.exists(fsutil.normalize(path)):
            raise FileExistsError(f"{path} already exists; use model.write().overwrite().save(path)")
        self.model.save_dir(path, overwrite=self.shouldOverwrite)


class _ModelReader(MLReader):
    def load(self, path: str) -> TerascaleModel:
        return TerascaleModel.from_dir(path)
