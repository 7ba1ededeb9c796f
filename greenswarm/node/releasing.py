"""A site that ends its trainer between windows, and the agent that starts it again.

The rule for *when* is :mod:`greenswarm.scheduler.release` (shared with the simulator). This module
is the node's side of it, in two halves:

* :class:`Releaser`, in the trainer (the node process): at each window's end it plans the release
  (the rule, fed the site's own forecast and its measured restart time, converted to clock seconds),
  says when it is due, and when it is, the node checkpoints, leaves the swarm and exits with
  :data:`RELEASED_EXIT` after writing ``run_dir/released.json``. When the node starts again it books
  the released stretch (at ``energy.released_kw``) and the restart (at training power) in its ledger,
  and journals both in ``run_dir/releases.jsonl``.
* :func:`wait_for_window`, in the agent (the supervisor, :mod:`greenswarm.node.supervisor`, a small
  process that holds no model): it watches the site's schedule and, when the next window opens,
  notes the instant in ``released.json`` and forks the trainer again. Meanwhile its presence
  (:mod:`greenswarm.node.presence`, a forked child) keeps the site in the swarm: its RELEASED record,
  and its last global state served to sites that catch up.

A trainer of several ranks (``node.ranks``) is a torchrun group that the agent starts (it cannot fork
one): its ranks all exit 0 on a release (torchrun calls any other status a failure), and the agent
knows the release by the marker, which names the launch (:func:`released_by`).

A site releases on a trace's windows or on a live signal (the agent then polls the feed itself,
on its own clock, with no thread: it forks the trainer next); not on a deadline plan, whose windows
depend on the trainer's progress (such a site says so and holds), and only under an agent (the
supervisor or a launcher).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from greenswarm.jsonlines import read_json_lines
from greenswarm.private_files import write_private
from greenswarm.scheduler.energy import EnergyLedger
from greenswarm.scheduler.live import LiveSchedule
from greenswarm.scheduler.policy import WindowSchedule
from greenswarm.scheduler.release import (
    ReleaseDecision,
    ReleaseRule,
    enter_level,
    expected_gap_s,
    release_forecaster,
)
from greenswarm.scheduler.state import SiteState
from greenswarm.timefmt import parse_instant

if TYPE_CHECKING:
    from greenswarm.node.config import SiteConfig
    from greenswarm.scheduler.clock import Clock

#: the node's exit status when it ended its trainer for a gap (EX_TEMPFAIL: "try again later")
RELEASED_EXIT = 75
MARKER = "released.json"
#: set in a launched trainer's environment: an agent starts it again after a release or a crash
LAUNCHED_ENV = "GREENSWARM_LAUNCHED"
#: the process name a torchrun group's rank 0 takes once it stops cleanly on SIGTERM (its node built, its
#: handler in place): an agent passes a stop only to a rank 0 that has it (earlier, the signal would
#: end that rank mid-start, and torchrun would call it a failure and start the group again)
RANK0_READY = "gs-rank0"
JOURNAL = "releases.jsonl"
#: the measured restarts the rule takes the median of
RECENT_RESTARTS = 5
#: the longest a released site's agent waits on one request to its live signal's API (one try): a
#: stop signal is acted on between polls, so this bounds how long a stop may wait (twice: a poll
#: reads the history and, when asked, the forecast)
AGENT_POLL_S = 5.0


def why_not_releasing(
    cfg: SiteConfig, schedule: object, world_size: int, supervised: bool, launched: bool = False
) -> str | None:
    """Why this site keeps its trainer through every gap whatever ``release.mode`` says, or None.
    ``launched``: an agent started this trainer (a launcher, or node.ranks' torchrun)."""
    if cfg.release.mode == "never":
        return "release.mode is never"
    if not supervised:
        return "releasing needs node.restart: on-crash (the supervisor is what starts the trainer again)"
    if world_size > 1 and not launched:
        return (
            "its ranks were started by a torchrun of its own, which nothing starts again; set "
            f"node.ranks: {world_size} and start greenswarm node without torchrun (it runs one)"
        )
    if not isinstance(schedule, WindowSchedule | LiveSchedule):
        return (
            "a deadline plan's windows depend on its trainer's progress, which a released site does "
            "not make: only a site on a trace's windows or a live signal releases"
        )
    return None


class Releaser:
    """Plans, triggers and books this site's releases (see the module's docstring)."""

    def __init__(
        self,
        cfg: SiteConfig,
        schedule: object,
        clock: Clock,
        ledger: EnergyLedger,
        log: logging.Logger,
        *,
        world_size: int = 1,
        supervised: bool = False,
    ):
        self.cfg, self.schedule, self.clock, self.ledger, self.log = cfg, schedule, clock, ledger, log
        self.run_dir = Path(cfg.node.run_dir)
        launched = bool(os.environ.get(LAUNCHED_ENV))
        self.off = why_not_releasing(cfg, schedule, world_size, supervised, launched)
        if self.off is not None and cfg.release.mode != "never":
            # (a warning for idle, which someone chose; auto is the default, and holding is its answer)
            level = logging.WARNING if cfg.release.mode == "idle" else logging.INFO
            mode = cfg.release.mode
            log.log(level, "release.mode is %s, but the site holds its trainer: %s", mode, self.off)
        self.decision: ReleaseDecision | None = None
        self.planned = False  # this gap's release is planned (or decided against)
        self.finishing = False  # no window is left: the node finishes its run now
        self.finishing_since: float | None = None  # (clock) when it said so, as it left its last window
        self._blind = False  # said once: a live signal with no sample yet, so no release
        self.release_at = math.inf  # clock time at which the planned release is due
        self.stop_at = parse_instant(cfg.node.stop_at) if cfg.node.stop_at else math.inf
        self.released = False  # the node is ending for a release
        self.restart: dict[str, Any] | None = None  # the marker this start resumed from a release
        self._phases: dict[str, float] = {"trainer process started": time.time()}  # wall times

    # -------------------------------------------------------------------- in a window's gap

    def rule(self) -> ReleaseRule:
        """The rule in clock seconds: a restart of ``w`` wall seconds takes ``w x speedup`` of a
        replay's clock (and the same ``w`` of a wall clock)."""
        per_wall = 1.0 / self.clock.wall_seconds(1.0)
        r, e = self.cfg.release, self.cfg.energy
        seconds = replace(
            r, restart_s=self.restart_wall_s() * per_wall, checkpoint_s=r.checkpoint_s * per_wall
        )
        return ReleaseRule(seconds, e.train_kw, e.idle_kw, e.released_kw)

    def applied(self) -> dict[str, Any]:
        """The rule as this site applies it, in clock seconds (``never`` when the site holds its
        trainer whatever its mode): what ``greenswarm simulate --calibrate`` models for a run in
        which no site released, so the calibrated simulator holds where the node did."""
        if self.off is not None or self.cfg.release.mode == "never":
            return {"mode": "never"}
        r = self.rule().config
        return {"mode": r.mode, "trust": r.trust, "restart_s": r.restart_s, "checkpoint_s": r.checkpoint_s}

    def restart_wall_s(self) -> float:
        """The median of this site's last measured restarts (window open to first step), or the
        configured ``release.restart_s`` before any."""
        measured = [
            float(e["restart_wall_s"])
            for e in read_json_lines(self.run_dir / JOURNAL)
            if e.get("event") == "restart" and isinstance(e.get("restart_wall_s"), int | float)
        ][-RECENT_RESTARTS:]
        return statistics.median(measured) if measured else self.cfg.release.restart_s

    def plan(self, now: float, after_window: bool = True, left: float | None = None) -> None:
        """The site is outside a window (it has just left one; or, ``after_window`` False, it started
        outside one): decide how long to hold before releasing, and say why -- a gap that does not
        follow a window as ``auto`` decides it. With no window left before the run ends, the trainer
        finishes now (its last evaluation and summary) instead of waiting for the end."""
        self.release_at, self.planned = math.inf, True
        if self.off is not None:
            return
        # a live signal's next window is unknown (its end is the agent's to notice, released)
        static = isinstance(self.schedule, WindowSchedule)
        nxt = self.schedule.next_window(now)
        ends = self.cfg.node.stop_at_trace_end or math.isfinite(self.stop_at)
        if static and ends and (nxt is None or nxt.start >= self.stop_at):
            # (from when it left the window, ``left``: its ledger books IDLE from there, the round in
            # flight and the window's checkpoint included)
            self.finishing, self.finishing_since = True, now if left is None else min(left, now)
            self.log.info("release: no window is left before the run ends: the trainer finishes now")
            return
        trace, region = self.schedule.trace, self.cfg.region  # (a live signal's: what it observed)
        if trace is None:
            # a live signal that has given no sample yet (a restarted trainer whose first poll failed
            # or came late): no gap to judge, and a trainer released now would be started again at
            # once by an agent that sees the window. Planned afresh at the next look.
            self.planned = False
            if not self._blind:
                self.log.info("release: the live signal has given no sample yet: no release until it does")
            self._blind = True
            return
        self._blind = False
        rule = self.rule()
        gap = None
        mode = self.cfg.release.mode if after_window else "auto"
        forecaster = release_forecaster(self.cfg.scheduler, mode)
        if forecaster is not None:
            level = enter_level(self.cfg.scheduler.window_policy(), trace, region)
            gap = expected_gap_s(forecaster, trace, region, now, level)
        self.decision = rule.decide(gap, mode)
        end = min(self.stop_at, self.schedule.end if self.cfg.node.stop_at_trace_end else math.inf)
        if not static and end - now <= self.decision.hold_s + rule.config.restart_s:
            # (a live signal's next window is unknown, but not the run's end: a release due so near
            # it would end the run released, with a checkpoint for nothing and no last evaluation)
            self.log.info("release: the run ends within the hold and a restart: the trainer holds to the end")
            return
        self.release_at = now + self.decision.hold_s
        self.log.info("release: %s", self.decision.reason)

    def planned_restart(self, now: float) -> float | None:
        """Clock time at which a released site's agent starts the trainer again: its schedule's
        next window (None while not released, or with no window left)."""
        if not self.released or not isinstance(self.schedule, WindowSchedule):
            return None
        nxt = self.schedule.next_window(now)
        return float(nxt.start) if nxt is not None else None

    def cancel(self) -> None:
        """The site is in a window again before its release was due."""
        self.release_at, self.planned = math.inf, False

    def due(self, now: float) -> bool:
        return now >= self.release_at

    def release(
        self,
        now: float,
        saved: float,
        checkpoint_wall_s: float,
        state_digest: str,
        record: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """The node has checkpointed (from clock time ``now`` to ``saved``) and is leaving: leave the
        marker the agent, its presence (:mod:`greenswarm.node.presence`: ``record``, the site's last
        progress record as RELEASED) and the next start read, and the journal's line.
        ``state_digest``: what the checkpoint restores."""
        self.released = True
        decision = self.decision
        entry = {
            "state_digest": state_digest,
            "event": "release",
            "mode": self.cfg.release.mode,
            "clock": now,
            "released_clock": saved,
            "wall": time.time(),
            "reason": decision.reason if decision else "",
            "hold_s": decision.hold_s if decision else 0.0,
            "expected_gap_s": decision.expected_gap_s if decision else None,
            "checkpoint_wall_s": checkpoint_wall_s,
            "launch": os.environ.get(LAUNCHED_ENV),  # (the agent's name for this trainer, if it has one)
        }
        _append(self.run_dir / JOURNAL, entry)
        marker = {**entry, "record": record() if record is not None else None}
        write_private(self.run_dir / MARKER, json.dumps(marker).encode())
        self.log.info(
            "release: the trainer ends (checkpoint written in %.1f s; %s)", checkpoint_wall_s, entry["reason"]
        )

    # -------------------------------------------------------------------- starting again

    def resume(self, now: float, state_digest: Callable[[], str]) -> bool:
        """At start, after the checkpoint was loaded: if the site was released, book the released
        stretch up to the agent's restart and the restart since at training power, and check that
        the state restored is the state released (``state_digest``); whether it was released."""
        marker = self.run_dir / MARKER
        entry = read_marker(self.run_dir)
        if not entry:
            return False
        current = (
            self.off is None
            and isinstance(entry.get("restart_clock"), int | float)
            and isinstance(entry.get("restart_wall"), int | float)
            and self.ledger.t <= float(entry.get("released_clock", math.inf)) + 1e-6
        )
        if not current:  # the agent ended while released, or a checkpoint came after this release
            marker.unlink(missing_ok=True)
            return False
        restart_at = float(entry["restart_clock"])
        # the release's checkpoint was written holding the GPUs; released from then to the restart
        self.ledger.advance(min(float(entry.get("released_clock", 0.0)), now), SiteState.IDLE)
        self.ledger.advance(min(restart_at, now), SiteState.RELEASED)
        self.ledger.advance(now, SiteState.RESTARTING)
        entry["state_digest_after"] = after = state_digest()
        if after != entry.get("state_digest"):
            self.log.warning(
                "release: the state restored (%s) is not the state released (%s): a checkpoint was "
                "lost or replaced in between; training goes on from what was restored",
                after,
                entry.get("state_digest"),
            )
        self.restart = entry
        return True

    def mark(self, phase: str) -> None:
        """Note when a phase of this start ended (wall time): a restart's journal line says where
        its seconds went."""
        self._phases[phase] = time.time()

    def restart_missed(self) -> None:
        """The window closed before the restarted trainer's first step: this restart is over (a
        crash from here on is booked as any crash is), and the gap's release is planned afresh."""
        if self.restart is not None:
            self.restart = None
            (self.run_dir / MARKER).unlink(missing_ok=True)
            self.log.info("release: the window closed before the restarted trainer's first step")

    def finished(self, now: float) -> None:
        """A trainer that finished after its last window (``finishing``) journals how long it stayed
        IDLE from leaving that window to ``now``, the end of its ledger: what ``greenswarm simulate
        --calibrate`` books as ``finish_s`` (seconds for a real site, minutes of a replay's trace)."""
        if self.finishing and self.finishing_since is not None:
            idle_s = max(0.0, now - self.finishing_since)
            _append(self.run_dir / JOURNAL, {"event": "finish", "clock": now, "idle_s": idle_s})

    def ended(self) -> None:
        """The trainer stops for good (a stop, the trace's end): no restart is pending."""
        self.restart = None
        (self.run_dir / MARKER).unlink(missing_ok=True)

    def first_step(self, now: float) -> None:
        """The restarted trainer took its first step: journal how long the restart took. The marker
        goes only now: a trainer killed while it starts is started again, from the same release."""
        if self.restart is None:
            return
        entry, self.restart = self.restart, None
        (self.run_dir / MARKER).unlink(missing_ok=True)
        began = float(entry["restart_wall"])
        self.mark("first step")
        seconds = self._phases["first step"] - began
        phases, last = {}, began
        for phase, t in self._phases.items():  # (in the order they happened)
            phases[phase], last = round(t - last, 3), t
        released_s = float(entry["restart_clock"]) - float(entry.get("released_clock", entry["clock"]))
        _append(
            self.run_dir / JOURNAL,
            {
                "event": "restart",
                "clock": now,
                "released_s": released_s,
                "restart_wall_s": seconds,
                "phases_s": phases,  # seconds each phase took, from the window's opening
                "state_digest": entry.get("state_digest"),
                "state_digest_after": entry.get("state_digest_after"),
            },
        )
        self.log.info(
            "RELEASED -> training again: %.1f s from the window's opening to the first step "
            "(released for %.1f clock h)",
            seconds,
            released_s / 3600.0,
        )


def released_by(run_dir: str | Path, launch: str) -> bool:
    """Whether the trainer that an agent started as ``launch`` (the value of :data:`LAUNCHED_ENV` it
    gave it) ended for a release: its marker names that launch (a torchrun group's ranks exit 0 when
    they release; a finished run leaves no marker, an earlier launch's marker names another)."""
    return read_marker(run_dir).get("launch") == launch


def read_marker(run_dir: str | Path) -> dict[str, Any]:
    """The release marker in ``run_dir`` (empty: none, or torn)."""
    try:
        entry = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return entry if isinstance(entry, dict) else {}


def _append(path: Path, entry: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def wait_for_window(cfg: SiteConfig, stopped: Callable[[], bool], log: logging.Logger) -> bool:
    """In the agent, while the site is released: wait for its next window (True: start the trainer
    again), or for a stop, the trace's end or ``node.stop_at`` (False). Reads the same schedule and
    clock as the node (a replay's ``start_wall`` is pinned before the first fork)."""
    from greenswarm.scheduler.site_schedule import site_schedule

    scheduler = cfg.scheduler
    if scheduler.signal is not None:  # one try per poll, a short timeout: a stop waits on no API
        quick = replace(scheduler.signal, retries=0, timeout_s=min(scheduler.signal.timeout_s, AGENT_POLL_S))
        scheduler = replace(scheduler, signal=quick)
    schedule, clock = site_schedule(scheduler, cfg.region, cfg.load_trace, log, poll=False)
    # a live signal: polled here, between sleeps, never on a thread (the agent forks the trainer next,
    # and a fork must not find a thread mid-request); its windows come as its samples do
    feed = schedule.feed if isinstance(schedule, LiveSchedule) else None
    try:
        return _wait(cfg, schedule, clock, feed, stopped, log)
    finally:
        if feed is not None:
            feed.stop()  # (closes its source: no thread was started)


def _wait(
    cfg: SiteConfig, schedule: Any, clock: Clock, feed: Any, stopped: Callable[[], bool], log: logging.Logger
) -> bool:
    """:func:`wait_for_window`'s loop; ``feed``: a live signal's, polled every ``poll_s`` of the clock."""
    from greenswarm.timefmt import utc_minute

    stop_at = parse_instant(cfg.node.stop_at) if cfg.node.stop_at else math.inf
    marker = Path(cfg.node.run_dir) / MARKER
    poll_at = -math.inf if feed is not None else math.inf
    while not stopped():
        now = clock.now()
        if feed is not None and now >= poll_at:
            feed.poll()
            poll_at, now = now + feed.poll_s, clock.now()
        if (cfg.node.stop_at_trace_end and now >= schedule.end) or now >= stop_at:
            marker.unlink(missing_ok=True)  # (the run ends released: its checkpoint holds the state)
            return False
        if schedule.in_window(now):
            entry = read_marker(cfg.node.run_dir)
            entry.update(restart_clock=now, restart_wall=time.time())
            write_private(marker, json.dumps(entry).encode())
            log.info("window opens (%s): starting the trainer again", utc_minute(now))
            return True
        nxt = schedule.next_window(now)
        target = min(
            nxt.start if nxt else max(schedule.end, now), now + cfg.scheduler.poll_s, stop_at, poll_at
        )
        clock.sleep_until(target, max_wall_s=cfg.node.idle_wall_s)
    return False
