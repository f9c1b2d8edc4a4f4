"""Where the AllReduce listens and what address it hands out: bind addresses, advertised
addresses and port ranges (``allreduce.host``, ``allreduce.advertise_host``,
``allreduce.port_range``).

Two addresses per listener, as Spark has ``spark.driver.bindAddress`` and ``spark.driver.host``:

- the **bind** address: an interface of this machine, or a wildcard (``0.0.0.0``, ``::``) for
  every interface, where the socket listens;
- the **advertised** address: what peers dial. It differs from the bind address behind NAT, in a
  container, or with a wildcard bind (a wildcard is never dialled: :func:`dialable` refuses it).

Ranks register their advertised address with the tree server, which hands each rank its
parent's address *as registered*, never as the server saw the connection come from, so a
rank behind a NAT is still reached at the address it names.

A port range (``"40000-40100"``) confines every listener to it, for firewalls that open only
those ports. :func:`bind_in_range` takes the first free port, starting at a random offset so
that listeners starting together (several ranks on one host, a retry) rarely try the same port;
a port taken between the choice and the ``bind`` (another process won the race) just moves it
to the next one. It never shares a port (no ``SO_REUSEPORT``); ``SO_REUSEADDR`` lets it reuse a
port whose earlier connections linger in TIME_WAIT, which on Linux never lets two listening
sockets share an address. When every port of the range is taken, :class:`PortRangeExhausted`
says so, naming the range and the address.

Standard library only.
"""

from __future__ import annotations

import errno
import ipaddress
import random
import re
import socket

WILDCARDS = ("0.0.0.0", "::")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class PortRangeExhausted(OSError):
    """No port of the configured range is free on the bind address."""


def is_wildcard(host: str) -> bool:
    """True for an address that binds every interface (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def valid_host(host: str) -> bool:
    """True for an IPv4 or IPv6 literal or a syntactically valid DNS host name (RFC 1123)."""
    if not isinstance(host, str) or not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    # the last label is never all digits (RFC 3696): 300.1.1 is a mistyped address, not a name
    return (0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())


def dialable(host: str, what: str) -> str:
    """``host`` if peers can dial it; ValueError naming ``what`` for '' or a wildcard."""
    if not host or is_wildcard(host):
        raise ValueError(f"{what} = {host!r}: peers cannot dial a wildcard or empty address; "
                         "name the address they should connect to (allreduce.advertise_host)")
    return host


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"LO-HI"`` (1 <= LO <= HI <= 65535) as ``(LO, HI)``; ``""`` is None (ephemeral ports);
    a single port ``"P"`` is ``(P, P)``. ValueError otherwise."""
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?", text)
    if not m:
        raise ValueError(f"port range {text!r}: must be LO-HI (e.g. 40000-40100) or one port")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"port range {text!r}: must satisfy 1 <= LO <= HI <= 65535")
    return lo, hi


def listen(host: str, port_range: tuple[int, int] | None = None, *, backlog: int = 128,
           buffer_bytes: int | None = None, rng: random.Random | None = None) -> socket.socket:
    """A listening TCP socket on ``host`` and a port of ``port_range`` (None: an ephemeral port
    the kernel picks, never a fixed one). ``buffer_bytes`` sizes the socket buffers before
    ``listen`` (accepted sockets inherit them). Ports in use are skipped (module docstring):
    each try is a fresh socket through ``bind`` and ``listen``, since two sockets can both bind
    a port that neither listens on yet and the loser learns it only at ``listen``. Any other
    error is raised at once, naming the address; :class:`PortRangeExhausted` when none is free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port_range is None:
        ports: list[int] = [0]
    else:
        lo, hi = port_range
        n = hi - lo + 1
        start = (rng or random).randrange(n)
        ports = [lo + (start + i) % n for i in range(n)]
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if buffer_bytes is not None:  # inherited by accepted sockets; set before listen()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.bind((host, port))
            sock.listen(backlog)
            return sock
        except OSError as e:
            sock.close()
            if port and e.errno == errno.EADDRINUSE:
                continue
            raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror or e})") from None
        except BaseException:
            sock.close()
            raise
    lo, hi = port_range  # type: ignore[misc]
    raise PortRangeExhausted(
        errno.EADDRINUSE,
        f"no free port on {host} in allreduce.port_range {lo}-{hi}: all {hi - lo + 1} are in use; widen "
        "the range (a host needs one port per rank it runs at once, the driver one for the tree server)")
