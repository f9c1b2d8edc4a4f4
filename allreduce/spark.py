"""Spark adapter: run a function in a barrier stage of K workers + S spares joined by a tree.

The only module of ``allreduce`` that imports pyspark. ``run_barrier`` starts a tree server on
the driver, launches one barrier stage of K + S tasks and hands every task a
:class:`BarrierTask` context:

- task p < K works on shard p; task K + i is spare i. A spare asks the server which shard to
  race (the slowest unfinished one, once half the shards have finished their first pass) and
  runs the same first pass on it; the first attempt of a shard to register survives, the other
  is told to stand down at its next heartbeat and exits cleanly. Spark turns its own
  speculation off in barrier stages; this is terascale's.
- Spark never retries a failed barrier result stage, so the adapter does: a new attempt with a
  new key, up to ``max_attempts``, logging why each attempt failed.
- Cpus per task (``task_cpus`` = ``train.threads``, a rank's threads): the stage asks Spark for
  that many cpus per task. When it equals the session's ``spark.task.cpus`` the stage runs as
  any other; on a cluster (standalone, YARN, Kubernetes) that it differs from, the stage's RDD
  carries a task resource profile of ``task_cpus`` cpus (stage-level scheduling; any
  ``spark.task.resource.*`` amount, a GPU, is kept). Local mode has no stage-level scheduling:
  every task gets the session's ``spark.task.cpus``, which must then be at least ``task_cpus``
  (terascale's own local sessions set it, ``jobs.session``); else :func:`barrier_profile`
  refuses before any task starts. The slot check (:func:`preflight`) counts tasks of the
  stage's cpus: ``workers + spares`` tasks must fit at once.

Spark Connect (a session from ``SparkSession.builder.remote``: no SparkContext, no RDD, and a
client that is not the driver, which the executors may not reach): the stage runs through the
DataFrame API, ``spark.range(0, n, 1, n).mapInArrow(..., barrier=True)`` (one row per task, its
value the task's index; results pickled in a binary column), and the tree server runs inside task
0: it binds its executor's address (every interface when ``allreduce.host`` is a wildcard),
tells the others its address through the barrier's ``allGather``, works as worker 0 beside it and
keeps serving until every task has passed a final ``barrier()``. Spares, survivors, retries
(the client is the driver attempt loop: a new key and a new server per attempt) and what the
task function does are the same. Settings come from ``spark.conf``; the slot check counts
``local[N]``'s N, or ``spark.executor.instances`` × ``spark.executor.cores``, in tasks of the
stage's cpus (a server that tells neither: Spark's own barrier check decides); a task resource
profile needs Spark 4.0 (``mapInArrow``'s ``profile``). ``on_attempt`` is not called: the server
is not in the client's process. ``is_connect`` and the settings' reads repeat
``pipeline.spark_tasks``' few lines: neither package may import the other.

Addresses (``allreduce.endpoints``): in a classic session the tree server binds ``allreduce.host`` ('' = the
driver's ``spark.driver.host``) and the tasks dial ``allreduce.advertise_host`` ('' = the bound
address; with a wildcard bind, ``spark.driver.host``). A rank's listener binds its executor's
address as Spark knows it (the task's ``BarrierTaskContext`` address), or every interface when
``allreduce.host`` is a wildcard, and the rank registers its executor's address: the one Spark
itself needs its peers to reach. Every listener takes its port from ``allreduce.port_range``
when set. Each attempt records the address its tree server bound (``tree_server``) and each
task the address it registered (``host``).

Security: the per-attempt key travels to the tasks inside the task closure. On a shared cluster
enable ``spark.authenticate`` and RPC encryption (``spark.network.crypto.enabled``) so it does not
cross the network in clear. The key is never logged.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from terascale.allreduce import ciphers, endpoints
from terascale.allreduce.client import ServerSession, SpareSession
from terascale.allreduce.errors import StandDown
from terascale.allreduce.node import TreeNode
from terascale.allreduce.protocol import new_key
from terascale.allreduce.server import TreeServer

log = logging.getLogger("terascale.allreduce")


class BarrierError(RuntimeError):
    """The barrier stage cannot run, or failed in every attempt; the message says why.
    ``attempts``: the driver attempts made (``BarrierResult.attempts`` records)."""

    def __init__(self, message: str, attempts: list[dict] | None = None):
        super().__init__(message)
        self.attempts = list(attempts or [])


@dataclass(frozen=True)
class NetConf:
    """The allreduce settings a task needs (plain values; pickled into the tasks)."""

    chunk_bytes: int = 1 << 20
    connect_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    io_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0
    max_frame_bytes: int = 1 << 28
    spare_poll_s: float = 0.25
    heartbeat_rows: int = 100_000  # a pass reports progress (and checks for stand-down) this often
    heartbeat_timeout_s: float = 60.0  # tree neighbours: silence this long = lost (allreduce.node)
    max_wait_s: float = 86400.0
    max_unauthenticated: int = 1024  # listeners' bounds on connections not yet authenticated
    max_unauthenticated_per_source: int = 64
    cipher: str = ciphers.DEFAULT_CIPHER  # frame protection after the handshake (allreduce.ciphers)
    host: str = ""  # allreduce.host: the tree server's bind address; a wildcard: the ranks' too
    advertise_host: str = ""  # allreduce.advertise_host: the address the tasks dial for the server
    port_range: tuple[int, int] | None = None  # allreduce.port_range, parsed; None: ephemeral
    window_chunks: int | None = None  # allreduce.window_chunks; None: auto (allreduce.node.auto_window)

    @classmethod
    def from_conf(cls, c) -> NetConf:
        return cls(c.chunk_bytes, c.connect_timeout_s, c.handshake_timeout_s, c.io_timeout_s,
                   c.startup_timeout_s, c.max_frame_bytes, heartbeat_timeout_s=c.heartbeat_timeout_s,
                   max_wait_s=c.max_wait_s, max_unauthenticated=c.max_unauthenticated,
                   max_unauthenticated_per_source=c.max_unauthenticated_per_source,
                   cipher=c.cipher, host=c.host, advertise_host=c.advertise_host,
                   port_range=endpoints.parse_port_range(c.port_range),
                   window_chunks=None if c.window_chunks == "auto" else int(c.window_chunks))


@dataclass
class BarrierTask:
    """What a task function gets: its shard, its attempt, heartbeats, and the tree to join."""

    shard: int
    attempt: int  # the driver's attempt number, 0-based
    attempt_id: str  # unique per task attempt, e.g. "w2-a0" or "s0-a1"
    is_spare: bool
    host: str  # the address this task registers for tree links (its executor's, as Spark knows it)
    num_shards: int
    net: NetConf
    gpu_address: str | None = None  # the GPU Spark assigned to this task, if any
    _server: tuple[str, int] = field(repr=False, default=("", 0))
    _key: bytes = field(repr=False, default=b"")
    _session: ServerSession | None = field(repr=False, default=None)
    _joined: bool = field(repr=False, default=False)
    bind_host: str = ""  # the address its listener binds ('' = host; a wildcard: every interface)

    def session(self) -> ServerSession:
        if self._session is None:
            n = self.net
            self._session = ServerSession.connect(
                self._server, self._key, shard=self.shard, attempt_id=self.attempt_id,
                connect_timeout_s=n.connect_timeout_s, handshake_timeout_s=n.handshake_timeout_s,
                io_timeout_s=n.io_timeout_s, max_frame_bytes=n.max_frame_bytes, cipher=n.cipher,
            )
        return self._session

    def heartbeat(self, rows_done: int) -> None:
        """Report first-pass progress; raises StandDown if another attempt of the shard won.

        A no-op once this task has joined the tree (its shard is won, by this attempt).
        """
        if self._joined:
            return
        s = self.session()
        if s.stand_down_requested():
            raise StandDown(self.shard, self.attempt_id, "another attempt of this shard registered first")
        s.report_progress(rows_done)

    def join(self) -> TreeNode:
        """Register as this shard's survivor and link up with the tree (raises StandDown)."""
        n = self.net
        session, self._session = self.session(), None
        self._joined = True
        return TreeNode.join(
            self._server, self._key, shard=self.shard, attempt_id=self.attempt_id,
            host=self.bind_host or self.host, advertise_host=self.host, port_range=n.port_range,
            chunk_bytes=n.chunk_bytes, connect_timeout_s=n.connect_timeout_s,
            handshake_timeout_s=n.handshake_timeout_s, io_timeout_s=n.io_timeout_s,
            startup_timeout_s=n.startup_timeout_s, max_frame_bytes=n.max_frame_bytes, session=session,
            heartbeat_timeout_s=n.heartbeat_timeout_s, max_wait_s=n.max_wait_s,
            max_unauthenticated=n.max_unauthenticated,
            max_unauthenticated_per_source=n.max_unauthenticated_per_source, cipher=n.cipher,
            window_chunks=n.window_chunks,
        )

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


