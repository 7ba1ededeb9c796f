"""Revocation lists, relay passes and state attestation, in-process: the rules the real swarms rely on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.bootstrap.relay_gate import RelayGate, _relay_maddrs, grant
from greenswarm.errors import ConfigError
from greenswarm.network import SwarmConfig
from greenswarm.node.state_sync import attested
from greenswarm.security.admission import REVOKED_GRACE_S, Admission
from greenswarm.security.certificates import (
    CertificateError,
    create_authority,
    issue,
    read_certificate,
    verify,
)
from greenswarm.security.certificates import load_authority_public as load_public
from greenswarm.security.records import MemberRecordValidator
from greenswarm.security.revocation import parse, revoke

pytestmark = pytest.mark.hardening


@pytest.fixture
def swarm(tmp_path: Path) -> SimpleNamespace:
    """An authority and two members, a and b, of swarm ``test``."""
    key = tmp_path / "authority.key"
    create_authority(key)
    members = {}
    for name in ("a", "b"):
        peer = load_or_create_identity(tmp_path / f"{name}.key")
        issue(
            key,
            swarm="test",
            site=name,
            region="R",
            peer_id=peer,
            valid_s=3600,
            out=tmp_path / f"{name}.cert",
        )
        members[name] = SimpleNamespace(peer=peer, cert=(tmp_path / f"{name}.cert").read_bytes())
    admission = Admission.from_files("test", f"{key}.pub")
    return SimpleNamespace(key=key, pub=f"{key}.pub", admission=admission, tmp=tmp_path, **members)


def test_a_revoked_member_fails_every_check_and_lists_only_grow(swarm: SimpleNamespace) -> None:
    out = swarm.tmp / "revoked.json"
    first, blob = revoke(swarm.key, swarm="test", out=out, peer_ids=[swarm.a.peer], reason="leaked key")
    assert first.serial == 1 and [e.peer_id for e in first.entries] == [swarm.a.peer]
    assert swarm.admission.revoke(blob) is not None
    with pytest.raises(CertificateError, match=r"revoked it .*\(leaked key\) \(revocation list #1\)"):
        swarm.admission.check(swarm.a.cert, swarm.a.peer)
    swarm.admission.check(swarm.b.cert, swarm.b.peer)  # the others are untouched
    # the next list keeps the first entry; an older list never replaces a newer one
    second, newer = revoke(swarm.key, swarm="test", out=out, certificates=[swarm.tmp / "b.cert"])
    assert second.serial == 2 and len(second.entries) == 2 and second.entries[1].certificate is not None
    assert swarm.admission.revoke(newer) is not None and swarm.admission.revoke(blob) is None
    with pytest.raises(CertificateError, match="revoked its certificate"):
        swarm.admission.check(swarm.b.cert, swarm.b.peer)
    # a certificate-only revocation: b with a new certificate is a member again
    issue(
        swarm.key,
        swarm="test",
        site="b",
        region="R",
        peer_id=swarm.b.peer,
        valid_s=600,
        out=swarm.tmp / "b2.cert",
    )
    swarm.admission.check((swarm.tmp / "b2.cert").read_bytes(), swarm.b.peer)


def test_a_record_signed_before_the_revocation_stays_readable(swarm: SimpleNamespace) -> None:
    """Readers ignore such records (the swarm view filters revoked peers); refusing them would make
    hivemind drop the whole dictionary they are stored in, the members' records with them."""
    _, blob = revoke(swarm.key, swarm="test", out=swarm.tmp / "r.json", peer_ids=[swarm.a.peer])
    swarm.admission.revoke(blob)
    revoked_at = swarm.admission.revocations.entries[0].revoked_at
    assert swarm.admission.revoked(swarm.a.peer, signed_at=revoked_at - 1) is None
    assert swarm.admission.revoked(swarm.a.peer, signed_at=revoked_at + 1) is not None
    assert swarm.admission.revoked(swarm.a.peer) is not None
    # the signer picks its signing time: a record "signed" before the revocation that would live on
    # for a day after it is a backdated one
    live = revoked_at - 1 + 60
    assert swarm.admission.revoked(swarm.a.peer, signed_at=revoked_at - 1, expires=live) is None
    backdated = revoked_at + REVOKED_GRACE_S + 60
    assert swarm.admission.revoked(swarm.a.peer, signed_at=revoked_at - 1, expires=backdated) is not None


def test_a_revoked_certificate_is_known_by_its_signed_fields(swarm: SimpleNamespace) -> None:
    """Re-indented (or with other line ends) it is the same certificate, and still revoked; a check by
    peer id alone holds the peer to the certificate it last showed."""
    _, blob = revoke(swarm.key, swarm="test", out=swarm.tmp / "r.json", certificates=[swarm.tmp / "a.cert"])
    swarm.admission.revoke(blob)
    reindented = json.dumps(json.loads(swarm.a.cert), indent=7).encode()
    with pytest.raises(CertificateError, match="revoked its certificate"):
        swarm.admission.check(reindented, swarm.a.peer)
    assert swarm.admission.revoked(swarm.a.peer) is not None  # (the one it showed above)
    assert swarm.admission.revoked(swarm.b.peer) is None


