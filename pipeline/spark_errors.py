"""One line out of Spark's long, wrapped job failure: the failed task and why.

Both Spark jobs use it: the featurize job (``pipeline.spark_featurize``) names the failed task in
its error (evaluate and predict too), and the train job passes it to ``allreduce.spark.run_barrier`` (as
``summarize_error``), which logs and records each failed attempt with it and matches it against
the errors not worth a retry. It lives here, not in ``allreduce``: ``pipeline`` does not import
``allreduce``, and ``allreduce`` stays free of any job's error reporting. Plain ``re``, no pyspark.
"""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*: \S.*$")  # "pkg.mod.SomeError: message"
_BARRIER_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully\.\s*\n([^\n]*)")
_LOST_TASK = re.compile(r"Lost task (\d+)\.\d+ in stage \S+ \(TID \d+\) \(([^)]*)\): ([^\n]*)")
_JVM_PREFIXES = ("org.apache.spark", "py4j", "java.", "scala.")


#: gRPC status codes that mean a Spark Connect client lost its server (not a job's own failure)
_LOST_SERVER = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"})


def lost_server(err: BaseException) -> str | None:
    """When ``err`` (or what caused it) is a gRPC call that ended because the Spark Connect server
    went away or stopped answering: one line saying so, with gRPC's status and details; else None."""
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "code", None)
        if callable(code) and type(e).__module__.startswith("grpc"):
            try:
                name = getattr(code(), "name", str(code()))
                details = e.details() if callable(getattr(e, "details", None)) else ""
            except Exception:  # noqa: BLE001 - a call object that cannot tell
                name, details = "", ""
            if name in _LOST_SERVER:
                return (f"the Spark Connect server stopped answering (gRPC {name}: {details or 'no details'}); "
                        "the job was not completed: run it again once the server is back")
        e = e.__cause__ or e.__context__
    return None


def spark_error_summary(err: BaseException) -> str:
    """One line naming the failed task and why, out of Spark's long wrapped job failure.

    The Python exception line when the task raised; else Spark's own reason (e.g. a Python
    worker that crashed); prefixed with the task's partition index when Spark names it. A Spark
    Connect server that went away is said so (:func:`lost_server`).
    """
    lost = lost_server(err)
    if lost is not None:
        return lost
    text = str(err)
    task = None
    spark_reason = None
    m = _BARRIER_TASK.search(text) or _LOST_TASK.search(text)
    if m is not None:
        task = m.group(1)
        spark_reason = m.group(m.lastindex)
        for prefix in ("org.apache.spark.SparkException: ", "org.apache.spark.api.python.PythonException: "):
            spark_reason = spark_reason.removeprefix(prefix)
        spark_reason = spark_reason.split(". Consider setting", 1)[0]
    found = [m.group(0) for m in map(_ERROR_LINE.match, (x.strip() for x in text.splitlines())) if m]
    found = [f for f in found if not f.startswith(_JVM_PREFIXES)]
    reason = found[-1] if found else spark_reason or (text.splitlines()[0] if text else type(err).__name__)
    return f"task {task}: {reason}" if task is not None else reason