TaskFn = Callable[[BarrierTask], dict]


def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N, F]``: one JVM, slots fixed from the start."""
    return re.fullmatch(r"local(\[[^\]]*\])?", master) is not None


def local_cores(master: str) -> int | None:
    """The task threads of a local master (``local`` 1, ``local[N]`` / ``local[N, F]`` N,
    ``local[*]`` the machine's cores); None for any other master."""
    m = re.fullmatch(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?", master)
    if m is None:
        return None
    if m.group(1) in (None, ""):
        return 1
    return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))


def is_connect(spark) -> bool:
    """True for a Spark Connect session (module docstring)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _conf(spark, key: str, default: str | None = None) -> str | None:
    if is_connect(spark):
        value = spark.conf.get(key, None)
        return default if value is None else value
    return spark.sparkContext.getConf().get(key, default)


def _master(spark) -> str:
    return (_conf(spark, "spark.master", "") or "") if is_connect(spark) else spark.sparkContext.master


def task_slots(spark, profile=None) -> int | None:
    """Concurrent task slots of the executors registered now for tasks of ``profile`` (a
    pyspark ResourceProfile; None: the session's default, i.e. executor cores / spark.task.cpus,
    summed), what Spark's barrier check uses; falls back to defaultParallelism / cpus. On Spark
    Connect, from the settings (module docstring); None when they do not tell."""
    if is_connect(spark):
        cpus = _profile_cpus(profile) or int(_conf(spark, "spark.task.cpus", "1"))
        cores = local_cores(_master(spark))
        if cores is None:
            executors, per = _conf(spark, "spark.executor.instances"), _conf(spark, "spark.executor.cores")
            if not (executors and per):
                return None
            return int(executors) * (int(per) // max(cpus, 1))
        return cores // max(cpus, 1)
    sc = spark.sparkContext
    try:
        jsc = sc._jsc.sc()
        java = profile._java_resource_profile if profile is not None else jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(java))
    except Exception:  # noqa: BLE001 - an older or different Spark: the public estimate
        cpus = _profile_cpus(profile) or int(sc.getConf().get("spark.task.cpus", "1"))
        return sc.defaultParallelism // max(cpus, 1)


def _profile_cpus(profile) -> int | None:
    req = profile.taskResources.get("cpus") if profile is not None else None
    return int(req.amount) if req is not None else None


def barrier_profile(spark, task_cpus: int):
    """The resource profile the barrier stage's RDD takes so that each task gets ``task_cpus``
    cpus: None (the session's default profile) when ``spark.task.cpus`` already gives that (in
    local mode: at least that), else a task resource profile (module docstring). Raises
    BarrierError in local mode when the session's tasks get fewer cpus."""
    cpus = int(_conf(spark, "spark.task.cpus", "1"))
    if cpus == task_cpus:
        return None
    if is_local(_master(spark)):
        if cpus > task_cpus:
            return None
        raise BarrierError(
            f"train.threads = {task_cpus}: each barrier task needs {task_cpus} cpus, but this local-mode session "
            f"gives every task spark.task.cpus = {cpus} (Spark has no stage-level scheduling in local mode): start "
            f"the session with spark.task.cpus={task_cpus} (terascale sets it when it starts the session itself; "
            f"with spark-submit pass --conf spark.task.cpus={task_cpus}), or lower train.threads"
        )
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    req = TaskResourceRequests().cpus(task_cpus)
    pairs = (spark.sparkContext.getConf().getAll() if not is_connect(spark)
             else [(k, v) for k in ("spark.task.resource.gpu.amount",) if (v := _conf(spark, k))])
    for key, amount in pairs:  # keep the tasks' other resources (a GPU)
        m = re.fullmatch(r"spark\.task\.resource\.([^.]+)\.amount", key)
        if m:
            req = req.resource(m.group(1), float(amount))
    return ResourceProfileBuilder().require(req).build


