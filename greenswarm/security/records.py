"""Certificate-bound DHT records: every record a member writes is signed by its peer and carries its
membership certificate; every process of a certified swarm refuses the rest.

hivemind lets a DHT *validator* sign each record as it is stored and check each record it is asked
to store or receives from a query. :class:`MemberRecordValidator` is that validator for a certified
swarm. It appends an envelope to the value:

    value || msgpack([signer peer id, certificate, signed_at, signature]) || length || MARKER

where the Ed25519 signature, made with the signer's libp2p identity key, covers the DHT key, subkey,
value, expiration time, signing time and signer. A record is accepted only when

* the signature verifies with the public key inside the signer's peer id (a forged or edited record,
  or one re-stored under another key or with a longer life -- a *replay* -- fails here);
* the certificate is this swarm's, signed by its authority, bound to the signer, and valid now; and
  the record does not outlive it (so an expired member's records vanish by themselves);
* the record was signed no later than now (plus clock skew) and lives at most :data:`MAX_TTL_S`;
* it speaks only for its signer: a subkey that is a peer id must be the signer's, and a value that
  names a ``peer_id``, ``site`` or ``region`` must name the signer's (so one member cannot overwrite
  or impersonate another's progress record, digest or averaging declaration).

One key is the authority's, not a member's: the swarm's revocation lists
(:mod:`greenswarm.security.revocation`), whose value carries the authority's own signature and
needs no member's envelope. The validator checks that signature, and applies the newest list it
sees to its process's admission, so each DHT node refuses a revoked member's records from the moment
the list passes through it.

It covers every record in the DHT -- hivemind's own matchmaking declarations included, since a DHT
key is a hash and cannot be told apart -- so an uncertified peer can neither be found as a group
leader nor be listed as a state holder. Because hivemind drops a *whole* dictionary value when one
of its entries fails, every DHT node of a certified swarm, the bootstrap peer included, must run this
validator (``--authority``): a node without it would store an intruder's entry next to the members'
and make readers drop them all.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from greenswarm.security.admission import Admission, RefusalLog
from greenswarm.security.certificates import CertificateError
from greenswarm.security.revocation import revocations_key

log = logging.getLogger(__name__)

MARKER = b"\x00greenswarm-signed/1"
#: the longest a member's record may live after it is signed (hivemind's own records live seconds to
#: minutes; progress records a few refreshes): bounds how long a captured record can be replayed
MAX_TTL_S = 86400.0
#: how far in the future a signing time may be (clocks of sites differ a little)
CLOCK_SKEW_S = 300.0
#: one log line per (writer, reason) per this many seconds: a flood of bad records must not flood logs
LOG_EVERY_S = 60.0


class RecordRefused(Exception):
    """Why a DHT record is refused (logged by the validator)."""


def _message(record: DHTRecord, signed_at: float, signer: bytes) -> bytes:
    """The bytes a member signs: everything that makes the record what it is."""
    parts = [record.key, record.subkey, record.value, signer]
    framed = b"".join(struct.pack(">I", len(p)) + p for p in parts)
    return b"greenswarm-record/1" + framed + struct.pack(">dd", record.expiration_time, signed_at)


class MemberRecordValidator(RecordValidatorBase):
    """Signs this peer's records and admits only records of certified members (see the module doc).

    ``seed`` is the Ed25519 seed of this peer's identity file; without one (a bootstrap peer, a
    reader) the validator only checks.
    """

    def __init__(self, admission: Admission, seed: bytes | None = None):
        self.admission = admission
        self.seed = seed
        self._signer: bytes | None = None  # this peer's id, raw
        self._key: Any = None
        self._refusals = RefusalLog(log, LOG_EVERY_S)
        self._revocations_key: bytes | None = None  # the hashed DHT key of the revocation lists

    def __getstate__(self) -> dict[str, Any]:  # key objects do not pickle; rebuilt on first use
        return {"admission": self.admission, "seed": self.seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    @property
    def priority(self) -> int:
        return 100  # signs last (over every other validator's signature), checks first

    # ---- signing (this peer's records) ----

    def _identity(self) -> tuple[Any, bytes]:
        if self._key is None:
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import ed25519

            from greenswarm.bootstrap.identity import peer_id_of

            self._key = ed25519.Ed25519PrivateKey.from_private_bytes(self.seed)
            public = self._key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
            self._signer = peer_id_of(public)
        return self._key, self._signer

    def sign_value(self, record: DHTRecord) -> bytes:
        if not self.seed:
            return record.value
        from hivemind.utils.serializer import MSGPackSerializer

        key, signer = self._identity()
        signed_at = time.time()
        signature = key.sign(_message(record, signed_at, signer))
        envelope = MSGPackSerializer.dumps([signer, self.admission.certificate, signed_at, signature])
        return record.value + envelope + struct.pack(">I", len(envelope)) + MARKER

    def strip_value(self, record: DHTRecord) -> bytes:
        return _split(record.value)[0]

    # ---- checking (everyone's records) ----

    def validate(self, record: DHTRecord) -> bool:
        try:
            self.check(record)
        except RecordRefused as e:
            self._refusals.warn(str(e))
            return False
        return True

    def check(self, record: DHTRecord, now: float | None = None) -> None:
        """Raise :class:`RecordRefused` saying why ``record`` is not a member's valid record."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric import ed25519
        from hivemind.p2p import PeerID

        from greenswarm.bootstrap.identity import ed25519_public_of

        value, envelope = _split(record.value)
        if record.key == self._revocations_dht_key():
            self._check_revocations(record, value)
            return
        if envelope is None:
            raise RecordRefused("refused an unsigned DHT record (its writer holds no membership certificate)")
        try:
            signer, certificate, signed_at, signature = _loads(envelope)
            signer, signed_at = bytes(signer), float(signed_at)
        except (ValueError, TypeError):
            raise RecordRefused("refused a DHT record with a garbled signature envelope") from None
        public = ed25519_public_of(signer)
        if public is None:
            raise RecordRefused("refused a DHT record signed by a peer id that holds no Ed25519 key")
        writer = PeerID(signer).to_base58()
        unsigned = DHTRecord(record.key, record.subkey, value, record.expiration_time)
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(
                bytes(signature), _message(unsigned, signed_at, signer)
            )
        except (InvalidSignature, TypeError):
            raise RecordRefused(
                f"refused a DHT record from {writer}: the signature does not match (forged, edited, or "
                "replayed under another key or expiry)"
            ) from None
        now = time.time() if now is None else now
        try:
            membership = self.admission.check(
                certificate, writer, now=now, signed_at=signed_at, expires=record.expiration_time
            )
        except CertificateError as e:
            raise RecordRefused(f"refused a DHT record from {writer}: {e}") from None
        if signed_at > now + CLOCK_SKEW_S:
            raise RecordRefused(f"refused a DHT record from {writer}: signed in the future ({signed_at:.0f})")
        life = record.expiration_time - signed_at
        if life > MAX_TTL_S:
            raise RecordRefused(
                f"refused a DHT record from {writer}: it would live {life:.0f} s (at most {MAX_TTL_S:.0f})"
            )
        if record.expiration_time > membership.expires:
            raise RecordRefused(
                f"refused a DHT record from {writer} (site {membership.site}): it outlives the certificate"
            )
        _check_claims(record.subkey, value, writer, signer, membership)

    def _revocations_dht_key(self) -> bytes:
        if self._revocations_key is None:
            from hivemind.dht.routing import DHTID

            self._revocations_key = DHTID.generate(source=revocations_key(self.admission.swarm)).to_bytes()
        return self._revocations_key

    def _check_revocations(self, record: DHTRecord, value: bytes) -> None:
        """A revocation list record: the authority's signature, the swarm, a bounded life; a newer
        list than the one in force is applied here, in this process."""
        blob = _first_object(value)
        if not isinstance(blob, bytes):
            raise RecordRefused("refused a revocation list record that holds no list")
        if record.expiration_time > time.time() + MAX_TTL_S + CLOCK_SKEW_S:
            raise RecordRefused(f"refused a revocation list record that would live beyond {MAX_TTL_S:.0f} s")
        try:
            # under its own serial only: an old list stored under a later serial (or as a plain value,
            # which replaces the whole dictionary) would otherwise crowd the newest list out
            serial = _first_object(record.subkey) if record.subkey else None
            if isinstance(serial, bool) or not isinstance(serial, int):
                raise CertificateError("a revocation list stored under no serial subkey")
            applied = self.admission.revoke(blob, "a revocation list stored on the DHT", serial=serial)
        except CertificateError as e:
            raise RecordRefused(f"refused {e}") from None
        if applied is not None:
            log.warning(
                "revocation list #%d of swarm '%s' in force: %d member(s) revoked",
                applied.serial,
                applied.swarm,
                len(applied.entries),
            )


