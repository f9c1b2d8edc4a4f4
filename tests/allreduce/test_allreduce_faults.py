"""Failures: dead and stalled peers, stand-down, missing shards, junk connections, secrets."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from terascale.allreduce import protocol as proto
from terascale.allreduce.client import ServerSession, SpareSession
from terascale.allreduce.errors import (
    AllreduceError,
    PeerAborted,
    PeerLost,
    PeerTimeout,
    RoundAborted,
    StandDown,
    StartupTimeout,
)
from terascale.allreduce.node import TreeNode
from terascale.allreduce.protocol import MsgType
from terascale.allreduce.server import TreeServer
from tests.allreduce.harness import CHUNK_BYTES, FAST, NODE_DEFAULTS, run_tree, tree_order_sum

N_MULTI = 5 * (CHUNK_BYTES // 4) + 3  # several float32 chunks: exercises the pipelined path


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.mark.parametrize("cipher", ["aes-gcm", "aes-gmac", "hmac-sha256"])
def test_peer_closing_mid_frame_raises_peer_lost_within_one_second(cipher):
    times = {}

    def body(node):
        if node.rank == 1:  # send half a data frame, then vanish
            payload = np.ones(CHUNK_BYTES // 4, dtype="<f4").tobytes()
            frame = proto.pack_header(MsgType.UP_F32, 1, len(payload)) + payload
            node._parent.sock.sendall(frame[: len(frame) // 2])
            node._parent.close()
            return None
        t0 = time.monotonic()
        try:
            node.allreduce(np.ones(N_MULTI, dtype=np.float32))
        finally:
            times[node.rank] = time.monotonic() - t0

    run = run_tree(2, body, check=False, cipher=cipher)
    err = run.errors[0]
    assert isinstance(err, PeerLost) and not isinstance(err, PeerAborted), repr(err)
    assert err.rank == 1 and "rank 1" in str(err)
    assert times[0] < 1.0  # io_timeout_s is 10 s: this is EOF detection, not a timeout


@pytest.mark.parametrize("cipher", ["aes-gcm", "hmac-sha256"])
def test_live_but_stuck_peer_raises_peer_timeout_naming_it_after_max_wait(cipher):
    """A rank whose heartbeats arrive but whose data never does is given up on after
    max_wait_s (not after heartbeat_timeout_s: it is alive), naming it."""
    max_wait = 0.8
    released = threading.Event()
    times = {}

    def body(node):
        if node.rank == 2:  # never enters the collective; its heartbeat thread runs on
            released.wait(10)
            return None
        t0 = time.monotonic()
        try:
            node.allreduce(np.ones(N_MULTI, dtype=np.float32))
        finally:
            times[node.rank] = time.monotonic() - t0
            if len(times) == 2:
                released.set()

    kwargs = {"heartbeat_timeout_s": 0.3, "max_wait_s": max_wait}
    run = run_tree(3, body, node_kwargs=kwargs, check=False, cipher=cipher)
    root_err = run.errors[0]
    assert isinstance(root_err, PeerTimeout) and root_err.rank == 2, repr(root_err)
    assert "rank 2" in str(root_err) and "alive" in str(root_err) and "max_wait_s" in str(root_err)
    assert max_wait * 0.9 < times[0] < max_wait + 1.0
    # rank 1 is told by the root (ABORT naming rank 0 as origin and rank 2 as the cause).
    assert isinstance(run.errors[1], (PeerLost, PeerTimeout)), repr(run.errors[1])
    assert times[1] < max_wait + 1.0
    if isinstance(run.errors[1], PeerAborted):
        assert run.errors[1].rank == 0 and "rank 2" in str(run.errors[1])


@pytest.mark.parametrize("cipher", ["aes-gcm", "aes-gmac", "hmac-sha256"])
def test_exception_in_one_rank_aborts_the_others_promptly(cipher):
    times = {}

    def body(node):
        if node.rank == 3:
            raise ValueError("loss is NaN")  # leaves the `with` block: ABORT to neighbours
        t0 = time.monotonic()
        try:
            node.allreduce(np.ones(N_MULTI, dtype=np.float32))
        finally:
            times[node.rank] = time.monotonic() - t0

    run = run_tree(5, body, node_kwargs={"io_timeout_s": 10.0}, check=False, cipher=cipher)
    assert isinstance(run.errors[3], ValueError)
    for r in (0, 1, 2, 4):
        assert isinstance(run.errors[r], PeerLost), (r, repr(run.errors[r]))
        assert times[r] < 2.0, (r, times[r])
    assert isinstance(run.errors[1], PeerAborted) and run.errors[1].rank == 3
    assert "loss is NaN" in str(run.errors[1])


def test_a_link_thread_that_cannot_start_fails_the_collective_and_leaves_no_thread(monkeypatch):
    """The root's second reader thread cannot start (as when the process is out of threads):
    the collective fails on every rank, the node is unusable, and the reader and writer
    threads that did start are joined (none keeps reading the child's frames)."""
    from terascale.allreduce import link_threads

    real_start = link_threads._Reader.start

    def start(self):
        if self._chan.rank == 2:  # the link's peer: the root's second child
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(link_threads._Reader, "start", start)
    before = set(threading.enumerate())

    def body(node):
        try:
            node.allreduce(np.ones(N_MULTI, dtype=np.float32))
        finally:
            if node.rank == 0:
                with pytest.raises(AllreduceError, match="unusable"):
                    node.allreduce(np.ones(4, dtype=np.float32))

    run = run_tree(3, body, node_kwargs={"io_timeout_s": 10.0}, check=False)
    assert isinstance(run.errors[0], RuntimeError) and "can't start" in str(run.errors[0])
    for r in (1, 2):
        assert isinstance(run.errors[r], PeerLost), (r, repr(run.errors[r]))
    _wait_until(lambda: not set(threading.enumerate()) - before)


def test_node_is_unusable_after_a_failure():
    def body(node):
        if node.rank == 1:
            node._parent.close()
            return None
        with pytest.raises(PeerLost):
            node.allreduce(np.ones(4, dtype=np.float32))
        with pytest.raises(AllreduceError, match="unusable"):
            node.allreduce(np.ones(4, dtype=np.float32))
        return "checked"

    assert run_tree(2, body).results[0] == "checked"


def test_duplicate_registration_gets_stand_down(key):
    with TreeServer(2, key, **FAST) as server:
        winner = {}
        t = threading.Thread(
            target=lambda: winner.setdefault(
                "node",
                TreeNode.join(server.address, key, shard=0, attempt_id="first", **NODE_DEFAULTS),
            )
        )
        t.start()
        # A spare of shard 0 still in pass 1 (connected, not registered) ...
        spare = ServerSession.connect(
            server.address, key, shard=0, attempt_id="spare", connect_timeout_s=5
        )
        spare.report_progress(10)
        _wait_until(lambda: server.survivors() == {0: "first"})
        # ... is told to stand down as soon as the first attempt registers,
        _wait_until(spare.stand_down_requested)
        with pytest.raises(StandDown, match="shard 0"):
            spare.register("127.0.0.1", 9, timeout_s=5)
        spare.close()
        # and a late duplicate registration gets STAND_DOWN in reply.
        with pytest.raises(StandDown) as info:
            TreeNode.join(server.address, key, shard=0, attempt_id="late", **NODE_DEFAULTS)
        assert (
            info.value.shard == 0
            and info.value.attempt_id == "late"
            and "'first'" in str(info.value)
        )
        assert server.unfinished_shards() == [1]
        other = TreeNode.join(server.address, key, shard=1, attempt_id="only", **NODE_DEFAULTS)
        t.join(10)
        placements = server.wait_tree(timeout=5)
        assert [p.rank for p in placements] == [0, 1] and server.survivors() == {
            0: "first",
            1: "only",
        }
        result = {}
        t2 = threading.Thread(
            target=lambda: result.setdefault(0, winner["node"].allreduce(np.ones(3)))
        )
        t2.start()
        assert np.all(other.allreduce(np.ones(3)) == 2.0)
        t2.join(10)
        assert np.all(result[0] == 2.0)
        winner["node"].close()
        other.close()
        # After the tree is formed, any further registration stands down.
        with pytest.raises(StandDown):
            TreeNode.join(server.address, key, shard=1, attempt_id="too-late", **NODE_DEFAULTS)


def test_spare_is_logged_with_its_address_and_races_the_straggler(key, caplog):
    """The server logs where each spare connected from (once, at INFO: operators and the
    multi-host test read which host may take a straggler's shard), and assigns the spare the
    unfinished shard with the least progress once half the shards are won."""
    caplog.set_level(logging.INFO, logger="terascale.allreduce")
    with TreeServer(2, key, **FAST) as server:
        spare = SpareSession.connect(server.address, key, spare=0, connect_timeout_s=5)
        _wait_until(lambda: "spare 0 connected from" in caplog.text)
        lines = [r.getMessage() for r in caplog.records if "spare 0 connected" in r.getMessage()]
        assert lines == [f"tree server: spare 0 connected from 127.0.0.1:{spare._chan.sock.getsockname()[1]}"]
        slow = ServerSession.connect(server.address, key, shard=1, attempt_id="slow", connect_timeout_s=5)
        slow.report_progress(3)
        ended = {}

        def winner():
            try:
                TreeNode.join(server.address, key, shard=0, attempt_id="a", **NODE_DEFAULTS)
            except RoundAborted as exc:  # the server closes below, before shard 1 is won
                ended["why"] = str(exc)

        t = threading.Thread(target=winner)
        t.start()
        assert spare.wait_assignment(poll_s=0.02, timeout_s=5) == 1
        slow.close()
    t.join(10)
    assert "closed before the tree formed" in ended["why"]


def test_missing_shard_fails_the_round_naming_it(key):
    with TreeServer(3, key, **{**FAST, "startup_timeout_s": 1.5}) as server:
        errors = {}

        def worker(shard):
            try:
                TreeNode.join(server.address, key, shard=shard, attempt_id="a", **NODE_DEFAULTS)
            except BaseException as exc:  # noqa: BLE001
                errors[shard] = exc

        threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 2)]
        for t in threads:
            t.start()
        _wait_until(lambda: server.survivors() == {0: "a", 2: "a"}, timeout=1.5)
        with pytest.raises(StartupTimeout, match="shard\\(s\\) 1$") as info:
            server.wait_tree(timeout=5)
        assert info.value.missing_shards == (1,) and info.value.timeout_s == 1.5
        for t in threads:
            t.join(5)
        assert server.state == "failed"
    for shard in (0, 2):  # connected workers were told, with the missing shard named
        assert isinstance(errors[shard], StartupTimeout) and errors[shard].missing_shards == (1,)


