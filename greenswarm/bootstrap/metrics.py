"""The bootstrap peer's Prometheus metrics (``greenswarm bootstrap --metrics-port``).

What the bootstrap does for the swarm happens in its p2p daemon: sites connect to it, and sites behind
NAT reach each other through its circuit relay. The daemon's control API lists the connected peers
but says nothing of the relay, so the bootstrap also starts the daemon with ``-metricsAddr`` on a
private loopback port (:func:`~greenswarm.network.with_p2pd_metrics`), where go-libp2p's relay
service publishes its own counters. :class:`BootstrapCollector` reads both at scrape time and gives
them greenswarm's names; it counts nothing itself. The daemon's numbers cover the daemon's lifetime:
the relay check the bootstrap runs at start on a public address (one connection, 1 MiB; docs/nat.md)
is among them.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Iterator
from typing import Any, Protocol

import requests
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from greenswarm.network import connections
from greenswarm.node.metrics import PEERS_TIMEOUT_S, peers_gauge

log = logging.getLogger("greenswarm.bootstrap.metrics")

#: a metrics page's samples: name -> [(labels, value)]
Samples = dict[str, list[tuple[dict[str, str], float]]]

#: how long a scrape waits for the daemon's own metrics (it answers on loopback in milliseconds)
P2PD_TIMEOUT_S = 2.0


def loopback_address() -> str:
    """A ``127.0.0.1:PORT`` free now, for the daemon's metrics (only this process reads them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def p2pd_samples(addr: str, timeout_s: float = P2PD_TIMEOUT_S) -> Samples:
    """The daemon's metrics at ``addr``: sample name -> [(labels, value)]. Raises when it does not answer."""
    response = requests.get(f"http://{addr}/metrics", timeout=timeout_s)
    response.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (0 when there are none: go-libp2p exports a
    labelled counter only after its first event)."""
    return sum(
        value for have, value in samples.get(name, []) if all(have.get(k) == v for k, v in labels.items())
    )


def relay_metrics(samples: Samples) -> Iterator[Metric]:
    """go-libp2p's relay-service counters (``libp2p_relaysvc_*``), under greenswarm's names. A daemon
    without the relay service (``--no-relay``) has none of them: then only ``relay_up 0``."""
    up = _total(samples, "libp2p_relaysvc_status")
    yield GaugeMetricFamily(
        "greenswarm_bootstrap_relay_up", "1 while the circuit-relay service runs", value=up
    )
    if "libp2p_relaysvc_status" not in samples:
        return
    events = CounterMetricFamily(
        "greenswarm_bootstrap_relayed_connections",
        "Connections the relay carried between two peers: opened and closed",
        labels=["event"],
    )
    opened = _total(samples, "libp2p_relaysvc_connections_total", type="opened")
    closed = _total(samples, "libp2p_relaysvc_connections_total", type="closed")
    events.add_metric(["opened"], opened)
    events.add_metric(["closed"], closed)
    yield events
    yield GaugeMetricFamily(
        "greenswarm_bootstrap_relayed_connections_open",
        "Connections the relay carries now",
        value=max(0.0, opened - closed),
    )
    reserved = _total(samples, "libp2p_relaysvc_reservations_total", type="opened")
    released = _total(samples, "libp2p_relaysvc_reservations_total", type="closed")
    yield GaugeMetricFamily(
        "greenswarm_bootstrap_relay_reservations",
        "Peers holding a relay slot now (sites reached through this bootstrap)",
        value=max(0.0, reserved - released),
    )
    yield CounterMetricFamily(
        "greenswarm_bootstrap_relayed_bytes",
        "Bytes the relay carried, both directions together (go-libp2p's count)",
        value=_total(samples, "libp2p_relaysvc_data_transferred_bytes_total"),
    )


class RunningBootstrap(Protocol):
    """What the metrics read of a :class:`~greenswarm.bootstrap.peer.BootstrapPeer`."""

    cfg: Any  # BootstrapConfig
    peer_id: str
    dht: Any  # hivemind's DHT
    p2pd_metrics: str | None  # where its daemon serves libp2p's metrics
    gated: Any  # its members-only relay (bootstrap/relay_gate.py), None in an open swarm


class BootstrapCollector(Collector):
    """Describes a running :class:`~greenswarm.bootstrap.peer.BootstrapPeer` at scrape time."""

    def __init__(self, peer: RunningBootstrap):
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        peer = self.peer
        info = GaugeMetricFamily(
            "greenswarm_bootstrap_info",
            "This bootstrap peer: its peer id and swarm",
            labels=["peer_id", "swarm"],
        )
        info.add_metric([peer.peer_id, peer.cfg.swarm], 1)
        yield info
        yield from peers_gauge(
            "greenswarm_bootstrap_peers_connected",
            "Peers connected to the bootstrap: directly, or only through a relay",
            functools.partial(connections, peer.dht, timeout_s=PEERS_TIMEOUT_S),
        )
        try:
            samples = p2pd_samples(peer.p2pd_metrics) if peer.p2pd_metrics else None
        except Exception as err:
            log.debug("metrics: the p2p daemon's metrics did not answer: %r", err)
            samples = None
        yield GaugeMetricFamily(
            "greenswarm_bootstrap_p2pd_metrics_up",
            "1 when the p2p daemon's own metrics answered this scrape (the relay's figures come from them)",
            value=int(samples is not None),
        )
        if samples is not None:
            yield from relay_metrics(samples)
        gated = getattr(peer, "gated", None)
        if gated is not None:  # a certified swarm: who the gate in front of the relay let in, and not
            yield GaugeMetricFamily(
                "greenswarm_bootstrap_relay_passes",
                "Members holding a relay pass now",
                value=gated.gate.held(),
            )
            yield CounterMetricFamily(
                "greenswarm_bootstrap_relay_refused",
                "Connections to the members-only relay refused at its gate (no pass: not a member)",
                value=gated.gate.refused,
            )
