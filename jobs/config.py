"""The one configuration schema of terascale.

Every parameter is declared once here, as a field of a frozen dataclass, with its default, its
constraint (as data) and its help text. ``conf/defaults.yaml`` is rendered from this module
(``terascale config --defaults``) and a test keeps the two equal. Values are resolved in this
order: schema defaults -> each ``--conf FILE`` -> each ``--set section.key=value``. Validation
happens on the driver before any Spark job or socket starts; every error names the key, the bad
value and what is allowed, and unknown keys get a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from terascale.allreduce import endpoints
from terascale.allreduce.ciphers import CIPHERS, DEFAULT_CIPHER
from terascale.pipeline.redact import redact, shown
from terascale.pipeline.sampling import CALIBRATIONS
from terascale.pipeline.shard_cache import budget_error, minimum_budget_mb
from terascale.pipeline.spark_compat import PARQUET_ENCODINGS
from terascale.pipeline.spec import MAX_BITS
from terascale.pipeline.table_sources import INPUT_FORMATS
from terascale.pipeline.table_spec import Field as TableField
from terascale.pipeline.table_spec import TableSpec, expand_crosses, parse_fields
from terascale.solvers.catalogue import PARAMS as SOLVER_PARAMS
from terascale.solvers.catalogue import loss_spec, solver_spec
from terascale.solvers.constraints import (  # noqa: F401 - ConfigError and the constraint types are this module's API too
    AutoOr,
    ConfigError,
    Interval,
    OneOf,
    Pattern,
    SubsetOf,
    check,
    param,
)
from terascale.solvers.constraints import freeze as _freeze
from terascale.solvers.params import SolverParams
from terascale.solvers.regpath import auto_penalty

CRITEO_INT_FIELDS = tuple(f"I{k}" for k in range(1, 14))
CRITEO_CAT_FIELDS = tuple(f"C{k}" for k in range(1, 27))
CRITEO_FIELDS = CRITEO_INT_FIELDS + CRITEO_CAT_FIELDS


@dataclass(frozen=True)
class TableColumns:
    """``featurize.columns``: a list of field declarations (``pipeline.table_spec``); each is
    checked as it is read, errors naming ``featurize.columns[i].key``."""

    def ok(self, v: Any) -> bool:
        return isinstance(v, tuple) and all(isinstance(x, TableField) for x in v)

    def describe(self) -> str:
        return "a list of fields {name, kind, ...}"

    def parse(self, value: Any, raw: bool) -> Any:
        if raw and isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"featurize.columns: must be a YAML list ({_yaml_problem(e)})") from None
        return parse_fields(value)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "section": True})


# ---------------------------------------------------------------------------------------------
# The schema.


@dataclass(frozen=True)
class FeaturizeConf:
    format: str = param("criteo", "input format: Criteo TSV, LibSVM, or table (any table Spark or pyarrow reads, "
                        "with the feature specification of featurize.columns)", OneOf(("criteo", "libsvm", "table")))
    bits: int = param(24, "hash space is 2^bits buckets (train indexes them with int32)", Interval(1, MAX_BITS, integer=True))
    seed: int = param(0, "murmur3 seed (mmh3.hash semantics)", Interval(0, 2**32 - 1, integer=True))
    fields: tuple = param(
        CRITEO_FIELDS, "Criteo fields that become features", SubsetOf(CRITEO_FIELDS)
    )
    int_bucketing: str = param(
        "log_squared",
        "integer field value v -> token value: log_squared = v if v <= 2 else floor(ln(v)^2); identity = v",
        OneOf(("log_squared", "identity")),
    )
    conjunctions: tuple = param(
        (), "pairs of field names [[A, B], ...]; token '{tokenA}^{tokenB}' when both are present"
    )
    libsvm_index_base: int = param(
        1, "LibSVM feature indices start at this number (1 for standard LibSVM files)", OneOf((0, 1))
    )
    spec_from: str = param(
        "", "a dataset or model directory (or a model pointer) whose feature specification this run uses instead of "
        "the one configured here, learned quantile boundaries included: featurize test or serving data as the "
        "training data was (--spec-from)")
    input_format: str = param(
        "parquet", "format table: the format of the --input files (json = JSON lines)", OneOf(INPUT_FORMATS))
    table: str = param("", "format table: a catalog table to read instead of --input files (db.name; --table)")
    where: str = param("", "format table: a Spark SQL filter of the rows to read, e.g. dt = '2026-11-27' (--where)")
    schema: str = param("", "format table, JSON or CSV input: the columns' types as Spark DDL (site string, price "
                        "double, segments array<string>); '' = inferred from the first file")
    csv_header: bool = param(True, "format table, CSV input: the first line names the columns")
    csv_delimiter: str = param(",", "format table, CSV input: the field separator (\\t for TSV)", Pattern())
    label: str = param("label", "format table: the label's column (a boolean, or a number: 1 when > 0, 0 when 0 or "
                       "-1, so 0/1, -1/+1 and click counts work)", Pattern())
    label_expr: str = param("", "format table: a Spark SQL expression for the label instead of a column (clicks > 0)")
    weight: str = param("", "format table: a column of row weights (finite, >= 0); '' = every row weighs 1")
    weight_expr: str = param("", "format table: a Spark SQL expression for the weight instead of a column")
    time_column: str = param("", "format table: a timestamp, date or integer column kept with each row (the dataset's "
                             "time column), so training can hold out the latest rows (train.holdout_latest); '' = none")
    columns: tuple = param(
        (), "format table: the feature fields, each {name, kind: categorical | numeric | multi | map, column or "
        "expr, bucketing: none | log | boundaries | quantile, boundaries, quantiles, missing: skip | token, "
        "max_values, overflow: quarantine | truncate, namespace} (docs: Featurize your own logs)", TableColumns())
    crosses: tuple = param((), "format table: crosses of 2 or 3 fields [[site, app], [site, app, hour]]")
    cross_all: tuple = param((), "format table: every pair among each list of fields [[site, app, device]] (VW's -q)")
    max_row_features: int = param(4096, "format table: a row with more tokens is quarantined (too_many_features)",
                                Interval(1, 1 << 20, integer=True))
    partitions: int = param(
        0, "number of output files; 0 = sized to about target_file_mb each", Interval(0, 100000, integer=True)
    )
    target_file_mb: int = param(128, "target output file size when partitions = 0", Interval(1, 4096, integer=True))
    on_error: str = param(
        "quarantine",
        "malformed lines: quarantine (write to _quarantine/ and count) or fail (stop at the first one)",
        OneOf(("quarantine", "fail")),
    )
    max_line_bytes: int = param(
        65536, "a longer line is malformed (line_too_long)", Interval(64, 2**30, integer=True)
    )
    block_mb: int = param(16, "bytes read and parsed per batch inside a task", Interval(1, 1024, integer=True))
    compression: str = param("snappy", "Parquet compression codec", OneOf(("snappy", "zstd", "lz4", "none")))
    parquet_encoding: str = param("auto", "the Parquet encoding of the indices: byte_stream_split (then the codec; "
                                  "the fastest write; Spark reads it from 4.3), delta_binary_packed (no codec; every "
                                  "Spark reads it), plain (then the codec; every Spark reads it); auto = "
                                  "byte_stream_split where the job's Spark reads it, else delta_binary_packed",
                                  OneOf(PARQUET_ENCODINGS))
    overwrite: bool = param(False, "replace an existing dataset at the output (atomically); without it "
                            "featurize refuses one (anything that is not a terascale dataset is always refused)")
    allow_empty: bool = param(
        False, "commit a dataset with no rows (inputs without lines, or every line quarantined); "
        "false: such a run fails naming the inputs and commits nothing")
    negative_rate: float = param(
        1.0, "negative downsampling: keep every positive and each negative (label 0) with this probability, "
        "decided by a hash of (input file, line number, sample_seed); kept negatives get weight 1/rate, so "
        "training and evaluate estimate the unsampled population (1 = keep every row)",
        Interval(0.0, 1.0, lo_open=True),
    )
    sample_seed: int = param(0, "seed of the negative_rate keep decisions", Interval(0, 2**32 - 1, integer=True))
    token_dictionary: bool = param(
        False, "also write _tokens.parquet, a bounded sample of the tokens that hashed to each bucket, so that "
        "terascale inspect can name a model's features (Criteo TSV only)")
    dictionary_per_bucket: int = param(
        4, "token dictionary: the smallest distinct tokens kept per bucket", Interval(1, 64, integer=True))
    dictionary_max_buckets: int = param(
        1 << 20, "token dictionary: at most this many buckets (a hash-chosen uniform sample of those seen); memory "
        "per featurize task and in the merge is at most max_buckets x per_bucket tokens",
        Interval(1, 1 << 26, integer=True))
    inject_fail_task: int = param(
        -1, "chaos drill: the first attempt of this task fails after writing part of its output (-1: off)",
        Interval(-1, None, integer=True),
    )
    inject_slow_task: int = param(
        -1, "chaos drill: the first attempt of this task waits inject_slow_s after writing its output, so that "
        "Spark's speculation (spark.speculation=true) runs a copy of it (-1: off)",
        Interval(-1, None, integer=True),
    )
    inject_slow_s: float = param(0.0, "chaos drill: how long inject_slow_task's first attempt waits", Interval(0.0, 3600.0))


@dataclass(frozen=True)
class InjectConf:
    slow_shard: int = param(-1, "chaos drill: this shard's first pass runs slow_factor times slower (-1: off)", Interval(-1, None, integer=True))
    slow_factor: float = param(1.0, "chaos drill: slowdown of slow_shard", Interval(1.0, 1000.0))
    fail_shard: int = param(-1, "chaos drill: this shard's task fails (-1: off)", Interval(-1, None, integer=True))
    fail_attempt: int = param(0, "chaos drill: the driver attempt at which fail_shard fails", Interval(0, None, integer=True))
    fail_pass: int = param(1, "chaos drill: the pass at which fail_shard fails", Interval(1, None, integer=True))
    fail_mode: str = param("raise", "chaos drill: raise an exception or kill the process", OneOf(("raise", "kill")))
    pass_delay_s: float = param(0.0, "chaos drill: every rank sleeps this long after each pass, stretching a run so an outside fault (a killed executor) can strike mid-training", Interval(0.0, 3600.0))
    corrupt_checkpoint: str = param(
        "", "chaos drill: when fail_shard fails, it first damages the newest shared checkpoint (per-rank checkpoints: its own): truncate, flip "
        "(one byte of its .npz), drop_npz or drop_json (delete that half); '' = off",
        OneOf(("", "truncate", "flip", "drop_npz", "drop_json")))
    late_shard: int = param(-1, "chaos drill: this shard pauses late_s seconds after pass late_pass, a live rank far "
                            "behind the others (-1: off)", Interval(-1, None, integer=True))
    late_pass: int = param(2, "chaos drill: the pass after which late_shard pauses", Interval(1, None, integer=True))
    late_s: float = param(0.0, "chaos drill: how long late_shard pauses", Interval(0.0, 86400.0))


@dataclass(frozen=True)
class _TrainJobHead:
    """train.* keys of the job that come before the solver's."""

    workers: int = param(2, "K: number of shards and AllReduce ranks", Interval(1, 4096, integer=True))
    spares: int = param(0, "S: spare barrier tasks that race the slowest shard's first pass", Interval(0, 4096, integer=True))
    max_attempts: int = param(3, "driver-side attempts of the barrier stage (Spark does not retry it)", Interval(1, 100, integer=True))


