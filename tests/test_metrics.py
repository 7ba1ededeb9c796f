"""Prometheus metrics: a site's (``node.metrics_port``) and the bootstrap's (``--metrics-port``).

In-process, a site's collector is run over a stand-in node made of the node's real parts (its
counters, energy ledger, round log, a federation that ran a round through a fake averager, a window
schedule) and its exposition parsed back: every number must be the one those parts hold; after a
restart, the counters count from 0 and the ``greenswarm_run_*`` gauges hold the checkpoint's totals. The
endpoint is scraped over HTTP; a port in use names the port's setting, an address that cannot be bound
the host's. Then a real bootstrap and two real sites that reach each other only through the
bootstrap's relay are scraped while they train: the sites' rounds and wire bytes, the bootstrap's peers,
relayed connections and relayed bytes; a third site given a port in use stops with one line.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import prometheus_client
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from greenswarm.averaging.round_report import RoundReport
from greenswarm.bootstrap.metrics import relay_metrics
from greenswarm.bootstrap.peer import BootstrapConfig, serve
from greenswarm.errors import ConfigError
from greenswarm.node.config import SiteConfig, load_site_config
from greenswarm.node.metrics import (
    MetricsEndpoint,
    SiteCollector,
    open_endpoint,
    peers_by_path,
    serve_site_metrics,
)
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.round_log import RoundEntry, RoundLog
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.trainer import StepStats
from greenswarm.scheduler.energy import EnergyLedger, PowerModel
from greenswarm.scheduler.policy import ThresholdPolicy, WindowSchedule
from greenswarm.scheduler.state import SiteState
from greenswarm.traces.trace import Trace
from tests.conftest import Swarm, site_config, wait_until, write_trace
from tests.test_rounds import ME, FakeAverager, N, federation, global_state, outcome

pytestmark = pytest.mark.observability

T = TypeVar("T")

T0 = 1767225600.0  # 2026-01-01T00:00Z
HOUR = 3600.0
#: intensity per hour: a window (below 100) from 01:00 to 03:00, the next from 04:00
INTENSITY = [300.0, 50.0, 60.0, 400.0, 40.0, 500.0]
DIRECT = "/ip4/127.0.0.1/tcp/4001"
CIRCUIT = "/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWBoot/p2p-circuit"
#: the settings an endpoint's errors name: (port, host)
SITE_FIELDS = ("node.metrics_port", "node.metrics_host")
BOOTSTRAP_FIELDS = ("--metrics-port", "--metrics-host")

#: what go-libp2p's relay service published on a real bootstrap (p2pd -metricsAddr) that carried two
#: sites' rounds, cut to the families the bootstrap reads and one it does not
P2PD_EXPOSITION = """\
# HELP libp2p_relaysvc_connections_total Relay Connection Total
# TYPE libp2p_relaysvc_connections_total counter
libp2p_relaysvc_connections_total{type="closed"} 1
libp2p_relaysvc_connections_total{type="opened"} 3
# HELP libp2p_relaysvc_data_transferred_bytes_total Bytes Transferred Total
# TYPE libp2p_relaysvc_data_transferred_bytes_total counter
libp2p_relaysvc_data_transferred_bytes_total 6.103732e+06
# HELP libp2p_relaysvc_reservations_total Relay Reservation Request
# TYPE libp2p_relaysvc_reservations_total counter
libp2p_relaysvc_reservations_total{type="opened"} 2
libp2p_relaysvc_reservations_total{type="renewed"} 4
# HELP libp2p_relaysvc_status Relay Status
# TYPE libp2p_relaysvc_status gauge
libp2p_relaysvc_status 1
# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 30
"""


def scrape(text: str) -> dict[str, Any]:
    """An exposition parsed: family name -> its type, and every sample as (name, labels) -> value."""
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    return {"types": families, "samples": samples}


def value(parsed: dict[str, Any], name: str, **labels: str) -> float | None:
    return parsed["samples"].get((name, tuple(sorted(labels.items()))))


class Collecting:
    """A collector that yields what ``families()`` makes."""

    def __init__(self, families: Any):
        self.collect = families


def collected(collector: Any) -> dict[str, Any]:
    """What a scrape of ``collector`` alone returns, through the text exposition format."""
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return scrape(prometheus_client.generate_latest(registry).decode())


def trace() -> Trace:
    times = np.array([T0 + i * HOUR for i in range(len(INTENSITY))])
    return Trace.from_columns(times, {"A": np.array(INTENSITY)}, "test")


def stand_in_site(tmp_path: Path, now: float, **overrides: Any) -> SimpleNamespace:
    """A site node made of the parts a real one reads from, as a process starts (nothing counted yet),
    one peer direct and one through the relay."""
    schedule = WindowSchedule(trace(), "A", ThresholdPolicy(100.0))
    ledger = EnergyLedger(schedule.trace, "A", PowerModel(train_kw=2.0, idle_kw=0.5), start=T0)
    fed = federation(FakeAverager(outcome(torch.zeros(N), report=RoundReport(wire_bytes=2048.0))))
    swarm = SimpleNamespace(
        connections=lambda timeout_s: {"peer-boot": [DIRECT], "peer-b": [CIRCUIT]},
        publisher=SimpleNamespace(last_record=None),
    )
    parts: dict[str, Any] = {
        "cfg": SiteConfig(name="site-a", region="A"),
        "peer_id": ME,
        "state": SiteState.SOLO,
        "stats": SiteStats(),
        "global_state": global_state(),
        "federation": fed,
        "round_log": RoundLog(tmp_path, time.monotonic()),
        "ledger": ledger,
        "schedule": schedule,
        "clock": SimpleNamespace(now=lambda: now),
        "swarm": swarm,
    }
    parts.update(overrides)
    return SimpleNamespace(**parts)


def first_hours(node: SimpleNamespace) -> None:
    """What the stand-in does in its first two hours: two inner steps, one averaged round (int8, 2 KiB
    sent) and one solo round in its round log, an hour IDLE and an hour SOLO in its ledger."""
    node.ledger.advance(T0 + HOUR, SiteState.IDLE)
    node.ledger.advance(T0 + 2 * HOUR, SiteState.SOLO)
    for loss in (5.0, 4.0):
        node.stats.add_step(StepStats(loss=loss, tokens=256))
    node.stats.counts.update(federated_rounds=1, solo_rounds=1, catch_ups=2)
    node.stats.add_attempt(0.5)
    node.federation.run(torch.ones(N), node.global_state, slot=7, partners=1, tokens=512)
    node.round_log.write(RoundEntry(7, "apply", 1, "l", "d", round_s=0.5, blocked_s=0.25))
    node.round_log.write(RoundEntry(8, "solo", 2, "l", "d", blocked_s=0.125))


def metered_site(tmp_path: Path, now: float, **overrides: Any) -> tuple[SimpleNamespace, SiteCollector]:
    """A stand-in site and its collector, made as the process started (``SiteNode.run`` makes it before
    anything else), after the site's first hours."""
    node = stand_in_site(tmp_path, now, **overrides)
    collector = SiteCollector(node)
    first_hours(node)
    return node, collector


