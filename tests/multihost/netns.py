"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge,
with links optionally shaped by ``tc`` (token bucket, both directions).

Layout of one :class:`Network` (every name starts with the run's unique prefix
``<family>-<pid>-<random>``, so parallel runs never collide)::

    namespace <prefix>-br                       namespace <prefix>-<host>   (one per host)
    ┌──────────────────────────────┐            ┌──────────────────────────┐
    │ bridge br0 (no address)      │            │ lo (up)                  │
    │   port p0 ── veth ───────────┼────────────┼── eth0  198.18.0.1/24    │  host 0
    │   port p1 ── veth ───────────┼── ...      │   tbf egress (optional)  │
    │   tbf egress on each port    │            └──────────────────────────┘
    └──────────────────────────────┘

Host ``i`` (in the order given) has the address ``198.18.0.(i+1)``: 198.18.0.0/15 is the
range set aside for network benchmarks (RFC 2544), so no real machine is ever a target. Nothing
is created in, or changed about, the machine's own namespace: no interface, address or route.
A shaped link has a ``tbf`` qdisc on the host's ``eth0`` (host → bridge) and on its bridge port
(bridge → host), so the rate holds in both directions. This kernel has no ``netem``: links
are shaped in rate only, not delay.

Use::

    reason = unavailable()          # None, or why this machine cannot (not root, no ip ...)
    with Network(["driver", "h0", "h1"], rate="1gbit") as net:
        net.run("h0", ["ping", "-c1", net.addr("driver")])
        p = net.popen("h1", [sys.executable, "-m", "http.server", "--bind", net.addr("h1")])
        before = net.counters("h1"); ...; after = net.counters("h1")

Teardown (``__exit__``, also after a failure inside the block, and ``close()``) kills the
processes started with :meth:`Network.popen` (their process groups), then any process still
inside one of the run's namespaces, and deletes the namespaces (which deletes their veths and
the bridge). Namespaces left by an earlier run of the same family whose owning process is
gone (a crash, ``kill -9``) are removed the same way when a new run starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

FAMILY = "tsnet"
SUBNET = "198.18.0.0/15"
PREFIXLEN = 24  # hosts are 198.18.0.1 ... 198.18.0.254: one on-link /24 inside the range
MAX_HOSTS = 254
_BRIDGE = "br0"
_IFACE = "eth0"


def _ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True,
                   check=True, timeout=30)