def test_server_close_and_fail_tell_connected_workers(key):
    server = TreeServer(2, key, **FAST).start()
    session = ServerSession.connect(
        server.address, key, shard=1, attempt_id="x", connect_timeout_s=5
    )
    server.fail("the Spark stage was cancelled")
    with pytest.raises(RoundAborted, match="cancelled"):
        session.register("127.0.0.1", 9, timeout_s=5)
    session.close()
    with pytest.raises(RoundAborted):
        server.wait_tree(timeout=1)
    server.close()

    server = TreeServer(2, key, **FAST).start()
    session = ServerSession.connect(
        server.address, key, shard=0, attempt_id="y", connect_timeout_s=5
    )
    server.close()
    with pytest.raises((RoundAborted, PeerLost)):
        session.register("127.0.0.1", 9, timeout_s=5)
    session.close()


def test_survivor_lost_before_the_tree_forms_frees_its_shard(key):
    with TreeServer(2, key, **FAST) as server:
        s = ServerSession.connect(
            server.address, key, shard=0, attempt_id="dies", connect_timeout_s=5
        )
        outcome = []

        def register():
            try:
                s.register("127.0.0.1", 9, timeout_s=5)
            except AllreduceError as exc:
                outcome.append(exc)

        t = threading.Thread(target=register)
        t.start()
        _wait_until(lambda: server.survivors() == {0: "dies"})
        s._chan.shutdown()  # the task dies
        t.join(5)
        _wait_until(lambda: server.unfinished_shards() == [0, 1])
        assert isinstance(outcome[0], PeerLost)
        s.close()