#: the site's checkpointed totals: each a counter ``greenswarm_<name>_total`` (this process) and a gauge
#: ``greenswarm_run_<name>`` (the run)
CHECKPOINTED = (
    "tokens",
    "local_steps",
    "rounds",
    "catch_ups",
    "refused_updates",
    "refused_states",
    "energy_kwh",
    "emissions_grams",
    "state_seconds",
)


def run_totals(parsed: dict[str, Any]) -> dict[tuple, float]:
    """The run's totals (``greenswarm_run_*``): (name, labels) -> value."""
    return {k: v for k, v in parsed["samples"].items() if k[0].startswith("greenswarm_run_")}


def samples_of(parsed: dict[str, Any], name: str) -> dict[tuple, float]:
    """``name``'s samples: their labels -> value."""
    return {labels: v for (n, labels), v in parsed["samples"].items() if n == name}


# ------------------------------------------------------------------------------------------- in-process


def test_a_sites_metrics_are_its_own_counters(tmp_path: Path) -> None:
    now = T0 + 1.5 * HOUR
    node, collector = metered_site(tmp_path, now)
    got = collected(collector)

    info = {k: v for k, v in got["samples"].items() if k[0] == "greenswarm_site_info"}
    assert list(info) == [
        (
            "greenswarm_site_info",
            (("peer_id", ME), ("region", "A"), ("site", "site-a"), ("swarm", "greenswarm")),
        )
    ]
    assert [value(got, "greenswarm_state", state=s.value) for s in SiteState] == [0, 1, 0, 0, 0]
    # training, as SiteStats holds it
    assert got["types"]["greenswarm_tokens"] == "counter"
    assert value(got, "greenswarm_tokens_total") == node.stats.tokens == 512
    assert value(got, "greenswarm_local_steps_total") == 2
    # a process that started afresh: what it counted is the run's total
    for name in CHECKPOINTED:
        assert got["types"][f"greenswarm_{name}"] == "counter"
        assert got["types"][f"greenswarm_run_{name}"] == "gauge"
        run = samples_of(got, f"greenswarm_run_{name}")
        assert samples_of(got, f"greenswarm_{name}_total") == run and run, name
    assert value(got, "greenswarm_loss") == pytest.approx(node.stats.loss)
    assert value(got, "greenswarm_eval_loss") is None  # never evaluated: absent, not 0
    assert value(got, "greenswarm_outer_step") == node.global_state.outer_round
    # rounds: the counters by outcome, the attempts' and the round log's seconds, the wire formats
    outcomes = ("federated", "solo", "failed", "resync")
    rounds = [value(got, "greenswarm_rounds_total", outcome=o) for o in outcomes]
    assert rounds == [1, 1, 0, 0]
    assert value(got, "greenswarm_catch_ups_total") == 2
    assert got["types"]["greenswarm_round_seconds"] == "summary"
    assert (value(got, "greenswarm_round_seconds_count"), value(got, "greenswarm_round_seconds_sum")) == (
        1,
        0.5,
    )
    assert value(got, "greenswarm_round_blocked_seconds_count") == 2
    assert value(got, "greenswarm_round_blocked_seconds_sum") == 0.375
    assert value(got, "greenswarm_wire_bytes_total", format="int8") == 2048.0
    assert value(got, "greenswarm_wire_rounds_total", format="int8") == 1
    # energy and emissions by state, as the ledger booked them (an hour at 0.5 kW, an hour at 2 kW)
    assert value(got, "greenswarm_energy_kwh_total", state="IDLE") == pytest.approx(0.5)
    assert value(got, "greenswarm_energy_kwh_total", state="SOLO") == pytest.approx(2.0)
    assert value(got, "greenswarm_emissions_grams_total", state="SOLO") == pytest.approx(2.0 * 50.0)
    assert value(got, "greenswarm_state_seconds_total", state="IDLE") == pytest.approx(HOUR)
    # the grid now, and the window: in one until 03:00, the next from 04:00
    assert value(got, "greenswarm_clock_timestamp_seconds") == now
    assert value(got, "greenswarm_grid_intensity_grams_per_kwh") == 50.0
    assert value(got, "greenswarm_in_window") == 1
    assert value(got, "greenswarm_window_end_timestamp_seconds") == T0 + 3 * HOUR
    assert value(got, "greenswarm_next_window_start_timestamp_seconds") == T0 + 4 * HOUR
    # the swarm: the bootstrap direct, the other site through the relay
    assert value(got, "greenswarm_peers_connected", path="direct") == 1
    assert value(got, "greenswarm_peers_connected", path="relay") == 1


