"""Swarm admission: an authority key, and membership certificates that bind a site to its peer id.

greenswarm has no central server to hand out tokens, so admission is carried by signatures. Whoever
runs a swarm creates an **authority** (``greenswarm swarm init``): an Ed25519 key pair. The private
half stays with the operator (mode 0600); the public half (``*.pub``) goes to every site. For each
site the operator issues a **membership certificate** (``greenswarm swarm admit``) that binds the
site's name and grid region to its libp2p peer id -- the id its identity file proves -- for a
limited time. A certificate is a small JSON file: the signed fields, and an Ed25519 signature over
their canonical encoding.

A certificate is valid for a peer when the signature verifies with the swarm's authority key, the
swarm name matches, the peer id is the peer's own, and the current time is inside ``[issued,
expires)``. Every refusal says which of these failed (:class:`CertificateError`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from datetime import UTC
from pathlib import Path

from greenswarm.errors import GreenswarmError
from greenswarm.private_files import write_private
from greenswarm.timefmt import parse_iso, utc_second

FORMAT = "greenswarm-membership/1"
PUBLIC_SUFFIX = ".pub"


class CertificateError(GreenswarmError):
    """A key or certificate is missing, unreadable, forged, expired or not this peer's."""


@dataclass(frozen=True)
class Membership:
    """The signed fields of a membership certificate."""

    swarm: str
    site: str
    region: str
    peer_id: str
    issued: float  # unix seconds
    expires: float  # unix seconds
    authority: str  # fingerprint of the authority's public key (which key signed it)
    format: str = FORMAT
    # the most tokens a second this site may claim in a round (None: only the swarm's averaging bound)
    max_tokens_per_s: float | None = None

    def fields(self) -> dict:
        """The signed fields; an optional one left unset is left out, so a certificate issued before
        the field existed keeps its signature."""
        return {k: v for k, v in asdict(self).items() if v is not None or k in _REQUIRED}

    def canonical(self) -> bytes:
        """The exact bytes that are signed: sorted keys, no whitespace."""
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":")).encode()


_REQUIRED = frozenset(("swarm", "site", "region", "peer_id", "issued", "expires", "authority", "format"))


def fingerprint(public_raw: bytes) -> str:
    """A short, stable name for an authority public key (hex of its first 8 bytes of SHA-256)."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def create_authority(path: str | Path) -> tuple[Path, Path]:
    """Create an authority key at ``path`` (0600) and its public half at ``path.pub``; refuse to
    overwrite an existing key (losing it would orphan every certificate it signed)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = Path(path)
    if path.exists():
        raise CertificateError(f"{path}: an authority key is already there; refusing to overwrite it")
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    write_private(path, private_pem)
    public = path.with_name(path.name + PUBLIC_SUFFIX)
    public.write_bytes(public_pem)
    return path, public


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{path}: no such {what} file") from None
    except OSError as e:
        raise CertificateError(f"{path}: cannot read {what} file: {e.strerror}") from None


def load_authority(path: str | Path):  # noqa: ANN201  (an Ed25519PrivateKey; cryptography is imported lazily)
    """The authority's private key from ``path``; errors name the file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = Path(path)
    blob = _read(path, "authority key")
    try:
        key = serialization.load_pem_private_key(blob, password=None)
    except (ValueError, TypeError):
        raise CertificateError(f"{path}: not a PEM private key (corrupted authority key?)") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise CertificateError(f"{path}: expected an Ed25519 authority key, got {type(key).__name__}")
    return key


def load_authority_public(path: str | Path):  # noqa: ANN201  (an Ed25519PublicKey)
    """The authority's public key from a ``.pub`` file (or from the private key file itself)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = Path(path)
    blob = _read(path, "authority public key")
    if b"PRIVATE KEY" in blob:
        return load_authority(path).public_key()
    try:
        key = serialization.load_pem_public_key(blob)
    except (ValueError, TypeError):
        raise CertificateError(f"{path}: not a PEM public key (corrupted authority key?)") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise CertificateError(f"{path}: expected an Ed25519 public key, got {type(key).__name__}")
    return key


def raw_public(public) -> bytes:  # noqa: ANN001  (an Ed25519PublicKey)
    """The 32 raw bytes of an Ed25519 public key."""
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def issue(
    authority_path: str | Path,
    *,
    swarm: str,
    site: str,
    region: str,
    peer_id: str,
    valid_s: float,
    out: str | Path,
    now: float | None = None,
    max_tokens_per_s: float | None = None,
) -> Membership:
    """Sign a membership certificate for ``site`` and write it to ``out`` (0600); ``max_tokens_per_s``
    bounds the weight the site may claim in a round (see :mod:`greenswarm.averaging.aggregation`)."""
    from hivemind.p2p import PeerID

    try:
        raw = PeerID.from_base58(peer_id).to_bytes()
    except Exception:
        raw = b""
    if len(raw) < 34 or raw[:1] not in (b"\x00", b"\x12"):  # an identity or sha2-256 multihash
        raise CertificateError(f"--peer-id: {peer_id!r} is not a libp2p peer id (12D3KooW...)")
    if not valid_s > 0:
        raise CertificateError(f"--expires: the certificate must be valid for some time, got {valid_s} s")
    if max_tokens_per_s is not None and not (max_tokens_per_s > 0 and max_tokens_per_s < float("inf")):
        raise CertificateError(f"--max-tokens-per-s: must be a number > 0, got {max_tokens_per_s:g}")
    key = load_authority(authority_path)
    issued = time.time() if now is None else now
    membership = Membership(
        swarm=swarm,
        site=site,
        region=region,
        peer_id=peer_id,
        issued=issued,
        expires=issued + valid_s,
        authority=fingerprint(raw_public(key.public_key())),
        max_tokens_per_s=float(max_tokens_per_s) if max_tokens_per_s is not None else None,
    )
    signature = base64.b64encode(key.sign(membership.canonical())).decode()
    blob = json.dumps({"membership": membership.fields(), "signature": signature}, indent=2) + "\n"
    write_private(Path(out), blob.encode())
    return membership


