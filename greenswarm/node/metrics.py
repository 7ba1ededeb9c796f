"""A Prometheus endpoint for a site (``node.metrics_port``), and the HTTP endpoint the bootstrap's shares.

The site already counts everything an operator watches: its counters (:class:`~greenswarm.node.
site_stats.SiteStats`, checkpointed), its energy ledger, its federation's wire formats, its round
log, its last progress record. :class:`SiteCollector` keeps no numbers of its own: it reads those at
scrape time, so a scrape can never disagree with the summary or the progress table, and the training
loop pays nothing between scrapes. It reads them from the HTTP server's thread without a lock, which
is safe for what it reads: numbers and references the loop replaces whole, and dicts it copies first
(a C-level copy the loop cannot interleave with). It never calls into the schedule of a live signal
or a deadline plan (their lookups move state); their window comes from the last progress record.

:class:`MetricsEndpoint` serves one private registry per process (never the library's global one: a
test or a demo may run several in one process). It binds before the node joins the swarm, so a port
already in use is one line naming the field at once, not a traceback after the join.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import socket
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from greenswarm.errors import ConfigError
from greenswarm.node.round_log import RoundLog
from greenswarm.node.telemetry import RunningSite
from greenswarm.scheduler.policy import WindowSchedule
from greenswarm.scheduler.state import SiteState

log = logging.getLogger("greenswarm.metrics")

#: how long a scrape waits for the p2p daemon's list of connections (Prometheus's default scrape
#: timeout is 10 s; a daemon that does not answer drops one gauge, not the scrape)
PEERS_TIMEOUT_S = 2.0

#: ``rounds_total``'s ``outcome`` label for each of the site's round counters (``SiteStats.counts``)
ROUND_OUTCOMES = {
    "federated_rounds": "federated",
    "solo_rounds": "solo",
    "failed_rounds": "failed",
    "resyncs": "resync",
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (an IP on loopback, or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


#: the endpoints' listening sockets. Helper processes forked while one is open (hivemind's DHT and
#: averager fork) close their copy at once: one that outlived its node would hold the port, and the
#: node restarted after a crash would find its own port in use.
_LISTENING: set[socket.socket] = set()


def _close_inherited() -> None:
    for sock in list(_LISTENING):
        sock.close()
    _LISTENING.clear()


os.register_at_fork(after_in_child=_close_inherited)


class MetricsEndpoint:
    """``/metrics`` over HTTP for one private registry (process metrics included), on its own thread.

    ``port_field`` names the setting in errors (``node.metrics_port``, ``--metrics-port``): a port in
    use, or a host this machine cannot bind, is a :class:`ConfigError` of one line. Bound to a host
    other than loopback, it says once that anyone who can reach the port can read the site's metrics.
    """

    def __init__(self, host: str, port: int, port_field: str):
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # CPU seconds, memory, open files of this process
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:  # EADDRINUSE, EADDRNOTAVAIL, an unknown host name (socket.gaierror)
            in_use = err.errno == errno.EADDRINUSE
            why = "is already in use" if in_use else f"cannot be bound ({err.strerror or err})"
            raise ConfigError(f"{host}:{port} {why}; pick another port", field=port_field) from None
        self.host, self.port = host, int(self._server.server_address[1])
        _LISTENING.add(self._server.socket)
        if is_loopback(host):
            log.info("serving http://%s:%d/metrics", host, self.port)
        else:
            log.warning(
                "serving http://%s:%d/metrics beyond this machine: whoever reaches the port reads "
                "what this process reports (firewall it, or bind 127.0.0.1)",
                host,
                self.port,
            )

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def close(self) -> None:
        _LISTENING.discard(self._server.socket)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def open_endpoint(host: str, port: int | None, port_field: str) -> MetricsEndpoint | None:
    """The endpoint ``port`` asks for, or None when metrics are off (None or 0)."""
    return MetricsEndpoint(host, port, port_field) if port else None


def peers_by_path(connections: dict[str, list[str]]) -> dict[str, int]:
    """How many connected peers are reached directly, and how many only through a relay (every address
    a ``/p2p-circuit`` one)."""
    relayed = sum(1 for addrs in connections.values() if addrs and all("/p2p-circuit" in a for a in addrs))
    return {"direct": len(connections) - relayed, "relay": relayed}


def peers_gauge(name: str, doc: str, connections: dict[str, list[str]]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc, labels=["path"])
    for path, count in peers_by_path(connections).items():
        gauge.add_metric([path], count)
    return gauge


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    """One unlabelled gauge, or nothing when the value is not known (better absent than a made-up 0)."""
    if value is not None and math.isfinite(value):
        yield GaugeMetricFamily(name, doc, value=float(value))


def _by_state(name: str, doc: str, values: dict[str, float]) -> CounterMetricFamily:
    counter = CounterMetricFamily(name, doc, labels=["state"])
    for state in SiteState:
        counter.add_metric([state.value], float(values.get(state.value, 0.0)))
    return counter


class MeteredSite(RunningSite, Protocol):
    """What the metrics read of a :class:`~greenswarm.node.site.SiteNode` beyond what its telemetry reads."""

    round_log: RoundLog


class SiteCollector(Collector):
    """Describes a running :class:`~greenswarm.node.site.SiteNode` at scrape time (rank 0).

    Parts the node has not made yet (before it joined the swarm) are left out of the scrape.
    """

    def __init__(self, node: MeteredSite):
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        cfg, stats, swarm = node.cfg, node.stats, node.swarm
        info = GaugeMetricFamily(
            "greenswarm_site_info",
            "This site: its name, grid region, swarm and peer id",
            labels=["site", "region", "swarm", "peer_id"],
        )
        info.add_metric([cfg.name, cfg.region, cfg.swarm.name, node.peer_id], 1)
        yield info
        current = node.state
        state = GaugeMetricFamily("greenswarm_state", "1 for the state the site is in", labels=["state"])
        for s in SiteState:
            state.add_metric([s.value], 1 if s is current else 0)
        yield state

        # training
        yield CounterMetricFamily("greenswarm_tokens", "Tokens this site trained on", value=stats.tokens)
        yield CounterMetricFamily(
            "greenswarm_local_steps", "Inner optimizer steps this site took", value=stats.local_steps
        )
        yield from _gauge("greenswarm_loss", "Training loss (moving average of the inner steps')", stats.loss)
        yield from _gauge("greenswarm_eval_loss", "The global model's last held-out loss", stats.eval_loss)
        global_state = getattr(node, "global_state", None)  # (made when the node starts)
        if global_state is not None:
            yield GaugeMetricFamily(
                "greenswarm_outer_step",
                "Outer steps in this site's global model",
                value=global_state.outer_round,
            )

        # rounds
        counts = dict(stats.counts)
        rounds = CounterMetricFamily(
            "greenswarm_rounds", "Rounds this site ended, by outcome (checkpointed)", labels=["outcome"]
        )
        for key, outcome in ROUND_OUTCOMES.items():
            rounds.add_metric([outcome], counts.get(key, 0))
        yield rounds
        yield CounterMetricFamily(
            "greenswarm_catch_ups", "More advanced global states this site adopted", value=counts["catch_ups"]
        )
        yield CounterMetricFamily(
            "greenswarm_refused_updates",
            "Groupmates' updates refused before averaging (NaN/Inf, norm far outside the group's)",
            value=counts["refused_updates"],
        )
        totals = node.round_log.totals
        yield SummaryMetricFamily(
            "greenswarm_round_seconds",
            "Averaging attempts: matchmaking and the all-reduce (wall seconds, this process)",
            count_value=totals.attempts,
            sum_value=totals.round_s,
        )
        yield SummaryMetricFamily(
            "greenswarm_round_blocked_seconds",
            "How long each round held training up (wall seconds, this process)",
            count_value=totals.rounds,
            sum_value=totals.blocked_s,
        )
        federation = node.federation
        if federation is not None:
            wire_bytes = CounterMetricFamily(
                "greenswarm_wire_bytes",
                "Bytes this site sent in its completed all-reduces (it received as many), by wire format: "
                "the format's nominal size, before any entropy stage, without protocol overhead",
                labels=["format"],
            )
            for fmt, count in sorted(dict(federation.wire_bytes).items()):
                wire_bytes.add_metric([fmt], count)
            yield wire_bytes
            wire_rounds = CounterMetricFamily(
                "greenswarm_wire_rounds", "Averaged rounds by wire format", labels=["format"]
            )
            for fmt, count in sorted(dict(federation.wire_rounds).items()):
                wire_rounds.add_metric([fmt], count)
            yield wire_rounds

        # energy and the grid
        ledger = node.ledger
        yield _by_state("greenswarm_energy_kwh", "Energy this site drew, by state (kWh)", dict(ledger.kwh))
        yield _by_state(
            "greenswarm_emissions_grams", "Emissions of that energy, by state (gCO2)", dict(ledger.grams)
        )
        yield _by_state(
            "greenswarm_state_seconds",
            "Clock seconds spent in each state (trace time in a replay)",
            dict(ledger.seconds),
        )
        now = node.clock.now()
        yield GaugeMetricFamily(
            "greenswarm_clock_timestamp_seconds", "The site's clock (trace time in a replay)", value=now
        )
        trace = ledger.trace  # (None: a live signal before its first sample)
        if trace is not None:
            yield GaugeMetricFamily(
                "greenswarm_grid_intensity_grams_per_kwh",
                "The grid's carbon intensity now, as the site books it (gCO2/kWh)",
                value=trace.intensity(ledger.region, now),
            )
        yield from self._window(now)

        # the swarm
        if swarm is not None:
            try:
                connections = swarm.connections(timeout_s=PEERS_TIMEOUT_S)
            except Exception as err:  # the daemon did not answer: one gauge fewer, not a failed scrape
                log.debug("metrics: cannot list connections: %r", err)
            else:
                yield peers_gauge(
                    "greenswarm_peers_connected",
                    "Peers the site's p2p daemon is connected to: directly, or only through a relay",
                    connections,
                )

    def _window(self, now: float) -> Iterator[Metric]:
        """Whether the site is in a window, when it ends and when the next one starts (clock time).

        A fixed schedule is asked directly (its lookups only read); a live signal or a deadline plan
        moves state when asked, so their answer is the one the loop put in its last progress record.
        """
        node, end, start = self.node, None, None
        schedule = node.schedule
        if isinstance(schedule, WindowSchedule):
            window, upcoming = schedule.current(now), schedule.next_window(now)
            inside = window is not None
            end, start = (window.end if window else None), (upcoming.start if upcoming else None)
        else:
            record = node.swarm.publisher.last_record if node.swarm is not None else None
            if record is None:
                return
            inside, end, start = record.in_window, record.window_end, record.next_start
        yield GaugeMetricFamily(
            "greenswarm_in_window", "1 while the site's window is open", value=int(inside)
        )
        yield from _gauge(
            "greenswarm_window_end_timestamp_seconds", "When the open window closes (clock time)", end
        )
        yield from _gauge(
            "greenswarm_next_window_start_timestamp_seconds", "When the next window opens (clock time)", start
        )


def serve_site_metrics(node: MeteredSite) -> MetricsEndpoint | None:
    """The site's endpoint (``node.metrics_port``; None when off), describing ``node`` from now on."""
    cfg = node.cfg.node
    endpoint = open_endpoint(cfg.metrics_host, cfg.metrics_port, "node.metrics_port")
    if endpoint is not None:
        endpoint.register(SiteCollector(node))
    return endpoint