def test_a_forged_or_foreign_list_is_refused(swarm: SimpleNamespace, tmp_path: Path) -> None:
    _, blob = revoke(swarm.key, swarm="test", out=tmp_path / "r.json", peer_ids=[swarm.a.peer])
    edited = json.loads(blob)
    edited["revocations"]["entries"][0]["peer_id"] = swarm.b.peer
    with pytest.raises(CertificateError, match="forged or edited"):
        swarm.admission.revoke(json.dumps(edited).encode())
    with pytest.raises(CertificateError, match="of swarm 'test', not 'other'"):
        parse(blob, swarm.admission.authority, "other", "list")
    other = tmp_path / "other.key"
    create_authority(other)
    _, theirs = revoke(other, swarm="test", out=tmp_path / "o.json", peer_ids=[swarm.a.peer])
    with pytest.raises(CertificateError, match="signed by another authority"):
        swarm.admission.revoke(theirs)
    with pytest.raises(CertificateError, match="name a --peer-id or a --cert"):
        revoke(swarm.key, swarm="test", out=tmp_path / "none.json")
    with pytest.raises(CertificateError, match="is not a libp2p peer id"):
        revoke(swarm.key, swarm="test", out=tmp_path / "bad.json", peer_ids=["nobody"])


def test_the_dht_validator_applies_a_list_as_it_passes(swarm: SimpleNamespace) -> None:
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    _, blob = revoke(swarm.key, swarm="test", out=swarm.tmp / "r.json", peer_ids=[swarm.a.peer])
    validator = MemberRecordValidator(swarm.admission)
    key = DHTID.generate(source="test_revocations").to_bytes()
    record = DHTRecord(key, MSGPackSerializer.dumps(1), MSGPackSerializer.dumps(blob), time.time() + 600)
    assert validator.validate(record)  # no member's envelope needed: the authority signed it
    assert swarm.admission.revoked(swarm.a.peer) is not None
    garbage = DHTRecord(key, MSGPackSerializer.dumps(2), MSGPackSerializer.dumps(b"{}"), time.time() + 600)
    assert not validator.validate(garbage)
    forever = DHTRecord(key, MSGPackSerializer.dumps(1), MSGPackSerializer.dumps(blob), time.time() + 10**7)
    assert not validator.validate(forever)
    # under its own serial only: list #1 stored as #5 (or as a plain value) would crowd out list #5
    for subkey in (MSGPackSerializer.dumps(5), MSGPackSerializer.dumps(None)):
        misfiled = DHTRecord(key, subkey, MSGPackSerializer.dumps(blob), time.time() + 600)
        assert not validator.validate(misfiled)


def test_a_site_given_a_list_that_revokes_it_does_not_start(swarm: SimpleNamespace) -> None:
    revoke(swarm.key, swarm="test", out=swarm.tmp / "r.json", peer_ids=[swarm.a.peer])
    swarm.admission.load_revocations(swarm.tmp / "r.json")
    assert swarm.admission.revoked(swarm.a.peer, swarm.a.cert) is not None
    with pytest.raises(CertificateError, match="no such revocation list file"):
        swarm.admission.load_revocations(swarm.tmp / "missing.json")
    with pytest.raises(ConfigError, match="revocations: a revocation list is the authority's"):
        SwarmConfig(revocations="r.json").validate()


def test_swarm_revoke_on_the_command_line(swarm: SimpleNamespace) -> None:
    out = swarm.tmp / "revoked.json"
    command = [
        sys.executable,
        "-m",
        "greenswarm",
        "swarm",
        "revoke",
        "--key",
        str(swarm.key),
        "--swarm",
        "test",
    ]
    args = [*command, "--peer-id", swarm.a.peer, "--out", str(out), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["serial"] == 1 and result["published"] is None
    failed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].endswith("name a --peer-id or a --cert to revoke")


def test_a_certificate_without_a_rate_keeps_its_signature(swarm: SimpleNamespace) -> None:
    """``max_tokens_per_s`` is signed when set and left out when not: certificates issued before the
    field existed verify as they did."""
    membership, _ = read_certificate(swarm.tmp / "a.cert")
    assert "max_tokens_per_s" not in json.loads((swarm.tmp / "a.cert").read_text())["membership"]
    assert membership.max_tokens_per_s is None
    issue(swarm.key, swarm="test", site="c", region="R", peer_id=swarm.a.peer, valid_s=60,
          out=swarm.tmp / "c.cert", max_tokens_per_s=500.0)  # fmt: skip
    assert verify(swarm.tmp / "c.cert", load_public(swarm.pub)).max_tokens_per_s == 500.0
    tampered = json.loads((swarm.tmp / "c.cert").read_text())
    tampered["membership"]["max_tokens_per_s"] = 5e9
    (swarm.tmp / "t.cert").write_text(json.dumps(tampered))
    with pytest.raises(CertificateError, match="forged or edited"):
        verify(swarm.tmp / "t.cert", load_public(swarm.pub))


