"""Slow is not dead: a live rank far behind is waited for; a frozen or killed one is named.

Ranks are threads (the delayed-rank test) or a real spawned OS process (SIGSTOP / SIGKILL),
all on 127.0.0.1 with tiny timeouts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from terascale.allreduce.errors import PeerAborted, PeerLost, PeerTimeout
from terascale.allreduce.node import TreeNode
from terascale.allreduce.protocol import new_key
from terascale.allreduce.server import TreeServer
from tests.allreduce.harness import FAST, run_tree, tree_order_sum

# 1.5 s, not less: the ranks are threads of one process sharing its GIL, and on a loaded 2-core
# machine one went 0.8 s without sending a heartbeat (a clean-clone run, 2026-11-28), so a 0.5 s
# timeout failed a live rank
IO_TIMEOUT = 1.5
HEARTBEAT_TIMEOUT = 1.5
DELAY = 3 * IO_TIMEOUT  # also 3 x the heartbeat timeout: only heartbeats keep the wait going
N = 50_000  # float64: 400 KB, ~100 chunks of 4 KiB through 4 KiB socket buffers
LIVE = {
    "chunk_bytes": 4096,
    "io_timeout_s": IO_TIMEOUT,
    "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
    "socket_buffer_bytes": 4096,
}


def _data(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(N)


def _collectives(delayed: int | None, waits: dict):
    def body(node):
        out = []
        for step in range(4):
            if node.rank == delayed and step == 2:
                time.sleep(DELAY)  # "GC pause / slow disk" between the 2nd and 3rd collective
            t0 = time.monotonic()
            out.append(node.allreduce(_data(node.rank, step)))
            waits.setdefault(node.rank, []).append(time.monotonic() - t0)
        return out

    return body


# an interior rank (children 3, 4) and a leaf; heartbeats sealed by each cipher
@pytest.mark.parametrize(
    "delayed,cipher", [(1, "aes-gcm"), (4, "aes-gcm"), (4, "aes-gmac"), (1, "hmac-sha256")]
)
def test_rank_far_behind_in_a_late_collective_is_waited_for_with_the_same_result(delayed, cipher):
    k = 5
    waits: dict = {}
    slow = run_tree(k, _collectives(delayed, waits), node_kwargs=LIVE, cipher=cipher)
    fast = run_tree(k, _collectives(None, {}), node_kwargs=LIVE, cipher=cipher)
    for step in range(4):
        expected = tree_order_sum([_data(r, step) for r in range(k)])
        for r in range(k):
            assert slow.results[r][step].tobytes() == expected.tobytes(), (r, step)
            assert fast.results[r][step].tobytes() == expected.tobytes(), (r, step)
    # the others did wait the delay out in the third collective (rank 0 waits on everyone)
    assert waits[0][2] > DELAY * 0.8, waits[0]


def _frozen_rank(address, key, hb, ready, go) -> None:
    """Rank 1 as a real process: one collective, then wait (where the test stops or kills it)."""
    with TreeNode.join(
        address, key, shard=1, attempt_id="proc", chunk_bytes=4096, connect_timeout_s=5.0,
        handshake_timeout_s=5.0, io_timeout_s=IO_TIMEOUT, heartbeat_timeout_s=hb,
    ) as node:
        node.allreduce(np.ones(1000))
        ready.set()
        go.wait(30)
        node.allreduce(np.ones(1000))


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_frozen_or_killed_process_is_named_promptly(how):
    hb = 1.0
    ctx = mp.get_context("spawn")
    key = new_key()
    ready, go = ctx.Event(), ctx.Event()
    detected: dict = {}
    errors: dict = {}
    with TreeServer(3, key, **FAST) as server:
        proc = ctx.Process(target=_frozen_rank, args=(server.address, key, hb, ready, go), daemon=True)
        proc.start()
        entered = threading.Barrier(3)

        def rank(shard):
            try:
                with TreeNode.join(
                    server.address, key, shard=shard, attempt_id="thread", chunk_bytes=4096,
                    connect_timeout_s=5.0, handshake_timeout_s=5.0, io_timeout_s=IO_TIMEOUT,
                    heartbeat_timeout_s=hb,
                ) as node:
                    node.allreduce(np.ones(1000))
                    entered.wait(30)
                    node.allreduce(np.ones(1000))
            except Exception as exc:  # noqa: BLE001 - checked below
                errors[shard] = exc
                detected[shard] = time.monotonic()

        threads = [threading.Thread(target=rank, args=(s,), daemon=True) for s in (0, 2)]
        for t in threads:
            t.start()
        try:
            assert ready.wait(60), "the rank process did not get through its first collective"
            os.kill(proc.pid, getattr(signal, how))
            struck = time.monotonic()
            entered.wait(30)  # ranks 0 and 2 now enter the second collective
            for t in threads:
                t.join(hb + 10)
            assert not any(t.is_alive() for t in threads)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
    root = errors[0]
    latency = detected[0] - struck
    print(f"{how}: rank 0 named rank 1 {latency:.3f} s after the signal ({root})")
    if how == "SIGSTOP":
        assert isinstance(root, PeerTimeout) and root.rank == 1, repr(root)
        assert "not even a heartbeat" in str(root) and "rank 1" in str(root)
        assert hb * 0.5 < latency < hb + 1.5
    else:
        assert isinstance(root, PeerLost) and not isinstance(root, PeerAborted), repr(root)
        assert root.rank == 1 and "rank 1" in str(root)
        assert latency < 1.0
    # rank 2 hears of it from the root, with rank 1 named
    assert isinstance(errors[2], PeerLost) and "rank 1" in str(errors[2]), repr(errors[2])
