"""Bind addresses, advertised addresses and port ranges (allreduce.endpoints; the keys
allreduce.host, allreduce.advertise_host, allreduce.port_range) on loopback addresses
127.0.0.x. The same in network namespaces: tests/multihost/test_addresses.py."""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from terascale.allreduce import endpoints
from terascale.allreduce.channel import open_listener
from terascale.allreduce.node import TreeNode
from terascale.allreduce.protocol import new_key
from terascale.allreduce.server import TreeServer
from terascale.jobs.config import ConfigError, check_listen_address, load_config
from tests.allreduce.harness import FAST, NODE_DEFAULTS


def _free_range(n: int, host: str = "127.0.0.1") -> tuple[int, int]:
    """``n`` consecutive ports none of which listens now (probed on ``host``)."""
    rng = random.Random(1234)
    for _ in range(200):
        lo = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(lo, lo + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return lo, lo + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range found")


@pytest.mark.parametrize("text,want", [("", None), ("40000-40100", (40000, 40100)), ("5000", (5000, 5000)),
                                       (" 1 - 65535 ", (1, 65535))])
def test_port_range_parses(text, want):
    assert endpoints.parse_port_range(text) == want


@pytest.mark.parametrize("text", ["40100-40000", "0-10", "1-65536", "a-b", "40000-", "-5", "1,2"])
def test_bad_port_ranges_are_refused(text):
    with pytest.raises(ValueError, match="port range"):
        endpoints.parse_port_range(text)


def test_hosts_wildcards_and_dialable():
    for ok in ("127.0.0.1", "::1", "0.0.0.0", "::", "198.18.0.1", "driver-0.terascale.svc.cluster.local",
               "host.", "a"):
        assert endpoints.valid_host(ok), ok
    for bad in ("", "bad_host", "-x", "x-", "a..b", "300.1.1", "a" * 64, "host:1234"):
        assert not endpoints.valid_host(bad), bad
    assert endpoints.is_wildcard("0.0.0.0") and endpoints.is_wildcard("::")
    assert not endpoints.is_wildcard("127.0.0.1") and not endpoints.is_wildcard("localhost")
    assert endpoints.dialable("127.0.0.3", "x") == "127.0.0.3"
    for wild in ("", "0.0.0.0", "::"):
        with pytest.raises(ValueError, match="peers cannot dial"):
            endpoints.dialable(wild, "x")


@pytest.mark.parametrize("key,value,allowed", [
    ("allreduce.port_range", "40100-40000", "LO-HI with 1 <= LO <= HI <= 65535"),
    ("allreduce.port_range", "40000:40100", "LO-HI"),
    ("allreduce.advertise_host", "0.0.0.0", "not a wildcard"),
    ("allreduce.advertise_host", "::", "not a wildcard"),
    ("allreduce.host", "bad_host!", "an IP address or a host name"),
])
def test_config_refuses_bad_values_naming_the_key(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"^{key} = '{value}': must be .*{allowed}"):
        load_config(sets=[f"{key}={value}"])


def test_config_accepts_the_documented_values():
    c = load_config(sets=["allreduce.host=0.0.0.0", "allreduce.advertise_host=driver.example.com",
                          "allreduce.port_range=40000-40100"]).allreduce
    assert (c.host, c.advertise_host, c.port_range) == ("0.0.0.0", "driver.example.com", "40000-40100")
    from terascale.allreduce.spark import NetConf

    net = NetConf.from_conf(c)
    assert (net.host, net.advertise_host, net.port_range) == ("0.0.0.0", "driver.example.com", (40000, 40100))


def test_driver_checks_it_can_listen_before_spark_starts():
    lo, hi = _free_range(2)
    check_listen_address(load_config(sets=["allreduce.host=127.0.0.1", f"allreduce.port_range={lo}-{hi}"]).allreduce)
    # 198.18.0.0/15 is never an address of this machine's own namespace
    with pytest.raises(ConfigError, match=r"^allreduce.host = '198.18.255.254': the driver cannot listen there"):
        check_listen_address(load_config(sets=["allreduce.host=198.18.255.254"]).allreduce)
    held = [open_listener("127.0.0.1", port_range=(lo, hi)) for _ in range(2)]
    try:
        with pytest.raises(ConfigError, match=rf"^allreduce.port_range = '{lo}-{hi}': no free port on 127.0.0.1"):
            check_listen_address(load_config(sets=["allreduce.host=127.0.0.1", f"allreduce.port_range={lo}-{hi}"]).allreduce)
    finally:
        for s in held:
            s.close()


def test_listeners_take_every_port_of_the_range_then_fail_naming_it():
    lo, hi = _free_range(5)
    socks = [open_listener("127.0.0.1", port_range=(lo, hi)) for _ in range(5)]
    try:
        assert sorted(s.getsockname()[1] for s in socks) == list(range(lo, hi + 1))
        with pytest.raises(endpoints.PortRangeExhausted, match=rf"no free port on 127.0.0.1 in allreduce.port_range {lo}-{hi}: all 5 are in use"):
            open_listener("127.0.0.1", port_range=(lo, hi))
        # a port freed is taken again (SO_REUSEADDR, its accepted connections gone)
        port = socks[2].getsockname()[1]
        socks[2].close()
        socks[2] = open_listener("127.0.0.1", port_range=(lo, hi))
        assert socks[2].getsockname()[1] == port
    finally:
        for s in socks:
            s.close()


def test_a_port_taken_by_another_process_is_skipped_not_shared():
    lo, hi = _free_range(2)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", lo))
    other.listen()
    try:
        for seed in range(8):  # whichever port the random start picks, it ends on the free one
            s = endpoints.listen("127.0.0.1", (lo, hi), rng=random.Random(seed))
            assert s.getsockname()[1] == hi
            s.close()
    finally:
        other.close()


def test_bind_errors_other_than_in_use_name_the_address():
    with pytest.raises(OSError, match=r"cannot listen on 198.18.255.254:"):
        endpoints.listen("198.18.255.254", (40000, 40001))


def test_tree_server_advertises_and_binds_separately():
    key = new_key()
    lo, hi = _free_range(3)
    with TreeServer(1, key, host="127.0.0.1", port_range=(lo, hi), **FAST) as s:
        assert s.address == s.bound_address and s.address[0] == "127.0.0.1" and lo <= s.address[1] <= hi
    with TreeServer(1, key, host="0.0.0.0", advertise_host="127.0.0.7", **FAST) as s:
        assert s.bound_address[0] == "0.0.0.0"
        assert s.address == ("127.0.0.7", s.bound_address[1])
    with pytest.raises(ValueError, match="peers cannot dial a wildcard"):
        TreeServer(1, key, host="0.0.0.0")


def test_ranks_bind_wildcard_advertise_their_own_address_and_honour_the_range():
    """Three ranks: one binds every interface and advertises 127.0.0.12, the others bind and
    advertise 127.0.0.11 / 127.0.0.13; everyone's listener (and the server's) in one range."""
    key = new_key()
    lo, hi = _free_range(4, "0.0.0.0")
    binds = [("127.0.0.11", ""), ("0.0.0.0", "127.0.0.12"), ("127.0.0.13", "")]
    results, errors = [None] * 3, [None] * 3
    with TreeServer(3, key, host="127.0.0.10", port_range=(lo, hi), **FAST) as server:
        def rank(shard):
            host, adv = binds[shard]
            try:
                with TreeNode.join(server.address, key, shard=shard, attempt_id=f"a{shard}", host=host,
                                   advertise_host=adv, port_range=(lo, hi), **NODE_DEFAULTS) as node:
                    results[shard] = node.allreduce(np.arange(100, dtype=np.float64) * (shard + 1))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[shard] = e

        threads = [threading.Thread(target=rank, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [None] * 3, errors
        registered = server.endpoints()
        server_port = server.bound_address[1]
    assert {s: h for s, (h, _) in registered.items()} == {0: "127.0.0.11", 1: "127.0.0.12", 2: "127.0.0.13"}
    ports = [p for _, p in registered.values()] + [server_port]
    assert all(lo <= p <= hi for p in ports), ports
    for r in results:
        np.testing.assert_array_equal(r, np.arange(100, dtype=np.float64) * 6)


def test_a_rank_cannot_advertise_a_wildcard():
    with TreeServer(1, new_key(), **FAST) as server, pytest.raises(ValueError, match="peers cannot dial"):
        TreeNode.join(server.address, new_key(), shard=0, attempt_id="a", host="0.0.0.0", **NODE_DEFAULTS)
