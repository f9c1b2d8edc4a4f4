"""allreduce.cipher: known answers, tampering, keys, nonces, versions and mixed-cipher peers."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from terascale.allreduce import ciphers
from terascale.allreduce import protocol as proto
from terascale.allreduce.channel import Channel, client_handshake, server_handshake
from terascale.allreduce.client import ServerSession
from terascale.allreduce.errors import AuthError, ProtocolError
from terascale.allreduce.protocol import MsgType
from terascale.allreduce.server import TreeServer
from tests.allreduce.harness import FAST

CIPHERS = list(ciphers.CIPHERS)
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

# ---------------------------------------------------------------------------------------------
# Known answers: AES-256 test cases 13-16 of McGrew & Viega, "The Galois/Counter Mode of
# Operation (GCM)" (the NIST GCM submission), and RFC 5869 (HKDF) test case 1.

_K15 = "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308"
_P15 = (
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
)
_C15 = (
    "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
    "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad"
)
GCM_VECTORS = [  # key, iv, plaintext, aad, ciphertext, tag
    ("00" * 32, "00" * 12, "", "", "", "530f8afbc74536b9a963b4f1c4cb738b"),
    ("00" * 32, "00" * 12, "00" * 16, "", "cea7403d4d606b6e074ec5d3baf39d18",
     "d0d1c8a799996bf0265b98b5d48ab919"),
    (_K15, "cafebabefacedbaddecaf888", _P15, "", _C15, "b094dac5d93471bdec1a502270e3cc6c"),
    (_K15, "cafebabefacedbaddecaf888", _P15[:120], "feedfacedeadbeeffeedfacedeadbeefabaddad2",
     _C15[:120], "76fc6ece0f4e1768cddf8853bb2d551b"),
]


@pytest.mark.parametrize("vector", GCM_VECTORS, ids=["tc13", "tc14", "tc15", "tc16"])
def test_gcm_wrapper_matches_published_vectors(vector):
    key, iv, pt, aad, ct, tag = (bytes.fromhex(h) for h in vector)
    aead = AESGCM(key)
    out = bytearray(len(pt) + 16)
    assert bytes(ciphers.gcm_seal_into(aead, iv, aad, pt, out)) == ct + tag
    plain = bytearray(len(pt))
    ciphers.gcm_open_into(aead, iv, aad, ct + tag, plain, "vector")
    assert bytes(plain) == pt
    for i in range(len(ct + tag)):  # every flipped byte of ciphertext or tag is refused
        bad = bytearray(ct + tag)
        bad[i] ^= 0x80
        plain = bytearray(b"\xaa" * len(pt))
        with pytest.raises(AuthError, match="AES-GCM verification failed"):
            ciphers.gcm_open_into(aead, iv, aad, bad, plain, "vector")
        assert not any(plain)  # nothing unverified left behind


def test_hkdf_matches_rfc5869_test_case_1():
    okm = ciphers.hkdf_sha256(
        bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
        bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42,
    )
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


def test_gcm_frame_is_aesgcm_with_direction_and_sequence_nonce_and_header_aad():
    payload = bytes(range(40))
    frame = proto.encode_frame(KEY, MsgType.UP_F32, 0x0102030405060708, payload,
                               cipher="aes-gcm", direction="s2c")
    header = frame[: proto.HEADER_BYTES]
    nonce = b"s2c\x00" + bytes(range(1, 9))
    assert frame[proto.HEADER_BYTES :] == AESGCM(KEY).encrypt(nonce, payload, header)
    assert payload not in frame  # encrypted
    gmac = proto.encode_frame(KEY, MsgType.UP_F32, 3, payload, cipher="aes-gmac")
    header = gmac[: proto.HEADER_BYTES]
    expected_tag = AESGCM(KEY).encrypt(b"c2s\x00" + (3).to_bytes(8, "big"), b"", header + payload)
    assert gmac == header + payload + expected_tag  # payload in clear, all of it authenticated


# ---------------------------------------------------------------------------------------------
# Tampering, wrong keys, old versions


@pytest.mark.parametrize("cipher", CIPHERS)
def test_every_flipped_bit_of_a_frame_is_rejected(cipher):
    payload = bytes(range(24))
    frame = proto.encode_frame(KEY, MsgType.UP_F32, 5, payload, cipher=cipher)
    assert proto.decode_frame(KEY, frame, expected_seq=5, cipher=cipher).payload == payload
    for bit in range(len(frame) * 8):
        bad = bytearray(frame)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ProtocolError):  # AuthError is a ProtocolError
            proto.decode_frame(KEY, bytes(bad), expected_seq=5, cipher=cipher)


@pytest.mark.parametrize("cipher", CIPHERS)
def test_wrong_key_or_direction_is_rejected(cipher):
    frame = proto.encode_frame(KEY, MsgType.DOWN_F64, 1, b"\x01" * 16, cipher=cipher)
    with pytest.raises(AuthError):
        proto.decode_frame(OTHER_KEY, frame, expected_seq=1, cipher=cipher)
    if cipher != "hmac-sha256":  # the AEAD nonce names the direction
        with pytest.raises(AuthError):
            proto.decode_frame(KEY, frame, expected_seq=1, cipher=cipher, direction="s2c")


@pytest.mark.parametrize("cipher", CIPHERS)
def test_tampered_data_frame_on_a_channel_leaves_nothing_in_the_buffer(cipher):
    a, b = socket.socketpair()
    tx = Channel(a, rank=1, peer=None, send_key=b"A" * 32, recv_key=b"B" * 32,
                 io_timeout_s=2.0, cipher=cipher, send_direction="c2s")
    rx = Channel(b, rank=0, peer=None, send_key=b"B" * 32, recv_key=b"A" * 32,
                 io_timeout_s=2.0, cipher=cipher, send_direction="s2c")
    try:
        x = np.arange(64, dtype="<f4")
        frame = bytearray(proto.encode_frame(b"A" * 32, MsgType.UP_F32, 1, x.tobytes(),
                                             cipher=cipher, direction="c2s"))
        frame[proto.HEADER_BYTES + 100] ^= 4
        a.sendall(bytes(frame))
        out = np.full(64, 7.0, dtype="<f4")
        with pytest.raises(AuthError):
            rx.recv_data_into(MsgType.UP_F32, memoryview(out).cast("B"))
        assert not out.any()  # neither the plaintext nor the tampered payload is left there
    finally:
        tx.close()
        rx.close()


def test_version_1_frames_are_refused():
    header = bytearray(proto.pack_header(MsgType.HELLO, 0, 10))
    header[4] = 1
    with pytest.raises(ProtocolError, match="unsupported protocol version 1 .*speaks 2"):
        proto.parse_header(bytes(header))
    a, b = socket.socketpair()
    try:
        hello = proto.encode_json({"proto": "terascale-allreduce/1", "role": "child",
                                   "nonce": "ab" * 16})
        frame = bytearray(proto.encode_frame(KEY, MsgType.HELLO, 0, hello))
        frame[4] = 1
        a.sendall(bytes(frame))
        with pytest.raises(ProtocolError, match="version 1"):
            server_handshake(b, KEY, role="parent", expect_role="child",
                             accept=lambda h: (1, None, {}), handshake_timeout_s=1.0,
                             io_timeout_s=1.0)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------------------
# Nonces and keys


@pytest.mark.parametrize("cipher", CIPHERS)
def test_a_link_refuses_to_wrap_its_sequence_numbers(cipher):
    a, b = socket.socketpair()
    last = proto.MAX_SEQ - 1
    tx = Channel(a, rank=1, peer=None, send_key=b"A" * 32, recv_key=b"B" * 32, io_timeout_s=2.0,
                 cipher=cipher, send_direction="c2s", first_seq=last)
    rx = Channel(b, rank=0, peer=None, send_key=b"B" * 32, recv_key=b"A" * 32, io_timeout_s=2.0,
                 cipher=cipher, send_direction="s2c", first_seq=last)
    try:
        out = bytearray(8)
        for value in (b"\x01" * 8, b"\x02" * 8):  # sequence numbers 2^64-2 and 2^64-1
            tx.send(MsgType.UP_F32, value)
            rx.recv_data_into(MsgType.UP_F32, memoryview(out))
            assert bytes(out) == value
        with pytest.raises(ciphers.NonceExhausted, match="2\\^64 frames .*would wrap"):
            tx.send(MsgType.UP_F32, b"\x03" * 8)
        assert not tx.try_send_abort(1, "no nonce left")  # best effort, never reuses a nonce
        assert not rx.readable(0.05)  # nothing was sent
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_sealing_the_next_frame_does_not_wait_for_the_send_of_the_one_before(cipher):
    """A writer thread is blocked mid-frame (the peer reads nothing yet): sealing the next frame
    still finishes (it takes only the sequence number's lock), and both frames then arrive in
    order and verify."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 14)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)
    tx = Channel(a, rank=1, peer=None, send_key=b"A" * 32, recv_key=b"B" * 32, io_timeout_s=30.0,
                 cipher=cipher, send_direction="c2s")
    rx = Channel(b, rank=0, peer=None, send_key=b"B" * 32, recv_key=b"A" * 32, io_timeout_s=30.0,
                 cipher=cipher, send_direction="s2c")
    n = 1 << 20  # 4 MiB of float32: far more than the socket buffers hold
    first, second = np.full(n, 1.5, "<f4"), np.full(n, -2.5, "<f4")
    bufs = [bytearray(4 * n + tx.tag_bytes) for _ in range(2)]
    try:
        frame = tx.seal_data(MsgType.UP_F32, memoryview(first).cast("B"), bufs[0])
        writer = threading.Thread(target=tx.send_sealed, args=(frame,), daemon=True)
        writer.start()
        assert rx.readable(10.0)  # the writer is on the wire, and stuck there: nobody reads
        sealed: list = []
        sealer = threading.Thread(
            target=lambda: sealed.append(tx.seal_data(MsgType.UP_F32, memoryview(second).cast("B"), bufs[1])),
            daemon=True)
        sealer.start()
        sealer.join(10.0)
        assert sealed, "sealing waited for the send of the frame before it"
        assert writer.is_alive()  # still blocked: the seal did not need the wire
        got = np.empty(n, "<f4")
        rx.recv_data_into(MsgType.UP_F32, memoryview(got).cast("B"))
        writer.join(10.0)
        assert not writer.is_alive() and got.tobytes() == first.tobytes()
        writer = threading.Thread(target=tx.send_sealed, args=(sealed[0],), daemon=True)
        writer.start()
        rx.recv_data_into(MsgType.UP_F32, memoryview(got).cast("B"))
        writer.join(10.0)
        assert got.tobytes() == second.tobytes()
    finally:
        tx.close()
        rx.close()


def test_session_keys_depend_on_cipher_transcript_and_direction():
    base = ciphers.session_keys(KEY, b"c" * 16, b"s" * 16, "aes-gcm", b"hellos")
    assert base[0] != base[1] and KEY not in base and all(len(k) == 32 for k in base)
    assert ciphers.session_keys(KEY, b"c" * 16, b"s" * 16, "aes-gmac", b"hellos") != base
    assert ciphers.session_keys(KEY, b"c" * 16, b"s" * 16, "aes-gcm", b"hellos!") != base
    assert ciphers.session_keys(KEY, b"c" * 16, b"t" * 16, "aes-gcm", b"hellos") != base
    assert ciphers.session_keys(KEY, b"c" * 16, b"s" * 16, "aes-gcm", b"hellos") == base
    with pytest.raises(ValueError, match="allreduce.cipher = 'rot13'"):
        ciphers.check_cipher("rot13")


# ---------------------------------------------------------------------------------------------
# Mixed ciphers are refused at the handshake


def _handshake_pair(client_cipher, server_cipher):
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            result["server"] = server_handshake(
                b, KEY, role="parent", expect_role="child",
                accept=lambda h: (h["rank"], None, {"rank": 0}), handshake_timeout_s=2.0,
                io_timeout_s=2.0, cipher=server_cipher,
            )
        except Exception as exc:  # noqa: BLE001 - checked below
            result["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = client_handshake(
            a, KEY, role="child", expect_role="parent", info={"rank": 1}, rank=0, peer=None,
            handshake_timeout_s=2.0, io_timeout_s=2.0, cipher=client_cipher,
        )
    except Exception as exc:  # noqa: BLE001 - checked below
        client = exc
    t.join(5)
    return a, b, client, result["server"]


@pytest.mark.parametrize("client_cipher,server_cipher",
                         [("aes-gmac", "aes-gcm"), ("aes-gcm", "hmac-sha256")])
def test_mixed_cipher_pair_is_refused_at_the_handshake_naming_both(client_cipher, server_cipher):
    a, b, client, server = _handshake_pair(client_cipher, server_cipher)
    try:
        for err in (client, server):
            assert isinstance(err, ProtocolError), repr(err)
            assert repr(client_cipher) in str(err) and repr(server_cipher) in str(err)
            assert "same cipher" in str(err)
        assert "rank 0" in str(client)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cipher", CIPHERS)
def test_matching_ciphers_link_up_and_exchange_data(cipher):
    a, b, client, server = _handshake_pair(cipher, cipher)
    chan, _ = server
    try:
        assert client[0].cipher == chan.cipher == cipher
        client[0].send(MsgType.UP_F64, np.arange(3.0).tobytes())
        out = np.empty(3)
        chan.recv_data_into(MsgType.UP_F64, memoryview(out).cast("B"))
        assert out.tolist() == [0.0, 1.0, 2.0]
    finally:
        client[0].close()
        chan.close()


def test_worker_with_another_cipher_than_the_tree_server_fails_at_once(key):
    with TreeServer(1, key, cipher="aes-gcm", **FAST) as server:
        with pytest.raises(ProtocolError) as info:
            ServerSession.connect(server.address, key, shard=0, attempt_id="a",
                                  connect_timeout_s=5.0, handshake_timeout_s=2.0,
                                  cipher="hmac-sha256")
        assert "the tree server uses allreduce.cipher = 'aes-gcm'" in str(info.value)
        assert "this side uses 'hmac-sha256'" in str(info.value)
        assert server.survivors() == {}
