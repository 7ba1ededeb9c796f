"""Revocation: the swarm authority's signed list of members that are admitted no longer.

A certificate is valid until it expires; a leaked identity file or a member that turned hostile
must be cut off sooner. The operator runs ``greenswarm swarm revoke`` with the authority key: it adds
the peer (or one certificate of it) to the swarm's **revocation list**, signs the whole list with the
authority key, writes it to a file, and -- given ``--initial-peers`` -- stores it on the swarm's DHT.

The list is cumulative and numbered: each revocation writes list ``serial + 1`` with every earlier
entry in it, so whoever holds the highest serial holds everything. It travels two ways:

* **as a file** (``swarm.revocations`` in a site's config, ``--revocations`` for the bootstrap and
  for ``greenswarm progress``), for sites that start later or never reach the DHT key;
* **on the DHT**, under ``<swarm>_revocations``, one subkey per serial. Its value needs no member's
  signature (the authority's is the proof), so the operator's own machine can store it, and every
  member stores again the newest list it knows while it runs, so the list outlives the 24 h a DHT
  record may live (:data:`greenswarm.security.records.MAX_TTL_S`).

Every process applies the newest list it has seen to its :class:`~greenswarm.security.admission.
Admission` (:meth:`Admission.revoke`), and from then on every check of a revoked member fails with
one line naming the list: its DHT records (the validator of each DHT node applies a list as it
passes through), its join requests and groups, its state downloads and its served states.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from greenswarm.private_files import write_private
from greenswarm.security.certificates import (
    CertificateError,
    certificate_id,
    certificate_id_of,
    fingerprint,
    load_authority,
    raw_public,
    read_certificate,
)
from greenswarm.timefmt import utc_second

FORMAT = "greenswarm-revocations/1"


def revocations_key(swarm: str) -> str:
    """The DHT key the swarm's revocation lists are stored under (one subkey per serial)."""
    return f"{swarm}_revocations"


@dataclass(frozen=True)
class Revoked:
    """One entry: a peer id, all of its certificates or (``certificate``: its SHA-256) just one."""

    peer_id: str
    revoked_at: float
    certificate: str | None = None  # its certificate_id (signed fields and signature); None: every one
    reason: str = ""

    def covers(self, peer_id: str, certificate: bytes | None) -> bool:
        if peer_id != self.peer_id:
            return False
        return self.certificate is None or (
            certificate is not None and certificate_id_of(certificate) == self.certificate
        )


@dataclass(frozen=True)
class RevocationList:
    """The signed fields of a revocation list."""

    swarm: str
    serial: int
    issued: float
    authority: str  # fingerprint of the authority key that signed it
    entries: tuple[Revoked, ...] = field(default_factory=tuple)
    format: str = FORMAT

    def canonical(self) -> bytes:
        data = asdict(self)
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def revoked(self, peer_id: str, certificate: bytes | None = None) -> Revoked | None:
        """The entry that revokes ``peer_id`` (holding ``certificate``), if one does."""
        return next((e for e in self.entries if e.covers(peer_id, certificate)), None)

    def describe(self, entry: Revoked) -> str:
        what = "its certificate" if entry.certificate else "it"
        why = f" ({entry.reason})" if entry.reason else ""
        return (
            f"the swarm's authority revoked {what} at {utc_second(entry.revoked_at)}{why} "
            f"(revocation list #{self.serial})"
        )


def encode(revocations: RevocationList, signature: bytes) -> bytes:
    """The bytes of a signed list, as a file holds them and the DHT stores them."""
    body = {
        "revocations": json.loads(revocations.canonical()),
        "signature": base64.b64encode(signature).decode(),
    }
    return (json.dumps(body, indent=2) + "\n").encode()