@dataclass(frozen=True)
class _TrainJobTail:
    """train.* keys of the job that come after the solver's."""

    holdout_period: int = param(10, "1 row in N is held out for early stopping (as VW's --holdout_period), chosen by a hash of the row's file (relative to the dataset) and index in it, seeded by train.seed: the same rows for any train.workers (solvers.holdout); 0 = none, 1 = all (nothing left to train on)", Interval(0, 1000000, integer=True))
    holdout_latest: float = param(0.0, "hold out this fraction of the latest rows by the dataset's time column "
                                  "(featurize.time_column: validate on later traffic) instead of 1 row in holdout_period; "
                                  "every row at the cut's time is held out; 0 = off", Interval(0.0, 0.99))
    recalibrate: str = param(
        "auto", "fit the slope and shift of sigma(a * margin + c) to the held-out rows after training (solvers."
        "recalibration) and score with them: on, off, or auto = on when the dataset was negative-downsampled "
        "(featurize.negative_rate < 1), whose weighted model over-predicts on unsampled data; needs held-out rows "
        "and a loss whose link is the sigmoid", OneOf(("auto", "on", "off")))
    init_model: str = param("", "warm-start from this model directory (its feature spec must equal the data's)", Pattern(nonempty=False))
    overwrite: bool = param(False, "replace an existing model at --model (atomically); without it train refuses "
                            "one (anything that is not a terascale model is always refused)")
    checkpoint_dir: str = param("", "per-pass checkpoints for retried attempts; '' = MODEL_DIR.checkpoint beside the "
                                "model; must be missing, empty or an earlier run's (its marker file)", Pattern(nonempty=False))
    checkpoint_interval_s: float = param(
        30.0, "checkpoint after a pass once this many seconds passed since the last one (0: after every pass); "
        "a checkpoint holds the L-BFGS memory, 2 x lbfgs_memory floats per feature that occurs in the data", Interval(0, None))
    preflight: str = param(
        "fail", "memory preflight on the driver before Spark starts (jobs/preflight.py): a rank's estimated peak "
        "memory (shard, model state, L-BFGS pairs, buffers, process) against the memory one task may use; "
        "fail = stop when it does not fit, warn = log and go on, off = skip", OneOf(("fail", "warn", "off")))
    rank_memory_mb: int = param(
        0, "memory one rank (one barrier task's Python worker) may use, for the preflight; 0 = from the Spark "
        "settings: spark.executor.pyspark.memory / executor cores, else on YARN and Kubernetes "
        "spark.executor.memoryOverhead / executor cores, in local mode the machine's memory / (workers + spares); "
        "elsewhere unknown (the preflight then only logs its estimate)", Interval(0, None, integer=True))
    data_cache: str = param(
        "memory", "where a rank keeps its shard: memory (numpy arrays); disk (the local shard cache, "
        "pipeline/shard_cache.py: written once, in the kernels' layout, into the executor's local directories, "
        "and streamed every pass in blocks, so the shard's bytes in memory stay within train.memory_budget_mb; "
        "the same model bit for bit; not with train.shuffle; CoCoA works from it but is not bounded); auto = disk "
        "when the largest shard does not fit the budget, memory when it does or the budget is unknown. The "
        "default is memory: with the budget unknown (standalone clusters) auto would always mean memory anyway",
        OneOf(("memory", "disk", "auto")))
    memory_budget_mb: int = param(
        0, "per rank, the shard's bytes it may hold in memory at once with train.data_cache = disk (and what auto "
        f"compares the shard with); at least {minimum_budget_mb(1)} MiB per thread (train.threads): a block of "
        "rows and the page cache's folios at its edges; 0 = what the "
        "rank's memory (train.rank_memory_mb, else the Spark settings, as the preflight finds it) leaves after the "
        "rest of its estimated peak", Interval(0, None, integer=True))
    cache_dir: str = param(
        "", "the local directory of the shard cache (one per executor machine); '' = the executor's local "
        "directories (SPARK_LOCAL_DIRS, YARN's LOCAL_DIRS), in local mode spark.local.dir, else the system's "
        "temporary directory", Pattern(nonempty=False))
    progress: str = param("auto", "driver console progress (pass, rows, objective, ETA): auto = a bar on a terminal, log lines otherwise", OneOf(("auto", "bar", "log")))
    inject: InjectConf = section(InjectConf, "fault injection for tests and chaos drills; off by default")


