"""A Spark standalone cluster spread over network-namespace hosts (tests/multihost/netns.py):
the master in host ``master``, one worker in each worker host, and ``spark-submit`` (client
mode, the ``make dist`` artifacts) from host ``driver``; every process binds and is reached at
its host's 198.18.0.x address (``SPARK_LOCAL_IP``, ``spark.driver.host``), never loopback.

It is tests/cluster/standalone.py's cluster with each process started through
``ip netns exec`` (:meth:`NetnsCluster.command`) and the master's state read from inside the
driver host (the machine's own namespace has no route to 198.18.0.0/15).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cluster.standalone import StandaloneCluster
from tests.multihost.netns import Network

_FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


class NetnsCluster(StandaloneCluster):
    """``NetnsCluster(dir, net, ["h0", "h1", ...])``: worker ``i`` runs in ``net``'s host
    ``hosts[i]``; ``net`` must also have hosts ``master`` and ``driver``."""

    def __init__(self, workdir: Path, net: Network, hosts: list[str], **kw) -> None:
        super().__init__(workdir, workers=len(hosts), hosts=tuple(net.addr(h) for h in hosts), **kw)
        self.net = net
        self.worker_hosts = list(hosts)
        self.master_host = net.addr("master")
        self.driver_host = net.addr("driver")
        self.port, self.ui_port = 7077, 8080  # the master's namespace is its own: no collision

    def command(self, role: str, argv: list[str]) -> list[str]:
        host = role if role in ("master", "driver") else self.worker_hosts[int(role.removeprefix("worker"))]
        return self.net.argv(host, argv)

    def fetch_json(self, url: str) -> dict:
        try:
            out = self.net.run("driver", [sys.executable, "-c", _FETCH, url], timeout=20)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise OSError(f"cannot fetch {url}: {e}") from None
        return json.loads(out.stdout)

    def worker_host_of(self, address: str) -> str:
        """The host name (``h1``) whose address is ``address``."""
        return next(h for h in self.worker_hosts if self.net.addr(h) == address)

    def restart_worker(self, host: str) -> None:
        """Start the worker of ``host`` again (after :meth:`Network.kill_host`: the machine
        came back); it registers with the master under a new id."""
        i = self.worker_hosts.index(host)
        wdir = self.dir / f"worker{i}"
        self._spawn(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.master_url,
                    "--host", self.net.addr(host), "--cores", str(self.cores), "--memory", self.memory,
                    "--webui-port", "8081", "--work-dir", str(wdir),
                    extra_env={"SPARK_LOCAL_IP": self.net.addr(host)})