def test_the_gate_admits_pass_holders_only_and_remembers_them(swarm: SimpleNamespace, tmp_path: Path) -> None:
    passes = tmp_path / "passes.json"
    gate = RelayGate("127.0.0.1", 0, ("127.0.0.1", 9), own={"10.77.0.1"}, passes=passes)
    assert gate.admitted("127.0.0.1") and gate.admitted("10.77.0.1")  # the host's own
    assert not gate.admitted("10.77.1.2")
    assert grant(swarm.admission, gate, swarm.a.cert, swarm.b.peer, ["10.77.1.2"])["error"].startswith(
        "no relay pass"
    )
    assert not gate.admitted("10.77.1.2")  # a's certificate shown by b: refused
    assert "cannot see which address" in grant(swarm.admission, gate, swarm.a.cert, swarm.a.peer, [])["error"]
    assert "until" in grant(swarm.admission, gate, swarm.a.cert, swarm.a.peer, ["::ffff:10.77.1.2"])
    assert gate.admitted("10.77.1.2") and gate.held() == 1
    # a restarted bootstrap lets its members back in at once
    again = RelayGate("127.0.0.1", 0, ("127.0.0.1", 9), own=set(), passes=passes)
    assert again.admitted("10.77.1.2")
    # revoked: the pass goes
    _, blob = revoke(swarm.key, swarm="test", out=tmp_path / "r.json", peer_ids=[swarm.a.peer])
    swarm.admission.revoke(blob)
    assert again.withdraw(lambda peer: swarm.admission.revoked(peer) is not None) == [swarm.a.peer]
    assert not again.admitted("10.77.1.2")
    assert "revoked" in grant(swarm.admission, again, swarm.a.cert, swarm.a.peer, ["10.77.1.2"])["error"]
    # a revocation that lands between the check and the pass wins
    assert not again.allow("10.77.1.3", swarm.b.peer, time.time() + 60, still=lambda: False)
    assert not again.admitted("10.77.1.3")
    # an expired pass lets nobody in, and the next withdrawal clears it away
    again.allow("10.77.1.4", swarm.b.peer, time.time() - 1)
    assert not again.admitted("10.77.1.4")
    again.withdraw(lambda peer: False)
    assert "10.77.1.4" not in again.passes


def test_the_relays_sites_are_given_are_the_gate_with_the_relays_id() -> None:
    boot = ["/ip4/10.77.0.1/tcp/31337/p2p/12D3KooWboot", "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWboot"]
    assert _relay_maddrs(boot, 31338, "12D3KooWrelay") == [
        "/ip4/10.77.0.1/tcp/31338/p2p/12D3KooWrelay",
        "/ip4/127.0.0.1/tcp/31338/p2p/12D3KooWrelay",
    ]


def _record(peer: str, digest: str | None) -> SimpleNamespace:
    return SimpleNamespace(peer_id=peer, state_digest=digest)


def test_a_served_state_is_adopted_only_as_its_lineages_holders_signed_it() -> None:
    good, forged = "a" * 32, "f" * 32
    # three holders signed the good state: a forger serving another is refused, its own record or not
    holders = [_record("x", good), _record("y", good), _record("forger", good)]
    assert attested(good, "x", holders) is None
    assert "is not the one its lineage's holders signed" in attested(forged, "forger", holders)
    lying = [_record("x", good), _record("y", good), _record("forger", forged)]
    assert "no more signatures" in attested(forged, "forger", lying)
    assert attested(good, "y", lying) is None
    # two colluders against two honest holders: a tie, so neither state is taken
    tie = [_record("x", good), _record("y", good), _record("f1", forged), _record("f2", forged)]
    assert "no more signatures" in attested(forged, "f1", tie)
    assert "no more signatures" in attested(good, "x", tie)
    # a lineage its server alone holds (a step it took alone): its own record vouches
    assert attested(good, "solo", [_record("solo", good)]) is None
    # two holders that disagree: neither is taken on its own word
    split = [_record("x", good), _record("forger", forged)]
    assert "no more signatures" in attested(good, "x", split)
    assert "no more signatures" in attested(forged, "forger", split)
    # the most signatures, but only the server's among them: another holder must vouch
    alone = [_record("x", good), _record("forger", forged), _record("forger", forged)]
    assert "only the server signed" in attested(forged, "forger", alone)
    assert "(yet)" in attested(good, "x", [_record("x", None)])