def _copy(f: dataclasses.Field, typ: Any) -> tuple[str, Any, dataclasses.Field]:
    if f.default_factory is not dataclasses.MISSING:
        return f.name, typ, field(default_factory=f.default_factory, metadata=f.metadata)
    return f.name, typ, field(default=f.default, metadata=f.metadata)


#: the train section: the job's keys and, in between, every solver parameter as the catalogue
#: declares it (terascale.solvers.catalogue.PARAMS): a solver's parameters are declared once
TrainConf = dataclasses.make_dataclass(
    "TrainConf",
    [_copy(f, f.type) for f in dataclasses.fields(_TrainJobHead)]
    + [_copy(f, type(f.default)) for f in SOLVER_PARAMS]
    + [_copy(f, f.type) for f in dataclasses.fields(_TrainJobTail)],
    frozen=True,
    namespace={"__module__": __name__, "__doc__": "The train section (job keys and the catalogue's solver parameters)."},
)


def solver_params(t: Any) -> SolverParams:
    """The SolverParams of a train section (validated: the solver's cross-checks run here)."""
    return SolverParams(**{f.name: getattr(t, f.name) for f in SOLVER_PARAMS})


@dataclass(frozen=True)
class HostAddress:
    """'' or an IP address or host name (``allreduce.endpoints.valid_host``); ``wildcard``:
    whether 0.0.0.0 / :: (every interface) is allowed."""

    wildcard: bool = True

    def ok(self, v: Any) -> bool:
        return isinstance(v, str) and (v == "" or (endpoints.valid_host(v)
                                                   and (self.wildcard or not endpoints.is_wildcard(v))))

    def describe(self) -> str:
        return ("'', an IP address or a host name"
                + (" (0.0.0.0 or :: = every interface)" if self.wildcard else ", not a wildcard (peers dial it)"))