def test_progress_reports_and_slowest_shard(key):
    with TreeServer(3, key, **FAST) as server:
        sessions = [
            ServerSession.connect(server.address, key, shard=s, attempt_id=a, connect_timeout_s=5)
            for s, a in ((0, "a"), (0, "b"), (1, "a"), (2, "a"))
        ]
        for sess, rows in zip(sessions, (50, 80, 10, 300), strict=True):
            sess.report_progress(rows)
        sessions[2].report_progress(20)  # the latest report wins
        _wait_until(
            lambda: (
                [(p.shard, p.attempt_id, p.rows_done) for p in server.progress()]
                == [(0, "a", 50), (0, "b", 80), (1, "a", 20), (2, "a", 300)]
            )
        )
        assert server.slowest_shard() == 1 and server.unfinished_shards() == [0, 1, 2]
        assert all(p.age_s >= 0 and not p.survivor for p in server.progress())
        for s in sessions:
            s.close()


def _junk(address, kind: str, closed_by_server: list) -> None:
    try:
        with socket.create_connection(address, timeout=5) as sock:
            if kind == "random":
                sock.sendall(os.urandom(200))
            elif kind == "http":
                sock.sendall(b"GET / HTTP/1.1\r\nHost: driver\r\nUser-Agent: probe\r\n\r\n")
            elif kind == "wrong-key":
                hello = proto.encode_json(
                    {
                        "proto": "terascale-allreduce/1",
                        "role": "worker",
                        "shard": 0,
                        "attempt_id": "evil",
                        "nonce": "00" * 16,
                    }
                )
                sock.sendall(proto.encode_frame(os.urandom(32), MsgType.HELLO, 0, hello))
            elif kind == "huge":
                sock.sendall(proto.pack_header(MsgType.HELLO, 0, 2**32 - 1))
            # "silent" sends nothing. In every case the server must close without answering.
            sock.settimeout(5)
            data = sock.recv(1)
            closed_by_server.append(data == b"")
    except OSError:
        closed_by_server.append(True)  # reset by the server: closed as well