def unavailable() -> str | None:
    """None when this machine can build a :class:`Network` (root, ``ip`` and ``tc``, network
    namespaces, veth pairs and a bridge, checked by building a tiny one); otherwise the reason."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid is {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{FAMILY}probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', '') or e}".strip()
    try:
        _ip("-n", probe, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        _ip("-n", probe, "link", "set", "b0", "master", _BRIDGE)
        _tc(probe, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1gbit", "burst", "256kb",
            "latency", "50ms")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"veth, bridge or tc tbf unsupported here: {(getattr(e, 'stderr', '') or str(e)).strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process whose network namespace is ``ns`` (processes this family started)."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "del", ns, check=False)


def clean_stale(family: str = FAMILY) -> list[str]:
    """Delete the namespaces ``<family>-<pid>-...`` whose creating process ``pid`` is gone;
    returns their names. Live runs (their owner still running) are left alone."""
    pattern = re.compile(rf"^{re.escape(family)}-(\d+)-[0-9a-f]+-")
    stale = [n for n in _netns_names() if (m := pattern.match(n)) and not _alive(int(m.group(1)))]
    for ns in stale:
        _delete(ns)
    return stale


def _rate_bytes(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate = {rate!r}: must be like 1gbit, 100mbit, 500kbit or 10mbps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


class Network:
    """A bridge and ``hosts`` network namespaces, each with one veth into the bridge.

    ``hosts``: names (letters, digits, ``_``; unique), host ``i`` gets ``198.18.0.(i+1)``.
    ``rate``: a tc rate (``"1gbit"``) for every host's link, both directions; None leaves the
    links unshaped (veth speed). ``family``: the namespace-name family (stale runs of the same
    family are cleaned on entry).
    """

    def __init__(self, hosts: Sequence[str], rate: str | None = None, family: str = FAMILY) -> None:
        names = list(hosts)
        if not names or len(names) > MAX_HOSTS:
            raise ValueError(f"hosts: must be 1..{MAX_HOSTS} names, got {len(names)}")
        if len(set(names)) != len(names) or not all(re.fullmatch(r"\w{1,20}", n) for n in names):
            raise ValueError(f"hosts = {names}: must be unique names of letters, digits and _")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", family):
            raise ValueError(f"family = {family!r}: must be 1-12 lowercase letters and digits")
        self.family = family
        self.prefix = f"{family}-{os.getpid()}-{secrets.token_hex(3)}"
        self.names = names
        self.rate = rate
        self.procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        if rate is not None:
            _rate_bytes(rate)  # validate before anything is created

    # -- names -----------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        """The namespace of ``host`` (``ip netns exec <ns> ...``)."""
        if host not in self.names:
            raise KeyError(f"no host {host!r} in this network (hosts: {self.names})")
        return f"{self.prefix}-{host}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def addr(self, host: str) -> str:
        """The IPv4 address of ``host``: 198.18.0.(i+1) for the i-th host."""
        self.ns(host)
        return f"198.18.0.{self.names.index(host) + 1}"

    def port(self, host: str) -> str:
        """The name of ``host``'s veth port on the bridge (inside :attr:`bridge_ns`)."""
        self.ns(host)
        return f"p{self.names.index(host)}"

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> Network:
        clean_stale(self.family)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", _BRIDGE, "type", "bridge", "forward_delay", "0")
        _ip("-n", br, "link", "set", _BRIDGE, "up")
        for host in self.names:
            ns, port = self.ns(host), self.port(host)
            self._add_ns(ns)
            # both ends are created directly inside their namespaces: no name in the root one
            _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", _IFACE, "netns", ns)
            _ip("-n", br, "link", "set", port, "master", _BRIDGE)
            _ip("-n", br, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/{PREFIXLEN}", "dev", _IFACE)
            _ip("-n", ns, "link", "set", _IFACE, "up")
            if self.rate is not None:
                self.shape(host, self.rate)
        self._wait_links()

    def _wait_links(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for host in self.names:
            while True:
                info = json.loads(_ip("-n", self.ns(host), "-j", "link", "show", _IFACE).stdout)[0]
                if "LOWER_UP" in info.get("flags", []):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{host}'s link did not come up within {timeout_s} s")
                time.sleep(0.05)

    def close(self) -> None:
        """Stop the processes started here, then delete the namespaces (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []
        for ns in reversed(self._created):
            _delete(ns)
        self._created = []

    # -- links -----------------------------------------------------------------------------
    def shape(self, host: str, rate: str | None) -> None:
        """Shape ``host``'s link to ``rate`` in both directions (tbf on its ``eth0`` and on its
        bridge port); ``None`` removes the shaping. Takes effect at once, also mid-run."""
        for ns, dev in ((self.ns(host), _IFACE), (self.bridge_ns, self.port(host))):
            if rate is None:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _tc(ns, "qdisc", "del", "dev", dev, "root")
                continue
            # burst: at least a 64 KiB GSO frame, and 2 ms at the rate; queue up to 50 ms
            burst = max(128 * 1024, int(_rate_bytes(rate) * 0.002))
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "50ms")

    def counters(self, host: str) -> dict[str, int]:
        """``host``'s ``eth0`` byte and packet counters (``rx_bytes``, ``tx_bytes``,
        ``rx_packets``, ``tx_packets``): everything it sent to or received from the bridge."""
        return self._stats(self.ns(host), _IFACE)

    def port_counters(self, host: str) -> dict[str, int]:
        """The counters of ``host``'s port on the bridge (its ``rx`` is what ``host`` sent)."""
        return self._stats(self.bridge_ns, self.port(host))

    @staticmethod
    def _stats(ns: str, dev: str) -> dict[str, int]:
        s = json.loads(_ip("-n", ns, "-j", "-s", "link", "show", dev).stdout)[0]["stats64"]
        return {"rx_bytes": s["rx"]["bytes"], "tx_bytes": s["tx"]["bytes"],
                "rx_packets": s["rx"]["packets"], "tx_packets": s["tx"]["packets"]}

    # -- processes -------------------------------------------------------------------------
    def argv(self, host: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *map(str, cmd)]

    def run(self, host: str, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``cmd`` inside ``host`` (default: check, capture text, 120 s)."""
        kw = {"check": True, "capture_output": True, "text": True, "timeout": 120} | kw
        return subprocess.run(self.argv(host, cmd), **kw)

    def popen(self, host: str, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` inside ``host`` in a process group of its own; :meth:`close` stops it."""
        p = subprocess.Popen(self.argv(host, cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def pids(self, host: str) -> list[int]:
        """Every process whose network namespace is ``host``'s (ours and their children)."""
        out = _ip("netns", "pids", self.ns(host), check=False).stdout
        return sorted(int(p) for p in out.split() if p.isdigit())

    def kill_host(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in ``host``, as if the machine died; returns the pids."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids
