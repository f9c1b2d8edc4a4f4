"""Benchmark: spanning-tree AllReduce over loopback TCP versus a raw loopback transfer.

Figures (all on 127.0.0.1, one OS process per rank, so the GIL does not serialize ranks):

* ``raw_loopback``: one process sends 64 MiB to another over one TCP connection (plain
  ``sendall`` / ``recv_into`` a preallocated buffer, no framing, no HMAC). Bandwidth =
  bytes / time from the receiver's "go" to its last byte.
* ``allreduce``: K = 2, 4, 8 processes join a :class:`~allreduce.node.TreeNode` tree and
  AllReduce a 2^24-element float32 vector (64 MiB). Time = the slowest rank's wall time of the
  ``allreduce`` call, every rank having passed a barrier just before. **Effective bandwidth =
  vector bytes (64 MiB) / that time**; ``ratio_to_raw`` divides it by the raw loopback GB/s.
  The best of ``repeats`` runs is reported, with the median. ``cpu_s`` is the CPU time (user +
  system, all threads) that all ranks together spent in that call: on a machine with fewer
  cores than busy threads, wall time is at least ``cpu_s / cores``.
* ``hmac_sha256_GBps``: single-thread HMAC-SHA256 throughput. Every byte of an AllReduce is
  sealed when sent and opened when received, once per tree edge and direction: 4 (K-1) passes
  over the vector in all; with ``allreduce.cipher = hmac-sha256`` that bounds the bandwidth on
  a machine with few cores (AES-GCM is about 5x faster). ``cipher`` picks the frames' cipher.
* ``scalars_latency_s``: mean time of ``allreduce_scalars`` of 4 floats (the latency-bound
  path L-BFGS uses for losses and dot products), slowest rank, over 200 back-to-back calls.

Run: ``python -m tests.benchmarks.allreduce_socket [--quick]``. ``main()`` returns the
figures as a dict (bandwidths in GB/s, 1 GB = 1e9 bytes; times in seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import numpy as np

RAW_BYTES = 64 << 20
VECTOR_ELEMENTS = 1 << 24
SCALAR_CALLS = 200
_CTX = mp.get_context("spawn")


# ---------------------------------------------------------------------------------------------
# Raw loopback TCP


def _raw_sender(port: int, nbytes: int, repeats: int) -> None:
    payload = np.ones(nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        go = bytearray(1)
        for _ in range(repeats):
            if sock.recv_into(go, 1) != 1:
                return
            sock.sendall(memoryview(payload))


def raw_loopback(nbytes: int = RAW_BYTES, repeats: int = 5) -> dict[str, Any]:
    """Time ``repeats`` transfers of ``nbytes`` from a child process to this one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        lsock.settimeout(60)
        proc = _CTX.Process(target=_raw_sender, args=(lsock.getsockname()[1], nbytes, repeats))
        proc.start()
        conn, _ = lsock.accept()
    times = []
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    with conn:
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                k = conn.recv_into(view[got:], nbytes - got)
                if k == 0:
                    raise RuntimeError("raw sender closed early")
                got += k
            times.append(time.perf_counter() - t0)
    proc.join(60)
    best, med = min(times), statistics.median(times)
    return {
        "bytes": nbytes,
        "best_s": best,
        "median_s": med,
        "GBps": nbytes / best / 1e9,
        "median_GBps": nbytes / med / 1e9,
    }


# ---------------------------------------------------------------------------------------------
# AllReduce


def _ar_worker(
    address, key, shard, n, repeats, chunk_bytes, queue, cipher="aes-gcm", overlap=True
) -> None:
    from terascale.allreduce.node import TreeNode

    try:
        x = np.random.default_rng(shard).standard_normal(n, dtype=np.float32)
        with TreeNode.join(
            address,
            key,
            shard=shard,
            attempt_id=f"bench-{os.getpid()}",
            chunk_bytes=chunk_bytes,
            io_timeout_s=120.0,
            cipher=cipher,
            overlap=overlap,
        ) as node:
            node.allreduce(x)  # warm up (page-faults the buffers, grows TCP windows)
            walls, cpus, digest = [], [], ""
            perf0 = node.perf()
            for _ in range(repeats):
                node.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                out = node.allreduce(x)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                digest = hashlib.sha256(out.tobytes()).hexdigest()
            perf = {k: (v - perf0.get(k, 0.0)) / repeats for k, v in node.perf().items()}
            node.barrier()
            t0 = time.perf_counter()
            for _ in range(SCALAR_CALLS):
                node.allreduce_scalars([1.0, 2.0, 3.0, 4.0])
            scalar_s = (time.perf_counter() - t0) / SCALAR_CALLS
        queue.put((shard, walls, cpus, digest, scalar_s, None, perf))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((shard, [], [], "", 0.0, f"{type(exc).__name__}: {exc}", {}))


