"""Peer identities: an Ed25519 libp2p private key in a file that survives restarts.

A bootstrap peer's address (``/ip4/.../p2p/<peer id>``) is what every site writes into its config, so
its peer id must not change when the host restarts. The key is stored in libp2p's protobuf format
(what ``p2pd -id`` reads) with mode 0600, and created on first use.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from greenswarm.errors import GreenswarmError
from greenswarm.private_files import write_private

_ED25519_SEED = 32


def peer_id_of(public: bytes) -> bytes:
    """The libp2p peer id of an Ed25519 public key, raw: the identity multihash of its protobuf."""
    from hivemind.proto import crypto_pb2

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public).SerializeToString()
    return bytes([0x00, len(encoded)]) + encoded


def _peer_id_from_public(public: bytes) -> str:
    """The libp2p peer id of an Ed25519 public key, as people write it (base58)."""
    from hivemind.p2p import PeerID

    return PeerID(peer_id_of(public)).to_base58()


def _generate(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from hivemind.proto import crypto_pb2

    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public).SerializeToString()
    write_private(path, blob)


def read_identity(path: str | Path) -> str:
    """Check an identity file and return its peer id; errors name the file and what is wrong with it."""
    _seed, public = _read_key(path)
    return _peer_id_from_public(public)


def identity_seed(path: str | Path) -> bytes:
    """The 32-byte Ed25519 private seed of an identity file: what signs this peer's DHT records."""
    return _read_key(path)[0]


def ed25519_public_of(peer_id: bytes) -> bytes | None:
    """The raw Ed25519 public key inside a peer id (an identity multihash), or None for other ids."""
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    if len(peer_id) < 2 or peer_id[0] != 0x00 or peer_id[1] != len(peer_id) - 2:
        return None
    key = crypto_pb2.PublicKey()
    try:
        key.ParseFromString(peer_id[2:])
    except DecodeError:
        return None
    if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) != _ED25519_SEED:
        return None
    return bytes(key.data)


def _read_key(path: str | Path) -> tuple[bytes, bytes]:
    """(private seed, public key) of an Ed25519 identity file, checked."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise GreenswarmError(f"{path}: cannot read identity file: {e.strerror}") from None
    key = crypto_pb2.PrivateKey()
    try:
        key.ParseFromString(blob)
    except DecodeError:
        raise GreenswarmError(f"{path}: not a libp2p private key (corrupted identity file?)") from None
    if key.key_type != crypto_pb2.KeyType.Ed25519 or len(key.data) != 2 * _ED25519_SEED:
        raise GreenswarmError(
            f"{path}: expected an Ed25519 libp2p key (made by greenswarm), got something else"
        )
    private = ed25519.Ed25519PrivateKey.from_private_bytes(key.data[:_ED25519_SEED])
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if public != key.data[_ED25519_SEED:]:
        raise GreenswarmError(
            f"{path}: identity file is corrupted (public half does not match the private key)"
        )
    return key.data[:_ED25519_SEED], public


def load_or_create_identity(path: str | Path) -> str:
    """Return the peer id stored at ``path``, creating a new identity (mode 0600) if the file is missing.

    An existing file readable by others is tightened to 0600: it holds the peer's private key.
    """
    path = Path(path)
    if not path.exists():
        _generate(path)
    elif path.is_dir():
        raise GreenswarmError(f"{path}: is a directory, expected an identity file")
    peer_id = read_identity(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        os.chmod(path, 0o600)
    return peer_id
