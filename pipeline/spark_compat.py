"""The Spark lines terascale supports, and what differs between them, hidden here.

Supported: Spark 3.5.x (the long-maintained line of Amazon EMR 7, Dataproc 2.2 and many
Databricks runtimes) and 4.0 through 4.x; ``pyproject.toml`` says ``pyspark>=3.5,<5``. Spark 4
needs Java 17 or later, 3.5 runs on Java 8, 11 and 17 (both on 17 in CI).

Two versions are checked, because they can differ: pyspark's Python package (what this process
imports: on YARN the cluster's own ``pyspark.zip``, whatever the packed environment holds) before
a session starts, and the JVM's (``SparkSession.version``) once one exists. Either outside the
supported range is a :class:`SparkVersionError` naming the version found and the ones supported;
so is a Java older than the line needs, found before pyspark launches it.

What differs between the lines:

- **Scalar Arrow UDFs** (``pyspark.sql.functions.arrow_udf``, Spark 4.1 and later): a function
  of ``pyarrow.Array`` columns to one ``pyarrow.Array``. Before 4.1 the same function runs as a
  scalar pandas UDF: Spark still ships the columns as Arrow, pyspark hands them over as pandas
  Series (a list column: an object Series of numpy arrays), converted back to Arrow here; the
  same values, at a conversion cost per row.
- **pandas on the driver** (Spark 3.5): pyspark 3.5's ``mapInArrow`` and pandas UDFs check that
  pandas imports on the driver, though the Arrow path never uses it: :func:`require_pandas`
  turns the missing module into an error that says what to install.
- **Arrow schemas** of Spark types: pyspark 4's ``to_arrow_schema`` needs a time zone for
  timestamps, 3.5's takes none (:func:`arrow_schema`).
- **Parquet encodings**: Spark reads INT32 columns encoded ``BYTE_STREAM_SPLIT`` only from
  :data:`BSS_SINCE` (3.5, 4.0, 4.1 and 4.2 fail with "Unsupported encoding": checked 2026-11-28);
  ``DELTA_BINARY_PACKED`` and ``PLAIN`` every supported line reads. :func:`parquet_encoding`
  picks the featurized indices' encoding for the session's Spark, :func:`check_readable` names a
  dataset an older Spark cannot read before Spark fails on it.
"""

from __future__ import annotations

import re
import warnings

import pyarrow as pa

from terascale.solvers.constraints import ConfigError

#: (lowest, first unsupported) as (major, minor): 3.5 <= version < 5.0
SUPPORTED = ((3, 5), (5, 0))
SUPPORTED_TEXT = "Spark 3.5.x and 4.x (pyspark>=3.5,<5)"


class SparkVersionError(ConfigError):
    """A Spark version terascale does not support (the message names it and the supported ones)."""


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a Spark version string: ``"3.5.9"``, ``"4.1.0-SNAPSHOT"``,
    ``"3.5.2-amzn-1"`` (a vendor build keeps the upstream line)."""
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    if m is None:
        raise SparkVersionError(f"cannot read the Spark version {text!r}; terascale supports {SUPPORTED_TEXT}")
    return int(m.group(1)), int(m.group(2))


def check_version(version: str, what: str = "pyspark") -> tuple[int, int]:
    """``(major, minor)`` of ``version`` when it is supported; else a :class:`SparkVersionError`.

    ``what`` names where the version came from (``pyspark`` or ``the Spark JVM``)."""
    found = parse_version(version)
    lo, hi = SUPPORTED
    if not lo <= found < hi:
        raise SparkVersionError(f"{what} {version} is not supported: terascale supports {SUPPORTED_TEXT}")
    return found


def check_pyspark() -> tuple[int, int]:
    """Check the pyspark package this process imports (before any session starts)."""
    import pyspark

    return check_version(pyspark.__version__, "pyspark")


def java_major(java: str) -> int | None:
    """The major version of the ``java`` executable (``17`` for 17.0.9, ``8`` for 1.8.0_392),
    None when it cannot be run or read."""
    import subprocess

    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def check_java(spark_line: tuple[int, int], java: str) -> None:
    """Before this process launches a JVM: Spark 4 needs Java 17 or later, Spark 3.5 Java 8, 11
    or 17. A Java that cannot be run or read is left to pyspark's own error."""
    major = java_major(java)
    need = 17 if spark_line >= (4, 0) else 8
    if major is not None and major < need:
        raise SparkVersionError(f"Spark {spark_line[0]}.{spark_line[1]} needs Java {need} or later, and {java} "
                                f"is Java {major}: set JAVA_HOME to a Java 17 (Spark 3.5 and 4.x both run on it)")


def java_command() -> str:
    """The java pyspark launches: ``$JAVA_HOME/bin/java``, else ``java`` on the PATH."""
    import os

    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else "java"


def check_session(spark) -> tuple[int, int]:
    """Check a session's Spark (the JVM's version: a driver may import another pyspark)."""
    return check_version(spark.version, "the Spark JVM")

#: featurize.parquet_encoding values
PARQUET_ENCODINGS = ("auto", "delta_binary_packed", "byte_stream_split", "plain")
#: the first Spark line that reads INT32 BYTE_STREAM_SPLIT (4.3.0 does; 3.5.9, 4.0.5, 4.1.4, 4.2.1 do not)
BSS_SINCE = (4, 3)