def test_a_site_is_described_before_it_joins_and_when_its_daemon_is_silent(tmp_path: Path) -> None:
    """A node scraped while it joins has no global state, federation or swarm yet: those are left out.
    Later, a daemon that does not answer costs the peers gauge, not the scrape. A live signal's or
    deadline plan's schedule moves state when asked, so the window comes from the last record."""
    joining = stand_in_site(tmp_path, T0, swarm=None, federation=None, peer_id="")
    del joining.global_state
    got = collected(SiteCollector(joining))
    assert value(got, "greenswarm_tokens_total") == 0 and value(got, "greenswarm_loss") is None
    assert value(got, "greenswarm_run_tokens") == 0
    assert value(got, "greenswarm_outer_step") is None
    assert not [k for k in got["samples"] if k[0].startswith(("greenswarm_wire", "greenswarm_peers"))]
    assert value(got, "greenswarm_in_window") == 0  # (00:00: before the first window)

    class MovingSchedule:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the collector asked a moving schedule for {name}")

    def silent(timeout_s: float) -> dict:
        raise TimeoutError("the p2p daemon did not answer")

    record = ProgressRecord(
        "site-a", "A", "SOLO", ME, 1, "l", 7, 2, 512, 4.9, T0 + 2.5 * HOUR, 0.0, 0.0, T0 + HOUR, time.time()
    )
    swarm = SimpleNamespace(connections=silent, publisher=SimpleNamespace(last_record=record))
    got = collected(metered_site(tmp_path, T0 + HOUR, schedule=MovingSchedule(), swarm=swarm)[1])
    assert value(got, "greenswarm_in_window") == 1
    assert value(got, "greenswarm_window_end_timestamp_seconds") == T0 + 2.5 * HOUR
    assert value(got, "greenswarm_next_window_start_timestamp_seconds") is None
    assert not [k for k in got["samples"] if k[0] == "greenswarm_peers_connected"]
    assert value(got, "greenswarm_tokens_total") == 512


