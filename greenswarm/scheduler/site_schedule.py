"""A site's schedule and clock, as its config says: a static trace's windows, a live signal's, or a
deadline plan over either (:mod:`greenswarm.scheduler.deadline_schedule`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from greenswarm.scheduler.clock import Clock, make_clock
from greenswarm.scheduler.deadline import PLAN_RETENTION_S, DeadlinePlanner
from greenswarm.scheduler.deadline_schedule import DeadlineSchedule, Work
from greenswarm.scheduler.live import LiveSchedule, loss_phrase
from greenswarm.scheduler.policy import WindowSchedule
from greenswarm.signals.feed import RETENTION_S, LiveFeed
from greenswarm.signals.sources import SignalSource, make_source
from greenswarm.timefmt import parse_instant
from greenswarm.traces.trace import Trace

if TYPE_CHECKING:
    from greenswarm.scheduler.config import SchedulerConfig

Schedule = WindowSchedule | LiveSchedule | DeadlineSchedule


def site_schedule(
    cfg: SchedulerConfig, region: str, load: Callable[[str], Trace], log: logging.Logger, *, poll: bool = True
) -> tuple[Schedule, Clock]:
    """A site's schedule and clock. Without ``cfg.signal``: the trace's windows, computed up front.
    With one: a live feed polled on its own thread (started here unless ``poll`` is False: a site's
    other ranks follow rank 0 and never ask the API themselves), and windows as it delivers. With
    ``policy: deadline``: the deadline plan over that trace or feed."""
    if cfg.signal is None:
        trace = load(cfg.trace)
        clock = make_clock(cfg.clock, trace.start)
        if cfg.policy == "deadline":
            return _deadline(cfg, trace, region, log), clock
        return WindowSchedule(trace, region, cfg.window_policy()), clock
    source: SignalSource = make_source(cfg.signal, cfg.trace, region, load, cfg.variant)
    start = source.history(-math.inf, math.inf).start if cfg.signal.kind in ("trace", "file") else math.nan
    clock = make_clock(cfg.clock, start)
    feed = LiveFeed(
        source,
        clock.now,
        cfg.signal.poll_s,
        log,
        wall_s=clock.wall_seconds,
        on_loss=loss_phrase(cfg.on_signal_loss, cfg.max_staleness_s),
        retention_s=PLAN_RETENTION_S if cfg.policy == "deadline" else RETENTION_S,
    )
    schedule = LiveSchedule(
        feed,
        region,
        cfg.window_policy(),
        on_loss=cfg.on_signal_loss,
        max_staleness_s=cfg.max_staleness_s,
        grace_s=cfg.signal.poll_s,
        log=log,
    )
    if poll:
        feed.start()
    if cfg.policy == "deadline":
        return _deadline(cfg, schedule, region, log), clock
    return schedule, clock


def _deadline(
    cfg: SchedulerConfig, base: Trace | LiveSchedule, region: str, log: logging.Logger
) -> DeadlineSchedule:
    assert cfg.deadline is not None  # (validated)
    planner = DeadlinePlanner(
        cfg.deadline_forecaster(),
        [region],
        parse_instant(cfg.deadline),
        margin=cfg.margin,
        threshold=cfg.threshold,
    )
    work = Work(cfg.work_hours, cfg.work_tokens)
    return DeadlineSchedule(base, region, planner, work, log, shared=cfg.shared)
