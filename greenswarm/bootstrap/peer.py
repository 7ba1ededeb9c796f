"""The bootstrap peer: a DHT peer with a stable identity that sites dial first and relay through.

It holds no model and takes no part in averaging; it only keeps the DHT reachable (sites store their
progress records and find averaging groups through it) and, as a public libp2p peer, runs the
circuit-relay service through which sites behind NAT reach each other (docs/nat.md).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.errors import ConfigError
from greenswarm.network import check_maddr, relay_service_options, start_dht, visible_peer_maddrs
from greenswarm.node.progress import record_validators

log = logging.getLogger("greenswarm.bootstrap")


@dataclass
class BootstrapConfig:
    """``listen``: where to accept connections; ``announce``: the public addresses to advertise
    (behind a port forward or in a cloud VM, the public IP); ``identity``: the key file that keeps the
    peer id stable across restarts; ``swarm``: the swarm whose records this peer validates."""

    identity: str
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce: list[str] = field(default_factory=list)
    swarm: str = "greenswarm"
    initial_peers: list[str] = field(default_factory=list)  # other bootstrap peers, for redundancy
    relay: bool = True  # carry connections for sites behind NAT (circuit relay with raised limits)

    def validate(self) -> None:
        if not self.listen:
            raise ConfigError("give at least one address to listen on", field="listen")
        for m in self.listen:
            check_maddr(m, "listen", need_peer_id=False)
        for m in self.announce:
            check_maddr(m, "announce", need_peer_id=False)
        for m in self.initial_peers:
            check_maddr(m, "initial_peers", need_peer_id=True)


class BootstrapPeer:
    """Runs until :meth:`stop`; :attr:`initial_peers` is what sites pass as ``--initial-peers``."""

    def __init__(self, cfg: BootstrapConfig):
        self.cfg = cfg
        self.peer_id = load_or_create_identity(cfg.identity)
        self._stopped = threading.Event()
        if cfg.relay:
            # p2pd starts a second relay service with go-libp2p's defaults (128 KiB and 2 min per
            # connection) that races the configured one; with one Go thread the configured one
            # registers first (docs/nat.md). An operator's own GOMAXPROCS wins.
            os.environ.setdefault("GOMAXPROCS", "1")
        self.dht = start_dht(
            cfg.initial_peers,
            host_maddrs=cfg.listen,
            announce_maddrs=cfg.announce,
            identity_path=cfg.identity,
            record_validators=record_validators(cfg.swarm),
            **(relay_service_options() if cfg.relay else {}),
        )
        self.initial_peers = visible_peer_maddrs(self.dht)

    def wait(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    def shutdown(self) -> None:
        self.dht.shutdown()


def serve(cfg: BootstrapConfig, as_json: bool = False) -> int:
    """``greenswarm bootstrap``: run the peer until SIGINT/SIGTERM, then exit with no daemon left."""
    import json

    from greenswarm.procs import on_termination, reap_children

    peer = BootstrapPeer(cfg)
    on_termination(peer.stop)
    try:
        if as_json:
            print(json.dumps({"peer_id": peer.peer_id, "initial_peers": peer.initial_peers}), flush=True)
        else:
            print(f"bootstrap peer {peer.peer_id} is up (swarm '{cfg.swarm}'). Sites join with:", flush=True)
            print(f"  --initial-peers {' '.join(peer.initial_peers)}", flush=True)
        peer.wait()
    finally:
        peer.shutdown()
        reap_children()
    log.info("bootstrap peer stopped")
    return 0
