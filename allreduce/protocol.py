"""The wire format of terascale's AllReduce: authenticated, sequenced, length-prefixed frames.

A frame is::

    header (18 bytes, network byte order, struct "!4sBBQI")
        magic        4 bytes   b"TSAR"
        version      u8        2
        type         u8        a :class:`MsgType`
        seq          u64       per direction of a connection: 0 for HELLO, then 1, 2, ...
        length       u32       payload bytes
    payload          ``length`` bytes (ciphertext with ``aes-gcm``)
    tag              32 bytes HMAC-SHA256 (HELLO frames, ``hmac-sha256``) or 16 bytes AES-GCM

The two HELLO frames of a handshake are HMAC-SHA256 tagged with the 32-byte secret of the
attempt (:func:`new_key`) and carry the cipher the side uses (``allreduce.cipher``, see
:mod:`allreduce.ciphers`); every later frame is protected by that cipher under a
per-connection, per-direction session key derived from the secret, both sides' nonces and both
HELLOs (:func:`derive_session_keys`), so a frame recorded on one connection, or sent in one
direction, is not valid on another. Version 1 peers (HMAC-only frames) are refused.

A HEARTBEAT (tree neighbours, see :mod:`allreduce.node`) has no payload: a header and a tag,
authenticated and sequenced like every frame, so it cannot be forged or replayed.

Payloads are raw bytes: numeric data as explicit little-endian IEEE-754 (``<f4`` / ``<f8``),
control messages as small UTF-8 JSON objects. Nothing is ever unpickled. The declared length is
checked against the frame limit (and the much smaller control limit for control types) before
anything is allocated, and a payload is neither returned nor parsed before its tag is verified.

This module is pure (bytes in, bytes out) apart from :func:`recv_exact`, :func:`send_buffers`
and :func:`read_frame`, which move exact byte counts over a socket with timeouts and map socket
failures to :class:`~allreduce.errors.PeerLost` / :class:`~allreduce.errors.PeerTimeout`.
"""

from __future__ import annotations

import enum
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import ciphers
from .errors import PeerLost, PeerTimeout, ProtocolError

MAGIC = b"TSAR"
VERSION = 2
HEADER = struct.Struct("!4sBBQI")
HEADER_BYTES = HEADER.size  # 18
TAG_BYTES = 32
KEY_BYTES = 32
NONCE_BYTES = 16
MAX_SEQ = (1 << 64) - 1
MAX_LENGTH = (1 << 32) - 1
CONTROL_MAX_BYTES = 64 * 1024
HELLO_MAX_BYTES = 4096  # a HELLO is a few hundred bytes; an unauthenticated peer gets no more
DEFAULT_MAX_FRAME_BYTES = 1 << 28


class MsgType(enum.IntEnum):
    """Message types. Control messages carry JSON; data messages carry little-endian floats."""

    HELLO = 1  # handshake, both directions, keyed by the attempt key
    REGISTER = 2  # worker -> server: {shard, attempt_id, host, port}
    PROGRESS = 3  # worker -> server: {shard, attempt_id, rows_done}
    TOPOLOGY = 4  # server -> worker: the worker's placement in the tree
    STAND_DOWN = 5  # server -> worker: another attempt of the shard won
    ABORT = 6  # any direction: {origin, reason[, missing_shards]}
    SPARE_POLL = 7  # spare -> server: {spare}: which shard should I race?
    ASSIGN = 8  # server -> spare: {shard: int | null, done: bool}
    HEARTBEAT = 9  # tree neighbours, both directions, empty payload: "alive", see allreduce.node
    UP_F32 = 16  # child -> parent, reduce phase
    UP_F64 = 17
    DOWN_F32 = 18  # parent -> child, broadcast phase
    DOWN_F64 = 19


CONTROL_TYPES = frozenset(
    {
        MsgType.HELLO,
        MsgType.REGISTER,
        MsgType.PROGRESS,
        MsgType.TOPOLOGY,
        MsgType.STAND_DOWN,
        MsgType.ABORT,
        MsgType.SPARE_POLL,
        MsgType.ASSIGN,
        MsgType.HEARTBEAT,
    }
)
_TYPES_BY_VALUE = {int(t): t for t in MsgType}


@dataclass(frozen=True)
class Header:
    """A parsed, validated (but not yet authenticated) frame header."""

    msg_type: MsgType
    seq: int
    length: int


@dataclass(frozen=True)
class Frame:
    """An authenticated frame."""

    msg_type: MsgType
    seq: int
    payload: bytes


# ---------------------------------------------------------------------------------------------
# Keys and tags