def test_a_restarted_sites_counters_start_at_0_and_its_run_totals_are_gauges(tmp_path: Path) -> None:
    """A site restarted after a crash restores its totals from its last checkpoint, older than the
    crash. Were they its counters, they would drop below what the crashed process exported, and
    Prometheus would read the drop as a reset and count the whole total again in ``increase()``. So the
    counters count what this process added (from 0: a reset Prometheus understands), and the run's
    totals, checkpoint included, are the ``greenswarm_run_*`` gauges."""
    crashed, collector = metered_site(tmp_path / "crashed", T0 + 2 * HOUR)
    checkpoint = {"site": crashed.stats.state_dict(), "ledger": crashed.ledger.state_dict()}
    totals = run_totals(collected(collector))  # the checkpoint's
    assert totals[("greenswarm_run_tokens", ())] == 512
    assert totals[("greenswarm_run_energy_kwh", (("state", "SOLO"),))] == pytest.approx(2.0)

    def restore(node: SimpleNamespace) -> None:
        node.stats.load_state_dict(checkpoint["site"])
        node.ledger.load_state_dict(checkpoint["ledger"])
        node.ledger.skip_to(T0 + 3 * HOUR)  # (the hour down is not booked)

    def assert_restarted(got: dict[str, Any]) -> None:
        for name in CHECKPOINTED:
            counters = samples_of(got, f"greenswarm_{name}_total")
            assert counters and set(counters.values()) == {0.0}, (name, counters)
        assert run_totals(got) == totals

    # the node makes its collector before it resumes (a port in use must fail before the join) ...
    restarted = stand_in_site(tmp_path / "restarted", T0 + 3 * HOUR)
    collector = SiteCollector(restarted)
    assert value(collected(collector), "greenswarm_run_tokens") == 0  # (scraped while it resumes)
    with collector.restoring():  # as the node resumes (site.py); a scrape meanwhile leaves them out
        restore(restarted)
        assert not samples_of(collected(collector), "greenswarm_tokens_total")
    assert_restarted(collected(collector))
    # ... and a collector made over totals already restored starts from them just the same
    restored = stand_in_site(tmp_path / "restored", T0 + 3 * HOUR)
    restore(restored)
    assert_restarted(collected(SiteCollector(restored)))

    # trained on: the counters count this process's work, the gauges go on from the checkpoint
    restarted.stats.add_step(StepStats(loss=3.0, tokens=128))
    restarted.stats.counts["federated_rounds"] += 1
    restarted.ledger.advance(T0 + 4 * HOUR, SiteState.FEDERATED)  # (2 kW for an hour at 400 g/kWh)
    got = collected(collector)
    assert (value(got, "greenswarm_tokens_total"), value(got, "greenswarm_run_tokens")) == (128, 512 + 128)
    assert value(got, "greenswarm_local_steps_total") == 1 and value(got, "greenswarm_run_local_steps") == 3
    assert value(got, "greenswarm_rounds_total", outcome="federated") == 1
    assert value(got, "greenswarm_run_rounds", outcome="federated") == 2
    assert value(got, "greenswarm_rounds_total", outcome="solo") == 0
    assert value(got, "greenswarm_run_rounds", outcome="solo") == 1
    assert value(got, "greenswarm_energy_kwh_total", state="FEDERATED") == pytest.approx(2.0)
    assert value(got, "greenswarm_energy_kwh_total", state="SOLO") == 0
    assert value(got, "greenswarm_run_energy_kwh", state="SOLO") == pytest.approx(2.0)
    assert value(got, "greenswarm_emissions_grams_total", state="FEDERATED") == pytest.approx(2.0 * 400.0)
    assert value(got, "greenswarm_state_seconds_total", state="FEDERATED") == pytest.approx(HOUR)
    assert value(got, "greenswarm_run_state_seconds", state="IDLE") == pytest.approx(HOUR)