@dataclass(frozen=True)
class PortRange:
    """'' or ``LO-HI`` with 1 <= LO <= HI <= 65535 (``allreduce.endpoints.parse_port_range``)."""

    def ok(self, v: Any) -> bool:
        try:
            return isinstance(v, str) and (endpoints.parse_port_range(v) is not None or v == "")
        except ValueError:
            return False

    def describe(self) -> str:
        return "'' (ephemeral ports) or LO-HI with 1 <= LO <= HI <= 65535, e.g. '40000-40100'"


@dataclass(frozen=True)
class AllreduceConf:
    host: str = param("", "address the listeners bind: '' = the tree server binds spark.driver.host and each rank its "
                      "executor's address; 0.0.0.0 or :: = every interface, the tree server's and every rank's (a "
                      "container whose Spark address is not one of its interfaces); any other address: the tree "
                      "server's (an interface of the driver)", HostAddress(wildcard=True))
    advertise_host: str = param("", "address the ranks dial to reach the tree server, when it is not the bound one "
                                "(NAT, a driver pod behind a Kubernetes service); '' = allreduce.host, or "
                                "spark.driver.host when that is '' or a wildcard. Ranks advertise their executor's "
                                "address, which Spark itself needs reachable", HostAddress(wildcard=False))
    port_range: str = param("", "ports the tree server and every rank listener take, for firewalls that open only "
                            "these: LO-HI (e.g. 40000-40100), one port per rank running on a host at once plus one "
                            "on the driver; '' = ephemeral ports", PortRange())
    chunk_bytes: int = param(1 << 20, "pipelining chunk of an AllReduce", Interval(8, 1 << 30, integer=True))
    window_chunks: int = param("auto", "a rank sends chunk i of an AllReduce up only after chunk i - W of the result "
                               "came down, so no flow runs ahead into the socket buffers and takes a shared link from "
                               "the flow the collective waits for (allreduce.collective_run); auto = the tree's depth "
                               "+ 2 from 3 ranks on (the best measured on 1 Gbit/s links), off for 1 or 2; 0 = off", AutoOr(Interval(0, 1 << 20, integer=True)))
    connect_timeout_s: float = param(30.0, "timeout of every connect", Interval(0, 3600, lo_open=True))
    handshake_timeout_s: float = param(10.0, "a connection must authenticate within this time", Interval(0, 3600, lo_open=True))
    io_timeout_s: float = param(120.0, "timeout of every exchange with the tree server and of a handshake's send or receive "
                                "(tree links wait by heartbeat_timeout_s instead: a rank far behind is waited for)",
                                Interval(0, 86400, lo_open=True))
    heartbeat_timeout_s: float = param(60.0, "a tree neighbour that sends nothing, not even a heartbeat (sent every "
                                       "heartbeat_timeout_s / 4), for this long is declared lost, naming its rank",
                                       Interval(0, 3600, lo_open=True))
    max_wait_s: float = param(86400.0, "longest one AllReduce waits for a neighbour that is alive (heartbeats arrive) "
                              "but sends no data", Interval(0, 604800, lo_open=True))
    max_unauthenticated: int = param(1024, "most connections a listener (the tree server, a rank) holds before they "
                                     "authenticate; a new one over it closes the oldest silent one", Interval(1, 1 << 20, integer=True))
    max_unauthenticated_per_source: int = param(64, "the same bound per source address", Interval(1, 1 << 20, integer=True))
    startup_timeout_s: float = param(600.0, "every shard must have a survivor within this time", Interval(0, 86400, lo_open=True))
    max_frame_bytes: int = param(1 << 28, "largest frame accepted (checked before allocating)", Interval(64, 1 << 31, integer=True))
    cipher: str = param(DEFAULT_CIPHER, "protection of every frame after the handshake: aes-gcm = AES-256-GCM, payload "
                        "encrypted and authenticated (gradients can reveal training data); aes-gmac = authenticated "
                        "only, payload in clear; hmac-sha256 = authenticated only, no extra library, slowest. "
                        "The driver and every rank use this one", OneOf(CIPHERS))


