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
from greenswarm.bootstrap.relay_gate import GatedRelay
from greenswarm.errors import ConfigError, SwarmError
from greenswarm.network import (
    RELAY_DATA_GIB,
    RELAY_HOURS,
    check_maddr,
    no_relay_options,
    relay_service_options,
    start_dht,
    visible_peer_maddrs,
    with_p2pd_metrics,
)
from greenswarm.node.metrics import open_endpoint
from greenswarm.node.progress import record_validators
from greenswarm.node.revocations import RevocationWatch
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
    ``revocations``: the authority's revocation list file, whose members it refuses and which it keeps
    on the DHT (:mod:`greenswarm.security.revocation`);
    ``metrics_port``: serve Prometheus metrics on ``metrics_host:metrics_port`` (None or 0: off)."""

    identity: str
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce: list[str] = field(default_factory=list)
    swarm: str = "greenswarm"
    initial_peers: list[str] = field(default_factory=list)  # other bootstrap peers, for redundancy
    relay: bool = True  # carry connections for sites behind NAT (circuit relay with raised limits)
    authority: str | None = None  # the swarm authority's public key (.pub), in a certified swarm
    revocations: str | None = None  # the authority's revocation list file, in a certified swarm
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    relay_port: int | None = None  # the gated relay's port (None: the listen port + 1, or any)
    relay_data_gib: float = RELAY_DATA_GIB  # what one relayed connection carries each way, at most
    relay_hours: float = RELAY_HOURS  # how long one relayed connection lasts, at most

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
        if self.relay_port is not None and not 0 <= self.relay_port <= 65535:
            raise ConfigError(f"must be a TCP port, got {self.relay_port}", field="relay_port")
        for name in ("relay_data_gib", "relay_hours"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigError(f"must be a number > 0, got {value!r}", field=name)
        if self.revocations and not self.authority:
            raise ConfigError("a revocation list needs --authority to be checked", field="revocations")
        if not self.metrics_host.strip():
            raise ConfigError("must name an address to bind (127.0.0.1 by default)", field="metrics_host")


class BootstrapPeer:
    """Runs until :meth:`stop`; :attr:`initial_peers` is what sites pass as ``--initial-peers``."""

    def __init__(self, cfg: BootstrapConfig):
        self.cfg = cfg
        self.peer_id = load_or_create_identity(cfg.identity)
        self.admission = Admission.from_files(cfg.swarm, cfg.authority) if cfg.authority else None
        if self.admission is not None:
            self.admission.load_revocations(cfg.revocations)  # (in the DHT's validator from the start)
        self._stopped = threading.Event()
        # with metrics, the daemon's own (the relay's counters) on a private port; see bootstrap/metrics.py
        self.p2pd_metrics = loopback_address() if cfg.metrics_port else None
        if cfg.relay:
            # p2pd starts a second relay service with go-libp2p's defaults (128 KiB and 2 min per
            # connection) that races the configured one; with one Go thread the configured one
            # usually registers first (docs/nat.md). An operator's own GOMAXPROCS wins.
            os.environ.setdefault("GOMAXPROCS", "1")
        self.relay_check = "off"
        # a certified swarm's relay is its own daemon behind a gate that lets members in only
        # (bootstrap/relay_gate.py); an open swarm's bootstrap relays on its DHT daemon, bounded
        gated = cfg.relay and self.admission is not None
        self.gated: GatedRelay | None = None
        self.relays: list[str] = []  # where sites reach the relay
        self.dht: DHT | None = None
        try:
            self._start_all(gated)
        except BaseException:  # (a gate port in use, a relay that never passed): stop what started
            if self.gated is not None:
                self.gated.close()
            if self.dht is not None:
                self.dht.shutdown()
            raise

    def _start_all(self, gated: bool) -> None:
        """The DHT daemon, the relay (gated or not) checked until it carries a long stream, and the
        revocation watch."""
        cfg = self.cfg
        why = ""
        for attempt in range(1, RELAY_ATTEMPTS + 1):
            if attempt == 1 or not gated:
                self.dht = self._start(relay_service=cfg.relay and not gated)
                self.initial_peers = visible_peer_maddrs(self.dht)
            if gated:
                if self.gated is None:
                    self.gated = self._gate()
                    self.relays = self.gated.start(self.dht, self.initial_peers)
                else:
                    self.gated.restart_daemon()
                target = self._gate_check_address()
            else:
                self.relays = list(self.initial_peers) if cfg.relay else []
                target = check_address(cfg.listen, self.initial_peers, self.peer_id)
            if not cfg.relay:
                break
            # ... so make sure: push a long stream through the relay, restart the daemon if it broke. On
            # loopback too (0.6-0.8 s): sites on this machine with reachability: relay use this relay,
            # and when the default won under load every one of their rounds failed (test_metrics)
            ok, why = relay_carries(target)
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
            if not gated:
                self.dht.shutdown()
        else:
            raise SwarmError(
                f"the relay service kept its default 128 KiB limit after {RELAY_ATTEMPTS} restarts ({why}); "
                "run with --no-relay, or report this with the log"
            )
        # a certified swarm's revocation lists: kept on the DHT (the given file's first), newer ones
        # followed; a revoked member's relay pass is withdrawn
        self.revocations = None
        if self.admission is not None:
            withdraw = self.gated.withdraw_revoked if self.gated is not None else None
            self.revocations = RevocationWatch(self.dht, self.admission, self.peer_id, withdraw)

    def _gate(self) -> GatedRelay:
        """The members-only relay: its gate listens where the bootstrap does, on ``relay_port``."""
        cfg = self.cfg
        host, port = _host_port(cfg.listen)
        gate_port = cfg.relay_port if cfg.relay_port is not None else (port + 1 if port else 0)
        own = {m.split("/")[2] for m in self.initial_peers if m.split("/")[1] in ("ip4", "ip6")}
        options = relay_service_options(cfg.relay_data_gib, cfg.relay_hours)
        if self.p2pd_metrics:  # the relay's counters are the relay daemon's
            options = with_p2pd_metrics(options, self.p2pd_metrics)
        assert self.admission is not None
        return GatedRelay(self.admission, cfg.identity, host, gate_port, own, options["force_reachability"])

    def _gate_check_address(self) -> str:
        """The relay's address for the relay check's local peers: loopback where the gate listens there."""
        assert self.gated is not None
        if self.gated.listen_host in ("0.0.0.0", "127.0.0.1", "::"):
            return f"/ip4/127.0.0.1/tcp/{self.gated.gate.port}/p2p/{self.gated.peer_id}"
        return self.relays[0]

    def _start(self, relay_service: bool) -> DHT:
        cfg = self.cfg
        if relay_service:
            options = relay_service_options(cfg.relay_data_gib, cfg.relay_hours)
        else:
            options = no_relay_options() if cfg.relay else {}
        if self.p2pd_metrics and relay_service:
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
        if self.revocations is not None:
            self.revocations.close()
        if self.gated is not None:
            self.gated.close()
        self.dht.shutdown()


def _host_port(listen: list[str]) -> tuple[str, int]:
    """The host and port of the first TCP address the bootstrap listens on."""
    for m in listen:
        parts = m.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            return parts[2], int(parts[4])
    return "0.0.0.0", 0


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
        reap_children()
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
                        "relays": peer.relays,
                    }
                ),
                flush=True,
            )
        else:
            print(f"bootstrap peer {peer.peer_id} is up (swarm '{cfg.swarm}'). Sites join with:", flush=True)
            print(f"  --initial-peers {' '.join(peer.initial_peers)}", flush=True)
            print(f"relay for sites behind NAT: {peer.relay_check}", flush=True)
            if peer.gated is not None:
                print(f"  members only, at {' '.join(peer.relays)} (sites find it themselves)", flush=True)
        peer.wait()
    finally:
        if endpoint is not None:
            endpoint.close()
        peer.shutdown()
        reap_children()
    log.info("bootstrap peer stopped")
    return 0
