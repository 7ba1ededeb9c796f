"""A Prometheus endpoint for a site (``node.metrics_port``), and the HTTP endpoint the bootstrap's shares.

The site already counts everything an operator watches: its counters (:class:`~greenswarm.node.
site_stats.SiteStats`, checkpointed), its energy ledger, its federation's wire formats, its round log,
its last progress record. :class:`SiteCollector` counts nothing itself: it reads those at scrape time,
so a scrape can never disagree with the summary or the progress table, and the training loop pays
nothing between scrapes. It reads them from the HTTP server's thread without the loop taking a lock
(but for a restore, below), which is safe for what it reads: numbers and references the loop replaces
whole, and dicts it copies first (a C-level copy the loop cannot interleave with). It never calls into
the schedule of a live signal or a deadline plan (their lookups move state); their window comes from
the last progress record.

The one thing it remembers is where the checkpointed totals stood when this process started (once the
node restored them from its checkpoint, which it does inside :meth:`SiteCollector.restoring`, since it
makes its collector before it resumes). A Prometheus counter counts from its
process's start: after a crash, a restarted site's counters start again at 0 (a reset Prometheus
understands), never at its last checkpoint's totals, older than the crash (a drop Prometheus would read
as a reset, and then count the whole total again). The run's totals, checkpoint included, are gauges
beside them (``greenswarm_run_*``).

:class:`MetricsEndpoint` serves one private registry per process (never the library's global one: a
test or a demo may run several in one process). It binds before the node joins the swarm, so a port
already in use is one line naming the field at once, not a traceback after the join.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

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

    ``port_field`` and ``host_field`` name the settings in errors (``node.metrics_port`` and
    ``node.metrics_host``, ``--metrics-port`` and ``--metrics-host``): a port in use is a
    :class:`ConfigError` of one line naming the port's, a host this machine cannot bind (not one of its
    addresses, a name that does not resolve) one naming the host's. Port 0 binds any free port
    (:attr:`port` says which). Bound to a host other than loopback, it says once that anyone who can
    reach the port can read the site's metrics.
    """

    def __init__(self, host: str, port: int, port_field: str, host_field: str):
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # CPU seconds, memory, open files of this process
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:  # EADDRINUSE, EADDRNOTAVAIL, an unknown host name (socket.gaierror)
            raise bind_error(err, host, port, port_field, host_field) from None
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


#: errors binding an address that are the port's fault: in use, or privileged (below 1024, not root)
PORT_ERRNOS = (errno.EADDRINUSE, errno.EACCES)


def bind_error(err: OSError, host: str, port: int, port_field: str, host_field: str) -> ConfigError:
    """The one-line error for an endpoint that could not bind ``host:port``, naming the setting at fault:
    the port's when it is in use (or privileged), the host's otherwise (EADDRNOTAVAIL: not an address
    of this machine; socket.gaierror: a name that does not resolve)."""
    if err.errno == errno.EADDRINUSE:
        return ConfigError(f"{host}:{port} is already in use; pick another port", field=port_field)
    why = f"cannot be bound ({err.strerror or err})"
    if err.errno in PORT_ERRNOS:
        return ConfigError(f"{host}:{port} {why}; pick another port", field=port_field)
    return ConfigError(f"{host}:{port} {why}; give an address of this machine", field=host_field)


def open_endpoint(host: str, port: int | None, port_field: str, host_field: str) -> MetricsEndpoint | None:
    """The endpoint ``port`` asks for, or None when metrics are off (None or 0)."""
    return MetricsEndpoint(host, port, port_field, host_field) if port else None


def peers_by_path(connections: dict[str, list[str]]) -> dict[str, int]:
    """How many connected peers are reached directly, and how many only through a relay (every address
    a ``/p2p-circuit`` one)."""
    relayed = sum(1 for addrs in connections.values() if addrs and all("/p2p-circuit" in a for a in addrs))
    return {"direct": len(connections) - relayed, "relay": relayed}