@dataclass(frozen=True)
class SparkConf:
    master: str = param("local[*]", "Spark master URL when the job creates the session", Pattern())
    app_name: str = param("terascale", "Spark application name", Pattern())
    log_level: str = param("WARN", "Spark log level", OneOf(("ERROR", "WARN", "INFO", "DEBUG")))
    conf: tuple = param({}, "extra Spark settings {key: value} applied when the session is created")
    remote: str = param("", "Spark Connect URL (sc://host:port[/;param=value...]): run the job on that Spark Connect "
                        "server instead of starting Spark; '' = the SPARK_REMOTE environment variable, if set "
                        "(spark.master is then the server's; spark.conf keys go to the server as session settings)",
                        Pattern(nonempty=False))
    remote_retry_s: float = param(120.0, "Spark Connect: how long the client retries a server it cannot reach "
                                  "(pyspark's backoff, 50 ms growing 4x to 60 s) before the job fails", Interval(1, 86400))


@dataclass(frozen=True)
class PredictConf:
    keep_columns: tuple = param(("label",), "dataset columns copied next to the prediction",
                                SubsetOf(("label", "weight", "indices", "values")))
    overwrite: bool = param(False, "replace earlier predictions at --output (atomically); without it predict "
                            "refuses them (anything that is not terascale's predictions is always refused)")
    calibration: str = param(
        "population",
        "which probabilities scoring reports: population = sigma(a * margin + c), with the slope and shift the model "
        "fitted on its held-out rows (train.recalibrate; a = 1, c = 0 when it fitted none), calibrated to the unsampled "
        "data; sampled = sigma(a * margin + c - ln r) for a model trained on negatives kept at rate r "
        "(featurize.negative_rate), the click rate among the kept rows, for teams that correct it themselves; "
        "raw = sigma(margin), the model's own margins without the held-out recalibration",
        OneOf(CALIBRATIONS),
    )


