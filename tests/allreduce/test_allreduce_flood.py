"""Hostile connections cannot lock workers out.

Another OS process holds 1000 idle TCP connections to the tree server and 1000 to the ranks'
listeners (all from 127.0.0.1, like the workers), reopening every one that is closed, while a
real tree of ranks (threads) registers, links up and runs several AllReduces. The job must give
the same bits as without the flood, and the server side must stay bounded: unauthenticated
connections held, threads, and the process's resident memory.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import select
import socket
import threading
import time

import numpy as np

from terascale.allreduce.node import TreeNode
from terascale.allreduce.server import TreeServer
from tests.allreduce.harness import FAST, tree_order_sum

IDLE = 1000  # per kind of target: the tree server, and the ranks' listeners together
PER_SOURCE = 64  # the default bound: every connection in this test comes from 127.0.0.1
K = 4
N = 20_000
STEPS = 3
NODE = {"chunk_bytes": 4096, "connect_timeout_s": 10.0, "handshake_timeout_s": 5.0,
        "io_timeout_s": 10.0, "heartbeat_timeout_s": 5.0, "startup_timeout_s": 30.0}


def _raise_fd_limit(need: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))


def _flood(targets, ready, stop, out, reopen_per_tick: int = 200) -> None:
    """Hold ``count`` idle connections to each ``(host, port, count)``, reopening closed ones
    (at most ``reopen_per_tick`` per 20 ms), until ``stop``; report what happened on ``out``
    (``max_held``: the most open at once after the listeners' closes were seen)."""
    _raise_fd_limit(sum(c for _, _, c in targets) + 256)
    poller = select.poll()
    socks: dict[int, tuple[socket.socket, int]] = {}
    missing = [c for _, _, c in targets]
    stats = {"opened": 0, "closed_by_peer": [0] * len(targets), "max_held": 0}

    def open_one(i: int) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex(targets[i][:2]) not in (0, errno.EINPROGRESS):
            s.close()
            return False
        socks[s.fileno()] = (s, i)
        poller.register(s, select.POLLIN)  # the server never sends junk anything: any event = closed
        stats["opened"] += 1
        return True

    def refill(budget: int) -> None:
        for i in range(len(targets)):
            while missing[i] and budget > 0:
                budget -= 1
                if not open_one(i):
                    return
                missing[i] -= 1

    refill(10**9)
    ready.set()
    next_refill = time.monotonic()
    while not stop.is_set():
        for fd, _ in poller.poll(max(next_refill - time.monotonic(), 0.0) * 1000):
            s, i = socks.pop(fd)
            poller.unregister(fd)
            s.close()
            stats["closed_by_peer"][i] += 1
            missing[i] += 1
        stats["max_held"] = max(stats["max_held"], len(socks))
        if time.monotonic() >= next_refill:
            refill(reopen_per_tick)
            next_refill = time.monotonic() + 0.02
    for s, _ in socks.values():
        s.close()
    out.put(stats)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _data(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * step + rank).standard_normal(N)


def test_a_thousand_idle_connections_do_not_lock_workers_out(key):
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    results: list = [None] * K
    errors: list = [None] * K
    t_start = time.monotonic()
    with TreeServer(K, key, **FAST) as server:

        def rank(shard: int) -> None:
            try:
                with TreeNode.join(server.address, key, shard=shard, attempt_id="a", **NODE) as node:
                    results[shard] = [node.allreduce(_data(shard, s)) for s in range(STEPS)]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[shard] = exc

        threads = {s: threading.Thread(target=rank, args=(s,), daemon=True) for s in range(K)}
        for s in range(1, K):  # rank 0 comes last, so the others' listeners wait to be flooded
            threads[s].start()
        deadline = time.monotonic() + 20
        while len(server.endpoints()) < K - 1:
            assert time.monotonic() < deadline, "ranks 1..3 did not register"
            time.sleep(0.01)
        listeners = list(server.endpoints().values())
        host, port = server.address
        targets = [(host, port, IDLE)] + [
            (h, p, IDLE // len(listeners) + (i < IDLE % len(listeners)))
            for i, (h, p) in enumerate(listeners)
        ]
        base_rss, base_threads = _rss_bytes(), threading.active_count()
        peak = {"rss": base_rss, "threads": base_threads, "pending": 0}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.02):
                peak["rss"] = max(peak["rss"], _rss_bytes())
                peak["threads"] = max(peak["threads"], threading.active_count())
                peak["pending"] = max(peak["pending"], server.acceptor.pending)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        attacker = ctx.Process(target=_flood, args=(targets, ready, stop, out), daemon=True)
        attacker.start()
        try:
            assert ready.wait(30), "the flood did not start"
            time.sleep(0.5)  # the flood is in full swing: every slot of 127.0.0.1 is taken
            t_job = time.monotonic()
            threads[0].start()
            for t in threads.values():
                t.join(60)
            job_s = time.monotonic() - t_job
            assert not any(t.is_alive() for t in threads.values()), "a rank hung"
        finally:
            stop.set()
            flood = out.get(timeout=30)
            attacker.join(10)
            sampling.set()
            sampler.join(5)
        acceptor = server.acceptor
        rejected, evicted, held_peak = acceptor.rejected, acceptor.evicted, acceptor.peak_pending
    total_s = time.monotonic() - t_start
    print(
        f"flood: {flood['opened']} connections opened, at most {flood['max_held']} held open at once; "
        f"closed by the tree server {flood['closed_by_peer'][0]}, by the rank listeners "
        f"{sum(flood['closed_by_peer'][1:])}; server: {rejected} rejected ({evicted} evicted), at most "
        f"{held_peak} unauthenticated held; test process RSS {base_rss / 2**20:.1f} -> peak "
        f"{peak['rss'] / 2**20:.1f} MiB, threads {base_threads} -> peak {peak['threads']}; "
        f"job {job_s:.2f} s under the flood, test {total_s:.2f} s"
    )
    assert errors == [None] * K, errors
    for step in range(STEPS):
        expected = tree_order_sum([_data(r, step) for r in range(K)])
        for r in range(K):
            assert results[r][step].tobytes() == expected.tobytes(), (r, step)
    assert flood["opened"] >= 2 * IDLE  # the flood really was on, reopening what was closed
    assert flood["closed_by_peer"][0] >= IDLE - PER_SOURCE  # the server shed the junk it could not hold
    # bounded: the server held at most the per-source bound unauthenticated, no thread per
    # connection, and a few MiB of memory at most (the flood's 2000 sockets live in the
    # attacker's process; the test process holds the server and the ranks)
    assert held_peak <= PER_SOURCE and peak["pending"] <= PER_SOURCE
    # per rank: its heartbeat and acceptor threads, and a collective's downward flow, a reader
    # per child (at most 2) and a sealer and a sender per link (at most 3): at most 11, whatever
    # the number of connections
    assert peak["threads"] - base_threads <= 11 * K
    assert peak["rss"] - base_rss < 32 * 2**20


# ---------------------------------------------------------------------------------------------
# The pieces: eviction order, the handshake timeout, the client's retries


def _listener_with_acceptor(key, **bounds):
    from terascale.allreduce.acceptor import Acceptor
    from terascale.allreduce.channel import open_listener

    linked = []
    acc = Acceptor(
        open_listener("127.0.0.1"), key, name="test", role="parent", expect_role="child",
        accept=lambda hello: (hello["rank"], None, {"rank": 0}),
        on_channel=lambda chan, hello: linked.append(chan), io_timeout_s=2.0, **bounds,
    ).start()
    return acc, linked


def _closed_by_server(sock: socket.socket, timeout: float = 2.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_over_the_per_source_bound_the_oldest_silent_connection_makes_room(key):
    from terascale.allreduce.channel import connect_authenticated

    acc, linked = _listener_with_acceptor(key, handshake_timeout_s=30.0, max_pending_per_source=4)
    addr = acc._listener.getsockname()
    try:
        talker = socket.create_connection(addr)
        talker.sendall(b"TSAR")  # started a header: not silent
        silent = [socket.create_connection(addr) for _ in range(3)]
        deadline = time.monotonic() + 5
        while acc.pending < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert acc.pending == 4
        # the bound is full; a legitimate child still links, at the cost of the oldest silent one
        chan, reply = connect_authenticated(
            addr, key, role="child", expect_role="parent", info={"rank": 1}, rank=0, peer=None,
            connect_timeout_s=5.0, handshake_timeout_s=5.0, io_timeout_s=5.0,
        )
        assert reply["rank"] == 0
        assert _closed_by_server(silent[0])
        assert not _closed_by_server(silent[1], 0.2) and not _closed_by_server(talker, 0.2)
        assert acc.evicted == 1 and acc.peak_pending == 4
        more = [socket.create_connection(addr) for _ in range(3)]  # 3 + 3 > 4: two must go
        assert _closed_by_server(silent[1]) and _closed_by_server(silent[2])
        assert not _closed_by_server(talker, 0.2)  # it spoke: silent ones go first
        assert not any(_closed_by_server(m, 0.1) for m in more)
        assert acc.pending == 4 and acc.evicted == 3 and acc.peak_pending == 4
        chan.close()
        for s in [talker, *silent, *more]:
            s.close()
    finally:
        acc.close()
        for c in linked:
            c.close()


def test_silent_connections_are_closed_at_the_handshake_timeout(key):
    acc, _ = _listener_with_acceptor(key, handshake_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        socks = [socket.create_connection(acc._listener.getsockname()) for _ in range(20)]
        assert all(_closed_by_server(s) for s in socks)
        assert 0.25 < time.monotonic() - t0 < 2.0 and acc.rejected == 20 and acc.evicted == 0
        for s in socks:
            s.close()
    finally:
        acc.close()


def test_workers_retry_connecting_with_backoff_within_the_connect_timeout(key):
    from terascale.allreduce.acceptor import Acceptor
    from terascale.allreduce.channel import connect_authenticated
    from terascale.allreduce.errors import PeerLost

    # bound but not listening yet: connections are refused until it listens, 0.5 s later
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    addr = sock.getsockname()
    linked = []

    def open_later():
        time.sleep(0.5)
        sock.listen(16)
        Acceptor(sock, key, name="late", role="parent", expect_role="child",
                 accept=lambda hello: (1, None, {"rank": 0}), on_channel=lambda c, h: linked.append(c),
                 handshake_timeout_s=2.0, io_timeout_s=2.0).start()

    threading.Thread(target=open_later, daemon=True).start()
    t0 = time.monotonic()
    chan, reply = connect_authenticated(
        addr, key, role="child", expect_role="parent", info={"rank": 1}, rank=0, peer=None,
        connect_timeout_s=10.0, handshake_timeout_s=2.0, io_timeout_s=2.0,
    )
    assert reply["rank"] == 0 and 0.45 < time.monotonic() - t0 < 5.0
    chan.close()
    # nobody ever listens: the error says how long and how many tries
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    t0 = time.monotonic()
    try:
        connect_authenticated(
            dead.getsockname(), key, role="child", expect_role="parent", info={"rank": 1}, rank=0,
            peer=None, connect_timeout_s=0.5, handshake_timeout_s=1.0, io_timeout_s=1.0,
        )
        raise AssertionError("connected to nothing")
    except PeerLost as exc:
        assert exc.rank == 0 and "rank 0" in str(exc) and "tries in 0.5 s" in str(exc), str(exc)
    assert 0.45 < time.monotonic() - t0 < 1.5
    dead.close()
