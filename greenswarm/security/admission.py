"""Admission: checking that a peer holds a valid membership certificate of this swarm.

One :class:`Admission` per process carries what every check needs -- the swarm's name, the
authority's public key and (for a site) the site's own certificate, which it shows to others. The
same object is handed to the DHT record validator (:mod:`greenswarm.security.records`), to the
averager (who may join a group, send a part, download the state) and to ``greenswarm progress``, so
all of them apply one rule: a peer is a member when its certificate verifies with the authority's
key, names this swarm, is bound to the peer's own id, and is valid now.

The transport makes the binding meaningful: every libp2p stream is authenticated, so the peer id
a handler sees (``context.remote_id``) belongs to whoever holds that id's private key. A copied
certificate is useless without the identity file it was issued to.

It holds raw bytes only (no key objects), so it pickles into hivemind's DHT and averager processes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greenswarm.security.certificates import (
    CertificateError,
    Membership,
    check_binding,
    check_signature,
    load_authority_public,
    parse_certificate,
    raw_public,
)
from greenswarm.security.revocation import RevocationList
from greenswarm.security.revocation import parse as parse_revocations

#: how many signature-checked certificates a process remembers (they are small; peers are few)
_CACHE_SIZE = 4096
#: a record a revoked peer says it signed before its revocation is still accepted (and ignored by
#: readers) only if it expires within this many seconds of the revocation: greenswarm's own records
#: live seconds to minutes, and a backdated one cannot outlive this
REVOKED_GRACE_S = 3600.0


@dataclass
class Admission:
    """The rule for who belongs to swarm ``swarm``; ``certificate`` is this process's own (empty for a
    reader such as ``greenswarm progress`` or a bootstrap peer, which check others but show nothing)."""

    swarm: str
    authority: bytes  # raw Ed25519 public key of the swarm authority
    certificate: bytes = b""  # this site's certificate file, as issued
    revocations: RevocationList | None = None  # the newest revocation list this process has seen
    revocation_bytes: bytes = b""  # ... as the authority signed it (what is stored again on the DHT)
    _checked: dict[bytes, Membership] = field(default_factory=dict, repr=False)
    # peer -> the certificate it last showed here: what a check by peer id alone (a served state, the
    # relay's passes) holds against a revocation of one certificate
    _shown: dict[str, bytes] = field(default_factory=dict, repr=False)

    @classmethod
    def from_files(
        cls, swarm: str, authority: str | Path, certificate: str | Path | None = None
    ) -> Admission:
        """Read the authority's public key and (optionally) this site's certificate; errors name the files."""
        public = raw_public(load_authority_public(authority))
        blob = b""
        if certificate is not None:
            try:
                blob = Path(certificate).read_bytes()
            except OSError as e:
                raise CertificateError(f"{certificate}: cannot read certificate: {e.strerror}") from None
        return cls(swarm=swarm, authority=public, certificate=blob)

    def revoke(
        self, blob: bytes, source: str = "a revocation list", serial: int | None = None
    ) -> RevocationList | None:
        """Apply a signed revocation list (its bytes) if it is newer than the one in force; the list
        now in force if it changed, None if ``blob`` was no newer. :class:`CertificateError` when it
        does not verify, or (given ``serial``: the subkey it was stored under) is another serial."""
        revocations = parse_revocations(blob, self.authority, self.swarm, source)
        if serial is not None and serial != revocations.serial:
            raise CertificateError(
                f"{source}: revocation list #{revocations.serial} stored under serial {serial}"
            )
        if self.revocations is not None and revocations.serial <= self.revocations.serial:
            return None
        self.revocations, self.revocation_bytes = revocations, bytes(blob)
        return revocations

    def load_revocations(self, path: str | Path | None) -> None:
        """Apply the revocation list file at ``path`` (nothing for None); errors name the file."""
        if path is not None:
            from greenswarm.security.revocation import read

            read(path, self.authority, self.swarm)  # (the file's own errors: missing, unreadable)
            self.revoke(Path(path).read_bytes(), str(path))

    def revoked(
        self,
        peer_id: str,
        certificate: bytes | None = None,
        signed_at: float | None = None,
        expires: float | None = None,
    ) -> str | None:
        """Why ``peer_id`` (holding ``certificate``; by default the one it last showed here) is revoked,
        or None. ``signed_at`` and ``expires``: for a DHT record, which counts only if signed after
        the revocation -- a record stored before it stays readable until it expires (see
        :mod:`greenswarm.security.revocation`), and readers ignore it. The signer chooses its
        ``signed_at``, so a record that says it was signed before the revocation must also expire
        within :data:`REVOKED_GRACE_S` of it: a revoked peer cannot backdate records that live on."""
        if self.revocations is None:
            return None
        if certificate is None:
            certificate = self._shown.get(peer_id)
        entry = self.revocations.revoked(peer_id, certificate)
        if entry is None:
            return None
        if signed_at is not None and signed_at < entry.revoked_at:
            if expires is None or expires <= entry.revoked_at + REVOKED_GRACE_S:
                return None
        return self.revocations.describe(entry)

    def check(
        self,
        certificate: Any,
        peer_id: str,
        now: float | None = None,
        signed_at: float | None = None,
        expires: float | None = None,
    ) -> Membership:
        """The membership of ``peer_id`` proven by ``certificate`` (bytes a peer showed); raises
        :class:`CertificateError` naming the peer and what failed (``signed_at``, ``expires``: see
        :meth:`revoked`)."""
        source = f"certificate of peer {peer_id}"
        if not certificate:
            raise CertificateError(f"peer {peer_id} showed no membership certificate")
        if not isinstance(certificate, bytes | bytearray):
            raise CertificateError(f"{source}: not a certificate ({type(certificate).__name__})")
        digest = hashlib.sha256(certificate).digest()
        membership = self._checked.get(digest)
        if membership is None:
            from cryptography.hazmat.primitives.asymmetric import ed25519

            membership, signature = parse_certificate(bytes(certificate), source)
            authority = ed25519.Ed25519PublicKey.from_public_bytes(self.authority)
            check_signature(membership, signature, authority, source)
            if len(self._checked) >= _CACHE_SIZE:
                self._checked.clear()
            self._checked[digest] = membership
        # the cheap half runs every time: a certificate that was valid a minute ago may have expired,
        # or been revoked
        checked = check_binding(membership, source, swarm=self.swarm, peer_id=peer_id, now=now)
        if len(self._shown) >= _CACHE_SIZE:
            self._shown.clear()
        self._shown[peer_id] = bytes(certificate)
        why = self.revoked(peer_id, bytes(certificate), signed_at, expires)
        if why is not None:
            raise CertificateError(f"{source}: {why}")
        return checked

    def is_member(self, certificate: Any, peer_id: str, now: float | None = None) -> bool:
        try:
            self.check(certificate, peer_id, now)
        except CertificateError:
            return False
        return True

    def __getstate__(self) -> dict[str, Any]:
        return {
            "swarm": self.swarm,
            "authority": self.authority,
            "certificate": self.certificate,
            "revocations": self.revocations,
            "revocation_bytes": self.revocation_bytes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


class RefusalLog:
    """One warning line per distinct refusal per ``every_s`` seconds: an outsider that floods a site
    with requests or records must not flood its log too."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0):
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, float] = {}

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(message, float("-inf")) < self.every_s:
            return
        if len(self._last) > 1024:
            self._last.clear()
        self._last[message] = now
        self.logger.warning("%s", message)
