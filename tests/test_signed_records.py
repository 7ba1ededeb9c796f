"""Certificate-bound DHT records (issue #7, part 2): every way a record can be wrong is refused, and
each refusal says why in one log line.

These drive the validator the DHT runs on every record it is asked to store or receives; the
real-process tests (``test_admission.py``, ``test_certified_swarm.py``) show it in a running swarm.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from greenswarm.bootstrap.identity import identity_seed, load_or_create_identity
from greenswarm.security.admission import Admission
from greenswarm.security.certificates import CertificateError, create_authority, issue
from greenswarm.security.records import MARKER, MAX_TTL_S, MemberRecordValidator, RecordRefused

pytestmark = pytest.mark.security

SWARM = "s"


@dataclasses.dataclass
class Member:
    peer_id: str
    validator: MemberRecordValidator
    cert: Path


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    create_authority(tmp_path / "authority.key")
    create_authority(tmp_path / "other.key")  # somebody else's authority

    def member(
        name: str, valid_s: float = 3600, authority: str = "authority.key", cert_of: str = ""
    ) -> Member:
        peer_id = load_or_create_identity(tmp_path / f"{name}.key")
        cert = tmp_path / f"{name}.cert"
        if not cert_of:
            issue(
                tmp_path / authority,
                swarm=SWARM,
                site=name,
                region="R",
                peer_id=peer_id,
                valid_s=valid_s,
                out=cert,
            )
        else:
            cert = tmp_path / f"{cert_of}.cert"
        admission = Admission.from_files(SWARM, tmp_path / "authority.key.pub", cert)
        return Member(
            peer_id, MemberRecordValidator(admission, identity_seed(tmp_path / f"{name}.key")), cert
        )

    reader = MemberRecordValidator(Admission.from_files(SWARM, tmp_path / "authority.key.pub"))
    return {"member": member, "reader": reader, "tmp": tmp_path}


def _record(value: object, subkey: object = None, key: bytes = b"k" * 20, ttl: float = 60.0) -> DHTRecord:
    sub = MSGPackSerializer.dumps(subkey) if subkey is not None else b""
    return DHTRecord(key, sub, MSGPackSerializer.dumps(value), time.time() + ttl)


def _signed(member: Member, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=member.validator.sign_value(record))


def _refusal(reader: MemberRecordValidator, record: DHTRecord, now: float | None = None) -> str:
    with pytest.raises(RecordRefused) as caught:
        reader.check(record, now=now)
    return str(caught.value)


def test_a_members_record_is_accepted_and_stripped(world: dict) -> None:
    a = world["member"]("a")
    record = _record({"site": "a", "peer_id": a.peer_id, "x": 1}, subkey=a.peer_id)
    signed = _signed(a, record)
    world["reader"].check(signed)
    assert world["reader"].validate(signed)
    assert world["reader"].strip_value(signed) == record.value


def test_unsigned_forged_and_replayed_records_are_refused(world: dict) -> None:
    a, reader = world["member"]("a"), world["reader"]
    record = _record({"x": 1})
    signed = _signed(a, record)
    assert "unsigned DHT record" in _refusal(reader, record)
    # an edited value (the envelope is kept): forged
    edited = dataclasses.replace(
        signed, value=MSGPackSerializer.dumps({"x": 2}) + signed.value[len(record.value) :]
    )
    assert "the signature does not match" in _refusal(reader, edited)
    # the same signed bytes replayed under another key, or with a longer life
    assert "the signature does not match" in _refusal(reader, dataclasses.replace(signed, key=b"j" * 20))
    longer = dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600)
    assert "the signature does not match" in _refusal(reader, longer)
    # garbage where the envelope should be
    junk = record.value + b"junk" + struct.pack(">I", 4) + MARKER
    assert "garbled" in _refusal(reader, dataclasses.replace(signed, value=junk))


def test_forged_expired_and_replayed_certificates_are_refused(world: dict) -> None:
    member, reader, tmp = world["member"], world["reader"], world["tmp"]
    record = _record({"x": 1}, ttl=1.0)
    # a certificate from another authority
    other = member("o", authority="other.key")
    assert "signed by another authority" in _refusal(reader, _signed(other, record))
    # an edited certificate: the site name changed after signing
    a = member("a")
    blob = json.loads(a.cert.read_text())
    blob["membership"]["site"] = "root"
    forged = tmp / "forged.cert"
    forged.write_text(json.dumps(blob))
    f = member("f", cert_of="forged")
    f.validator.admission.certificate = forged.read_bytes()
    assert "forged or edited" in _refusal(reader, _signed(f, record))
    # a valid certificate of another peer, replayed by an outsider with its own identity
    x = member("x", cert_of="a")
    assert f"issued to peer {a.peer_id}, but this peer is {x.peer_id}" in _refusal(reader, _signed(x, record))
    # an expired certificate
    e = member("e", valid_s=0.5)
    signed = _signed(e, record)
    assert "expired at" in _refusal(reader, signed, now=time.time() + 0.6)  # read after it expired


def test_records_cannot_outlive_their_certificate_or_live_too_long(world: dict) -> None:
    member, reader = world["member"], world["reader"]
    short = member("short", valid_s=60)
    assert "outlives the certificate" in _refusal(reader, _signed(short, _record({"x": 1}, ttl=120)))
    a = member("a", valid_s=10 * MAX_TTL_S)
    assert "at most" in _refusal(reader, _signed(a, _record({"x": 1}, ttl=2 * MAX_TTL_S)))


def test_a_member_speaks_only_for_itself(world: dict) -> None:
    a, b, reader = world["member"]("a"), world["member"]("b"), world["reader"]
    assert f"under peer {b.peer_id}'s subkey" in _refusal(reader, _signed(a, _record(1.0, subkey=b.peer_id)))
    raw_b = _peer_bytes(b.peer_id)
    assert "another peer's subkey" in _refusal(reader, _signed(a, _record(1.0, subkey=raw_b)))
    assert "claims site 'b'" in _refusal(reader, _signed(a, _record({"site": "b", "peer_id": a.peer_id})))
    assert "claims peer_id" in _refusal(reader, _signed(a, _record({"peer_id": b.peer_id})))
    reader.check(_signed(a, _record(1.0, subkey=_peer_bytes(a.peer_id))))  # its own subkey is fine


def test_refusals_are_logged_once_per_reason(world: dict, caplog: pytest.LogCaptureFixture) -> None:
    reader = world["reader"]
    with caplog.at_level(logging.WARNING, logger="greenswarm.security.records"):
        for _ in range(5):
            assert not reader.validate(_record({"x": 1}))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused an unsigned DHT record (its writer holds no membership certificate)"]


def test_a_peer_that_shows_no_certificate_is_not_a_member(world: dict) -> None:
    admission = world["reader"].admission
    with pytest.raises(CertificateError, match="showed no membership certificate"):
        admission.check(None, "12D3KooWPeer")
    with pytest.raises(CertificateError, match="not a greenswarm membership certificate"):
        admission.check(b"{}", "12D3KooWPeer")


def _peer_bytes(peer_id: str) -> bytes:
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer_id).to_bytes()