@pytest.mark.parametrize("cipher", ["aes-gcm", "aes-gmac"])
def test_junk_connections_do_not_disturb_a_real_job(key, caplog, cipher):
    caplog.set_level(logging.DEBUG, logger="terascale.allreduce")
    n = 3 * (CHUNK_BYTES // 4) + 7
    kinds = ["silent", "random", "http", "wrong-key"] * 24 + ["huge"] * 4
    closed: list[bool] = []
    junk_threads: list[threading.Thread] = []

    def during(server):  # runs while the workers join and reduce; the server stays up meanwhile
        for kind in kinds:
            t = threading.Thread(target=_junk, args=(server.address, kind, closed), daemon=True)
            t.start()
            junk_threads.append(t)
        for t in junk_threads:
            t.join(5)
        assert server.rejected_connections == 100  # no junk connection took a slot

    def body(node):
        return node.allreduce(np.random.default_rng(node.rank).standard_normal(n))

    run = run_tree(
        4, body, key=key, server_kwargs={"handshake_timeout_s": 0.5}, during=during, cipher=cipher
    )
    expected = tree_order_sum([np.random.default_rng(r).standard_normal(n) for r in range(4)])
    for r in range(4):
        assert run.results[r].tobytes() == expected.tobytes()
    assert len(closed) == len(kinds) == 100 and all(closed)
    assert run.server.survivors() == {s: f"attempt-{s}" for s in range(4)}
    text = caplog.text
    assert key.hex() not in text and repr(key) not in text and key.hex().upper() not in text
    assert "tree formed over 4 rank(s)" in text and "registered as the survivor" in text


def test_key_is_never_logged(key, caplog):
    caplog.set_level(logging.DEBUG)
    with TreeServer(2, key, **FAST) as server:
        with pytest.raises(StandDown):
            t = threading.Thread(
                target=lambda: TreeNode.join(
                    server.address, key, shard=0, attempt_id="a", **NODE_DEFAULTS
                ).close()
            )
            t.start()
            _wait_until(lambda: server.survivors() == {0: "a"})
            TreeNode.join(server.address, key, shard=0, attempt_id="b", **NODE_DEFAULTS)
        TreeNode.join(server.address, key, shard=1, attempt_id="a", **NODE_DEFAULTS).close()
        t.join(5)
    for record in caplog.records:
        msg = record.getMessage()
        assert key.hex() not in msg and repr(key) not in msg and str(list(key)) not in msg