def test_endpoint_serves_a_private_registry_over_http(tmp_path: Path) -> None:
    endpoint = MetricsEndpoint("127.0.0.1", 0, *SITE_FIELDS)  # (0 here: any free port)
    try:
        endpoint.register(metered_site(tmp_path, T0 + 1.5 * HOUR)[1])
        response = requests.get(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
        got = scrape(response.text)
        assert value(got, "greenswarm_tokens_total") == 512
        assert "process_cpu_seconds" in got["types"]  # the process's own, in the same registry
        # the library's global registry is untouched: two endpoints in one process never collide
        assert b"greenswarm_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    finally:
        endpoint.close()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5)
    assert open_endpoint("127.0.0.1", None, *SITE_FIELDS) is None
    assert open_endpoint("127.0.0.1", 0, *SITE_FIELDS) is None  # 0: off, as in the config


def test_a_port_in_use_is_one_line_naming_the_field_and_other_hosts_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            MetricsEndpoint("127.0.0.1", port, *SITE_FIELDS)
    assert err.value.field == "node.metrics_port"
    assert str(err.value) == f"node.metrics_port: 127.0.0.1:{port} is already in use; pick another port"

    with caplog.at_level(logging.INFO, logger="greenswarm.metrics"):
        MetricsEndpoint("127.0.0.1", 0, *SITE_FIELDS).close()
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        caplog.clear()
        MetricsEndpoint("0.0.0.0", 0, *BOOTSTRAP_FIELDS).close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "beyond this machine" in warnings[0].getMessage()