@dataclass(frozen=True)
class TrackingConf:
    mlflow_uri: str = param(
        "", "MLflow tracking URI that train logs a run to and evaluate adds its metrics to (http(s)://HOST:PORT, "
        "sqlite:///PATH.db, file:///DIR, databricks, ...; jobs.tracking); '' = the MLFLOW_TRACKING_URI environment "
        "variable, no tracking when that is unset too; off = no tracking whatever the environment says. Needs the "
        "mlflow extra (pip install 'terascale[mlflow]'); a tracking server that cannot be reached (or mlflow missing) "
        "is a warning, never a failed job", Pattern(nonempty=False))
    experiment: str = param("terascale", "MLflow experiment of train's runs (created when missing)", Pattern())
    run_name: str = param("", "name of train's MLflow run; '' = the model directory's last path element", Pattern(nonempty=False))
    log_model: bool = param(
        True, "also log the model as an MLflow pyfunc model (jobs.mlflow_model: scores raw log lines exactly as "
        "terascale score does; mlflow.pyfunc.load_model, mlflow models serve); it holds a copy of the model directory")
    registered_model: str = param(
        "", "register the logged pyfunc model under this name in the MLflow model registry (a new version per "
        "run; needs tracking.log_model); '' = do not register", Pattern(nonempty=False))
    timeout_s: float = param(
        10.0, "each request to an MLflow tracking server times out after this many seconds and is retried at most "
        "twice (the MLFLOW_HTTP_REQUEST_TIMEOUT and _MAX_RETRIES environment variables win when set): an unreachable "
        "server costs a bounded wait and a warning", Interval(0, 3600, lo_open=True))


@dataclass(frozen=True)
class Config:
    featurize: FeaturizeConf = section(FeaturizeConf, "raw click logs -> hashed Parquet")
    train: TrainConf = section(TrainConf, "distributed training")
    predict: PredictConf = section(PredictConf, "the predict job")
    allreduce: AllreduceConf = section(AllreduceConf, "spanning-tree AllReduce")
    spark: SparkConf = section(SparkConf, "the Spark session")
    tracking: TrackingConf = section(TrackingConf, "MLflow tracking of train and evaluate (optional: the mlflow extra)")


# ---------------------------------------------------------------------------------------------
# Introspection helpers.


def _is_section(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("section"))


def iter_params(cls: type = Config, prefix: str = ""):
    """Yield (dotted_key, dataclasses.Field) for every leaf parameter."""
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if _is_section(f):
            yield from iter_params(_field_type(cls, f), key + ".")
        else:
            yield key, f


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    return typing.get_type_hints(cls)[f.name]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def all_keys() -> list[str]:
    return [k for k, _ in iter_params()]


# ---------------------------------------------------------------------------------------------
# Coercion and validation.


def _coerce_field(key: str, typ: Any, f: dataclasses.Field, value: Any, raw: bool) -> Any:
    """:func:`_coerce`, or the constraint's own ``parse`` for a field of two kinds (``AutoOr``:
    ``auto`` or a number, e.g. ``train.l2``)."""
    parse = getattr(f.metadata.get("constraint"), "parse", None)
    return parse(value, raw) if parse is not None else _coerce(key, typ, value, raw)


