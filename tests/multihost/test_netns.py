"""The network-namespace harness (tests/multihost/netns.py): hosts reach each other over the
bridge and only through it, bytes show in the interface counters, links are shaped in both
directions, and nothing is left behind (after a failure or a crashed earlier run) or changed in
the machine's own namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.multihost import netns

pytestmark = [pytest.mark.multihost]

REASON = netns.unavailable()
if REASON:
    pytestmark.append(pytest.mark.skip(reason=f"multihost: {REASON}"))

# a TCP sink on the receiving host, and a client that sends N bytes to it
SINK = ("import socket,sys; s=socket.create_server((sys.argv[1], 5001)); print('up', flush=True);"
        "c,_=s.accept(); n=0\nwhile (b:=c.recv(1<<16)): n+=len(b)\nprint(n, flush=True)")
SEND = ("import socket,sys; c=socket.create_connection((sys.argv[1], 5001), timeout=30);"
        "c.sendall(b'x'*int(sys.argv[2])); c.close()")


def _root_links() -> list[str]:
    return sorted(i["ifname"] for i in json.loads(subprocess.run(
        ["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout))


def _ours(prefix: str) -> list[str]:
    return [n for n in netns._netns_names() if n.startswith(prefix)]


def test_hosts_talk_over_the_bridge_and_counters_see_the_bytes():
    root_before = _root_links()
    with netns.Network(["a", "b", "c"], rate="1gbit") as net:
        assert [net.addr(h) for h in ("a", "b", "c")] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert len(_ours(net.prefix)) == 4  # the bridge's and three hosts'
        # each host sees only lo and its eth0, with its own address
        links = json.loads(net.run("b", ["ip", "-j", "addr", "show"]).stdout)
        assert sorted(i["ifname"] for i in links) == ["eth0", "lo"]
        assert [a["local"] for i in links if i["ifname"] == "eth0" for a in i["addr_info"]
                if a["family"] == "inet"] == ["198.18.0.2"]
        # shaped both ways: tbf on the host's eth0 and on its bridge port
        for ns, dev in ((net.ns("b"), "eth0"), (net.bridge_ns, net.port("b"))):
            q = json.loads(subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev],
                                          capture_output=True, text=True, check=True).stdout)
            assert q[0]["kind"] == "tbf" and q[0]["options"]["rate"] == 125_000_000, q
        sink = net.popen("b", [sys.executable, "-c", SINK, net.addr("b")], stdout=subprocess.PIPE,
                         text=True)
        assert sink.stdout.readline().strip() == "up"
        before = {h: net.counters(h) for h in ("a", "b", "c")}
        port_before = net.port_counters("a")
        n = 3_000_000
        net.run("a", [sys.executable, "-c", SEND, net.addr("b"), str(n)])
        assert int(sink.stdout.readline()) == n
        sink.wait(timeout=10)
        after = {h: net.counters(h) for h in ("a", "b", "c")}
        sent = after["a"]["tx_bytes"] - before["a"]["tx_bytes"]
        got = after["b"]["rx_bytes"] - before["b"]["rx_bytes"]
        assert n < sent < n * 1.1 and n < got < n * 1.1, (sent, got)  # payload + TCP/IP headers
        assert net.port_counters("a")["rx_bytes"] - port_before["rx_bytes"] == sent
        # c is on the bridge but saw no unicast of it (a learning bridge: ARP broadcasts only)
        assert after["c"]["rx_bytes"] - before["c"]["rx_bytes"] < 10_000
        # the machine's own addresses are not reachable from a host: no route out of 198.18/24
        r = net.run("a", ["ip", "route", "get", "8.8.8.8"], check=False)
        assert r.returncode != 0 and "unreachable" in r.stderr.lower()
        prefix = net.prefix
    assert _ours(prefix) == []
    assert _root_links() == root_before


def test_teardown_after_a_failure_kills_processes_and_removes_namespaces():
    with pytest.raises(RuntimeError, match="boom"), netns.Network(["x", "y"]) as net:
        p = net.popen("x", ["sleep", "300"])
        assert net.pids("x") == [p.pid]  # ip netns exec execs: the pid is the command's
        prefix = net.prefix
        raise RuntimeError("boom")
    assert p.poll() is not None
    assert _ours(prefix) == []


def test_a_crashed_runs_namespaces_are_cleaned_by_the_next_run(tmp_path):
    # a child process builds a network and is SIGKILLed before it can tear it down
    script = ("import os, sys, signal; sys.path.insert(0, sys.argv[1]);"
              "from tests.multihost import netns;"
              "net = netns.Network(['h'], family='tscrash').__enter__();"
              "net.popen('h', ['sleep', '300'], stdout=-3, stderr=-3); print(net.prefix, flush=True);"
              "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", script, os.getcwd()], capture_output=True, text=True,
                         timeout=60)
    prefix = out.stdout.strip()
    assert prefix.startswith("tscrash-"), out.stderr
    left = _ours(prefix)
    assert len(left) == 2
    orphan = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"{prefix}-h"], capture_output=True,
                                             text=True).stdout.split()]
    assert len(orphan) == 1  # its sleep outlived it
    with netns.Network(["h"], family="tscrash") as net:  # cleans the dead run's namespaces
        assert _ours(prefix) == []
        assert _ours(net.prefix)  # and not its own
    assert not netns._alive(orphan[0]) or open(f"/proc/{orphan[0]}/stat").read().split()[2] == "Z"


def test_bad_arguments_are_refused_before_anything_is_created():
    with pytest.raises(ValueError, match="rate = '1 gigabit'"):
        netns.Network(["a"], rate="1 gigabit")
    with pytest.raises(ValueError, match="unique"):
        netns.Network(["a", "a"])
    with pytest.raises(KeyError, match="no host 'z'"):
        netns.Network(["a"]).addr("z")
