"""A released site's presence in the swarm: its record and its last global state, without a trainer.

While a site is released (:mod:`greenswarm.node.releasing`) its agent runs this in a process of its
own, forked for the gap and ended when the next window opens: it joins the swarm with the site's
identity, publishes the site's progress record -- state RELEASED, ``next_start`` the planned
restart -- and serves the global state of the site's last checkpoint to sites that catch up or
join, exactly as a training site serves its own (the state is checked the same way by whoever
downloads it). It holds the global model in host memory (the parameters and the outer momentum:
what a checkpoint's ``outer`` holds), no trainer, no optimizer, no GPU.

Without it a site that enters a window while every site ahead of it is released would go on from
its own older state, and the lineages would have to be reconciled later.

It also serves the site's metrics (``node.metrics_port``) while the trainer is gone, so a scrape of a
released site finds it RELEASED with its run's totals (as the release's checkpoint holds them) rather
than a dead endpoint: the same collector as the trainer's (:class:`~greenswarm.node.metrics.
SiteCollector`), reading a :class:`ReleasedSite` instead of a running node.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greenswarm.averaging.outer import OuterOptimizer
from greenswarm.faults import FaultPlan
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import SiteConfig
from greenswarm.node.export import MODEL_FILE
from greenswarm.node.global_state import GlobalState
from greenswarm.node.joining import join_swarm
from greenswarm.node.metrics import SiteMetrics, serve_site_metrics
from greenswarm.node.model import ModelIdentity
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.releasing import MARKER
from greenswarm.node.round_log import RoundLog
from greenswarm.node.site_stats import SiteStats
from greenswarm.procs import Terminated, exit_with_parent, on_termination, reap_children, set_process_name
from greenswarm.scheduler.energy import EnergyLedger, make_power_model
from greenswarm.scheduler.live import LiveSchedule
from greenswarm.scheduler.policy import WindowSchedule
from greenswarm.scheduler.site_schedule import site_schedule
from greenswarm.scheduler.state import SiteState

log = logging.getLogger("greenswarm.presence")

#: the presence process's name (``ps -o comm``): it is a fork of the agent, with the agent's command line
PROCESS_NAME = "gs-presence"


@dataclass
class ReleasedSite:
    """A released site as its metrics read it (:class:`~greenswarm.node.metrics.MeteredSite`): state
    RELEASED, its counters, ledger and global state as the release's checkpoint left them, the swarm
    once the presence has joined; no trainer, no federation, no shards."""

    cfg: SiteConfig
    clock: Any
    schedule: Any
    ledger: EnergyLedger
    stats: SiteStats
    global_state: GlobalState
    round_log: RoundLog
    log: logging.Logger
    state: SiteState = SiteState.RELEASED
    peer_id: str = ""
    swarm: Any = None
    world: Any = None
    federation: Any = None
    trainer: Any = None
    shards: Any = None
    connections: dict[str, list[str]] = field(default_factory=dict)


#: what serves a released site's metrics: the site the collector reads and its endpoint
Served = tuple[ReleasedSite, SiteMetrics]


def _serve_metrics(cfg: SiteConfig, payload: dict[str, Any], state: GlobalState) -> Served | None:
    """The released site's metrics endpoint, or None: ``node.metrics_port`` off, or anything about
    it failed (the port held by another process, the schedule unreadable): said in one line, and the
    presence goes on without it -- standing in the swarm matters more than a scrape."""
    if not cfg.node.metrics_port:
        return None
    schedule = None
    try:
        schedule, clock = site_schedule(cfg.scheduler, cfg.region, cfg.load_trace, log, poll=False)
        # a live signal's feed is not polled here (the agent polls it): its window comes from the record
        trace = schedule.trace if isinstance(schedule, WindowSchedule) else (lambda: None)
        power = make_power_model(cfg.energy, on_gpu=False)
        ledger = EnergyLedger(trace, cfg.region, power, start=clock.now())
        ledger.load_state_dict(payload["ledger"])
        stats = SiteStats()
        stats.load_state_dict(payload["site"])
        round_log = RoundLog(cfg.node.run_dir, time.monotonic())
        site = ReleasedSite(cfg, clock, schedule, ledger, stats, state, round_log, log)
        metrics = serve_site_metrics(site)
    except Exception as err:  # ConfigError: the port is held (by another process), or the schedule
        log.warning("presence: no metrics while released: %s", err)
        _close_feed(schedule)
        return None
    assert metrics is not None  # (the port is set)
    return site, metrics


def _close_feed(schedule: Any) -> None:
    if isinstance(schedule, LiveSchedule):
        schedule.feed.stop()  # (never started: closes its source)


def _close_metrics(served: Served | None) -> None:
    if served is not None:
        site, metrics = served
        metrics.close()
        _close_feed(site.schedule)


def run_presence(cfg: SiteConfig) -> int:
    """Be the released site in the swarm until a stop signal (the agent's, when the window opens)."""
    set_process_name(PROCESS_NAME)
    run_dir = Path(cfg.node.run_dir)
    try:
        entry = json.loads((run_dir / MARKER).read_text())
        wire = dict(entry["record"])
        identity = ModelIdentity.from_wire(json.loads((run_dir / MODEL_FILE).read_text())["identity"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("presence: nothing to stand for (%r): the released site is absent meanwhile", err)
        return 0
    payload = Checkpointer(run_dir).load(mmap=True)  # (its trainer part is never read into memory)
    if payload is None:
        log.warning("presence: no checkpoint in %s: the released site is absent meanwhile", run_dir)
        return 0
    averaging = cfg.averaging
    outer = OuterOptimizer.from_config(
        payload["outer"][0].clone(), averaging.outer, averaging.outer_lr, averaging.outer_momentum,
        averaging.nesterov,
    )  # fmt: skip
    state = GlobalState(outer, cfg.name)
    state.adopt(payload["site"], payload["outer"])
    served = _serve_metrics(cfg, payload, state)
    del payload  # (the trainer's part, model and optimizer, is not served: only the global state)
    stop, joining = threading.Event(), threading.Event()

    def leave() -> None:
        stop.set()
        if joining.is_set():  # still starting: leave now, as a command's stop does (see below)
            raise Terminated("stopped while joining the swarm")

    joining.set()
    on_termination(leave)
    exit_with_parent(on_orphaned=stop.set)  # an agent killed outright must not leave it standing in
    try:
        swarm, _ = join_swarm(cfg, outer.numel, state.served, FaultPlan(), log, identity)
        joining.clear()
    except Terminated:
        # the agent's stop (the window opened, or the operator's stop) came while the swarm's start
        # (p2pd, the DHT's bootstrap: seconds on a loaded machine) was under way: the agent forks the
        # trainer only once this process has ended, so finishing the start first took seconds out of
        # the window (docs/testing.md row 84)
        log.info("presence: stopped while it was joining the swarm: leaving at once")
        _close_metrics(served)
        # the DHT process and its p2pd, however far their start got; the DHT process ignores SIGTERM
        # (its owner shuts it down: procs.on_termination), so it is killed after the short wait
        reap_children(timeout=0.2)
        return 0
    except BaseException:
        _close_metrics(served)
        raise
    if served is not None:
        served[0].swarm, served[0].peer_id = swarm, swarm.peer_id
    try:
        (outer_round, lineage, round_index), attested = state.attestation()
        wire.update(
            peer_id=swarm.peer_id,
            outer_round=outer_round,
            lineage=lineage,
            round_index=round_index,
            state_digest=attested,
        )
        log.info(
            "presence: site %s released, serving outer step %d (%s) as %s until its next window",
            cfg.name, outer_round, lineage, swarm.peer_id,
        )  # fmt: skip
        while not stop.is_set():
            wire["wall_time"] = time.time()
            swarm.publisher.maybe_publish(lambda: ProgressRecord.from_wire(wire))
            swarm.entry.poll()
            stop.wait(cfg.node.idle_wall_s)
    finally:
        # beside the swarm's close: an HTTP server's shutdown waits out its poll (up to 0.5 s), and
        # the agent forks the trainer only once this process has ended
        closing = threading.Thread(target=_close_metrics, args=(served,), name="metrics-close")
        closing.start()
        swarm.close(log)
        closing.join()
    return 0