def preflight(spark, slots_needed: int, what: str, wait_s: float = 0.0, poll_s: float = 1.0,
              profile=None) -> None:
    """Fail fast (not hang) when the cluster cannot gang-schedule the barrier stage (of tasks
    of ``profile``, :func:`barrier_profile`; None: the session's default).

    On a cluster, executors register a while after the session starts (containers launch,
    archives unpack): wait up to ``wait_s`` for enough slots before giving up."""
    if (_conf(spark, "spark.dynamicAllocation.enabled", "false") or "false").lower() == "true":
        raise BarrierError(
            "barrier stages need a fixed set of executors: set spark.dynamicAllocation.enabled=false"
        )
    # local[N]: the slots exist from the start; local-cluster and real clusters register later
    fixed = is_local(_master(spark)) or is_connect(spark)  # Connect: the settings, which do not change
    deadline = time.monotonic() + (0.0 if fixed else wait_s)
    next_log = 0.0
    while (slots := task_slots(spark, profile)) is not None and slots < slots_needed:
        now = time.monotonic()
        if now >= deadline:
            cpus = _profile_cpus(profile) or int(_conf(spark, "spark.task.cpus", "1"))
            per_task = (f"executor cores / {cpus} cpus per task (train.threads)" if profile is not None
                        else f"executor cores / spark.task.cpus={cpus}")
            raise BarrierError(
                f"the barrier stage needs {slots_needed} concurrent task slots ({what}), but the "
                f"cluster offers {slots} ({per_task})"
                + (f" after waiting {wait_s:.0f} s for executors" if wait_s and not fixed else "")
                + "; add executors or cores, or lower train.workers / train.spares"
                + (" / train.threads" if cpus > 1 else "")
            )
        if now >= next_log:
            log.info("waiting for executors: %d of %d task slots registered", slots, slots_needed)
            next_log = now + 10.0
        time.sleep(poll_s)