def parse(blob: bytes, authority_public: bytes, swarm: str, source: str) -> RevocationList:
    """A revocation list from its bytes, its signature checked with ``authority_public`` (raw
    Ed25519) and its swarm with ``swarm``; :class:`CertificateError` naming ``source`` otherwise."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        data = json.loads(blob)
        fields = dict(data["revocations"])
        entries = tuple(Revoked(**e) for e in fields.pop("entries"))
        revocations = RevocationList(entries=entries, **fields)
        signature = base64.b64decode(data["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise CertificateError(f"{source}: not a greenswarm revocation list (corrupted?)") from None
    if revocations.format != FORMAT:
        raise CertificateError(f"{source}: unknown revocation list format {revocations.format!r}")
    if revocations.authority != fingerprint(authority_public):
        raise CertificateError(f"{source}: signed by another authority ({revocations.authority})")
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(authority_public).verify(
            signature, revocations.canonical()
        )
    except InvalidSignature:
        raise CertificateError(
            f"{source}: the signature does not match the contents (forged or edited)"
        ) from None
    if revocations.swarm != swarm:
        raise CertificateError(f"{source}: a revocation list of swarm {revocations.swarm!r}, not {swarm!r}")
    return revocations


def read(path: str | Path, authority_public: bytes, swarm: str) -> RevocationList:
    """A revocation list file, checked (see :func:`parse`); errors name the file."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{path}: no such revocation list file") from None
    except OSError as e:
        raise CertificateError(f"{path}: cannot read revocation list: {e.strerror}") from None
    return parse(blob, authority_public, swarm, str(path))


def revoke(
    authority_path: str | Path,
    *,
    swarm: str,
    out: str | Path,
    peer_ids: list[str] | None = None,
    certificates: list[str | Path] | None = None,
    reason: str = "",
    now: float | None = None,
) -> tuple[RevocationList, bytes]:
    """Add ``peer_ids`` (every certificate of each) and ``certificates`` (just those) to the list at
    ``out`` (a new one if there is none), sign it as the next serial and write it (0600 is not needed:
    a revocation list is public, but it is written whole, never torn). Returns the list and its bytes."""
    key = load_authority(authority_path)
    public = raw_public(key.public_key())
    out = Path(out)
    previous = read(out, public, swarm) if out.exists() else None
    now = time.time() if now is None else now
    entries = list(previous.entries) if previous else []
    added = []
    for peer in peer_ids or []:
        added.append(Revoked(peer_id=_peer_id(peer), revoked_at=now, reason=reason))
    for cert in certificates or []:
        membership, _signature = read_certificate(cert)
        if membership.swarm != swarm:
            raise CertificateError(f"{cert}: a certificate of swarm {membership.swarm!r}, not {swarm!r}")
        added.append(
            Revoked(
                peer_id=membership.peer_id,
                revoked_at=now,
                certificate=certificate_id(membership, _signature),
                reason=reason,
            )
        )
    if not added:
        raise CertificateError("swarm revoke: name a --peer-id or a --cert to revoke")
    entries += [e for e in added if e not in entries]
    revocations = RevocationList(
        swarm=swarm,
        serial=(previous.serial if previous else 0) + 1,
        issued=now,
        authority=fingerprint(public),
        entries=tuple(entries),
    )
    blob = encode(revocations, key.sign(revocations.canonical()))
    try:
        write_private(out, blob)
    except OSError as e:
        raise CertificateError(f"{out}: cannot write the revocation list: {e.strerror or e}") from None
    return revocations, blob


def _peer_id(text: str) -> str:
    from hivemind.p2p import PeerID

    try:
        raw = PeerID.from_base58(text).to_bytes()
    except Exception:
        raw = b""
    if len(raw) < 34 or raw[:1] not in (b"\x00", b"\x12"):
        raise CertificateError(f"--peer-id: {text!r} is not a libp2p peer id (12D3KooW...)")
    return text


def newest(lists: list[Any]) -> Any:
    """The list with the highest serial of ``lists`` (None when empty)."""
    return max(lists, key=lambda r: r.serial, default=None)
