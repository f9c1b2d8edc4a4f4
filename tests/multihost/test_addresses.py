"""allreduce.host / advertise_host / port_range across hosts (network namespaces, each a
process of tests/multihost/tree_app.py): the tree server binds every interface of the driver
host and advertises its address, ranks bind every interface or their own address and register
the address their peers must dial, every listener takes its port from the range, and the
AllReduce's bytes cross the bridge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from terascale.allreduce.protocol import new_key
from tests.multihost import netns

pytestmark = [pytest.mark.multihost]
REASON = netns.unavailable()
if REASON:
    pytestmark.append(pytest.mark.skip(reason=f"multihost: {REASON}"))

ROOT = Path(__file__).resolve().parents[2]
PORTS = "41000-41002"


def _app(net, host, *args) -> subprocess.Popen:
    return net.popen(host, [sys.executable, "-m", "tests.multihost.tree_app", *map(str, args)], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env=os.environ | {"PYTHONPATH": str(ROOT)})


def test_wildcard_binds_advertised_addresses_and_port_range_across_hosts(tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_bytes(new_key())
    keyfile.chmod(0o600)
    with netns.Network(["driver", "h0", "h1", "h2"]) as net:
        # the driver binds every interface (as in a container) and advertises its address
        server = _app(net, "driver", "server", keyfile, 3, "0.0.0.0", net.addr("driver"), PORTS)
        first = json.loads(server.stdout.readline() or "null") or pytest.fail(server.stderr.read())
        assert first["bound"][0] == "0.0.0.0" and first["address"][0] == "198.18.0.1"
        assert 41000 <= first["bound"][1] <= 41002
        before = {h: net.counters(h) for h in ("h0", "h1", "h2")}
        # h0 and h2 bind every interface, advertising their own address; h1 binds its address
        binds = {"h0": ("0.0.0.0", net.addr("h0")), "h1": (net.addr("h1"), ""), "h2": ("0.0.0.0", net.addr("h2"))}
        ranks = [_app(net, h, "rank", keyfile, *first["address"], i, bind, adv, PORTS)
                 for i, (h, (bind, adv)) in enumerate(binds.items())]
        outs = [r.communicate(timeout=120) for r in ranks]
        for r, (_out, err) in zip(ranks, outs, strict=True):
            assert r.returncode == 0, err[-3000:]
        registered = json.loads(server.stdout.readline())["endpoints"]
        server.wait(timeout=30)
        after = {h: net.counters(h) for h in ("h0", "h1", "h2")}
    want = np.arange(1000, dtype=np.float64) * 6
    for out, _ in outs:
        np.testing.assert_array_equal(np.array(json.loads(out)["sum"]), want)
    # each rank registered the address its peers dial, never the wildcard it bound
    assert {s: h for s, (h, _) in registered.items()} == {"0": "198.18.0.2", "1": "198.18.0.3", "2": "198.18.0.4"}
    assert all(41000 <= p <= 41002 for _, p in registered.values()), registered
    # the vector (8 kB per rank, each way) crossed each host's link
    for h in ("h0", "h1", "h2"):
        assert after[h]["tx_bytes"] - before[h]["tx_bytes"] > 8000
        assert after[h]["rx_bytes"] - before[h]["rx_bytes"] > 8000


def test_a_listener_cannot_bind_another_hosts_address_and_the_range_runs_out(tmp_path):
    with netns.Network(["a", "b"]) as net:
        code = ("import sys; from terascale.allreduce import endpoints as e\n"
                "try:\n    e.listen(sys.argv[1], (41000, 41001))\nexcept OSError as x: print(x.strerror)\n")
        wrong = net.run("a", [sys.executable, "-c", code, net.addr("b")]).stdout
        assert "cannot listen on 198.18.0.2:" in wrong and "Cannot assign requested address" in wrong
        code = ("from terascale.allreduce import endpoints as e\n"
                "held = [e.listen('0.0.0.0', (41000, 41001)) for _ in range(2)]\n"
                "print(sorted(s.getsockname()[1] for s in held))\n"
                "try:\n    e.listen('198.18.0.1', (41000, 41001))\nexcept e.PortRangeExhausted as x: print(x.strerror)\n")
        out = net.run("a", [sys.executable, "-c", code]).stdout.splitlines()
    assert out[0] == "[41000, 41001]"
    assert out[1].startswith("no free port on 198.18.0.1 in allreduce.port_range 41000-41001: all 2 are in use")