def server_addresses(conf, host: str, advertise_host: str) -> tuple[str, str]:
    """The tree server's ``(bind, advertised)`` addresses from ``allreduce.host`` and
    ``allreduce.advertise_host`` and the Spark configuration ``conf`` (module docstring)."""
    driver = conf.get("spark.driver.host", "127.0.0.1")
    bind = host or driver
    advertise = advertise_host or (driver if endpoints.is_wildcard(bind) else bind)
    return bind, endpoints.dialable(advertise, "allreduce.advertise_host")


def _task_host() -> str:
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    addr = ctx.getTaskInfos()[ctx.partitionId()].address
    return addr.rsplit(":", 1)[0] if addr else "127.0.0.1"


def _task_gpu() -> str | None:
    """The address of the GPU Spark's resource scheduling gave this task (None without one)."""
    from pyspark import BarrierTaskContext

    gpu = BarrierTaskContext.get().resources().get("gpu")
    return gpu.addresses[0] if gpu is not None and gpu.addresses else None


def _run_task(p: int, k: int, attempt: int, server: tuple[str, int], key: bytes, net: NetConf,
              task_fn: TaskFn) -> dict:
    host = _task_host()
    bind = net.host if endpoints.is_wildcard(net.host) else host
    if p < k:
        shard, spare, attempt_id = p, False, f"w{p}-a{attempt}"
    else:
        i = p - k
        with_spare = SpareSession.connect(
            server, key, spare=i, connect_timeout_s=net.connect_timeout_s,
            handshake_timeout_s=net.handshake_timeout_s, io_timeout_s=net.io_timeout_s,
            cipher=net.cipher,
        )
        shard = with_spare.wait_assignment(poll_s=net.spare_poll_s, timeout_s=net.startup_timeout_s)
        if shard is None:
            return {"task": p, "role": "spare", "shard": None, "host": host, "outcome": "unused"}
        spare, attempt_id = True, f"s{i}-a{attempt}"
    ctx = BarrierTask(shard, attempt, attempt_id, spare, host, k, net, _task_gpu(), server, key,
                      bind_host=bind)
    t0 = time.perf_counter()
    try:
        result = task_fn(ctx)
    except StandDown:
        return {"task": p, "role": "spare" if spare else "worker", "shard": shard, "host": host,
                "attempt_id": attempt_id, "outcome": "stood_down", "seconds": time.perf_counter() - t0}
    finally:
        ctx.close()
    return {"task": p, "role": "spare" if spare else "worker", "shard": shard, "host": host,
            "attempt_id": attempt_id, "outcome": "survivor", "seconds": time.perf_counter() - t0,
            "result": result}


@dataclass
class BarrierResult:
    results: list[dict]  # one per shard (index = shard): the survivor's task_fn result
    tasks: list[dict]  # every task's outcome: survivor / stood_down / unused
    attempts: list[dict]  # every driver attempt: number, seconds, outcome, error