def new_key() -> bytes:
    """A fresh 32-byte secret for one attempt of a job (from :mod:`secrets`)."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(key: object) -> bytes:
    """Return ``key`` as bytes if it is a 32-byte secret; the error never shows the key."""
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"the AllReduce key must be bytes, not {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"the AllReduce key must be {KEY_BYTES} bytes, got {len(key)} bytes")
    return bytes(key)


def derive_session_keys(
    key: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
    cipher: str = ciphers.DEFAULT_CIPHER,
    transcript: bytes = b"",
) -> tuple[bytes, bytes]:
    """Per-connection keys ``(client_to_server, server_to_client)`` (HKDF-SHA256) bound to both
    nonces, the cipher and the handshake ``transcript`` (:func:`allreduce.ciphers.session_keys`)."""
    return ciphers.session_keys(key, client_nonce, server_nonce, cipher, transcript)


# ---------------------------------------------------------------------------------------------
# Pure codec


def pack_header(msg_type: int, seq: int, length: int) -> bytes:
    """Encode a header; raises ProtocolError for values that do not fit the format."""
    if int(msg_type) not in _TYPES_BY_VALUE:
        raise ProtocolError(f"unknown message type {msg_type}")
    if not 0 <= seq <= MAX_SEQ:
        raise ProtocolError(f"sequence number {seq} out of range 0..2^64-1")
    if not 0 <= length <= MAX_LENGTH:
        raise ProtocolError(f"payload length {length} out of range 0..2^32-1")
    return HEADER.pack(MAGIC, VERSION, int(msg_type), seq, length)


def parse_header(buf: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Header:
    """Validate magic, version, type and length of an 18-byte header (before any allocation).

    Control messages are limited to :data:`CONTROL_MAX_BYTES`, every frame to
    ``max_frame_bytes``. The header is not authenticated yet: only the length is used, to bound
    the read of the rest of the frame.
    """
    if len(buf) != HEADER_BYTES:
        raise ProtocolError(f"a frame header is {HEADER_BYTES} bytes, got {len(buf)}")
    magic, version, mtype, seq, length = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a terascale AllReduce peer)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    msg_type = _TYPES_BY_VALUE.get(mtype)
    if msg_type is None:
        raise ProtocolError(f"unknown message type {mtype}")
    limit = CONTROL_MAX_BYTES if msg_type in CONTROL_TYPES else max_frame_bytes
    if length > limit:
        raise ProtocolError(
            f"{msg_type.name} frame declares {length} payload bytes, more than the limit {limit}"
        )
    return Header(msg_type, seq, length)


def encode_frame(
    key: bytes,
    msg_type: int,
    seq: int,
    payload: Any = b"",
    *,
    cipher: str = "hmac-sha256",
    direction: str = "c2s",
) -> bytes:
    """One complete frame as bytes (for HELLOs and tests; a channel seals in place).

    HELLO frames are always ``hmac-sha256`` under the attempt key.
    """
    payload = memoryview(payload).cast("B")
    header = pack_header(msg_type, seq, len(payload))
    fc = ciphers.frame_cipher(cipher, key, direction)
    if fc.encrypts:
        return header + bytes(fc.seal(header, payload))
    return b"".join((header, payload, fc.seal(header, payload)))


def check_seq(seq: int, expected: int, what: str) -> None:
    """Reject a replayed, reordered or skipped frame (called after the tag is verified)."""
    if seq != expected:
        kind = "replayed" if seq < expected else "out-of-order"
        raise ProtocolError(f"{kind} frame from {what}: sequence number {seq}, expected {expected}")


def decode_frame(
    key: bytes,
    data: Any,
    *,
    expected_seq: int,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    cipher: str = "hmac-sha256",
    direction: str = "c2s",
) -> Frame:
    """Decode and authenticate exactly one frame; only ProtocolError (or AuthError) escapes.

    The payload is returned only after its tag has been verified, and the sequence number is
    checked against ``expected_seq``.
    """
    fc = ciphers.frame_cipher(cipher, key, direction)
    data = memoryview(data).cast("B")
    if len(data) < HEADER_BYTES + fc.tag_bytes:
        raise ProtocolError(f"truncated frame: {len(data)} bytes")
    header_bytes = bytes(data[:HEADER_BYTES])
    header = parse_header(header_bytes, max_frame_bytes=max_frame_bytes)
    total = HEADER_BYTES + header.length + fc.tag_bytes
    if len(data) != total:
        kind = "truncated" if len(data) < total else "oversized"
        raise ProtocolError(f"{kind} frame: {len(data)} bytes, header says {total}")
    payload = bytearray(header.length)
    open_payload(fc, header_bytes, data[HEADER_BYTES:], payload, "frame")
    check_seq(header.seq, expected_seq, "peer")
    return Frame(header.msg_type, header.seq, bytes(payload))


def open_payload(
    fc: ciphers.FrameCipher, header_bytes: bytes, rest: Any, out: Any, what: str
) -> None:
    """Authenticate ``rest`` (the received ``payload || tag``) and leave the payload in ``out``."""
    n = len(out)
    if fc.encrypts:
        fc.open_into(header_bytes, rest, out, what)
    else:
        memoryview(out).cast("B")[:] = rest[:n]
        fc.open_into(header_bytes, rest[n:], out, what)


def encode_json(obj: dict[str, Any]) -> bytes:
    """A control payload: compact UTF-8 JSON, at most CONTROL_MAX_BYTES."""
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) > CONTROL_MAX_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {CONTROL_MAX_BYTES}")
    return data


def decode_json(payload: bytes, what: str) -> dict[str, Any]:
    """Parse an (already authenticated) control payload; it must be a JSON object."""
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{what}: payload is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: payload must be a JSON object, got {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------------------------------------
# Socket helpers


def recv_exact(
    sock: socket.socket,
    view: memoryview,
    *,
    rank: int | None,
    peer: str | None = None,
    deadline: float | None = None,
    stall: Callable[[int], None] | None = None,
) -> None:
    """Fill ``view`` (a writable byte view) from ``sock``, exactly.

    Without ``deadline`` every receive is bounded by the socket's own timeout; with a deadline
    (``time.monotonic()`` value) the whole read must finish by then, which stops a peer that
    trickles one byte at a time. EOF -> PeerLost; timeout -> PeerTimeout; both name ``rank``.
    With ``stall``, a receive that times out calls ``stall(bytes_received_so_far)`` instead,
    which raises to give up or returns to keep waiting (the liveness check of a tree link).
    """
    n = len(view)
    got = 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeout(rank, f"received {got} of {n} bytes", peer=peer)
            sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if stall is None or deadline is not None:
                raise PeerTimeout(rank, f"received {got} of {n} bytes", peer=peer) from None
            stall(got)
            continue
        except OSError as exc:
            raise PeerLost(
                rank, f"receive failed after {got} of {n} bytes ({exc})", peer=peer
            ) from None
        if k == 0:
            raise PeerLost(rank, f"connection closed after {got} of {n} bytes", peer=peer)
        got += k


def send_buffers(
    sock: socket.socket,
    buffers: Sequence[Any],
    *,
    rank: int | None,
    peer: str | None = None,
    stall: Callable[[int], None] | None = None,
) -> None:
    """Send ``buffers`` back to back with scatter/gather I/O (no concatenation).

    Bounded by the socket's timeout; errors map to PeerTimeout / PeerLost naming ``rank``.
    With ``stall``, a send that times out calls ``stall(bytes_sent_so_far)`` instead, which
    raises to give up or returns to keep trying.
    """
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    sent = 0
    try:
        while views:
            try:
                k = sock.sendmsg(views)
            except TimeoutError:
                if stall is None:
                    raise
                stall(sent)
                continue
            sent += k
            while views and k >= len(views[0]):
                k -= len(views[0])
                views.pop(0)
            if views and k:
                views[0] = views[0][k:]
    except TimeoutError:
        raise PeerTimeout(rank, f"sent {sent} of {total} bytes", peer=peer) from None
    except OSError as exc:
        raise PeerLost(
            rank, f"send failed after {sent} of {total} bytes ({exc})", peer=peer
        ) from None


def read_frame(
    sock: socket.socket,
    fc: ciphers.FrameCipher,
    *,
    expected_seq: int,
    rank: int | None,
    peer: str | None = None,
    deadline: float | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    allowed: Callable[[Header], None] | None = None,
) -> Frame:
    """Receive one frame of at most CONTROL_MAX_BYTES payload and authenticate it.

    ``allowed`` may reject a header (by raising) before its payload is read.
    """
    who = peer or ("an unidentified peer" if rank is None else f"rank {rank}")
    header_buf = bytearray(HEADER_BYTES)
    recv_exact(sock, memoryview(header_buf), rank=rank, peer=peer, deadline=deadline)
    header = parse_header(header_buf, max_frame_bytes=max_frame_bytes)
    if header.length > CONTROL_MAX_BYTES:
        raise ProtocolError(
            f"{who} sent a {header.msg_type.name} frame of {header.length} bytes where a control message was expected"
        )
    if allowed is not None:
        allowed(header)
    rest = bytearray(header.length + fc.tag_bytes)
    rest_view = memoryview(rest)
    recv_exact(sock, rest_view, rank=rank, peer=peer, deadline=deadline)
    payload = bytearray(header.length)
    open_payload(fc, bytes(header_buf), rest_view, payload, f"a frame from {who}")
    check_seq(header.seq, expected_seq, who)
    return Frame(header.msg_type, header.seq, bytes(payload))
