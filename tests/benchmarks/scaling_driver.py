"""The driver side of the scaling benchmark: a tree server and K rank processes.

    python -m tests.benchmarks.scaling_driver --bind ADDR --k K --hosts JSON -- RANK ARGS...

``--hosts`` is a JSON list of K ``[command prefix, address]`` pairs: rank process s runs as
``prefix + [python, -m, tests.benchmarks.scaling_rank, ...]`` and listens on ``address``
(``["ip", "netns", "exec", "h3"]`` and ``"198.18.0.13"`` on the namespace cluster, ``[]`` and
``"127.0.0.1"`` on loopback). The tree server binds ``--bind`` (the driver namespace's address
on the cluster). Run it inside the driver's namespace; it prints one JSON line: the ranks'
reports (``scaling_rank``, which gets ``RANK ARGS`` besides its server, address, K and shard) in
shard order, after checking that every rank got the same bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(k: int, bind: str, hosts: list[tuple[list[str], str]], rank_args: list[str],
              timeout_s: float = 900.0) -> list[dict]:
    """Start the tree server on ``bind`` and one rank process per host; their reports by shard."""
    from terascale.allreduce.protocol import new_key
    from terascale.allreduce.server import TreeServer

    if len(hosts) != k:
        raise ValueError(f"{len(hosts)} hosts for K = {k}")
    key = new_key()
    with TreeServer(k, key, host=bind, startup_timeout_s=timeout_s, io_timeout_s=300.0) as server:
        addr = f"{server.address[0]}:{server.address[1]}"
        procs = []
        for s, (prefix, host) in enumerate(hosts):
            cmd = [*prefix, sys.executable, "-m", "tests.benchmarks.scaling_rank", "--server", addr, "--bind", host,
                   "--k", str(k), "--shard", str(s), *rank_args]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=ROOT)
            p.stdin.write(key.hex() + "\n")
            p.stdin.close()
            p.stdin = None  # communicate() below must not touch it
            procs.append(p)
        reports, errors = [], []
        for s, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"K = {k}: rank process of shard {s} timed out") from None
            if p.returncode != 0:
                errors.append(f"shard {s} exited {p.returncode}: {err[-2000:]}")
                continue
            reports.append(json.loads(out.strip().splitlines()[-1]))
    if errors:
        raise RuntimeError(f"K = {k}: " + "; ".join(errors))
    if len({r["digest"] for r in reports}) != 1:
        raise RuntimeError(f"K = {k}: ranks disagree on the AllReduce result")
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--hosts", required=True)
    p.add_argument("rank_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    hosts = [(list(prefix), str(addr)) for prefix, addr in json.loads(a.hosts)]
    rank_args = a.rank_args[1:] if a.rank_args[:1] == ["--"] else a.rank_args
    print(json.dumps(run_ranks(a.k, a.bind, hosts, rank_args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