def allreduce_bandwidth(
    k: int,
    n: int = VECTOR_ELEMENTS,
    repeats: int = 5,
    chunk_bytes: int = 1 << 20,
    cipher: str = "aes-gcm",
    overlap: bool = True,
) -> dict[str, Any]:
    """AllReduce of ``n`` float32 over ``k`` processes; see the module docstring."""
    from terascale.allreduce.protocol import new_key
    from terascale.allreduce.server import TreeServer

    key = new_key()
    queue = _CTX.Queue()
    with TreeServer(k, key, startup_timeout_s=120.0, cipher=cipher) as server:
        procs = [
            _CTX.Process(
                target=_ar_worker,
                args=(server.address, key, s, n, repeats, chunk_bytes, queue, cipher, overlap),
            )
            for s in range(k)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in range(k)]
        for p in procs:
            p.join(60)
    errors = [r[5] for r in results if r[5]]
    if errors:
        raise RuntimeError(f"AllReduce benchmark with K={k} failed: {errors}")
    if len({r[3] for r in results}) != 1:
        raise RuntimeError(f"ranks disagree on the AllReduce result with K={k}")
    walls = [max(r[1][i] for r in results) for i in range(repeats)]  # slowest rank per run
    cpus = [sum(r[2][i] for r in results) for i in range(repeats)]  # all ranks' CPU per run
    nbytes = n * 4
    best, med = min(walls), statistics.median(walls)
    return {
        "k": k,
        "cipher": cipher,
        "overlap": overlap,
        "elements": n,
        "bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        "best_s": best,
        "median_s": med,
        "times_s": walls,
        "GBps": nbytes / best / 1e9,
        "median_GBps": nbytes / med / 1e9,
        "cpu_s": statistics.median(cpus),
        "scalars_latency_s": max(r[4] for r in results),
        # per rank (shard order), per call: seconds in each stage (TreeNode.perf)
        "perf_per_rank": [r[6] for r in sorted(results, key=lambda r: r[0])],
    }


def hmac_throughput(nbytes: int = 64 << 20) -> float:
    """Single-thread HMAC-SHA256 throughput in GB/s."""
    data = np.ones(nbytes, dtype=np.uint8)
    mac = hmac.new(b"k" * 32, digestmod="sha256")
    best = float("inf")
    for _ in range(3):
        h = mac.copy()
        t0 = time.perf_counter()
        h.update(memoryview(data))
        h.digest()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="AllReduce over loopback vs raw loopback TCP")
    parser.add_argument("--ks", default="2,4,8", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--quick", action="store_true", help="2^20 elements, 2 repeats")
    args = parser.parse_args(argv)
    n = 1 << 20 if args.quick else VECTOR_ELEMENTS
    repeats = 2 if args.quick else args.repeats

    raw = raw_loopback(n * 4, repeats=repeats)
    hmac_gbps = hmac_throughput()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(
        f"cores: {os.cpu_count()}  load average: {load}  "
        f"HMAC-SHA256 (1 thread): {hmac_gbps:.2f} GB/s"
    )
    print(
        f"raw loopback TCP, {raw['bytes'] >> 20} MiB: {raw['GBps']:.2f} GB/s "
        f"(best of {repeats}; median {raw['median_GBps']:.2f})"
    )
    runs = []
    for k in (int(s) for s in args.ks.split(",")):
        r = allreduce_bandwidth(k, n=n, repeats=repeats, chunk_bytes=args.chunk_bytes)
        r["ratio_to_raw"] = r["GBps"] / raw["GBps"]
        runs.append(r)
        print(
            f"allreduce K={k}: {r['bytes'] >> 20} MiB float32 in {r['best_s'] * 1e3:.0f} ms -> "
            f"{r['GBps']:.2f} GB/s effective (vector bytes / wall time) = "
            f"{r['ratio_to_raw']:.0%} of raw loopback; median {r['median_GBps']:.2f} GB/s; "
            f"CPU {r['cpu_s']:.2f} s over all ranks; "
            f"allreduce_scalars(4 floats) {r['scalars_latency_s'] * 1e6:.0f} us/call",
            flush=True,
        )
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m": load,
        "hmac_sha256_GBps": hmac_gbps,
        "raw_loopback": raw,
        "allreduce": runs,
    }


if __name__ == "__main__":
    main()
