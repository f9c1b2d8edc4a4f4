"""The wire codec: round trips, fuzzing, authentication before use, limits, replay."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from terascale.allreduce import ciphers
from terascale.allreduce import protocol as proto
from terascale.allreduce.channel import Channel, client_handshake, server_handshake
from terascale.allreduce.errors import (
    AuthError,
    PeerAborted,
    PeerLost,
    PeerTimeout,
    ProtocolError,
    RoundAborted,
    StandDown,
    StartupTimeout,
)
from terascale.allreduce.protocol import MsgType

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
MAX_SEQ = 2**64 - 1
# The decoder's main fuzz runs 10,000 examples; its variations and the socket fuzz fewer each.
# Deadlines are per example: decoding takes microseconds, a socket read ends within READ_BOUND_S.
FUZZ_MAIN = settings(max_examples=10_000, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=2_000, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SOCKET = settings(max_examples=2_000, deadline=5000, suppress_health_check=[HealthCheck.too_slow])


def _frame(msg_type=MsgType.UP_F32, seq=1, payload=b"\x00" * 16, key=KEY) -> bytes:
    return proto.encode_frame(key, msg_type, seq, payload)


# ---------------------------------------------------------------------------------------------
# Round trips


@given(
    msg_type=st.sampled_from(list(MsgType)),
    seq=st.integers(0, MAX_SEQ),
    payload=st.binary(max_size=2048),
)
@example(msg_type=MsgType.HELLO, seq=0, payload=b"")
@example(msg_type=MsgType.UP_F64, seq=MAX_SEQ, payload=b"")
@example(msg_type=MsgType.DOWN_F32, seq=MAX_SEQ, payload=b"\xff" * 2048)
@example(msg_type=MsgType.ABORT, seq=1, payload=b"\x00")
@example(msg_type=MsgType.TOPOLOGY, seq=1, payload=b"{" * proto.CONTROL_MAX_BYTES)  # max size
@settings(deadline=None)
def test_frame_round_trip(msg_type, seq, payload):
    frame = proto.encode_frame(KEY, msg_type, seq, payload)
    assert len(frame) == proto.HEADER_BYTES + len(payload) + proto.TAG_BYTES
    assert frame[:4] == b"TSAR" and frame[4] == proto.VERSION
    decoded = proto.decode_frame(KEY, frame, expected_seq=seq)
    assert (decoded.msg_type, decoded.seq, decoded.payload) == (msg_type, seq, payload)


def test_header_is_network_byte_order():
    header = proto.pack_header(MsgType.UP_F32, 0x0102030405060708, 0x0A0B0C0D)
    assert header == b"TSAR" + bytes([2, 16]) + bytes(range(1, 9)) + bytes([0x0A, 0x0B, 0x0C, 0x0D])


@pytest.mark.parametrize(
    "msg_type, limit", [(MsgType.UP_F32, 4096), (MsgType.PROGRESS, proto.CONTROL_MAX_BYTES)]
)
def test_max_size_payload_accepted_one_more_rejected(msg_type, limit):
    frame = proto.encode_frame(KEY, msg_type, 7, b"\x01" * limit)
    assert (
        len(proto.decode_frame(KEY, frame, expected_seq=7, max_frame_bytes=4096).payload) == limit
    )
    too_big = proto.encode_frame(KEY, msg_type, 7, b"\x01" * (limit + 1))
    with pytest.raises(ProtocolError, match="limit"):
        proto.decode_frame(KEY, too_big, expected_seq=7, max_frame_bytes=4096)


def test_pack_header_rejects_out_of_range_fields():
    with pytest.raises(ProtocolError):
        proto.pack_header(MsgType.UP_F32, MAX_SEQ + 1, 0)
    with pytest.raises(ProtocolError):
        proto.pack_header(MsgType.UP_F32, 0, 2**32)
    with pytest.raises(ProtocolError):
        proto.pack_header(99, 0, 0)


def test_json_control_payloads_round_trip_and_reject_junk():
    obj = {"shard": 3, "attempt_id": "a-1", "rows_done": 12345}
    assert proto.decode_json(proto.encode_json(obj), "x") == obj
    for bad in (b"\xff\xfe", b"[1, 2]", b"{", b"NaN"):
        with pytest.raises(ProtocolError):
            proto.decode_json(bad, "x")


# ---------------------------------------------------------------------------------------------
# Fuzzing: only ProtocolError (incl. AuthError) ever escapes the decoder


@FUZZ_MAIN
@given(data=st.binary(max_size=512))
@example(data=b"")
@example(data=b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
@example(data=b"TSAR" + b"\x00" * 60)
def test_random_bytes_only_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        proto.decode_frame(KEY, data, expected_seq=1)


@FUZZ
@given(payload=st.binary(max_size=256), cut=st.integers(0, 10_000))
def test_truncated_frames_only_raise_protocol_error(payload, cut):
    frame = _frame(payload=payload)
    cut = cut % len(frame)
    with pytest.raises(ProtocolError):
        proto.decode_frame(KEY, frame[:cut], expected_seq=1)
    with pytest.raises(ProtocolError):
        proto.decode_frame(KEY, frame + b"\x00", expected_seq=1)


@FUZZ
@given(payload=st.binary(max_size=256), bit=st.integers(0, 10**9))
@example(payload=b"", bit=0)
def test_every_bit_flip_is_rejected(payload, bit):
    frame = bytearray(_frame(payload=payload))
    bit %= len(frame) * 8
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ProtocolError):
        proto.decode_frame(KEY, bytes(frame), expected_seq=1)


@FUZZ
@given(payload=st.binary(max_size=256))
def test_wrong_key_is_auth_error(payload):
    with pytest.raises(AuthError):
        proto.decode_frame(OTHER_KEY, _frame(payload=payload), expected_seq=1)


def test_replayed_and_reordered_sequence_numbers_rejected():
    frame = _frame(seq=4)
    assert proto.decode_frame(KEY, frame, expected_seq=4).seq == 4
    with pytest.raises(ProtocolError, match="replayed"):
        proto.decode_frame(KEY, frame, expected_seq=5)
    with pytest.raises(ProtocolError, match="out-of-order"):
        proto.decode_frame(KEY, frame, expected_seq=3)


def test_declared_length_2_32_minus_1_rejected_without_allocating():
    header = proto.pack_header(MsgType.UP_F32, 1, 2**32 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="limit"):
            proto.parse_header(header, max_frame_bytes=2**31)
        with pytest.raises(ProtocolError):
            proto.decode_frame(KEY, header + b"\x00" * 64, expected_seq=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_check_key_never_echoes_the_key():
    with pytest.raises(ValueError) as info:
        proto.check_key(b"secret-but-short")
    assert "secret" not in str(info.value)
    with pytest.raises(TypeError):
        proto.check_key("not bytes")
    assert len(proto.new_key()) == 32 and proto.new_key() != proto.new_key()


def test_session_keys_depend_on_both_nonces_and_direction():
    a = proto.derive_session_keys(KEY, b"c" * 16, b"s" * 16)
    b = proto.derive_session_keys(KEY, b"c" * 16, b"t" * 16)
    assert a[0] != a[1] and a != b and KEY not in a


# ---------------------------------------------------------------------------------------------
# Channels over real sockets


CIPHERS = list(ciphers.CIPHERS)


def _channel_pair(io_timeout_s=2.0, cipher=ciphers.DEFAULT_CIPHER):
    """``ca`` is rank 0's link to rank 1, ``cb`` rank 1's link to rank 0 (errors name the peer).

    ``ca`` sends client-to-server (key ``A``), ``cb`` server-to-client (key ``B``).
    """
    a, b = socket.socketpair()
    ca = Channel(
        a, rank=1, peer=None, send_key=b"A" * 32, recv_key=b"B" * 32, io_timeout_s=io_timeout_s,
        cipher=cipher, send_direction="c2s",
    )
    cb = Channel(
        b, rank=0, peer=None, send_key=b"B" * 32, recv_key=b"A" * 32, io_timeout_s=io_timeout_s,
        cipher=cipher, send_direction="s2c",
    )
    return ca, cb


def _as_ca(msg_type, seq, payload=b"", cipher=ciphers.DEFAULT_CIPHER, key=b"A" * 32):
    """A frame as ``ca`` of :func:`_channel_pair` would send it (or, with another key, forged)."""
    return proto.encode_frame(key, msg_type, seq, payload, cipher=cipher, direction="c2s")


@pytest.mark.parametrize("cipher", CIPHERS)
def test_channel_data_round_trip_into_preallocated_buffer(cipher):
    ca, cb = _channel_pair(cipher=cipher)
    x = np.arange(1000, dtype="<f8")
    out = np.empty_like(x)
    ca.send(MsgType.UP_F64, memoryview(x).cast("B"))
    cb.recv_data_into(MsgType.UP_F64, memoryview(out).cast("B"))
    assert out.tobytes() == x.tobytes()
    ca.send_json(MsgType.PROGRESS, {"rows_done": 5})
    assert cb.recv_control({MsgType.PROGRESS}) == (MsgType.PROGRESS, {"rows_done": 5})
    ca.close()
    cb.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_forged_hmac_rejected_before_payload_is_parsed(monkeypatch, cipher):
    ca, cb = _channel_pair(cipher=cipher)
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(proto.json, "loads", lambda s: parsed.append(s) or real_loads(s))
    payload = proto.encode_json({"shard": 0})
    header = proto.pack_header(MsgType.PROGRESS, 1, len(payload))
    ca.sock.sendall(header + payload + b"\x00" * 32)  # forged tag
    with pytest.raises(AuthError):
        cb.recv_control({MsgType.PROGRESS})
    assert parsed == []
    ca.close()
    cb.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_forged_data_frame_raises_auth_error(cipher):
    ca, cb = _channel_pair(cipher=cipher)
    payload = np.ones(8, dtype="<f4").tobytes()
    ca.sock.sendall(_as_ca(MsgType.UP_F32, 1, payload, cipher, key=b"X" * 32))
    with pytest.raises(AuthError):
        cb.recv_data_into(MsgType.UP_F32, memoryview(bytearray(len(payload))))
    ca.close()
    cb.close()


def test_channel_rejects_huge_declared_length_without_allocating():
    ca, cb = _channel_pair()
    ca.sock.sendall(proto.pack_header(MsgType.UP_F32, 1, 2**32 - 1))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            cb.recv_data_into(MsgType.UP_F32, memoryview(bytearray(64)))
        ca.sock.sendall(proto.pack_header(MsgType.PROGRESS, 1, 2**32 - 1))
        with pytest.raises(ProtocolError):
            cb.recv_control({MsgType.PROGRESS})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    ca.close()
    cb.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_channel_rejects_replayed_frame(cipher):
    ca, cb = _channel_pair(cipher=cipher)
    sent = []
    real = ca.sock.sendmsg
    ca.sock = _Recorder(ca.sock, sent)
    ca.send_json(MsgType.PROGRESS, {"rows_done": 1})
    assert cb.recv_control({MsgType.PROGRESS})[1] == {"rows_done": 1}
    real([b"".join(sent)])  # replay the recorded frame byte for byte
    with pytest.raises(ProtocolError, match="replayed"):
        cb.recv_control({MsgType.PROGRESS})
    ca.close()
    cb.close()


class _Recorder:
    """Socket stand-in that records what is sent."""

    def __init__(self, sock, sink):
        self._sock, self._sink = sock, sink

    def sendmsg(self, buffers):
        for b in buffers:
            self._sink.append(bytes(b))
        return self._sock.sendmsg(buffers)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("taken_by,cipher", [
    ("reader", "aes-gcm"), ("poll_heartbeats", "aes-gcm"), ("reader", "aes-gmac"),
    ("poll_heartbeats", "hmac-sha256"),
])
def test_heartbeats_are_skipped_and_a_replayed_or_forged_one_is_rejected(taken_by, cipher):
    ca, cb = _channel_pair(cipher=cipher)
    ca.enable_liveness(1.0)
    cb.enable_liveness(1.0)
    real = ca.sock
    ca.send_heartbeat()
    ca.send(MsgType.UP_F32, b"\x01" * 8)
    out = bytearray(8)
    if taken_by == "poll_heartbeats":
        time.sleep(0.05)
        cb.poll_heartbeats()  # takes the heartbeat, leaves the data frame for the reader
    cb.recv_data_into(MsgType.UP_F32, memoryview(out))
    assert bytes(out) == b"\x01" * 8
    # a replayed heartbeat (sequence number 1 again) and a forged one are both refused
    real.sendall(_as_ca(MsgType.HEARTBEAT, 1, b"", cipher))
    if taken_by == "poll_heartbeats":
        time.sleep(0.05)
        cb.poll_heartbeats()  # keeps the error for the next receive
    with pytest.raises(ProtocolError, match="replayed"):
        cb.recv_data_into(MsgType.UP_F32, memoryview(out))
    ca2, cb2 = _channel_pair(cipher=cipher)
    cb2.enable_liveness(1.0)
    forged = proto.pack_header(MsgType.HEARTBEAT, 1, 0)
    ca2.sock.sendall(forged + b"\x00" * ca2._tag_bytes)
    with pytest.raises(AuthError):
        cb2.recv_data_into(MsgType.UP_F32, memoryview(out))
    for c in (ca, cb, ca2, cb2):
        c.close()


def test_wrong_length_or_type_is_protocol_error_naming_the_rank():
    ca, cb = _channel_pair()
    ca.send(MsgType.UP_F32, b"\x00" * 8)
    with pytest.raises(ProtocolError, match="rank 0 .*8 bytes, expected 16"):
        cb.recv_data_into(MsgType.UP_F32, memoryview(bytearray(16)))
    ca2, cb2 = _channel_pair()
    ca2.send(MsgType.UP_F64, b"\x00" * 8)
    with pytest.raises(ProtocolError, match="UP_F64, expected UP_F32"):
        cb2.recv_data_into(MsgType.UP_F32, memoryview(bytearray(8)))
    for c in (ca, cb, ca2, cb2):
        c.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_abort_frame_raises_peer_aborted_with_origin(cipher):
    ca, cb = _channel_pair(cipher=cipher)
    assert ca.try_send_abort(7, "rank 7: disk full")
    with pytest.raises(PeerAborted) as info:
        cb.recv_data_into(MsgType.DOWN_F32, memoryview(bytearray(16)))
    assert info.value.rank == 7 and "disk full" in str(info.value)
    ca.close()
    cb.close()


def test_peer_closing_mid_frame_is_peer_lost_immediately():
    ca, cb = _channel_pair(io_timeout_s=10.0)
    frame = _frame(payload=b"\x00" * 4096, seq=1, key=b"A" * 32)
    ca.sock.sendall(frame[:1000])
    ca.close()
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="rank 0") as info:
        cb.recv_data_into(MsgType.UP_F32, memoryview(bytearray(4096)))
    assert info.value.rank == 0
    assert time.monotonic() - t0 < 1.0
    cb.close()


def test_silent_peer_is_peer_timeout():
    ca, cb = _channel_pair(io_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="rank 0") as info:
        cb.recv_data_into(MsgType.UP_F32, memoryview(bytearray(16)))
    assert info.value.rank == 0 and 0.15 < time.monotonic() - t0 < 1.5
    ca.close()
    cb.close()


def test_trickling_peer_cannot_outlast_the_deadline():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        frame = _frame(payload=b"\x00" * 64)
        for i in range(len(frame)):
            if stop.wait(0.05):
                return
            try:
                a.send(frame[i : i + 1])
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):
        proto.read_frame(
            b, ciphers.HmacCipher(KEY), expected_seq=1, rank=None, deadline=time.monotonic() + 0.3
        )
    assert time.monotonic() - t0 < 1.0
    stop.set()
    t.join()
    a.close()
    b.close()


def test_handshake_binds_session_keys_and_rejects_wrong_key():
    def accept(hello):
        return hello["rank"], None, {"rank": 0}

    for server_key, ok in ((KEY, True), (OTHER_KEY, False)):
        a, b = socket.socketpair()
        result = {}

        def serve(sock=b, k=server_key, result=result):
            try:
                result["server"] = server_handshake(
                    sock,
                    k,
                    role="parent",
                    expect_role="child",
                    accept=accept,
                    handshake_timeout_s=1.0,
                    io_timeout_s=1.0,
                )
            except Exception as exc:  # noqa: BLE001
                result["server"] = exc
                sock.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            client, reply = client_handshake(
                a,
                KEY,
                role="child",
                expect_role="parent",
                info={"rank": 1},
                rank=0,
                peer=None,
                handshake_timeout_s=1.0,
                io_timeout_s=1.0,
            )
        except (PeerLost, PeerTimeout) as exc:
            client, reply = exc, None
        t.join()
        if ok:
            server, hello = result["server"]
            assert reply["rank"] == 0 and hello["rank"] == 1
            client.send_json(MsgType.PROGRESS, {"x": 1})
            assert server.recv_control({MsgType.PROGRESS})[1] == {"x": 1}
            server.send(MsgType.DOWN_F32, b"\x00" * 4)
            client.recv_data_into(MsgType.DOWN_F32, memoryview(bytearray(4)))
            client.close()
            server.close()
        else:
            assert isinstance(result["server"], AuthError)
            assert isinstance(client, PeerLost)  # refused without an answer
            a.close()


# ---------------------------------------------------------------------------------------------
# Fuzzing the readers over real sockets: whatever arrives, a read ends with the protocol's error
# (or a timeout) within a time bound, and allocates nothing from an unauthenticated length


SEND_KEY = b"A" * 32  # the fuzzed writer's key = the reading channel's receive key
READ_BOUND_S = 2.0  # per input; the readers' own timeouts are 5-10 ms
_FRAMES = {  # as the default cipher (aes-gcm) seals them, client to server
    "heartbeat": lambda seq: _as_ca(MsgType.HEARTBEAT, seq, b"", key=SEND_KEY),
    "data": lambda seq: _as_ca(MsgType.UP_F32, seq, bytes(range(64)), key=SEND_KEY),
    "progress": lambda seq: _as_ca(
        MsgType.PROGRESS, seq, proto.encode_json({"rows_done": seq}), key=SEND_KEY
    ),
    "abort": lambda seq: _as_ca(
        MsgType.ABORT, seq, proto.encode_json({"origin": 3, "reason": "fuzz"}), key=SEND_KEY
    ),
}


@st.composite
def _streams(draw):
    """Valid frames, then one mutation: cut, bit flip, bad length / type / seq, junk, noise."""
    kinds = draw(st.lists(st.sampled_from(sorted(_FRAMES)), max_size=4))
    frames = [_FRAMES[k](i + 1) for i, k in enumerate(kinds)]
    starts = [sum(len(f) for f in frames[:i]) for i in range(len(frames))]
    data = bytearray(b"".join(frames))
    how = draw(st.sampled_from(["none", "cut", "flip", "length", "type", "seq", "append", "noise"]))
    if how == "noise":
        data = bytearray(draw(st.binary(max_size=600)))
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=80))
    elif data and how == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif data and how == "flip":
        bit = draw(st.integers(0, len(data) * 8 - 1))
        data[bit // 8] ^= 1 << (bit % 8)
    elif starts and how in ("length", "type", "seq"):
        at = draw(st.sampled_from(starts))
        if how == "length":
            data[at + 14 : at + 18] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
        elif how == "type":
            data[at + 5] = draw(st.integers(0, 255))
        else:
            data[at + 6 : at + 14] = draw(st.integers(0, MAX_SEQ)).to_bytes(8, "big")
    # (bytes, then close the writer?) mostly closed: an open one costs a timeout
    return bytes(data), draw(st.sampled_from([True, True, True, False]))


@FUZZ_SOCKET
@given(stream=_streams(), reader=st.sampled_from(["data", "control"]), live=st.booleans())
@example(stream=(proto.pack_header(MsgType.UP_F32, 1, 2**32 - 1), False), reader="data", live=True)
@example(stream=(proto.pack_header(MsgType.ABORT, 1, 2**16), True), reader="data", live=False)
@example(stream=(proto.pack_header(MsgType.HEARTBEAT, 1, 60000), False), reader="data", live=True)
@example(stream=(b"GET / HTTP/1.1\r\n\r\n", False), reader="control", live=False)
def test_socket_readers_end_with_the_protocol_error_in_bounded_time(stream, reader, live):
    data, close = stream
    a, b = socket.socketpair()
    chan = Channel(
        b, rank=5, peer=None, send_key=b"B" * 32, recv_key=SEND_KEY, io_timeout_s=0.005,
        send_direction="s2c",
    )
    if live:
        chan.enable_liveness(0.005, max_wait_s=0.01)
    try:
        a.sendall(data)
        if close:
            a.shutdown(socket.SHUT_WR)
        out = memoryview(bytearray(64))
        tracemalloc.start()  # only around the read: tracing hypothesis itself would be slow
        t0 = time.monotonic()
        try:
            with pytest.raises((ProtocolError, PeerLost, PeerTimeout)) as info:
                for _ in range(6):  # at most 4 valid frames, then the end of the stream
                    if live:
                        chan.poll_heartbeats()
                    if reader == "data":
                        chan.recv_data_into(MsgType.UP_F32, out)
                    else:
                        chan.recv_control({MsgType.PROGRESS})
            elapsed = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        chan.close()
        a.close()
    assert elapsed < READ_BOUND_S, (elapsed, info.value)
    assert peak < proto.CONTROL_MAX_BYTES + 32 * 1024, peak  # a control frame at most
    if isinstance(info.value, (PeerLost, PeerTimeout)) and not isinstance(info.value, PeerAborted):
        assert info.value.rank == 5  # the error names the peer


def _hello_frames(key: bytes, role: str = "child") -> bytes:
    hello = {"proto": "terascale-allreduce/2", "role": role, "rank": 1, "nonce": "ab" * 16,
             "cipher": "aes-gcm"}
    return proto.encode_frame(key, MsgType.HELLO, 0, proto.encode_json(hello))


@pytest.fixture(scope="module")
def acceptor():
    from terascale.allreduce.acceptor import Acceptor
    from terascale.allreduce.channel import open_listener

    linked = []
    acc = Acceptor(
        open_listener("127.0.0.1"),
        KEY,
        name="fuzz",
        role="parent",
        expect_role="child",
        accept=lambda hello: (1, None, {"rank": 0}),
        on_channel=lambda chan, hello: (linked.append(chan), chan.close()),
        handshake_timeout_s=0.02,
        io_timeout_s=1.0,
    ).start()
    yield acc, linked
    acc.close()


@settings(max_examples=500, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300), mutate=st.booleans(), close=st.sampled_from([True, True, False]))
@example(data=proto.pack_header(MsgType.HELLO, 0, 2**32 - 1), mutate=False, close=False)
@example(data=proto.pack_header(MsgType.HELLO, 0, proto.HELLO_MAX_BYTES + 1), mutate=False, close=False)
@example(data=b"", mutate=False, close=False)
def test_acceptor_answers_nothing_but_a_valid_hello_in_bounded_time(acceptor, data, mutate, close):
    acc, _ = acceptor
    if mutate:  # a real HELLO with the fuzz bytes spliced into it
        hello = bytearray(_hello_frames(KEY))
        at = len(data) % len(hello)
        hello[at : at + len(data)] = data
        data = bytes(hello)
    with socket.create_connection(acc._listener.getsockname(), timeout=READ_BOUND_S) as sock:
        t0 = time.monotonic()
        try:
            sock.sendall(data)
            if close:
                sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(1)
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            assert not isinstance(exc, TimeoutError)
            answer = b""  # closed by the listener (reset: it had unread junk)
        elapsed = time.monotonic() - t0
    if answer:  # only a HELLO authenticated with the key gets one
        proto.decode_frame(KEY, data, expected_seq=0)
    assert elapsed < READ_BOUND_S


def test_acceptor_still_links_a_real_child_after_the_fuzz(acceptor):
    acc, linked = acceptor
    n = len(linked)
    sock = socket.create_connection(acc._listener.getsockname(), timeout=2)
    chan, reply = client_handshake(
        sock, KEY, role="child", expect_role="parent", info={"rank": 1}, rank=0, peer=None,
        handshake_timeout_s=2.0, io_timeout_s=2.0,
    )
    assert reply["rank"] == 0
    deadline = time.monotonic() + 2
    while len(linked) == n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(linked) == n + 1 and acc.pending == 0
    chan.close()


def test_errors_pickle_with_their_fields():
    for err in (
        PeerLost(3, "x"),
        PeerTimeout(None, "y", peer="the tree server"),
        PeerAborted(2, "z"),
        StandDown(1, "a"),
        StartupTimeout([4, 2], 1.5),
        RoundAborted("r"),
        AuthError("bad tag"),
    ):
        clone = pickle.loads(pickle.dumps(err))
        assert type(clone) is type(err) and str(clone) == str(err)
    assert PeerTimeout(5).rank == 5 and "rank 5" in str(PeerTimeout(5))
    assert StartupTimeout([4, 2]).missing_shards == (2, 4)
