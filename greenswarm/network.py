"""Joining the swarm's DHT: multiaddr checks, the swarm config, and a DHT that fails with one clear line.

Every command that talks to the swarm (bootstrap, node, progress) goes through :func:`start_dht`, so
they agree on validators (signed, schema-checked records) and report an unreachable swarm the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from greenswarm.errors import ConfigError, SwarmError

if TYPE_CHECKING:
    from hivemind import DHT

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MADDR_HINT = "expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


def check_maddr(text: str, what: str, need_peer_id: bool) -> str:
    """Validate one multiaddr; ``what`` names the flag or field in the error."""
    from hivemind.utils.multiaddr import Multiaddr

    text = text.strip()
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # the multiaddr library raises several unrelated exception types
        raise ConfigError(f"{text!r} is not a multiaddr ({e}); {MADDR_HINT}", field=what) from None
    names = [p.name for p in maddr.protocols()]
    if not any(n in names for n in ("ip4", "ip6", "dns", "dns4", "dns6")):
        raise ConfigError(f"{text!r} has no /ip4, /ip6 or /dns part; {MADDR_HINT}", field=what)
    if "tcp" not in names and "udp" not in names:
        raise ConfigError(f"{text!r} has no /tcp/PORT part; {MADDR_HINT}", field=what)
    if need_peer_id and "p2p" not in names:
        raise ConfigError(f"{text!r} has no /p2p/PEER_ID part; {MADDR_HINT}", field=what)
    return text


def check_peers(peers: list[str], what: str) -> list[str]:
    """Validate a list of peer multiaddrs (each must name its peer id)."""
    return [check_maddr(p, what, need_peer_id=True) for p in peers]


@dataclass
class SwarmConfig:
    """How a process joins the swarm.

    ``name`` separates swarms that share a DHT: it prefixes every key and averaging group, so two
    experiments on one bootstrap peer never average with each other.
    """

    name: str = "greenswarm"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None

    def validate(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"{self.name!r}: use 1-64 letters, digits, '-' or '_'", field="name")
        check_peers(self.initial_peers, "initial_peers")
        for m in self.host_maddrs:
            check_maddr(m, "host_maddrs", need_peer_id=False)
        for m in self.announce_maddrs:
            check_maddr(m, "announce_maddrs", need_peer_id=False)


def start_dht(
    initial_peers: list[str],
    *,
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    identity_path: str | None = None,
    client_mode: bool = False,
    record_validators: list[Any] | None = None,
    **kwargs: Any,
) -> DHT:
    """Start a hivemind DHT; an unreachable swarm or a taken port becomes a one-line :class:`SwarmError`."""
    from hivemind import DHT
    from hivemind.p2p import P2PDaemonError

    try:
        return DHT(
            initial_peers=initial_peers or None,
            start=True,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            identity_path=identity_path,
            client_mode=client_mode,
            record_validators=record_validators or [],
            check_if_identity_free=False,  # hivemind's check reads RSA keys only; ours are Ed25519
            **kwargs,
        )
    except P2PDaemonError as e:
        text = str(e)
        if "bootstrap" in text:
            peers = ", ".join(initial_peers)
            raise SwarmError(
                f"cannot reach the swarm: none of the initial peers answered ({peers})"
            ) from None
        if "address already in use" in text:
            raise SwarmError(f"cannot listen on {', '.join(host_maddrs)}: address already in use") from None
        raise SwarmError(f"cannot start the p2p daemon: {text}") from None


def visible_peer_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs (with /p2p/ID) others should use to reach this peer, loopback last."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    return sorted(addrs, key=lambda a: ("/127.0.0.1/" in a or "/::1/" in a, a))