def has_arrow_udf() -> bool:
    try:
        from pyspark.sql.functions import arrow_udf  # noqa: F401
    except ImportError:
        return False
    return True


def arrow_scalar_udf(fn, return_type: str):
    """A Spark scalar UDF of ``fn(*pyarrow.Array) -> pyarrow.Array`` (see the module docstring)."""
    if has_arrow_udf():
        from pyspark.sql.functions import arrow_udf

        return arrow_udf(fn, return_type)
    require_pandas("a scalar UDF (TerascaleModel.transform)")
    from pyspark.sql.functions import PandasUDFType, pandas_udf

    def on_pandas(*series):
        return fn(*(pa.Array.from_pandas(s) for s in series)).to_pandas()

    with warnings.catch_warnings():  # PandasUDFType is deprecated in favour of type hints of a fixed arity
        warnings.simplefilter("ignore")
        return pandas_udf(on_pandas, return_type, PandasUDFType.SCALAR)


def arrow_schema(schema):
    """The Arrow schema of a Spark ``StructType`` (what ``mapInArrow`` hands the tasks, timestamps
    in UTC): pyspark 4 asks for the timestamps' zone, 3.5 takes none and gives UTC."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return to_arrow_schema(schema, timezone="UTC")
    except TypeError:  # pyspark 3.5: to_arrow_schema(schema)
        return to_arrow_schema(schema)


def map_in_arrow(df, fn, schema, what: str):
    """``df.mapInArrow(fn, schema)``, after :func:`require_pandas` (``what`` names the step)."""
    require_pandas(what)
    return df.mapInArrow(fn, schema)


def require_connect(remote: str) -> None:
    """A Spark Connect client needs pyspark's ``connect`` extra (grpcio, grpcio-status,
    googleapis-common-protos, zstandard from 4.0; pandas): named, with what to install, before any
    connection is tried."""
    import importlib.util

    import pyspark

    missing = [m for m in ("grpc", "grpc_status", "google.rpc", "pandas")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    if parse_version(pyspark.__version__) >= (4, 0) and importlib.util.find_spec("zstandard") is None:
        missing.append("zstandard")
    if missing:
        raise SparkVersionError(f"spark.remote / SPARK_REMOTE is set: a Spark Connect client needs {', '.join(missing)} "
                                f"(pyspark's connect extra): pip install 'terascale[connect]'")


#: pyspark's Connect client backoff (3.5 and 4.x): the first wait, its growth, its cap (ms)
CONNECT_BACKOFF_MS = (50, 4.0, 60_000)


def connect_retries(seconds: float) -> int:
    """The number of retries whose backoff waits add up to at least ``seconds``."""
    first, factor, cap = CONNECT_BACKOFF_MS
    total, k = 0.0, 0
    while total < seconds * 1000:
        total += min(first * factor ** k, cap)
        k += 1
    return k


def limit_connect_retries(spark, seconds: float) -> None:
    """Make a Connect session's client give up on an unreachable server after about ``seconds``
    (pyspark's default tolerates at least 10 minutes): its default policy with fewer retries."""
    retries = connect_retries(seconds)
    client = spark.client
    if hasattr(client, "set_retry_policies"):  # pyspark 4
        from pyspark.sql.connect.client.retries import DefaultPolicy

        client.set_retry_policies([DefaultPolicy(max_retries=retries)])
    else:  # pyspark 3.5: a dict of the one policy's settings
        client._retry_policy["max_retries"] = retries


def require_pandas(what: str) -> None:
    """On Spark before 4.0, where pyspark's Arrow paths check for pandas on the driver: pandas
    must import (see the module docstring)."""
    import pyspark

    if parse_version(pyspark.__version__) >= (4, 0):
        return
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise SparkVersionError(f"{what} on pyspark {pyspark.__version__} needs pandas on the driver "
                                f"(pyspark 3.5 checks for it before any Arrow stage): pip install 'pandas>=2.2'") from None


def parquet_encoding(setting: str, spark_version: str) -> str:
    """The encoding of a featurized dataset's indices: ``setting`` unless ``auto``, which is
    ``byte_stream_split`` where the session's Spark reads it (:data:`BSS_SINCE` and later: the
    fastest write) and ``delta_binary_packed`` before (written without a codec; it writes and
    reads faster than ``plain`` with one, docs/pages/explanation/design-notes.md)."""
    if setting not in PARQUET_ENCODINGS:
        raise ValueError(f"parquet encoding {setting!r} is not one of {PARQUET_ENCODINGS}")
    if setting != "auto":
        return setting
    return "byte_stream_split" if parse_version(spark_version) >= BSS_SINCE else "delta_binary_packed"


def check_readable(encoding: str | None, spark_version: str, where: str) -> None:
    """A clear error where Spark ``spark_version`` is about to read a dataset (``where``) whose
    indices are encoded ``encoding`` (its manifest's ``parquet_encoding``; None: written before
    it was recorded, byte_stream_split) and cannot."""
    if (encoding or "byte_stream_split") == "byte_stream_split" and parse_version(spark_version) < BSS_SINCE:
        raise SparkVersionError(
            f"Spark {spark_version} cannot read {where}: its indices are encoded BYTE_STREAM_SPLIT, which Spark "
            f"reads from {BSS_SINCE[0]}.{BSS_SINCE[1]}; featurize it again on this Spark (featurize.parquet_encoding "
            f"auto or plain)")