def _coerce(key: str, typ: Any, value: Any, raw: bool) -> Any:
    """Convert ``value`` (from YAML, or a raw --set string when ``raw``) to the field type."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{key} = {shown(key, value)!r}: must be {what}")

    if typ is str:
        if raw:
            return value
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ is bool:
        if raw:
            low = value.strip().lower()
            if low in ("true", "yes", "1", "on"):
                return True
            if low in ("false", "no", "0", "off"):
                return False
            raise bad("true or false")
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ is int:
        if raw:
            try:
                return int(value.strip(), 0)
            except ValueError:
                raise bad("an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if typ is float:
        if raw:
            try:
                return float(value.strip())
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if typ is tuple:
        if raw:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"{key}: must be a YAML list or mapping ({_yaml_problem(e)})") from None
        if value is None:
            return ()
        if isinstance(value, (list, tuple, dict)):
            return _freeze(value)
        raise bad("a list or mapping")
    raise ConfigError(f"{key}: unsupported type {typ!r}")  # a schema bug, not a user error


def _check(key: str, f: dataclasses.Field, value: Any) -> None:
    check(key, f, value, show=shown)


def recalibration_obstacle(t: Any) -> str | None:
    """Why the train section ``t`` cannot fit a held-out recalibration (``train.recalibrate``), or
    None when it can: it needs probabilities (a loss whose link is the sigmoid) and held-out rows."""
    if loss_spec(t.loss).link != "sigmoid":
        return f"train.loss = {t.loss!r} predicts margins, not probabilities (logistic does)"
    if not solver_spec(t.solver).holdout:
        return f"train.solver = {t.solver!r} trains on every row"
    if t.holdout_period in (0, 1) and not t.holdout_latest:
        return f"train.holdout_period = {t.holdout_period} holds no rows out to fit on (set N > 1; the default is 10)"
    return None


def _cross_checks(cfg: Config) -> None:
    fz = cfg.featurize
    for i, pair in enumerate(fz.conjunctions):
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ConfigError(
                f"featurize.conjunctions[{i}] = {pair!r}: must be a pair of field names like [C1, C2]"
            )
        for name in pair:
            if name not in fz.fields:
                raise ConfigError(
                    f"featurize.conjunctions[{i}] = {list(pair)!r}: field {name!r} is not in featurize.fields"
                )
    if fz.format == "table":
        if not fz.columns:
            raise ConfigError("featurize.columns = []: featurize.format = 'table' needs at least one field, "
                              "e.g. --set 'featurize.columns=[{name: site}, {name: price, kind: numeric}]'")
        expand_crosses(fz.crosses, fz.cross_all, [f.name for f in fz.columns])
        if fz.conjunctions:
            raise ConfigError("featurize.conjunctions: for Criteo TSV; a table spec crosses fields with featurize.crosses")
    elif fz.columns or fz.crosses or fz.cross_all or fz.table or fz.where or fz.time_column:
        key = next(k for k, v in (("columns", fz.columns), ("crosses", fz.crosses), ("cross_all", fz.cross_all),
                                  ("table", fz.table), ("where", fz.where), ("time_column", fz.time_column)) if v)
        raise ConfigError(f"featurize.{key}: only for featurize.format = 'table' (got {fz.format!r})")
    if fz.token_dictionary and fz.format != "criteo":
        raise ConfigError(f"featurize.token_dictionary = true: needs featurize.format = 'criteo' (got {fz.format!r}); "
                          "LibSVM features are already named by their index")
    for kv in cfg.spark.conf:
        if not (isinstance(kv, tuple) and len(kv) == 2):
            # the value is not shown: a malformed mapping cannot be redacted key by key
            raise ConfigError("spark.conf: must be a mapping of setting -> value, not a list "
                              "(YAML: spark: {conf: {spark.executor.memory: 4g}})")
    solver_params(cfg.train)  # the solver's own cross-checks (the catalogue's SolverSpec.check)
    t = cfg.train
    auto = auto_penalty(t)  # a regularization path (solvers.regpath)
    if auto is not None and t.holdout_period in (0, 1) and not t.holdout_latest:
        raise ConfigError(f"train.{auto} = 'auto': chooses {auto} by the held-out loss, which needs held-out rows: "
                          f"set train.holdout_period to N > 1 (1 row in N held out; the default is 10; got "
                          f"{t.holdout_period}), or set train.{auto} to a number")
    obstacle = recalibration_obstacle(t)
    if t.recalibrate == "on" and obstacle is not None:
        raise ConfigError(f"train.recalibrate = 'on': fits sigma(a * margin + c) on the held-out rows, but {obstacle}; "
                          "set train.recalibrate=off or auto")
    if t.data_cache == "disk" and t.shuffle:
        raise ConfigError("train.shuffle = true: needs train.data_cache = 'memory' or 'auto' (got 'disk'): a shuffled "
                          "online pass reads rows at random, which a shard streamed from the local cache cannot "
                          "bound in memory; set train.shuffle=false or train.data_cache=memory")
    if t.data_cache != "memory" and 0 < t.memory_budget_mb < minimum_budget_mb(t.threads):
        raise budget_error(t.memory_budget_mb, t.threads, t.data_cache)
    if cfg.tracking.registered_model and not cfg.tracking.log_model:
        raise ConfigError(f"tracking.registered_model = {cfg.tracking.registered_model!r}: registers the logged pyfunc "
                          "model, but tracking.log_model = false logs none; set tracking.log_model=true or "
                          "tracking.registered_model=''")
    if cfg.train.inject.slow_shard >= cfg.train.workers:
        raise ConfigError(
            f"train.inject.slow_shard = {cfg.train.inject.slow_shard}: must be -1 or a shard in [0, {cfg.train.workers - 1}]"
        )
    if cfg.train.inject.fail_shard >= cfg.train.workers:
        raise ConfigError(
            f"train.inject.fail_shard = {cfg.train.inject.fail_shard}: must be -1 or a shard in [0, {cfg.train.workers - 1}]"
        )


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown configuration key '{key}'{hint}")


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if _is_section(f):
            kwargs[f.name] = _build(_field_type(cls, f), values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def _flatten(doc: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """Flatten a nested YAML mapping into dotted keys; leaves are parameter values."""
    out: dict[str, Any] = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(doc).__name__}")
    leaves = {k for k, _ in iter_params()}
    for k, v in doc.items():
        key = prefix + str(k)
        if key in _section_keys():
            if v is None:
                continue
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: '{key}' is a section and must be a mapping")
            out.update(_flatten(v, where, key + "."))
        elif key in leaves:
            out[key] = v
        else:
            e = _unknown(key)
            raise ConfigError(f"{where}: {e}")
    return out


def _section_keys(cls: type = Config, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        if _is_section(f):
            keys.add(prefix + f.name)
            keys |= _section_keys(_field_type(cls, f), prefix + f.name + ".")
    return keys


def _owner_field(key: str) -> tuple[Any, dataclasses.Field]:
    for k, f in iter_params():
        if k == key:
            owner = Config
            for part in key.split(".")[:-1]:
                owner = _field_type(owner, next(x for x in dataclasses.fields(owner) if x.name == part))
            return _field_type(owner, f), f
    raise _unknown(key)


def feature_spec(cfg: Config):
    """The ``pipeline.spec.FeatureSpec`` the ``featurize`` section describes."""
    from terascale.pipeline.spec import FeatureSpec

    f = cfg.featurize
    if f.format == "table":
        t = TableSpec(fields=tuple(f.columns), crosses=expand_crosses(f.crosses, f.cross_all, [x.name for x in f.columns]),
                      label=f.label, label_expr=f.label_expr, weight=f.weight, weight_expr=f.weight_expr,
                      max_row_features=f.max_row_features)
        return FeatureSpec(format="table", bits=f.bits, seed=f.seed, fields=(), int_bucketing="log_squared",
                           conjunctions=(), libsvm_index_base=1, table=t)
    return FeatureSpec(
        format=f.format, bits=f.bits, seed=f.seed, fields=tuple(f.fields), int_bucketing=f.int_bucketing,
        conjunctions=tuple(tuple(p) for p in f.conjunctions), libsvm_index_base=f.libsvm_index_base,
    )


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error without PyYAML's snippet of the offending line (it may hold a secret)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def check_listen_address(a: AllreduceConf) -> None:
    """Before Spark starts, on the driver: the tree server can listen on ``allreduce.host``
    within ``allreduce.port_range`` (when the host is set; '' means spark.driver.host, which
    Spark itself checks). Raises ConfigError naming the key."""
    if not a.host:
        return
    try:
        endpoints.listen(a.host, endpoints.parse_port_range(a.port_range)).close()
    except endpoints.PortRangeExhausted as e:
        raise ConfigError(f"allreduce.port_range = {a.port_range!r}: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"allreduce.host = {a.host!r}: the driver cannot listen there ({e.strerror or e}); "
                          "it must be an address of this machine or a wildcard (peers dial "
                          "allreduce.advertise_host)") from None


def load_config(conf_files: list[str | Path] = (), sets: list[str] = ()) -> Config:
    """Resolve defaults <- conf files <- --set overrides, then validate. Raises ConfigError."""
    values: dict[str, Any] = {}
    for path in conf_files:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--conf {path}: cannot read ({e.strerror})") from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--conf {path}: not valid YAML ({_yaml_problem(e)})") from None
        for key, v in _flatten(doc or {}, str(path)).items():
            typ, f = _owner_field(key)
            values[key] = _coerce_field(key, typ, f, v, raw=False)
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: must look like section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in _section_keys():
            raise ConfigError(f"--set {item!r}: '{key}' is a section; set one of its keys")
        typ, f = _owner_field(key)
        values[key] = _coerce_field(key, typ, f, raw, raw=True)
    for key, v in values.items():
        _, f = _owner_field(key)
        _check(key, f, v)
    cfg = _build(Config, values)
    _cross_checks(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Rendering.


def _plain(v: Any) -> Any:
    if hasattr(v, "to_json"):  # a declaration of its own (a table field)
        return v.to_json()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def to_dict(obj: Any = None) -> dict[str, Any]:
    """The configuration (or one section) as plain nested dicts/lists (JSON- and YAML-ready),
    redacted: secrets are ``***`` (``pipeline.redact``). For showing and storing; Spark gets
    the real values from the ``Config`` itself (``jobs.session``)."""
    return redact(_plain_dict(Config() if obj is None else obj))


def _plain_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if _is_section(f):
            out[f.name] = _plain_dict(v)
        elif f.name == "conf" and isinstance(obj, SparkConf):
            out[f.name] = {k: x for k, x in v}
        else:
            out[f.name] = _plain(v)
    return out


def render_yaml(cfg: Config | None = None, with_help: bool = True) -> str:
    """YAML of the configuration, redacted (``to_dict``); with help text as comments (this is
    conf/defaults.yaml)."""
    cfg = Config() if cfg is None else cfg
    lines: list[str] = []
    if with_help:
        lines += [
            "# terascale configuration defaults. Generated by `terascale config --defaults`",
            "# from jobs/config.py (the one schema); a test keeps this file equal to it.",
        ]

    def emit(obj: Any, shown: dict[str, Any], indent: int) -> None:
        pad = "  " * indent
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if _is_section(f):
                if with_help:
                    lines.append(f"{pad}# {f.metadata['help']}")
                lines.append(f"{pad}{f.name}:")
                emit(v, shown[f.name], indent + 1)
                continue
            if with_help:
                c = f.metadata.get("constraint")
                allowed = f" [{c.describe()}]" if c is not None else ""
                lines.append(f"{pad}# {f.metadata['help']}{allowed}")
            plain = shown[f.name]
            dumped = yaml.safe_dump({f.name: plain}, default_flow_style=True, width=10**6, sort_keys=False).strip()
            if dumped.startswith("{") and dumped.endswith("}"):
                dumped = dumped[1:-1]
            lines.append(f"{pad}{dumped}")

    emit(cfg, to_dict(cfg), 0)
    return "\n".join(lines) + "\n"