def run_barrier(spark, num_shards: int, spares: int, task_fn: TaskFn, *, net: NetConf,
                max_attempts: int = 3, server_host: str = "", job_name: str = "terascale barrier",
                summarize_error: Callable[[BaseException], str], no_retry: tuple[str, ...] = (),
                on_attempt: Callable[[TreeServer, int], None] | None = None,
                task_cpus: int = 1) -> BarrierResult:
    """Run ``task_fn`` on ``num_shards`` workers + ``spares`` spares; retry failed attempts.
    Each task gets ``task_cpus`` cpus (module docstring; the train job's ``train.threads``).

    ``summarize_error`` turns a failed Spark job's exception into one line naming the failed task
    and why (the caller's: e.g. ``pipeline.spark_errors.spark_error_summary``, which the train
    job passes); each failed attempt is logged and recorded with it. A failure whose summary
    names one of the exception class names in ``no_retry`` (errors a new attempt would only
    repeat, e.g. invalid input) fails the job at once.
    ``on_attempt(server, attempt)`` is called when an attempt's tree server is up (e.g. to
    show its pass-1 progress; a classic session only: under Spark Connect the server runs in task 0). ``server_host`` overrides ``net.host`` (module docstring).
    """
    connect = is_connect(spark)
    attempts: list[dict] = []
    profile = barrier_profile(spark, task_cpus)
    if connect and profile is not None:
        import inspect

        if "profile" not in inspect.signature(spark.range(0).mapInArrow).parameters:
            raise BarrierError(f"train.threads = {task_cpus}: each barrier task needs a task resource profile of "
                               f"{task_cpus} cpus, which a Spark Connect client passes to mapInArrow from pyspark 4.0; "
                               "with this pyspark, set train.threads to the server's spark.task.cpus")
    for attempt in range(max_attempts):
        # every attempt: executors may still be registering, or replacing a lost one
        preflight(spark, num_shards + spares, f"{num_shards} workers + {spares} spares"
                  + (f" of {task_cpus} cpus each" if task_cpus > 1 else ""), wait_s=net.startup_timeout_s,
                  profile=profile)
        key = new_key()
        t0 = time.perf_counter()
        bound = None
        try:
            if connect:
                tasks = _connect_stage(spark, num_shards, spares, attempt, key, net, task_fn, profile)
                bound = next((t["tree_server"] for t in tasks if t.get("tree_server")), None)
            else:
                host, advertise = server_addresses(spark.sparkContext.getConf(), server_host or net.host,
                                                   net.advertise_host)
                with _tree_server(num_shards, key, net, host, advertise) as server:
                    bound = "{}:{}".format(*server.bound_address)
                    if on_attempt is not None:
                        on_attempt(server, attempt)
                    log.info("%s: attempt %d of %d, tree server on %s:%d, %d workers + %d spares", job_name,
                             attempt + 1, max_attempts, *server.address, num_shards, spares)
                    tasks = _classic_stage(spark, num_shards, spares, attempt, server.address, key, net, task_fn,
                                           profile, f"{job_name}: attempt {attempt + 1}")
        except Exception as e:  # noqa: BLE001 - a failed barrier stage: log why, then retry
            why = summarize_error(e)
            attempts.append({"attempt": attempt, "seconds": time.perf_counter() - t0, "outcome": "failed", "error": why,
                             "tree_server": bound})
            log.warning("%s: attempt %d failed: %s", job_name, attempt + 1, why)
            if any(name in why for name in no_retry):
                raise BarrierError(f"{job_name}: {why} (attempt {attempt + 1}, not retried: "
                                   "a new attempt would fail the same way)", attempts) from None
            continue
        survivors = sorted((t for t in tasks if t["outcome"] == "survivor"), key=lambda t: t["shard"])
        if [t["shard"] for t in survivors] != list(range(num_shards)):
            outcomes = ", ".join(f"task {t['task']} {t['outcome']}" + (f" on shard {t['shard']}" if t.get("shard") is not None else "")
                                 for t in tasks)
            why = f"survivors for shards {[t['shard'] for t in survivors]}, expected 0..{num_shards - 1} ({outcomes})"
            attempts.append({"attempt": attempt, "seconds": time.perf_counter() - t0, "outcome": "failed", "error": why,
                             "tree_server": bound})
            log.warning("%s: attempt %d failed: %s", job_name, attempt + 1, why)
            continue
        for t in tasks:
            if t["outcome"] != "survivor":
                log.info("%s: task %d (%s) %s%s", job_name, t["task"], t["role"], t["outcome"].replace("_", " "),
                         f" on shard {t['shard']}" if t.get("shard") is not None else "")
        log.info("%s: attempt %d succeeded in %.1f s%s; survivors: %s", job_name, attempt + 1,
                 time.perf_counter() - t0, f" (tree server in task 0 on {bound})" if connect else "",
                 ", ".join(f"{t['shard']}={t['attempt_id']}" for t in survivors))
        attempts.append({"attempt": attempt, "seconds": time.perf_counter() - t0, "outcome": "succeeded",
                         "tree_server": bound})
        return BarrierResult([t["result"] for t in survivors], tasks, attempts)
    raise BarrierError(
        f"{job_name}: all {max_attempts} attempts failed; last error: {attempts[-1]['error']}", attempts
    )