def peers_gauge(
    name: str, doc: str, list_connections: Callable[[], dict[str, list[str]]]
) -> Iterator[Metric]:
    """Peers by path (direct, relay) from ``list_connections``; nothing when the p2p daemon does not
    answer (one gauge fewer, not a failed scrape)."""
    try:
        connections = list_connections()
    except Exception as err:  # the daemon did not answer in PEERS_TIMEOUT_S
        log.debug("metrics: cannot list connections: %r", err)
        return
    gauge = GaugeMetricFamily(name, doc, labels=["path"])
    for path, count in peers_by_path(connections).items():
        gauge.add_metric([path], count)
    yield gauge


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    """One unlabelled gauge, or nothing when the value is not known (better absent than a made-up 0)."""
    if value is not None and math.isfinite(value):
        yield GaugeMetricFamily(name, doc, value=float(value))


#: a site's checkpointed totals, flat: ``tokens``, ``local_steps``, each of ``SiteStats.counts``, and
#: the energy ledger's ``kwh/<state>``, ``grams/<state>``, ``seconds/<state>``
Totals = dict[str, float]

#: the energy ledger's totals by state: its attribute -> (the metrics' name, what it is)
LEDGER_TOTALS = {
    "kwh": ("energy_kwh", "Energy this site drew by state, kWh"),
    "grams": ("emissions_grams", "Emissions of that energy by state, gCO2"),
    "seconds": ("state_seconds", "Clock seconds spent in each state (trace time in a replay)"),
}


def stats_totals(stats: Any) -> Totals:
    """The checkpointed counters of a :class:`~greenswarm.node.site_stats.SiteStats`."""
    counts = {key: float(n) for key, n in dict(stats.counts).items()}
    return {"tokens": float(stats.tokens), "local_steps": float(stats.local_steps), **counts}


def ledger_totals(ledger: Any) -> Totals:
    """The checkpointed totals of an :class:`~greenswarm.scheduler.energy.EnergyLedger`, by state."""
    return {
        f"{part}/{state}": float(v)
        for part in LEDGER_TOTALS
        for state, v in dict(getattr(ledger, part)).items()
    }


def _nothing(*_: Any) -> Iterator[Metric]:
    """No samples: what a checkpointed total exports while the node restores it."""
    return iter(())


def _counted(
    run: Totals, at_start: Totals, name: str, doc: str, label: str | None, keys: dict[str, str]
) -> Iterator[Metric]:
    """``greenswarm_<name>``, a counter of what this process added to a checkpointed total (the total
    now less the total at its start), and ``greenswarm_run_<name>``, a gauge of the run's total.
    ``keys``: the label's value -> the total's key in ``run`` (one, under "", without a label)."""
    labels = [label] if label else []
    counter = CounterMetricFamily(f"greenswarm_{name}", f"{doc}; since this process started", labels=labels)
    gauge = GaugeMetricFamily(
        f"greenswarm_run_{name}", f"{doc}; over the run, restarts included (checkpointed)", labels=labels
    )
    for value, key in keys.items():
        total = run.get(key, 0.0)
        counter.add_metric([value] if label else [], max(0.0, total - at_start.get(key, 0.0)))
        gauge.add_metric([value] if label else [], total)
    yield counter
    yield gauge


class MeteredSite(RunningSite, Protocol):
    """What the metrics read of a :class:`~greenswarm.node.site.SiteNode` beyond what its telemetry reads."""

    round_log: RoundLog