def test_an_address_that_cannot_be_bound_names_the_host_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an address of this machine (EADDRNOTAVAIL), or a name that does not resolve: the host is at
    fault, not the port; the site's error names ``node.metrics_host``, the bootstrap's
    ``--metrics-host``."""
    for host in ("192.0.2.1", "no-such-host.invalid"):  # (TEST-NET-1; a reserved top-level domain)
        cfg = load_site_config(
            None, ["name=a", "region=A", "node.metrics_port=9464", f"node.metrics_host={host}"]
        )
        with pytest.raises(ConfigError) as err:
            serve_site_metrics(stand_in_site(tmp_path, T0, cfg=cfg))
        assert err.value.field == "node.metrics_host", err.value
        assert str(err.value).startswith(f"node.metrics_host: {host}:9464 cannot be bound (")
        assert str(err.value).endswith("); give an address of this machine")
        with pytest.raises(ConfigError) as err:
            serve(BootstrapConfig(str(tmp_path / "boot.key"), metrics_port=9464, metrics_host=host))
        assert err.value.field == "--metrics-host", err.value
    assert str(err.value).startswith("--metrics-host: no-such-host.invalid:9464 cannot be bound (")

    # a privileged port (below 1024, not root) is the port's fault
    def refused(port: int, addr: str, registry: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("greenswarm.node.metrics.start_http_server", refused)
    with pytest.raises(ConfigError) as err:
        MetricsEndpoint("127.0.0.1", 80, *SITE_FIELDS)
    assert str(err.value) == (
        "node.metrics_port: 127.0.0.1:80 cannot be bound (Permission denied); pick another port"
    )


def test_helpers_forked_by_the_node_do_not_hold_its_port() -> None:
    """hivemind forks its DHT and averager after the endpoint is up; a helper that outlived a crashed
    node must not keep the port from the node forked next."""
    endpoint = MetricsEndpoint("127.0.0.1", 0, *SITE_FIELDS)
    child = os.fork()
    if child == 0:  # a helper that lingers
        time.sleep(30)
        os._exit(0)
    try:
        endpoint.close()
        with socket.socket() as again:
            again.bind(("127.0.0.1", endpoint.port))  # EADDRINUSE if the child still listened on it
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_metrics_settings_are_checked_with_the_config(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("name: a\nregion: A\nnode:\n  metrics_port: 9464\n")
    assert load_site_config(path).node.metrics_port == 9464
    assert load_site_config(None, ["name=a", "region=A"]).node.metrics_port is None  # off by default
    assert load_site_config(None, ["name=a", "region=A"]).node.metrics_host == "127.0.0.1"
    for override, field in (
        ("node.metrics_port=70000", "node.metrics_port"),
        ("node.metrics_host=' '", "node.metrics_host"),
    ):
        with pytest.raises(ConfigError) as err:
            load_site_config(None, ["name=a", "region=A", override])
        assert err.value.field == field, err.value


def test_the_bootstraps_relay_figures_are_p2pds_own() -> None:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(P2PD_EXPOSITION):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    got = collected(Collecting(lambda: relay_metrics(samples)))
    assert value(got, "greenswarm_bootstrap_relay_up") == 1
    assert value(got, "greenswarm_bootstrap_relayed_connections_total", event="opened") == 3
    assert value(got, "greenswarm_bootstrap_relayed_connections_total", event="closed") == 1
    assert value(got, "greenswarm_bootstrap_relayed_connections_open") == 2
    assert value(got, "greenswarm_bootstrap_relay_reservations") == 2  # renewals are no new slots
    assert value(got, "greenswarm_bootstrap_relayed_bytes_total") == 6103732
    # a daemon without the relay service (--no-relay) publishes none of it: only "relay down"
    got = collected(Collecting(lambda: relay_metrics({"go_goroutines": [({}, 30.0)]})))
    assert [k[0] for k in got["samples"]] == ["greenswarm_bootstrap_relay_up"]
    assert value(got, "greenswarm_bootstrap_relay_up") == 0
    assert peers_by_path({"a": [DIRECT, CIRCUIT], "b": [CIRCUIT], "c": []}) == {"direct": 2, "relay": 1}


# ------------------------------------------------------------------------------------------- real processes


def private_port() -> int:
    """A port on 127.0.0.1, free now, that no p2p daemon can take before a process of this test binds it:
    daemons bind tcp/0, which the kernel serves from its ephemeral range only, and this one is below
    that range (at random: two tests that run at once seldom pick the same)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # (Linux's default)
    while True:
        port = random.randrange(low // 2, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def serving_metrics(swarm: Swarm, name: str, start: Callable[[int], T]) -> tuple[int, T]:
    """Start ``name`` with ``start(port)`` on a :func:`private_port` and return the port once its
    endpoint serves it (and what ``start`` returned). Should another process have bound that port
    meanwhile, ``name`` stops saying so, and is started again on another port."""

    def settled(serving: str) -> bool:
        return serving in swarm.log(name) or swarm.procs[name].poll() is not None

    for _ in range(3):
        port = private_port()
        try:
            started = start(port)
        except RuntimeError as err:  # (swarm.bootstrap: the bootstrap exited)
            if "is already in use" in str(err):
                continue
            raise
        serving = f"serving http://127.0.0.1:{port}/metrics"
        wait_until(functools.partial(settled, serving), 120, serving)
        if serving in swarm.log(name):
            return port, started
        if "is already in use" not in swarm.log(name):
            raise AssertionError(f"{name} exited:\n{swarm.log(name)[-3000:]}")
    raise AssertionError(f"{name}: three ports in a row were taken before it bound them")


@pytest.mark.swarm
def test_a_live_swarm_is_scraped_over_http(swarm: Swarm, tmp_path: Path) -> None:
    """A bootstrap and two sites behind its relay (``reachability: relay``: each announces only a
    ``/p2p-circuit`` address, so every byte between them crosses the bootstrap), all in a window."""

    def bootstrap(port: int) -> list[str]:
        return swarm.bootstrap("bootstrap", "test", "/ip4/127.0.0.1/tcp/0", "", "--metrics-port", str(port))

    boot_port, peers = serving_metrics(swarm, "bootstrap", bootstrap)
    trace_csv = write_trace(tmp_path / "trace.csv", {"A": [20.0] * 36, "B": [20.0] * 36})
    start_file = tmp_path / "start"
    ports: dict[str, int] = {}
    for name, region in (("site-a", "A"), ("site-b", "B")):

        def site_node(port: int, name: str = name, region: str = region) -> None:
            cfg = site_config(
                name, region, trace_csv, peers, tmp_path / name, speedup=120.0, start_file=start_file,
                sync_s=600.0, swarm={"reachability": "relay"}, node={"metrics_port": port},
            )  # fmt: skip
            swarm.node(name, swarm.write_config(name, cfg))

        ports[name], _ = serving_metrics(swarm, name, site_node)
    swarm.start_replay(list(ports), start_file)

    # a third site given site-a's port stops at once with one line naming the field and the port
    clash = site_config(
        "site-c", "A", trace_csv, peers, tmp_path / "site-c", speedup=120.0, start_file=start_file,
        sync_s=600.0, node={"metrics_port": ports["site-a"]},
    )  # fmt: skip
    swarm.node("site-c", swarm.write_config("site-c", clash))

    def site(name: str) -> dict[str, Any]:
        return scrape(requests.get(f"http://127.0.0.1:{ports[name]}/metrics", timeout=10).text)

    def averaged() -> bool:
        for name in ports:  # (a site that ended stops serving its metrics: say why it ended)
            assert swarm.procs[name].poll() is None, f"{name} ended first:\n{swarm.log(name)[-3000:]}"
        return all((value(site(n), "greenswarm_rounds_total", outcome="federated") or 0) >= 1 for n in ports)

    wait_until(averaged, 120, "a federated round at both sites")
    boot = scrape(requests.get(f"http://127.0.0.1:{boot_port}/metrics", timeout=10).text)
    a = site("site-a")

    assert value(a, "greenswarm_state", state="FEDERATED") == 1
    assert value(a, "greenswarm_tokens_total") > 0 and value(a, "greenswarm_local_steps_total") > 0
    assert value(a, "greenswarm_loss") > 0
    assert sum(v for (n, _), v in a["samples"].items() if n == "greenswarm_wire_bytes_total") > 0
    assert value(a, "greenswarm_round_seconds_count") >= 1
    assert value(a, "greenswarm_energy_kwh_total", state="FEDERATED") > 0
    assert value(a, "greenswarm_grid_intensity_grams_per_kwh") == 20.0
    assert value(a, "greenswarm_in_window") == 1
    assert value(a, "greenswarm_peers_connected", path="relay") >= 1  # site-b, through the bootstrap

    assert value(boot, "greenswarm_bootstrap_p2pd_metrics_up") == 1
    assert (
        value(boot, "greenswarm_bootstrap_peers_connected", path="direct") >= 2
    )  # the sites (a peer passing by adds one)
    assert value(boot, "greenswarm_bootstrap_relay_reservations") == 2
    assert value(boot, "greenswarm_bootstrap_relayed_connections_total", event="opened") >= 1
    assert value(boot, "greenswarm_bootstrap_relayed_bytes_total") > 0

    assert swarm.wait("site-c", timeout=60) == 2
    lines = [line for line in swarm.log("site-c").splitlines() if "error" in line]
    assert lines == [
        f"greenswarm node: error: node.metrics_port: 127.0.0.1:{ports['site-a']} is already in use; "
        "pick another port"
    ], swarm.log("site-c")[-2000:]
    assert "Traceback" not in swarm.log("site-c")


@pytest.mark.swarm
def test_the_bootstraps_metrics_flags_fail_in_one_line(swarm: Swarm, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        key = str(tmp_path / "boot.key")
        in_use = swarm.run(
            "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", key, "--metrics-port", str(port)
        )
    bad = swarm.run("bootstrap", "--identity", key, "--metrics-port", "70000")
    elsewhere = swarm.run(
        "bootstrap", "--identity", key, "--metrics-port", "9465", "--metrics-host", "192.0.2.1"
    )  # (TEST-NET-1: no address of this machine)
    said = "greenswarm bootstrap: error: --metrics-port: 127.0.0.1:%d is already in use; pick another port"
    assert (in_use.returncode, in_use.stderr.strip()) == (2, said % port), in_use.stderr
    assert bad.returncode == 2 and bad.stderr.strip().startswith(
        "greenswarm bootstrap: error: --metrics-port:"
    )
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert elsewhere.stderr.strip().startswith("greenswarm bootstrap: error: --metrics-host: 192.0.2.1:9465 ")
    assert elsewhere.stderr.strip().endswith("; give an address of this machine"), elsewhere.stderr
    assert "Traceback" not in in_use.stderr + bad.stderr + elsewhere.stderr
