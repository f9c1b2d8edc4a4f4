"""A real Spark Connect server for the tests: pyspark's own ``SparkConnectServer`` started with
``spark-submit`` in local mode, listening on a free loopback port (nothing else binds it).

    with ConnectServer(master="local[3]") as server:
        SparkSession.builder.remote(server.url).getOrCreate()

Its executors' Python is this interpreter (terascale importable, as on a cluster whose image has
it); its log is kept in ``log_path`` for a failing test's message. ``stop()`` kills the whole
process group (the JVM and its Python workers), as a server that goes away would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark

CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectServer:
    def __init__(self, log_path: Path, master: str = "local[3]", conf: dict | None = None, start_timeout_s: float = 180.0):
        self.log_path, self.master, self.start_timeout_s = Path(log_path), master, start_timeout_s
        self.conf = {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1",
                     "spark.driver.bindAddress": "127.0.0.1", "spark.connect.grpc.binding.address": "127.0.0.1",
                     "spark.executorEnv.NUMPY_MADVISE_HUGEPAGE": "0", **(conf or {})}
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self) -> ConnectServer:
        home = os.path.dirname(pyspark.__file__)
        self.port = free_port()
        cmd = [os.path.join(home, "bin", "spark-submit"), "--master", self.master, "--class", CLASS,
               "--conf", f"spark.connect.grpc.binding.port={self.port}"]
        for k, v in self.conf.items():
            cmd += ["--conf", f"{k}={v}"]
        env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable)
        env.pop("SPARK_REMOTE", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, "spark-internal"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Spark Connect server exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the Spark Connect server did not listen within {self.start_timeout_s:.0f} s:\n"
                                       f"{self.log()[-3000:]}") from None
                time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def __enter__(self) -> ConnectServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