def _split(raw: bytes) -> tuple[bytes, bytes | None]:
    """(value, envelope) of a stored value; envelope None when it carries no member signature."""
    tail = len(MARKER) + 4
    if len(raw) < tail or not raw.endswith(MARKER):
        return raw, None
    (length,) = struct.unpack(">I", raw[-tail : -len(MARKER)])
    if length > len(raw) - tail:
        return raw, None
    start = len(raw) - tail - length
    return raw[:start], raw[start : len(raw) - tail]


def _loads(blob: bytes) -> list[Any]:
    from hivemind.utils.serializer import MSGPackSerializer

    try:
        items = MSGPackSerializer.loads(blob)
    except Exception as e:  # msgpack raises several types on garbage
        raise ValueError(str(e)) from None
    if not isinstance(items, list | tuple) or len(items) != 4:
        raise ValueError("not a 4-item envelope")
    return list(items)


def _first_object(value: bytes) -> Any:
    """The first msgpack object of a value (other validators may have appended their signatures)."""
    import msgpack

    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=lambda code, data: None)
    unpacker.feed(value)
    try:
        return next(unpacker)
    except Exception:  # not msgpack: nothing to check
        return None


def _check_claims(subkey: bytes, value: bytes, writer: str, signer: bytes, membership: Any) -> None:
    """A member's record may speak only for that member."""
    sub = _first_object(subkey) if subkey else None
    if isinstance(sub, bytes) and len(sub) > 2 and sub[0] in (0x00, 0x12) and sub[1] == len(sub) - 2:
        if sub != signer:
            raise RecordRefused(f"refused a DHT record from {writer}: it writes under another peer's subkey")
    elif isinstance(sub, str) and sub.startswith(("12D3KooW", "Qm")) and sub != writer:
        raise RecordRefused(f"refused a DHT record from {writer}: it writes under peer {sub}'s subkey")
    claims = _first_object(value)
    if isinstance(claims, dict):
        for name, own in (("peer_id", writer), ("site", membership.site), ("region", membership.region)):
            if name in claims and claims[name] != own:
                raise RecordRefused(
                    f"refused a DHT record from {writer} (site {membership.site}): it claims "
                    f"{name} {claims[name]!r}, but its certificate says {own!r}"
                )
