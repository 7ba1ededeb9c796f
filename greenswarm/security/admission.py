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

#: how many signature-checked certificates a process remembers (they are small; peers are few)
_CACHE_SIZE = 4096


@dataclass
class Admission:
    """The rule for who belongs to swarm ``swarm``; ``certificate`` is this process's own (empty for a
    reader such as ``greenswarm progress`` or a bootstrap peer, which check others but show nothing)."""

    swarm: str
    authority: bytes  # raw Ed25519 public key of the swarm authority
    certificate: bytes = b""  # this site's certificate file, as issued
    _checked: dict[bytes, Membership] = field(default_factory=dict, repr=False)

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

    def check(self, certificate: Any, peer_id: str, now: float | None = None) -> Membership:
        """The membership of ``peer_id`` proven by ``certificate`` (bytes a peer showed); raises
        :class:`CertificateError` naming the peer and what failed."""
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
        # the cheap half runs every time: a certificate that was valid a minute ago may have expired
        return check_binding(membership, source, swarm=self.swarm, peer_id=peer_id, now=now)

    def is_member(self, certificate: Any, peer_id: str, now: float | None = None) -> bool:
        try:
            self.check(certificate, peer_id, now)
        except CertificateError:
            return False
        return True

    def __getstate__(self) -> dict[str, Any]:
        return {"swarm": self.swarm, "authority": self.authority, "certificate": self.certificate}

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
