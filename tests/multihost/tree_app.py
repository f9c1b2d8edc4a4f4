"""A tree server or one rank as a process of its own (run inside a network namespace by
tests/multihost/test_addresses.py).

    python -m tests.multihost.tree_app server KEYFILE N HOST ADVERTISE PORTS
        prints {"bound": [h, p], "address": [h, p]}, then, once the N ranks have registered,
        {"endpoints": {shard: [h, p]}}
    python -m tests.multihost.tree_app rank KEYFILE SERVER_HOST SERVER_PORT SHARD HOST ADVERTISE PORTS
        joins, AllReduces arange(1000) * (shard + 1) and prints {"sum": [...]} (float64)

PORTS is an ``allreduce.port_range`` value ('' = ephemeral); the key is read from KEYFILE.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from terascale.allreduce.endpoints import parse_port_range
from terascale.allreduce.node import TreeNode
from terascale.allreduce.server import TreeServer

TIMEOUTS = {"handshake_timeout_s": 10.0, "io_timeout_s": 30.0, "startup_timeout_s": 60.0}


def _say(obj) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: list[str]) -> int:
    role, keyfile = argv[0], argv[1]
    key = open(keyfile, "rb").read()
    if role == "server":
        n, host, advertise, ports = int(argv[2]), argv[3], argv[4], parse_port_range(argv[5])
        with TreeServer(n, key, host=host, advertise_host=advertise, port_range=ports, **TIMEOUTS) as s:
            _say({"bound": list(s.bound_address), "address": list(s.address)})
            s.wait_tree(timeout=60)
            _say({"endpoints": {str(k): list(v) for k, v in s.endpoints().items()}})
            time.sleep(1.0)  # the ranks link up with each other, not with the server
        return 0
    server = (argv[2], int(argv[3]))
    shard, host, advertise, ports = int(argv[4]), argv[5], argv[6], parse_port_range(argv[7])
    with TreeNode.join(server, key, shard=shard, attempt_id=f"r{shard}", host=host, advertise_host=advertise,
                       port_range=ports, connect_timeout_s=30.0, chunk_bytes=4096, **TIMEOUTS) as node:
        out = node.allreduce(np.arange(1000, dtype=np.float64) * (shard + 1))
    _say({"sum": out.tolist()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