class SiteCollector(Collector):
    """Describes a running :class:`~greenswarm.node.site.SiteNode` at scrape time (rank 0).

    Parts the node has not made yet (before it joined the swarm) are left out of the scrape.

    The site's checkpointed counters (its :class:`~greenswarm.node.site_stats.SiteStats` and energy
    ledger) are exported twice: as counters of what this process added (the totals now less the totals
    at its start) and as ``greenswarm_run_*`` gauges of the run's totals. The start is when the
    collector is made, and again when the node has restored those parts from a checkpoint inside
    :meth:`restoring` (it makes its collector first: a port in use must fail before the join), so a
    restarted site's counters start at 0, never at its last checkpoint's totals.
    """

    def __init__(self, node: MeteredSite):
        self.node = node
        self._lock = threading.Lock()  # taken briefly by scrapes, and by the node around its restore
        self._restoring = False
        self._count_from_now()

    def _count_from_now(self) -> None:
        self._stats_at_start = stats_totals(self.node.stats)
        self._ledger_at_start = ledger_totals(self.node.ledger)

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Around the node's restore from a checkpoint: the counters count from the restored totals.
        Scrapes meanwhile leave the checkpointed counters and gauges out rather than wait (a big
        checkpoint takes a while to read), so none sees the totals and their start on different sides."""
        with self._lock:
            self._restoring = True
        try:
            yield
        finally:
            with self._lock:
                self._count_from_now()
                self._restoring = False

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

        with self._lock:  # (the totals and their start read on the same side of a restore)
            restoring = self._restoring
            run = {**stats_totals(stats), **ledger_totals(node.ledger)}
            at_start = {**self._stats_at_start, **self._ledger_at_start}
        counted = functools.partial(_counted, run, at_start) if not restoring else _nothing

        # training
        yield from counted("tokens", "Tokens this site trained on", None, {"": "tokens"})
        yield from counted("local_steps", "Inner optimizer steps this site took", None, {"": "local_steps"})
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
        outcomes = {outcome: key for key, outcome in ROUND_OUTCOMES.items()}
        yield from counted("rounds", "Rounds this site ended, by outcome", "outcome", outcomes)
        yield from counted(
            "catch_ups", "More advanced global states this site adopted", None, {"": "catch_ups"}
        )
        yield from counted(
            "refused_updates",
            "Groupmates' updates refused before averaging (NaN/Inf, norm far outside the group's)",
            None,
            {"": "refused_updates"},
        )
        yield from counted(
            "refused_states",
            "States served to this site that their lineage's holders had not signed (refused, not adopted)",
            None,
            {"": "refused_states"},
        )
        yield SummaryMetricFamily(
            "greenswarm_round_seconds",
            "Averaging attempts: matchmaking and the all-reduce (wall seconds, this process)",
            count_value=stats.attempts,
            sum_value=stats.attempt_s,
        )
        totals = node.round_log.totals  # (a round's line is written after its checkpoint)
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
        for part, (name, doc) in LEDGER_TOTALS.items():
            yield from counted(name, doc, "state", {s.value: f"{part}/{s.value}" for s in SiteState})
        ledger = node.ledger
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
            yield from peers_gauge(
                "greenswarm_peers_connected",
                "Peers the site's p2p daemon is connected to: directly, or only through a relay",
                functools.partial(swarm.connections, timeout_s=PEERS_TIMEOUT_S),
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


class SiteMetrics:
    """A site's endpoint and its collector: what the node holds while it runs."""

    def __init__(self, endpoint: MetricsEndpoint, collector: SiteCollector):
        self.endpoint, self.collector = endpoint, collector

    def restoring(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`SiteCollector.restoring`."""
        return self.collector.restoring()

    def close(self) -> None:
        self.endpoint.close()


def serve_site_metrics(node: MeteredSite) -> SiteMetrics | None:
    """The site's endpoint (``node.metrics_port``; None when off), describing ``node`` from now on."""
    cfg = node.cfg.node
    endpoint = open_endpoint(cfg.metrics_host, cfg.metrics_port, "node.metrics_port", "node.metrics_host")
    if endpoint is None:
        return None
    collector = SiteCollector(node)
    endpoint.register(collector)
    return SiteMetrics(endpoint, collector)
