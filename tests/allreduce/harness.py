"""Test harness for the AllReduce tests: an in-process tree server plus N worker threads,
and the slow, obvious tree-order reference sum."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from terascale.allreduce.node import TreeNode
from terascale.allreduce.protocol import new_key
from terascale.allreduce.server import TreeServer

# Small chunks so every size class (0, 1, chunk-1, chunk+1, many chunks) is cheap to test.
CHUNK_BYTES = 64
FAST = {"handshake_timeout_s": 5.0, "io_timeout_s": 10.0, "startup_timeout_s": 20.0}
NODE_DEFAULTS = {"chunk_bytes": CHUNK_BYTES, "connect_timeout_s": 5.0, **FAST}


class TreeRun:
    """Outcome of :func:`run_tree`: per-shard results and errors, and the server."""

    def __init__(self, n: int, server: TreeServer) -> None:
        self.results: list[Any] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self.server = server

    def raise_errors(self) -> None:
        for shard, err in enumerate(self.errors):
            if err is not None:
                raise AssertionError(f"shard {shard} failed: {err!r}") from err


def run_tree(
    n: int,
    body: Callable[[TreeNode], Any],
    *,
    key: bytes | None = None,
    server_kwargs: dict[str, Any] | None = None,
    node_kwargs: dict[str, Any] | None = None,
    during: Callable[[TreeServer], None] | None = None,
    timeout: float = 30.0,
    check: bool = True,
    cipher: str | None = None,
) -> TreeRun:
    """Start a server and ``n`` worker threads; each joins the tree and runs ``body(node)``.

    ``cipher`` (``allreduce.cipher``) is used by the server and every node; None = the default.
    """
    key = key or new_key()
    chosen = {} if cipher is None else {"cipher": cipher}
    skw = {**FAST, **chosen, **(server_kwargs or {})}
    nkw = {**NODE_DEFAULTS, **chosen, **(node_kwargs or {})}
    with TreeServer(n, key, **skw) as server:
        run = TreeRun(n, server)

        def worker(shard: int) -> None:
            try:
                with TreeNode.join(
                    server.address, key, shard=shard, attempt_id=f"attempt-{shard}", **nkw
                ) as node:
                    run.results[shard] = body(node)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                run.errors[shard] = exc

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(n)]
        for t in threads:
            t.start()
        if during is not None:
            during(server)
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a worker hung"
    if check:
        run.raise_errors()
    return run


def tree_order_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """The slow, obvious reference: S(r) = (x_r + S(2r+1)) + S(2r+2), in the arrays' dtype."""
    k = len(arrays)

    def subtree(r: int) -> np.ndarray:
        acc = arrays[r].copy()
        for c in (2 * r + 1, 2 * r + 2):
            if c < k:
                acc = acc + subtree(c)
        return acc

    return subtree(0)
