"""Peer identities and multiaddr checks: a bootstrap peer's address must survive restarts, and a
mistyped address must be refused with the flag or field that holds it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from greenswarm.bootstrap.identity import load_or_create_identity, read_identity
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.network import check_maddr, check_peers


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_creates_private_file_and_stable_peer_id(tmp_path: Path) -> None:
    """First call creates a 0600 key; later calls return the same 12D3KooW... peer id."""
    path = tmp_path / "keys" / "boot.key"
    peer_id = load_or_create_identity(path)
    assert peer_id.startswith("12D3KooW")
    assert mode_of(path) == 0o600
    assert load_or_create_identity(path) == peer_id
    assert read_identity(path) == peer_id
    assert not list(path.parent.glob("*.tmp"))


def test_distinct_files_distinct_ids(tmp_path: Path) -> None:
    """Two identities never collide (each is a fresh Ed25519 key)."""
    assert load_or_create_identity(tmp_path / "a.key") != load_or_create_identity(tmp_path / "b.key")


def test_readable_key_is_tightened(tmp_path: Path) -> None:
    """A key copied with mode 0644 holds a private key others can read: it is chmod'ed to 0600."""
    path = tmp_path / "boot.key"
    peer_id = load_or_create_identity(path)
    os.chmod(path, 0o644)
    assert load_or_create_identity(path) == peer_id
    assert mode_of(path) == 0o600


def test_peer_id_matches_hivemind(tmp_path: Path) -> None:
    """Our peer id must be the one p2pd derives from the same file, or the printed address is wrong."""
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    path = tmp_path / "boot.key"
    peer_id = load_or_create_identity(path)
    key = crypto_pb2.PrivateKey()
    key.ParseFromString(path.read_bytes())
    assert key.key_type == crypto_pb2.KeyType.Ed25519
    assert PeerID.from_base58(peer_id).to_base58() == peer_id


@pytest.mark.parametrize(
    "content",
    [b"this is not a key\n", b"\x08\x01\x12\x05short", b"", b"\xff\xfe\xfd" * 50],
    ids=["text", "truncated-ed25519", "empty", "binary"],
)
def test_corrupted_identity_names_the_file(tmp_path: Path, content: bytes) -> None:
    """Corrupted or foreign key files fail with a GreenswarmError naming the file, not a protobuf trace."""
    path = tmp_path / "boot.key"
    path.write_bytes(content)
    with pytest.raises(GreenswarmError) as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)


def test_mismatched_public_half_is_detected(tmp_path: Path) -> None:
    """A key whose public half was altered would give a peer id p2pd disagrees with: refuse it."""
    from hivemind.proto import crypto_pb2

    path = tmp_path / "boot.key"
    load_or_create_identity(path)
    key = crypto_pb2.PrivateKey()
    key.ParseFromString(path.read_bytes())
    data = bytearray(key.data)
    data[-1] ^= 0xFF
    path.write_bytes(crypto_pb2.PrivateKey(key_type=key.key_type, data=bytes(data)).SerializeToString())
    with pytest.raises(GreenswarmError, match="public half"):
        load_or_create_identity(path)


def test_directory_is_not_an_identity(tmp_path: Path) -> None:
    """Pointing --identity at a directory is a user error with a clear message."""
    with pytest.raises(GreenswarmError, match="is a directory"):
        load_or_create_identity(tmp_path)


@pytest.fixture(scope="module")
def peer_id(tmp_path_factory: pytest.TempPathFactory) -> str:
    return load_or_create_identity(tmp_path_factory.mktemp("id") / "peer.key")


def test_check_maddr_accepts_full_address(peer_id: str) -> None:
    """A complete bootstrap address passes unchanged (surrounding blanks are stripped)."""
    maddr = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}"
    assert check_maddr(f"  {maddr} ", "--initial-peers", need_peer_id=True) == maddr
    assert check_peers([maddr, maddr], "initial_peers") == [maddr, maddr]
    assert check_maddr("/dns4/boot.example.org/tcp/31337", "host_maddrs", need_peer_id=False)
    assert check_maddr("/ip4/0.0.0.0/tcp/0", "host_maddrs", need_peer_id=False)


@pytest.mark.parametrize(
    ("text", "need_peer_id", "expected"),
    [
        ("garbage", True, "not a multiaddr"),
        ("1.2.3.4:31337", True, "not a multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", True, "no /p2p/PEER_ID part"),
        ("/ip4/127.0.0.1/p2p/{peer}", True, "no /tcp/PORT part"),
        ("/ip4/127.0.0.1", False, "no /tcp/PORT part"),
        ("/tcp/31337/p2p/{peer}", True, "no /ip4, /ip6 or /dns part"),
        ("/ip4/127.0.0.1/tcp/1/p2p/notapeerid", True, "not a multiaddr"),
        ("/ip4/999.0.0.1/tcp/1", False, "not a multiaddr"),
    ],
)
def test_check_maddr_rejects(peer_id: str, text: str, need_peer_id: bool, expected: str) -> None:
    """Each kind of mistake gets a ConfigError that names the flag and shows a correct example."""
    text = text.format(peer=peer_id)
    with pytest.raises(ConfigError) as info:
        check_maddr(text, "--initial-peers", need_peer_id=need_peer_id)
    err = info.value
    assert err.field == "--initial-peers"
    assert str(err).startswith("--initial-peers: ")
    assert expected in str(err)
    assert "12D3KooW" in str(err)  # the hint shows what a good address looks like
