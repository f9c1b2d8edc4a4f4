"""A real Spark standalone cluster on 127.0.0.1 (a master and N workers from the installed
pyspark's ``spark-class``), and ``spark-submit`` against it the way a user runs terascale:
the packed environment (``--archives env.tar.gz#env``), the code zip (``--py-files``) and the
entry points from ``make dist``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
    env.update(SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(workdir / "logs"),
               SPARK_NO_DAEMONIZE="1", PYTHONHASHSEED="0")
    return env


class StandaloneCluster:
    """``with StandaloneCluster(dir, workers=2) as c: c.submit(...)``; stops everything on exit.

    Subclasses place the processes elsewhere (tests/multihost/cluster.py: each in a network
    namespace) through :meth:`command`, :attr:`master_host`, :attr:`driver_host` and
    :meth:`fetch_json`."""

    master_host = "127.0.0.1"  # the master binds and is reached at this address
    driver_host = "127.0.0.1"  # spark-submit's driver binds and is reached at this address

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "2G",
                 start_timeout_s: float = 120.0, hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.dir = Path(workdir)
        self.hosts = hosts  # worker i binds hosts[i % len(hosts)] (loopback addresses only)
        self.n_workers, self.cores, self.memory = workers, cores, memory
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.port, self.ui_port = free_port(), free_port()

    @property
    def master_url(self) -> str:
        return f"spark://{self.master_host}:{self.port}"

    def command(self, role: str, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` for ``role`` ("master", "worker<i>", "driver")."""
        return argv

    def fetch_json(self, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)

    def _spawn(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        env = _base_env(self.dir) | (extra_env or {})
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        try:
            p = subprocess.Popen(self.command(name, [str(SPARK_HOME / "bin" / "spark-class"), *args]), env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            log.close()
            raise
        p.log = log  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def __enter__(self) -> StandaloneCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", self.master_host,
                        "--port", str(self.port), "--webui-port", str(self.ui_port),
                        extra_env={"SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                                   "SPARK_LOCAL_IP": self.master_host})
            for i in range(self.n_workers):
                wdir = self.dir / f"worker{i}"
                wdir.mkdir(exist_ok=True)
                host = self.hosts[i % len(self.hosts)]
                self._spawn(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.master_url,
                            "--host", host, "--cores", str(self.cores), "--memory", self.memory,
                            "--webui-port", str(free_port()), "--work-dir", str(wdir),
                            extra_env={"SPARK_LOCAL_IP": host})
            self._wait_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def state(self) -> dict:
        return self.fetch_json(f"http://{self.master_host}:{self.ui_port}/json/")

    def _wait_workers(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a cluster process exited with {p.returncode}; see {p.log.name}")
            try:
                alive = [w for w in self.state()["workers"] if w["state"] == "ALIVE"]
                if len(alive) >= self.n_workers:
                    return
            except (OSError, ValueError):
                # not up yet: no answer, or (while the master's web UI is still starting) its
                # HTML page where /json/ will be (a CI run on a loaded machine met it)
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.n_workers} workers did not register within {self.start_timeout_s} s; logs in {self.dir}")

    def executor_pids(self) -> list[int]:
        """PIDs of the executor JVMs this cluster's workers run (CoarseGrainedExecutorBackend)."""
        worker_urls = {f"spark://Worker@{w['host']}:{w['port']}" for w in self.state()["workers"]}
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in args and "--worker-url" in args \
                    and args[args.index("--worker-url") + 1] in worker_urls:
                pids.append(int(proc.name))
        return sorted(pids)

    def stop(self) -> None:
        try:  # the executors of this cluster's workers, while the master can still say which
            orphans = self.executor_pids()
        except OSError:
            orphans = []
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.log.close()
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the worker took it down already
        self.procs = []


class Dist:
    """The ``make dist`` artifacts and a driver-side Python unpacked from the packed env."""

    def __init__(self, dist_dir: Path, workdir: Path) -> None:
        self.dir = Path(dist_dir)
        wheels = sorted(self.dir.glob("terascale-*-py3-none-any.whl"))
        need = [self.dir / "env.tar.gz", self.dir / "terascale-pyfiles.zip", self.dir / "jobs" / "train.py"]
        missing = [str(p) for p in need if not p.exists()] + ([] if wheels else [f"{self.dir}/terascale-*.whl"])
        if missing:
            raise FileNotFoundError(f"missing dist artifacts {missing}: run `make dist`")
        self.env_archive, self.pyfiles = need[0], need[1]
        self.driver_env = Path(workdir) / "driver-env"
        if not (self.driver_env / "bin" / "python").exists():
            # as a user unpacks it (venv-pack keeps bin/python a link to the base interpreter)
            self.driver_env.mkdir(parents=True, exist_ok=True)
            subprocess.run(["tar", "-xzf", str(self.env_archive), "-C", str(self.driver_env)], check=True)

    def entry(self, job: str) -> str:
        return str(self.dir / "jobs" / f"{job}.py")


def spark_submit(cluster: StandaloneCluster, dist: Dist, job: str, args: list[str], log_path: Path,
                 conf: dict[str, str] | None = None, timeout_s: float = 600.0,
                 archives: bool = True) -> subprocess.Popen:
    """Start ``spark-submit`` of a terascale job on the cluster (client mode) with the packed
    artifacts, as docs/pages/how-to/cluster.md shows; returns the running process (output in ``log_path``).
    ``archives=False``: the executors run the driver's copy of the unpacked environment (a
    filesystem every host shares) instead of unpacking ``env.tar.gz`` each (about 240 MB per
    executor and application)."""
    settings = {
        # executors: the unpacked archive, or the driver's unpacked copy
        "spark.pyspark.python": "./env/bin/python" if archives else str(dist.driver_env / "bin" / "python"),
        "spark.pyspark.driver.python": str(dist.driver_env / "bin" / "python"),  # client mode
        "spark.dynamicAllocation.enabled": "false",
        "spark.ui.enabled": "false",
        "spark.driver.host": cluster.driver_host,
        "spark.executor.memory": "1g",
        # compiled kernels carry over from one application to the next (pipeline.numba_cache)
        "spark.executorEnv.NUMBA_CACHE_DIR": str(cluster.dir / "numba-cache"),
        **(conf or {}),
    }
    cmd = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster.master_url,
           *(["--archives", f"{dist.env_archive}#env"] if archives else []), "--py-files", str(dist.pyfiles)]
    for k, v in settings.items():
        cmd += ["--conf", f"{k}={v}"]
    cmd += [dist.entry(job), *args]
    cmd = cluster.command("driver", cmd)
    env = _base_env(cluster.dir) | {"SPARK_LOCAL_IP": cluster.driver_host}
    log = open(log_path, "wb")  # noqa: SIM115 - closed by wait()
    try:  # its own process group: a timeout takes down the Python driver it starts as well
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cluster.dir,
                             start_new_session=True)
    except BaseException:
        log.close()
        raise
    p.log = log  # type: ignore[attr-defined]
    p.timeout_s = timeout_s  # type: ignore[attr-defined]
    return p


def wait(p: subprocess.Popen) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=p.timeout_s)  # type: ignore[attr-defined]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    p.log.close()  # type: ignore[attr-defined]
    return rc, Path(p.log.name).read_text(errors="replace")  # type: ignore[attr-defined]
