"""One rank of the scaling benchmark (``bench_scaling``), a process of its own on its host.

    python -m tests.benchmarks.scaling_rank --server HOST:PORT --bind ADDR --dataset DIR --k K
        --shard S [--rounds R] [--chunk-bytes C] [--socket-buffer-bytes B] [--link-only N] [--window-chunks W]
        (the attempt key, hex, on stdin)

It reads shard S of the dataset's K-shard plan (``pipeline.dataset.plan_shards``, the train
job's plan) into memory, compiles the kernel on a few rows (untimed), joins the tree (listening
on ``--bind``) and warms the links with one AllReduce. Then, ``--rounds`` times:

- **pass**: a barrier, then one real L-BFGS function evaluation's local work and collective:
  the gradient pass over the shard (``solvers.objective.shard_sums``: loss and gradient, one
  thread) and the AllReduce of ``[g | loss | bad]`` in float64 (2^bits + 3 elements, as
  ``solvers.objective`` sends it); the rank records its compute seconds and its AllReduce
  seconds (which include waiting for the slowest rank);
- **allreduce**: a barrier, then the same AllReduce alone (no compute before it): the
  communication time without any wait.

It prints one JSON line: per round the pass's ``compute_s``, ``pass_allreduce_s`` and
``pass_s`` (from the barrier to the AllReduce's end), the lone ``allreduce_s`` and its CPU
seconds (``allreduce_cpu_s``: this process, all threads), and the shard's rows and non-zeros,
plus the SHA-256 of the last AllReduce's result (every rank must agree).

``--link-only N`` (calibration): no data; the rank AllReduces N random float64 ``--rounds`` times
(each after a barrier), then times 50 AllReduces of 4 scalars (``scalar_s``, the mean).
``--socket-buffer-bytes`` fixes the links' SO_SNDBUF/SO_RCVBUF (``TreeNode.join``); the default
leaves Linux's autotuning on, as the train job does. ``--window-chunks`` sets the AllReduce's
window (``allreduce.window_chunks``; default auto, as the train job).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np


def load_shard(dataset: str, k: int, shard: int):
    """Shard ``shard`` of the K-shard plan of ``dataset``, as the kernels take it."""
    from terascale.pipeline.dataset import plan_shards, read_csr
    from terascale.pipeline.manifest import read_manifest
    from terascale.solvers.shard import Shard

    m = read_manifest(dataset)
    n_features = 1 << int(m["spec"]["bits"])
    parts = plan_shards(dataset, k, m)[shard]
    return Shard.from_csr(read_csr(parts, n_features))


def gradient_pass(shard, theta: np.ndarray, out: np.ndarray) -> None:
    """``out`` = [g | loss | bad] of the logistic loss at ``theta`` over the shard (one thread)."""
    from terascale.solvers.kernels.losses import LOGISTIC
    from terascale.solvers.objective import shard_sums

    d = shard.n_features + 1
    out[:] = 0.0
    loss, problem = shard_sums(shard, theta, LOGISTIC, out[:d])
    out[d] = loss
    out[d + 1] = 0.0 if problem is None else 1.0


def warm_up(shard, theta: np.ndarray, out: np.ndarray) -> None:
    """Compile (or load from numba's cache) the gradient kernel on the first rows; untimed."""
    from terascale.solvers.kernels import objective as K
    from terascale.solvers.kernels.losses import LOGISTIC

    d = shard.n_features + 1
    K.loss_grad_hess(shard.indptr, shard.indices, shard.values, shard.vpos, shard.labels, shard.weights, theta,
                     LOGISTIC, out[:d], np.zeros(0), 0, min(100, shard.n_rows), 0.0)


def link_only(node, n: int, rounds: int, seed: int) -> dict:
    """The ``--link-only`` calibration body (module docstring) on a joined ``node``."""
    x = np.random.default_rng(seed).standard_normal(n)
    out = []
    with node:
        node.allreduce(x)
        for _ in range(rounds):
            node.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            res = node.allreduce(x)
            t1, c1 = time.perf_counter(), time.process_time()
            out.append({"allreduce_s": t1 - t0, "allreduce_cpu_s": c1 - c0})
        node.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            node.allreduce_scalars([1.0, 2.0, 3.0, 4.0])
        scalar_s = (time.perf_counter() - t0) / 50
        return {"shard": seed, "rank": node.rank, "rounds": out, "scalar_s": scalar_s, "vector_bytes": x.nbytes,
                "digest": hashlib.sha256(res.tobytes()).hexdigest(), "perf": node.perf()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--dataset", default="")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--socket-buffer-bytes", type=int, default=0)
    p.add_argument("--link-only", type=int, default=0)
    p.add_argument("--window-chunks", default="auto", help="the AllReduce's window: auto (the train job's default) or N")
    a = p.parse_args(argv)
    key = bytes.fromhex(sys.stdin.readline().strip())
    host, port = a.server.rsplit(":", 1)

    from terascale.allreduce.node import TreeNode

    join = {"shard": a.shard, "attempt_id": f"scaling-{a.k}-{a.shard}", "host": a.bind, "chunk_bytes": a.chunk_bytes,
            "io_timeout_s": 300.0, "startup_timeout_s": 600.0, "connect_timeout_s": 60.0,
            "socket_buffer_bytes": a.socket_buffer_bytes or None, "window_chunks": None if a.window_chunks == "auto" else int(a.window_chunks)}
    if a.link_only:
        print(json.dumps(link_only(TreeNode.join((host, int(port)), key, **join), a.link_only, a.rounds, a.shard)),
              flush=True)
        return 0
    shard = load_shard(a.dataset, a.k, a.shard)
    d = shard.n_features + 1
    theta = np.zeros(d)
    vec = np.zeros(d + 2)
    warm_up(shard, theta, vec)
    rounds = []
    with TreeNode.join((host, int(port)), key, **join) as node:
        node.allreduce(vec)  # warm up: buffers, TCP windows
        digest = ""
        for _ in range(a.rounds):
            node.barrier()
            t0 = time.perf_counter()
            gradient_pass(shard, theta, vec)
            t1 = time.perf_counter()
            node.allreduce(vec)
            t2 = time.perf_counter()
            node.barrier()
            c3, t3 = time.process_time(), time.perf_counter()
            res = node.allreduce(vec)
            t4, c4 = time.perf_counter(), time.process_time()
            digest = hashlib.sha256(res.tobytes()).hexdigest()
            rounds.append({"compute_s": t1 - t0, "pass_allreduce_s": t2 - t1, "pass_s": t2 - t0,
                           "allreduce_s": t4 - t3, "allreduce_cpu_s": c4 - c3})
        rank = node.rank
        perf = node.perf()
    print(json.dumps({"shard": a.shard, "rank": rank, "rows": shard.n_rows, "nnz": int(shard.indptr[-1]),
                      "vector_bytes": vec.nbytes, "rounds": rounds, "digest": digest, "perf": perf}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