def read_certificate(path: str | Path) -> tuple[Membership, bytes]:
    """The fields and signature of a certificate file (not yet verified); errors name the file."""
    path = Path(path)
    return parse_certificate(_read(path, "certificate"), str(path))


def parse_certificate(blob: bytes, source: str) -> tuple[Membership, bytes]:
    """The fields and signature of a certificate's bytes (a file's, or what a peer sent); ``source``
    names where they came from in every error."""
    try:
        data = json.loads(blob)
        membership = Membership(**data["membership"])
        signature = base64.b64decode(data["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise CertificateError(f"{source}: not a greenswarm membership certificate (corrupted?)") from None
    if membership.format != FORMAT:
        raise CertificateError(f"{source}: unknown certificate format {membership.format!r}")
    return membership, signature


def certificate_id(membership: Membership, signature: bytes) -> str:
    """What names one certificate: the SHA-256 (hex) of its signed fields and signature. Not of a
    file's bytes: the same certificate re-indented, or with other line ends, is the same one."""
    return hashlib.sha256(membership.canonical() + b"." + signature).hexdigest()


def certificate_id_of(blob: bytes) -> str | None:
    """:func:`certificate_id` of a certificate's bytes; None for bytes that hold no certificate."""
    try:
        return certificate_id(*parse_certificate(bytes(blob), "certificate"))
    except CertificateError:
        return None


def verify(
    path: str | Path,
    authority_public,  # noqa: ANN001  (an Ed25519PublicKey)
    *,
    swarm: str | None = None,
    peer_id: str | None = None,
    now: float | None = None,
) -> Membership:
    """Check a certificate file; return its fields, or raise :class:`CertificateError` saying what failed."""
    membership, signature = read_certificate(path)
    check_signature(membership, signature, authority_public, str(path))
    return check_binding(membership, str(path), swarm=swarm, peer_id=peer_id, now=now)


def check_signature(
    membership: Membership,
    signature: bytes,
    authority_public,  # noqa: ANN001  (an Ed25519PublicKey)
    source: str,
) -> None:
    """Raise unless the authority signed exactly these fields (the expensive half of a check)."""
    from cryptography.exceptions import InvalidSignature

    if membership.authority != fingerprint(raw_public(authority_public)):
        raise CertificateError(
            f"{source}: signed by another authority ({membership.authority}), "
            f"not this swarm's ({fingerprint(raw_public(authority_public))})"
        )
    try:
        authority_public.verify(signature, membership.canonical())
    except InvalidSignature:
        raise CertificateError(
            f"{source}: the signature does not match the contents (forged or edited)"
        ) from None


def check_binding(
    membership: Membership,
    source: str,
    *,
    swarm: str | None = None,
    peer_id: str | None = None,
    now: float | None = None,
) -> Membership:
    """Raise unless a (signature-checked) certificate is for ``swarm``, held by ``peer_id``, and valid
    at ``now``; return it."""
    if swarm is not None and membership.swarm != swarm:
        raise CertificateError(f"{source}: issued for swarm {membership.swarm!r}, not {swarm!r}")
    if peer_id is not None and membership.peer_id != peer_id:
        raise CertificateError(
            f"{source}: issued to peer {membership.peer_id}, but this peer is {peer_id} "
            "(a certificate belongs to one identity file)"
        )
    now = time.time() if now is None else now
    if now < membership.issued:
        raise CertificateError(f"{source}: not valid yet (issued for {utc_second(membership.issued)})")
    if now >= membership.expires:
        raise CertificateError(f"{source}: expired at {utc_second(membership.expires)}; ask for a new one")
    return membership


def parse_validity(text: str) -> float:
    """``--expires``: a duration (``30d``, ``12h``, ``90m``) or an ISO date; seconds from now."""
    text = text.strip()
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * units[text[-1]]
    try:  # a date alone is midnight UTC; "Z" is spelled out, so that "2027-01-31Z" reads as UTC too
        when = parse_iso(text.replace("Z", "+00:00"), UTC)
    except ValueError:
        raise CertificateError(
            f"--expires: {text!r} is neither a duration (30d, 12h, 90m) nor an ISO date (2027-01-31)"
        ) from None
    return when - time.time()
