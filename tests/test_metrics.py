"""Prometheus metrics: a site's (``node.metrics_port``) and the bootstrap's (``--metrics-port``).

In-process, a site's collector is run over a stand-in node made of the node's real parts (its
counters, energy ledger, round log, a federation that ran a round through a fake averager, a window
schedule) and its exposition parsed back: every number must be the one those parts hold. The endpoint
is scraped over HTTP. Then a real bootstrap and two real sites that reach each other only through the
bootstrap's relay are scraped while they train: the sites' rounds and wire bytes, the bootstrap's peers,
relayed connections and relayed bytes; a third site given a port in use stops with one line.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import prometheus_client
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from greenswarm.averaging.round_report import RoundReport
from greenswarm.bootstrap.metrics import relay_metrics
from greenswarm.errors import ConfigError
from greenswarm.node.config import SiteConfig, load_site_config
from greenswarm.node.metrics import MetricsEndpoint, SiteCollector, open_endpoint, peers_by_path
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.round_log import RoundEntry, RoundLog
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.trainer import StepStats
from greenswarm.scheduler.energy import EnergyLedger, PowerModel
from greenswarm.scheduler.policy import ThresholdPolicy, WindowSchedule
from greenswarm.scheduler.state import SiteState
from greenswarm.traces.trace import Trace
from tests.conftest import Swarm, free_port, site_config, wait_until, write_trace
from tests.test_rounds import ME, FakeAverager, N, federation, global_state, outcome

pytestmark = pytest.mark.observability

T0 = 1767225600.0  # 2026-01-01T00:00Z
HOUR = 3600.0
#: intensity per hour: a window (below 100) from 01:00 to 03:00, the next from 04:00
INTENSITY = [300.0, 50.0, 60.0, 400.0, 40.0, 500.0]
DIRECT = "/ip4/127.0.0.1/tcp/4001"
CIRCUIT = "/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWBoot/p2p-circuit"

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
    """A site node made of the parts a real one reads from, in the state an hour into its first window:
    two inner steps, one averaged round (int8, 2 KiB sent) and one solo round in its round log, an
    hour IDLE and an hour SOLO in its ledger, one peer direct and one through the relay."""
    schedule = WindowSchedule(trace(), "A", ThresholdPolicy(100.0))
    ledger = EnergyLedger(schedule.trace, "A", PowerModel(train_kw=2.0, idle_kw=0.5), start=T0)
    ledger.advance(T0 + HOUR, SiteState.IDLE)
    ledger.advance(T0 + 2 * HOUR, SiteState.SOLO)
    stats = SiteStats()
    for loss in (5.0, 4.0):
        stats.add_step(StepStats(loss=loss, tokens=256))
    stats.counts.update(federated_rounds=1, solo_rounds=1, catch_ups=2)
    fed = federation(FakeAverager(outcome(torch.zeros(N), report=RoundReport(wire_bytes=2048.0))))
    state = global_state()
    fed.run(torch.ones(N), state, slot=7, partners=1, tokens=512)
    round_log = RoundLog(tmp_path, time.monotonic())
    round_log.write(RoundEntry(7, "apply", 1, "l", "d", round_s=0.5, blocked_s=0.25))
    round_log.write(RoundEntry(8, "solo", 2, "l", "d", blocked_s=0.125))
    swarm = SimpleNamespace(
        connections=lambda timeout_s: {"peer-boot": [DIRECT], "peer-b": [CIRCUIT]},
        publisher=SimpleNamespace(last_record=None),
    )
    parts: dict[str, Any] = {
        "cfg": SiteConfig(name="site-a", region="A"),
        "peer_id": ME,
        "state": SiteState.SOLO,
        "stats": stats,
        "global_state": state,
        "federation": fed,
        "round_log": round_log,
        "ledger": ledger,
        "schedule": schedule,
        "clock": SimpleNamespace(now=lambda: now),
        "swarm": swarm,
    }
    parts.update(overrides)
    return SimpleNamespace(**parts)


# ------------------------------------------------------------------------------------------- in-process


def test_a_sites_metrics_are_its_own_counters(tmp_path: Path) -> None:
    now = T0 + 1.5 * HOUR
    node = stand_in_site(tmp_path, now)
    got = collected(SiteCollector(node))

    info = {k: v for k, v in got["samples"].items() if k[0] == "greenswarm_site_info"}
    assert list(info) == [
        (
            "greenswarm_site_info",
            (("peer_id", ME), ("region", "A"), ("site", "site-a"), ("swarm", "greenswarm")),
        )
    ]
    assert [value(got, "greenswarm_state", state=s.value) for s in SiteState] == [0, 1, 0]
    # training, as SiteStats holds it
    assert got["types"]["greenswarm_tokens"] == "counter"
    assert value(got, "greenswarm_tokens_total") == node.stats.tokens == 512
    assert value(got, "greenswarm_local_steps_total") == 2
    assert value(got, "greenswarm_loss") == pytest.approx(node.stats.loss)
    assert value(got, "greenswarm_eval_loss") is None  # never evaluated: absent, not 0
    assert value(got, "greenswarm_outer_step") == node.global_state.outer_round
    # rounds: the counters by outcome, the round log's seconds, the federation's wire formats
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
    joining = stand_in_site(tmp_path, T0, swarm=None, federation=None, peer_id="", stats=SiteStats())
    del joining.global_state
    got = collected(SiteCollector(joining))
    assert value(got, "greenswarm_tokens_total") == 0 and value(got, "greenswarm_loss") is None
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
    got = collected(SiteCollector(stand_in_site(tmp_path, T0 + HOUR, schedule=MovingSchedule(), swarm=swarm)))
    assert value(got, "greenswarm_in_window") == 1
    assert value(got, "greenswarm_window_end_timestamp_seconds") == T0 + 2.5 * HOUR
    assert value(got, "greenswarm_next_window_start_timestamp_seconds") is None
    assert not [k for k in got["samples"] if k[0] == "greenswarm_peers_connected"]
    assert value(got, "greenswarm_tokens_total") == 512


def test_endpoint_serves_a_private_registry_over_http(tmp_path: Path) -> None:
    endpoint = MetricsEndpoint("127.0.0.1", 0, "node.metrics_port")  # (0 here: any free port)
    try:
        endpoint.register(SiteCollector(stand_in_site(tmp_path, T0 + 1.5 * HOUR)))
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
    assert open_endpoint("127.0.0.1", None, "node.metrics_port") is None
    assert open_endpoint("127.0.0.1", 0, "node.metrics_port") is None  # 0: off, as in the config


def test_a_port_in_use_is_one_line_naming_the_field_and_other_hosts_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            MetricsEndpoint("127.0.0.1", port, "node.metrics_port")
    assert err.value.field == "node.metrics_port"
    assert str(err.value) == f"node.metrics_port: 127.0.0.1:{port} is already in use; pick another port"

    with caplog.at_level(logging.INFO, logger="greenswarm.metrics"):
        MetricsEndpoint("127.0.0.1", 0, "node.metrics_port").close()
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        caplog.clear()
        MetricsEndpoint("0.0.0.0", 0, "--metrics-port").close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "beyond this machine" in warnings[0].getMessage()


def test_helpers_forked_by_the_node_do_not_hold_its_port() -> None:
    """hivemind forks its DHT and averager after the endpoint is up; a helper that outlived a crashed
    node must not keep the port from the node forked next."""
    endpoint = MetricsEndpoint("127.0.0.1", 0, "node.metrics_port")
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


@pytest.mark.swarm
def test_a_live_swarm_is_scraped_over_http(swarm: Swarm, tmp_path: Path) -> None:
    """A bootstrap and two sites behind its relay (``reachability: relay``: each announces only a
    ``/p2p-circuit`` address, so every byte between them crosses the bootstrap), all in a window."""
    boot_port = free_port()
    peers = swarm.bootstrap("bootstrap", "test", "/ip4/127.0.0.1/tcp/0", "", "--metrics-port", str(boot_port))
    trace_csv = write_trace(tmp_path / "trace.csv", {"A": [20.0] * 36, "B": [20.0] * 36})
    start_file = tmp_path / "start"
    ports = {"site-a": free_port(), "site-b": free_port()}
    for name, region in (("site-a", "A"), ("site-b", "B")):
        cfg = site_config(
            name, region, trace_csv, peers, tmp_path / name, speedup=120.0, start_file=start_file,
            sync_s=600.0, swarm={"reachability": "relay"}, node={"metrics_port": ports[name]},
        )  # fmt: skip
        swarm.node(name, swarm.write_config(name, cfg))
    swarm.start_replay(list(ports), start_file)  # both ready: both endpoints are up

    # a third site given site-a's port stops at once with one line naming the field and the port
    clash = site_config(
        "site-c", "A", trace_csv, peers, tmp_path / "site-c", speedup=120.0, start_file=start_file,
        sync_s=600.0, node={"metrics_port": ports["site-a"]},
    )  # fmt: skip
    swarm.node("site-c", swarm.write_config("site-c", clash))

    def site(name: str) -> dict[str, Any]:
        return scrape(requests.get(f"http://127.0.0.1:{ports[name]}/metrics", timeout=10).text)

    def averaged() -> bool:
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
    assert value(boot, "greenswarm_bootstrap_peers_connected", path="direct") == 2
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
    said = "greenswarm bootstrap: error: --metrics-port: 127.0.0.1:%d is already in use; pick another port"
    assert (in_use.returncode, in_use.stderr.strip()) == (2, said % port), in_use.stderr
    assert bad.returncode == 2 and bad.stderr.strip().startswith(
        "greenswarm bootstrap: error: --metrics-port:"
    )
    assert "Traceback" not in in_use.stderr + bad.stderr
