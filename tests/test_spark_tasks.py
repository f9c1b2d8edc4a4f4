"""The pieces of Spark Connect support that need no server: the task slicing, the fence of the
task attempts' directory, the client's retry budget, and the error for a server that went away
(a real gRPC call to a loopback port nothing listens on)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from terascale.pipeline import artifacts, fsutil
from terascale.pipeline.spark_compat import CONNECT_BACKOFF_MS, connect_retries
from terascale.pipeline.spark_errors import lost_server, spark_error_summary
from terascale.pipeline.spark_tasks import slices
from tests.connect_server import free_port


@pytest.mark.parametrize("n_items,n", [(0, 1), (1, 1), (11, 3), (11, 11), (3, 5), (100, 7)])
def test_slices_cover_the_items_in_order(n_items, n):
    items = list(range(n_items))
    parts = slices(items, n)
    assert len(parts) == n and sum(parts, []) == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_retire_attempts_fences_off_a_late_attempt(tmp_path):
    out = str(tmp_path / "data")
    attempts = artifacts.open_attempts(out, "r1")
    assert attempts == str(tmp_path / ".data.attempts-r1")
    fs, inner = fsutil.resolve(fsutil.join(attempts, "task-00000-a0"))
    fs.create_dir(inner, recursive=False)  # an attempt while the directory is open
    late = fs.open_output_stream(inner + "/part.parquet")  # still writing when the commit comes
    artifacts.retire_attempts(out, "r1")
    late.write(b"x" * 1000)
    late.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing of the run is left
    _, late_dir = fsutil.resolve(fsutil.join(attempts, "task-00000-a1"))
    with pytest.raises(OSError):
        fs.create_dir(late_dir, recursive=False)  # a later attempt cannot even start
    with pytest.raises(OSError):
        fs.open_output_stream(inner + "/late.parquet")
    assert fs.get_file_info(inner).type == pafs.FileType.NotFound
    artifacts.retire_attempts(out, "r1")  # retired already: nothing to do


def test_connect_retries_cover_the_budget():
    first, factor, cap = CONNECT_BACKOFF_MS
    for seconds in (0.01, 1, 3, 60, 120, 600, 3600):
        k = connect_retries(seconds)
        waits = [min(first * factor ** i, cap) for i in range(k)]
        assert sum(waits) >= seconds * 1000 > sum(waits[:-1])
    assert connect_retries(120) == 7  # 50 ms, 0.2, 0.8, 3.2, 12.8, 51.2, 60 s


def test_a_server_that_does_not_answer_is_named():
    import grpc

    port = free_port()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/spark.connect.SparkConnectService/Config")
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=5)
    try:
        raise RuntimeError("featurize failed") from info.value
    except RuntimeError as wrapped:
        err = wrapped
    for e in (info.value, err):
        said = lost_server(e)
        assert said is not None and said.startswith("the Spark Connect server stopped answering (gRPC UNAVAILABLE")
        assert spark_error_summary(e) == said
    assert lost_server(ValueError("boom")) is None
    assert spark_error_summary(ValueError("boom")) == "boom"
