"""Frame protection after the handshake: AES-256-GCM, AES-256-GMAC or HMAC-SHA256.

``allreduce.cipher`` picks one for every link of a job (driver and every rank must agree; the
HELLO carries the choice and a mixed pair is refused at the handshake):

``aes-gcm`` (default)
    The payload is encrypted and, together with the header, authenticated. The wire carries
    ``header || ciphertext || 16-byte tag``. Gradients can reveal training data; nobody on the
    network reads them.
``aes-gmac``
    AES-GCM with an empty plaintext and the whole frame (header || payload) as associated
    data: integrity and authenticity, no secrecy. The wire carries ``header || payload ||
    16-byte tag``.
``hmac-sha256``
    ``header || payload || HMAC-SHA256(key, header || payload)`` (32-byte tag), the protocol's
    original frames; needs no library beyond the standard one.

Keys (:func:`session_keys`): HKDF-SHA256 (RFC 5869) with the attempt's 32-byte secret as input
key material, both handshake nonces as salt and an info string naming the protocol, the cipher,
the direction and a SHA-256 of both HELLO payloads (so the sender's rank, shard and attempt are
bound to the key). Every connection and every direction has its own key.

AEAD nonce (96 bits) = 4-byte direction (``c2s`` / ``s2c``) || 64-bit big-endian frame
sequence number. A sequence number is used once per direction of a connection, and the
channel refuses to send past ``2^64 - 1`` (:class:`NonceExhausted`), so a nonce never repeats
under one key. The 18-byte header is associated data, so magic, version, type, sequence and
length are authenticated; the sender's rank and attempt are bound through the key.

Decryption writes into the caller's buffer and verifies the tag; on a bad tag the buffer is
zeroed before :class:`~allreduce.errors.AuthError` is raised, so unverified plaintext is never
left behind. ``cryptography`` is imported only when an AES cipher is used.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
from typing import Any

from .errors import AuthError, ProtocolError

CIPHERS = ("aes-gcm", "aes-gmac", "hmac-sha256")
DEFAULT_CIPHER = "aes-gcm"
GCM_TAG_BYTES = 16
HMAC_TAG_BYTES = 32
DIRECTIONS = {"c2s": b"c2s\x00", "s2c": b"s2c\x00"}


class NonceExhausted(ProtocolError):
    """A connection sent 2^64 frames in one direction: its nonces would repeat."""


def check_cipher(name: object) -> str:
    if name not in CIPHERS:
        raise ValueError(f"allreduce.cipher = {name!r}: must be one of {list(CIPHERS)}")
    return str(name)


# ---------------------------------------------------------------------------------------------
# HKDF-SHA256 (RFC 5869)


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-Extract then HKDF-Expand with HMAC-SHA256; ``length`` at most 255 * 32 bytes."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF length {length} out of range")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def session_keys(
    key: bytes, client_nonce: bytes, server_nonce: bytes, cipher: str, transcript: bytes = b""
) -> tuple[bytes, bytes]:
    """Per-connection keys ``(client_to_server, server_to_client)``.

    ``transcript`` is the concatenation of both HELLO payloads (client's first).
    """
    check_cipher(cipher)
    digest = hashlib.sha256(transcript).digest()
    salt = client_nonce + server_nonce
    base = b"terascale-allreduce/2 " + cipher.encode() + b" "
    c2s = hkdf_sha256(key, salt, base + b"c2s " + digest)
    s2c = hkdf_sha256(key, salt, base + b"s2c " + digest)
    return c2s, s2c


# ---------------------------------------------------------------------------------------------
# Frame ciphers (one direction of one connection each)


class FrameCipher(abc.ABC):
    """Protects the frames of one direction of one connection.

    ``encrypts``: the wire payload is ciphertext (a sender needs an output buffer, a receiver
    receives ``ciphertext || tag`` contiguously). Otherwise the payload travels as is and the
    tag follows it.
    """

    name = ""
    tag_bytes = 0
    encrypts = False

    @abc.abstractmethod
    def seal(self, header: bytes, payload: Any, out: Any = None) -> Any:
        """The tag (or, if ``encrypts``, ``ciphertext || tag`` written into ``out``)."""

    @abc.abstractmethod
    def open_into(self, header: bytes, wire: Any, out: Any, what: str) -> None:
        """Verify ``wire`` (``ciphertext || tag`` if ``encrypts``, else ``payload || tag`` with
        ``out`` holding the payload already, ``wire`` then being the tag) and put the payload
        in ``out``; AuthError (``out`` zeroed) if it does not verify."""


class HmacCipher(FrameCipher):
    name = "hmac-sha256"
    tag_bytes = HMAC_TAG_BYTES

    def __init__(self, key: bytes, direction: str = "c2s") -> None:
        self._base = hmac.new(key, digestmod="sha256")

    def seal(self, header: bytes, payload: Any = b"", out: Any = None) -> bytes:
        h = self._base.copy()
        h.update(header)
        if len(payload):
            h.update(payload)
        return h.digest()

    def open_into(self, header: bytes, wire: Any, out: Any, what: str) -> None:
        if not hmac.compare_digest(self.seal(header, out), bytes(wire)):
            wipe(out)
            raise AuthError(f"HMAC verification failed for {what} (wrong key or tampered frame)")


class _Aes(FrameCipher):
    tag_bytes = GCM_TAG_BYTES

    def __init__(self, key: bytes, direction: str = "c2s") -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)
        self._dir = DIRECTIONS[direction]

    def _nonce(self, header: bytes) -> bytes:
        return self._dir + bytes(header[6:14])  # the header's 64-bit sequence number


def gcm_seal_into(aead: Any, nonce: bytes, aad: Any, payload: Any, out: Any) -> memoryview:
    """AES-GCM: ``ciphertext || tag`` of ``payload`` into ``out`` (``len(payload) + 16`` bytes)."""
    view = memoryview(out)[: len(payload) + GCM_TAG_BYTES]
    aead.encrypt_into(nonce, payload, aad, view)
    return view


def gcm_open_into(aead: Any, nonce: bytes, aad: Any, wire: Any, out: Any, what: str) -> None:
    """AES-GCM: verify ``wire`` (``ciphertext || tag``) and decrypt it into ``out``; on a bad tag
    ``out`` (where the library may have written unverified plaintext) is zeroed, then
    AuthError."""
    from cryptography.exceptions import InvalidTag

    try:
        aead.decrypt_into(nonce, wire, aad, out)
    except InvalidTag:
        wipe(out)
        raise AuthError(
            f"AES-GCM verification failed for {what} (wrong key or tampered frame)"
        ) from None


class GcmCipher(_Aes):
    name = "aes-gcm"
    encrypts = True

    def seal(self, header: bytes, payload: Any, out: Any = None) -> Any:
        if out is None:
            out = bytearray(len(payload) + GCM_TAG_BYTES)
        return gcm_seal_into(self._aead, self._nonce(header), header, payload, out)

    def open_into(self, header: bytes, wire: Any, out: Any, what: str) -> None:
        gcm_open_into(self._aead, self._nonce(header), header, wire, out, what)


class GmacCipher(_Aes):
    name = "aes-gmac"

    def __init__(self, key: bytes, direction: str = "c2s") -> None:
        super().__init__(key, direction)
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._cipher, self._gcm, self._aes = Cipher, modes.GCM, algorithms.AES(key)

    def seal(self, header: bytes, payload: Any = b"", out: Any = None) -> bytes:
        enc = self._cipher(self._aes, self._gcm(self._nonce(header))).encryptor()
        enc.authenticate_additional_data(bytes(header))
        if len(payload):
            enc.authenticate_additional_data(payload)
        enc.finalize()
        return enc.tag

    def open_into(self, header: bytes, wire: Any, out: Any, what: str) -> None:
        from cryptography.exceptions import InvalidTag

        try:
            dec = self._cipher(self._aes, self._gcm(self._nonce(header), bytes(wire))).decryptor()
            dec.authenticate_additional_data(bytes(header))
            if len(out):
                dec.authenticate_additional_data(out)
            dec.finalize()
        except (InvalidTag, ValueError):
            wipe(out)
            raise AuthError(
                f"AES-GMAC verification failed for {what} (wrong key or tampered frame)"
            ) from None


_CLASSES = {"aes-gcm": GcmCipher, "aes-gmac": GmacCipher, "hmac-sha256": HmacCipher}


def frame_cipher(name: str, key: bytes, direction: str) -> FrameCipher:
    """The :class:`FrameCipher` ``name`` keyed with ``key`` for ``direction`` (c2s / s2c)."""
    return _CLASSES[check_cipher(name)](key, direction)


def wipe(out: Any) -> None:
    if out is not None and len(out):
        view = memoryview(out).cast("B")
        view[:] = bytes(len(view))