def _tree_server(num_shards: int, key: bytes, net: NetConf, host: str, advertise: str) -> TreeServer:
    """An attempt's tree server (not started: a context manager) bound to ``host``, advertising
    ``advertise``, with ``net``'s limits, timeouts, cipher and ports."""
    return TreeServer(num_shards, key, host=host, handshake_timeout_s=net.handshake_timeout_s,
                      io_timeout_s=net.io_timeout_s, startup_timeout_s=net.startup_timeout_s,
                      max_frame_bytes=net.max_frame_bytes, max_unauthenticated=net.max_unauthenticated,
                      max_unauthenticated_per_source=net.max_unauthenticated_per_source,
                      cipher=net.cipher, advertise_host=advertise, port_range=net.port_range)


def _classic_stage(spark, num_shards: int, spares: int, attempt: int, address: tuple[str, int], key: bytes,
                   net: NetConf, task_fn: TaskFn, profile, description: str) -> list[dict]:
    """One attempt's barrier stage on a classic session (an RDD), the tree server on the driver."""
    sc = spark.sparkContext

    def fn(p, _it, k=num_shards, a=attempt, s=address, key=key, n=net, f=task_fn):
        yield _run_task(p, k, a, s, key, n, f)

    sc.setJobDescription(description)
    try:
        rdd = sc.parallelize(range(num_shards + spares), num_shards + spares)
        if profile is not None:
            rdd = rdd.withResources(profile)
        return rdd.barrier().mapPartitionsWithIndex(fn).collect()
    finally:
        sc.setJobDescription(None)


def _connect_stage(spark, num_shards: int, spares: int, attempt: int, key: bytes, net: NetConf, task_fn: TaskFn,
                   profile) -> list[dict]:
    """One attempt's barrier stage through the DataFrame API (Spark Connect), the tree server in
    task 0 (module docstring)."""
    n = num_shards + spares

    def fn(batches, k=num_shards, a=attempt, key=key, net=net, f=task_fn):
        import pickle

        import pyarrow as pa

        for b in batches:
            for p in b.column(0).to_pylist():
                out = pickle.dumps(_served_task(p, k, a, key, net, f), protocol=pickle.HIGHEST_PROTOCOL)
                yield pa.RecordBatch.from_arrays([pa.array([out], pa.binary())], names=["task"])

    kwargs = {"barrier": True, **({"profile": profile} if profile is not None else {})}
    rows = spark.range(0, n, 1, n).mapInArrow(fn, "task binary", **kwargs).collect()
    import pickle

    return sorted((pickle.loads(r["task"]) for r in rows), key=lambda t: t["task"])


def _served_task(p: int, k: int, attempt: int, key: bytes, net: NetConf, task_fn: TaskFn) -> dict:
    """Task ``p`` of a Connect stage: task 0 starts the tree server and every task learns its
    address through ``allGather``; all pass a final ``barrier()`` before task 0 stops serving."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    server = None
    try:
        if p == 0:
            host = _task_host()
            bind = net.host if endpoints.is_wildcard(net.host) else host
            server = _tree_server(k, key, net, bind, host).__enter__()
        told = ctx.allGather("{}:{}".format(*server.address) if server is not None else "")[0]
        h, port = told.rsplit(":", 1)
        result = _run_task(p, k, attempt, (h, int(port)), key, net, task_fn)
        ctx.barrier()  # task 0's server serves until every task is done with it
        if server is not None:
            result["tree_server"] = "{}:{}".format(*server.bound_address)
        return result
    finally:
        if server is not None:
            server.__exit__(None, None, None)
