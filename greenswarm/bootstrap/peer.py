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
from typing import TYPE_CHECKING

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.bootstrap.metrics import BootstrapCollector, loopback_address
from greenswarm.bootstrap.relay_check import check_address, relay_carries
from greenswarm.errors import ConfigError, SwarmError
from greenswarm.network import (
    check_maddr,
    relay_service_options,
    start_dht,
    visible_peer_maddrs,
    with_p2pd_metrics,
)
from greenswarm.node.metrics import open_endpoint
from greenswarm.node.progress import record_validators
from greenswarm.security.admission import Admission

if TYPE_CHECKING:
    from hivemind import DHT

log = logging.getLogger("greenswarm.bootstrap")

#: How many times the bootstrap restarts its p2p daemon until the relay check passes.
RELAY_ATTEMPTS = 8


@dataclass
class BootstrapConfig:
    """``listen``: where to accept connections; ``announce``: the public addresses to advertise
    (behind a port forward or in a cloud VM, the public IP); ``identity``: the key file that keeps the
    peer id stable across restarts; ``swarm``: the swarm whose records this peer validates;
    ``authority``: that swarm's authority public key, in a certified swarm (the bootstrap then stores
    members' records only: an intruder's entry stored next to theirs would make readers drop them);
    ``metrics_port``: serve Prometheus metrics on ``metrics_host:metrics_port`` (None or 0: off)."""

    identity: str
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce: list[str] = field(default_factory=list)
    swarm: str = "greenswarm"
    initial_peers: list[str] = field(default_factory=list)  # other bootstrap peers, for redundancy
    relay: bool = True  # carry connections for sites behind NAT (circuit relay with raised limits)
    authority: str | None = None  # the swarm authority's public key (.pub), in a certified swarm
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def validate(self) -> None:
        if not self.listen:
            raise ConfigError("give at least one address to listen on", field="listen")
        for m in self.listen:
            check_maddr(m, "listen", need_peer_id=False)
        for m in self.announce:
            check_maddr(m, "announce", need_peer_id=False)
        for m in self.initial_peers:
            check_maddr(m, "initial_peers", need_peer_id=True)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"must be a TCP port (0 or unset: off), got {self.metrics_port}", field="metrics_port"
            )
        if not self.metrics_host.strip():
            raise ConfigError("must name an address to bind (127.0.0.1 by default)", field="metrics_host")


class BootstrapPeer:
    """Runs until :meth:`stop`; :attr:`initial_peers` is what sites pass as ``--initial-peers``."""

    def __init__(self, cfg: BootstrapConfig):
        self.cfg = cfg
        self.peer_id = load_or_create_identity(cfg.identity)
        self.admission = Admission.from_files(cfg.swarm, cfg.authority) if cfg.authority else None
        self._stopped = threading.Event()
        # with metrics, the daemon's own (the relay's counters) on a private port; see bootstrap/metrics.py
        self.p2pd_metrics = loopback_address() if cfg.metrics_port else None
        if cfg.relay:
            # p2pd starts a second relay service with go-libp2p's defaults (128 KiB and 2 min per
            # connection) that races the configured one; with one Go thread the configured one
            # usually registers first (docs/nat.md). An operator's own GOMAXPROCS wins.
            os.environ.setdefault("GOMAXPROCS", "1")
        self.relay_check = "off" if not cfg.relay else "skipped: listening on loopback only"
        for attempt in range(1, RELAY_ATTEMPTS + 1):
            self.dht = self._start()
            self.initial_peers = visible_peer_maddrs(self.dht)
            if not cfg.relay or all("/127.0.0.1/" in m or "/::1/" in m for m in cfg.listen):
                break
            # ... so make sure: push a long stream through the relay, restart the daemon if it broke
            ok, why = relay_carries(check_address(cfg.listen, self.initial_peers, self.peer_id))
            self.relay_check = f"{'passed' if ok else 'failed'} (attempt {attempt}): {why}"
            if ok:
                log.info("relay check passed on attempt %d: %s", attempt, why)
                break
            log.warning(
                "relay check failed (%s); restarting the p2p daemon, attempt %d of %d",
                why,
                attempt,
                RELAY_ATTEMPTS,
            )
            self.dht.shutdown()
        else:
            raise SwarmError(
                f"the relay service kept its default 128 KiB limit after {RELAY_ATTEMPTS} restarts ({why}); "
                "run with --no-relay, or report this with the log"
            )

    def _start(self) -> DHT:
        cfg = self.cfg
        options = relay_service_options() if cfg.relay else {}
        if self.p2pd_metrics:
            options = with_p2pd_metrics(options, self.p2pd_metrics)
        return start_dht(
            cfg.initial_peers,
            host_maddrs=cfg.listen,
            announce_maddrs=cfg.announce,
            identity_path=cfg.identity,
            record_validators=record_validators(cfg.swarm, self.admission),
            **options,
        )

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

    # bound first: a port in use is one line at once, before the daemon and the relay check
    endpoint = open_endpoint(cfg.metrics_host, cfg.metrics_port, "--metrics-port", "--metrics-host")
    try:
        peer = BootstrapPeer(cfg)
    except BaseException:
        if endpoint is not None:
            endpoint.close()
        raise
    on_termination(peer.stop)
    if endpoint is not None:
        endpoint.register(BootstrapCollector(peer))
    try:
        if as_json:
            print(
                json.dumps(
                    {
                        "peer_id": peer.peer_id,
                        "initial_peers": peer.initial_peers,
                        "relay_check": peer.relay_check,
                    }
                ),
                flush=True,
            )
        else:
            print(f"bootstrap peer {peer.peer_id} is up (swarm '{cfg.swarm}'). Sites join with:", flush=True)
            print(f"  --initial-peers {' '.join(peer.initial_peers)}", flush=True)
            print(f"relay for sites behind NAT: {peer.relay_check}", flush=True)
        peer.wait()
    finally:
        if endpoint is not None:
            endpoint.close()
        peer.shutdown()
        reap_children()
    log.info("bootstrap peer stopped")
    return 0
