"""A running site that trains in the hours its deadline plan chooses (``scheduler.policy: deadline``).

:class:`DeadlineSchedule` answers the node's lookups (``current``, ``in_window``, ``next_window``,
``end``, ``trace``) from a :class:`~greenswarm.scheduler.deadline.DeadlinePlanner` instead of a window
rule. At each step of the signal's grid (an hour of an hourly trace) it plans again -- receding
horizon -- with the samples known so far and the work still left: site-hours the site has trained,
or tokens left divided by the throughput measured so far. A step the plan chooses is a "window" from
the step's start for as long as the plan needs; so the node's loop, its energy ledger and its
progress record work unchanged. Each decision that changes what the site does is logged with why
(the value now against the plan's price, the work left, the time to the deadline), and the plan's
next start is published in the site's progress record.

The signal is either a static trace (the planner cuts it at now: no decision reads a later sample)
or a live one (:class:`~greenswarm.scheduler.live.LiveSchedule`'s observed samples, extended as its
``on_signal_loss`` says; past that the site trains only when the deadline forces it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from greenswarm.scheduler.deadline import (
    DONE,
    DONE_S,
    FALLBACK,
    FORCED,
    LATE,
    DeadlinePlanner,
    Decision,
    Supply,
)
from greenswarm.scheduler.live import LiveSchedule
from greenswarm.scheduler.policy import Window
from greenswarm.timefmt import utc_minute
from greenswarm.traces.trace import Trace

HOUR_S = 3600.0
MEASURING, SIGNAL_LOST = "measuring-throughput", "signal-lost"
BLIND_STEP_S = 60.0  # without a signal the site decides again every clock minute


@dataclass(frozen=True)
class Work:
    """The work a site must finish by the deadline: site-hours of training, or tokens."""

    hours: float | None = None
    tokens: int | None = None

    def left_s(self, trained_s: float, tokens: int) -> float | None:
        """Site-seconds still to train; None while tokens are the target and no rate is measured yet."""
        if self.hours is not None:
            return max(self.hours * HOUR_S - trained_s, 0.0)
        assert self.tokens is not None
        if tokens >= self.tokens:
            return 0.0
        if trained_s <= 0 or tokens <= 0:
            return None
        return (self.tokens - tokens) * trained_s / tokens

    def describe(self) -> str:
        return f"{self.hours:g} site-hours" if self.hours is not None else f"{self.tokens:,} tokens"


#: (clock seconds trained so far, tokens trained so far): the node's own counts
Progress = Callable[[], tuple[float, int]]
#: the other sites of the swarm: (site name, tokens it trained, the plan it publishes or None), from
#: their progress records
Peers = Callable[[], list[tuple[str, int, dict | None]]]


def share_of(plan: dict | None, deadline: float, target: int, now: float) -> tuple[bool, Supply | None, str]:
    """Whether a peer's published plan shares this site's deadline and target, its supply as a
    :class:`Supply` (trimmed to the part of its horizon still ahead at ``now``; None when it
    published none), and why it is left out, otherwise."""
    if not isinstance(plan, dict):
        return False, None, "no shared plan"
    try:
        same = float(plan["deadline"]) == deadline and int(plan["target"]) == target
        values = [float(v) for v in plan["values"]]
        total, at = float(plan["work_tokens"]), float(plan["at"])
    except (KeyError, TypeError, ValueError):
        return False, None, "a malformed plan"
    if not same:
        return False, None, f"another deadline or target ({plan.get('deadline')}, {plan.get('target')})"
    finite = all(math.isfinite(v) for v in [*values, total, at])
    if not values or not finite or total <= 0:
        return True, None, ""
    ahead = min(max((deadline - now) / (deadline - at), 0.0), 1.0) if deadline > at else 0.0
    return True, Supply(tuple(values), tuple([total * ahead / len(values)] * len(values))), ""


class DeadlineSchedule:
    """The lookups of a window schedule, answered by a deadline plan (see module doc)."""

    def __init__(
        self,
        base: Trace | LiveSchedule,
        region: str,
        planner: DeadlinePlanner,
        work: Work,
        log: logging.Logger,
        *,
        shared: bool = False,
    ):
        self.base, self.region, self.planner, self.work, self.log = base, region, planner, work, log
        if shared and work.tokens is None:
            raise ValueError("a shared deadline plan counts tokens: give work_tokens")
        self.shared = shared
        self.peers: Peers = list
        self.refresh_peers: Callable[[], None] = lambda: None
        self.share: dict | None = None  # what this site publishes in its progress record (shared plans)
        self.partners = 0  # sites whose plans the last decision priced with
        self._peer_tokens: dict[str, int] = {}  # the most tokens each sharing site has shown
        self._ignored: set[str] = set()
        self.end = base.end
        self.progress: Progress = lambda: (0.0, 0)
        self.decision: Decision | None = None
        self._trained_at_decision = 0.0
        self._said: tuple[str, bool, int] | None = None
        self.decisions = 0
        self.reasons: dict[str, int] = {}
        self.finished_at: float | None = None
        self._measuring = False

    def bind(
        self, progress: Progress, peers: Peers | None = None, refresh_peers: Callable[[], None] | None = None
    ) -> None:
        """Where the schedule reads the site's progress (the node binds its ledger and counters) and,
        for a shared plan, the other sites' (their progress records), with how to read those afresh.

        ``peers`` may answer from a view polled in the background, a poll period old; a shared plan
        calls ``refresh_peers`` before it decides at each step of its grid, so that it decides on the
        records as they are at that moment (the one decision made within a step, when a first
        throughput is measured, reads the view as it is). Under a replayed clock a poll period is
        hours of the trace: a site that decided at its deadline on a view from before its partner's
        last step trained past the deadline for a target already met (docs/testing.md row 95)."""
        self.progress = progress
        if peers is not None:
            self.peers = peers
        if refresh_peers is not None:
            self.refresh_peers = refresh_peers

    def _left(self, trained: float, tokens: int, t: float) -> tuple[float | None, list[Supply]]:
        """Seconds of this site's training the work left amounts to (None: rate not yet measured), and
        the other sites' supplies when the plan is shared.

        A peer's tokens count while it shares the deadline and target, at the most it ever showed:
        a site that stopped, or restarted under a new record, keeps what it trained."""
        if not self.shared:
            return self.work.left_s(trained, tokens), []
        assert self.work.tokens is not None
        supplies = []
        for site, their_tokens, plan in self.peers():
            shares, supply, why = share_of(plan, self.planner.deadline, self.work.tokens, t)
            if not shares:
                if why not in self._ignored and why != "no shared plan":
                    self._ignored.add(why)
                    self.log.warning("deadline plan: %s's plan is left out of the shared one: %s", site, why)
                continue
            self._peer_tokens[site] = max(self._peer_tokens.get(site, 0), int(their_tokens))
            if supply is not None:
                supplies.append(supply)
        mine = Work(tokens=self.work.tokens - sum(self._peer_tokens.values()))  # the others' part done
        return mine.left_s(trained, tokens), supplies

    # ------------------------------------------------------------------ the node's lookups

    @property
    def trace(self) -> Trace | None:
        """The signal as known so far (what the ledger books against)."""
        return self.base if isinstance(self.base, Trace) else self.base.trace

    def current(self, t: float) -> Window | None:
        trained, tokens = self.progress()
        d = self.decision
        if self.shared and self.finished_at is None and (d is None or not d.begin <= t < d.end):
            self.refresh_peers()  # a new decision is due: on the others' records as they are now
        left, supplies = self._left(trained, tokens, t)
        if self.finished_at is None and left is not None and left <= DONE_S:
            self.finished_at = t
            self.log.info("deadline plan: work done (%s) at %s", self.work.describe(), utc_minute(t))
        if self.finished_at is not None:
            return None
        decision = self._decide(t, trained, tokens, left, supplies)
        if decision is None or not decision.trains():
            return None
        share = min(float(decision.allow_s[0]), decision.left_s)  # this step's part of the plan
        done = trained - self._trained_at_decision
        if done >= share - 1e-6:
            return None
        if share >= decision.end - decision.begin - 1e-6:
            return Window(decision.begin, decision.end)
        return Window(decision.begin, t + share - done)

    def in_window(self, t: float) -> bool:
        return self.current(t) is not None

    def next_window(self, t: float) -> Window | None:
        """The next plan is made at the next step: a waiting site wakes for it (or at its next poll)."""
        d = self.decision
        if d is None or self.finished_at is not None or not d.begin <= t < d.end:
            return None
        return Window(d.end, d.end)

    @property
    def next_start(self) -> float | None:
        """When the plan now in force next chooses to train (None: not planned, or done)."""
        d = self.decision
        if d is None or d.reason == DONE or self.finished_at is not None:
            return None
        trained, _ = self.progress()
        training_now = d.trains() and trained - self._trained_at_decision < float(d.allow_s[0]) - DONE_S
        return d.begin if training_now else d.next_start[0]

    def finished(self) -> bool:
        """The work is done (the node stops; a site with nothing left to train draws nothing)."""
        return self.finished_at is not None

    # ------------------------------------------------------------------ deciding

    def _decide(
        self, t: float, trained: float, tokens: int, left: float | None, supplies: list[Supply]
    ) -> Decision | None:
        d = self.decision
        measured = not (self._measuring and left is not None)  # a first rate replans at once
        if d is not None and d.begin <= t < d.end and measured:
            return d
        trace = self.trace
        if isinstance(self.base, LiveSchedule):
            self.base.refresh(t)
            trace = self.base.trace
        self._measuring = left is None
        rate = tokens / trained if self.work.tokens is not None and trained > 0 and tokens > 0 else 1.0
        if trace is None:  # no signal at all: only the deadline can make the site train
            decision = self._blind(t, left)
        elif left is None:  # tokens to do and no rate yet: train (a step) to measure it
            decision = self.planner.decide(trace, t, math.inf)
            decision = replace(decision, allow_s=decision.allow_s * 0.0 + (decision.end - decision.begin))
            decision = replace(decision, reason=MEASURING)
        elif self.shared:  # in tokens, priced with the other sites' supply
            decision = self.planner.decide(trace, t, left * rate, rate=rate, others=supplies)
        else:
            decision = self.planner.decide(trace, t, left)
        if self.shared:
            self.partners = len(supplies)
            self.share = self._share(decision, t, rate if left is not None else 0.0)
        lost = isinstance(self.base, LiveSchedule) and t >= self.base.usable_until
        if lost and decision.reason not in (FORCED, LATE, SIGNAL_LOST):
            decision = replace(decision, allow_s=decision.allow_s * 0.0, reason=SIGNAL_LOST)
        self.decision, self._trained_at_decision = decision, trained
        self.decisions += 1
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        self._say(decision, t)
        return decision

    def _blind(self, t: float, left: float | None) -> Decision:
        """A decision without any signal (a feed that never delivered): wait, unless the work left no
        longer fits before the deadline; decided again a minute later."""
        slack = self.planner.deadline - t
        forced = left is not None and left >= slack - DONE_S
        allow = np.array([BLIND_STEP_S if forced else 0.0])
        reason = (LATE if t >= self.planner.deadline else FORCED) if forced else SIGNAL_LOST
        return Decision(
            t, t + BLIND_STEP_S, allow, np.array([math.nan]), math.inf, reason, [None], left or 0.0
        )

    def _share(self, d: Decision, t: float, rate: float) -> dict:
        """What this site publishes for the others: its supply (its forecast by parts) when it planned,
        else its present value for the time left, at the rate it measured (0 while measuring)."""
        if d.supply is not None:
            values, work = list(d.supply.values), float(sum(d.supply.work))
        else:
            now = float(d.now[0]) if math.isfinite(float(d.now[0])) else 0.0
            values, work = [now], rate * max(self.planner.deadline - t, 0.0)
        return {"deadline": self.planner.deadline, "target": self.work.tokens, "values": values,
                "work_tokens": float(work), "at": float(t)}  # fmt: skip

    def _say(self, d: Decision, t: float) -> None:
        """One line when what the site does, or why, changes."""
        key = (d.reason, d.trains(), self.partners)
        if key == self._said:
            return
        self._said = key
        value = f"{d.now[0]:.0f} g now"
        if d.reason == MEASURING:
            why = f"training to measure the throughput ({self.work.describe()} to do)"
        elif d.reason == FORCED:
            why = "training: the work left no longer fits before the deadline otherwise"
        elif d.reason == LATE:
            why = "training: the deadline has passed with work left; until it is done"
        elif d.reason == FALLBACK:
            what = "training" if d.trains() else "waiting"
            why = f"{what} by the threshold ({value} vs {d.price:.0f} g): under a day of history to plan on"
        elif d.reason == SIGNAL_LOST:
            why = "waiting: the signal is lost"
        elif d.trains():
            why = f"training: {value}, below the plan's price {d.price:.0f} g"
        else:
            nxt = utc_minute(d.next_start[0]) if d.next_start[0] is not None else "-"
            why = f"waiting: {value}, above the plan's price {d.price:.0f} g; next planned start {nxt}"
        left = f"{d.left_s / HOUR_S:,.1f} site-h left" if math.isfinite(d.left_s) else "rate unknown"
        if self.shared:
            left += f", shared with {self.partners} other site{'s' if self.partners != 1 else ''}"
        to_go = (self.planner.deadline - t) / HOUR_S
        self.log.info("deadline plan at %s: %s (%s, %.1f h to the deadline)", utc_minute(t), why, left, to_go)

    def describe(self) -> dict | None:
        """The live signal's part of the site's summary (None over a static trace)."""
        return self.base.describe() if isinstance(self.base, LiveSchedule) else None

    def plan(self) -> dict:
        """The plan's part of the site's summary."""
        trained, tokens = self.progress()
        out: dict = {
            "policy": "deadline",
            "deadline": self.planner.deadline,
            "work": {"hours": self.work.hours, "tokens": self.work.tokens},
            "forecaster": getattr(self.planner.forecaster, "name", type(self.planner.forecaster).__name__),
            "trained_site_hours": trained / HOUR_S,
            "tokens": tokens,
            "finished_at": self.finished_at,
            "met_deadline": self.finished_at is not None and self.finished_at <= self.planner.deadline,
            "decisions": self.decisions,
            "reasons": dict(self.reasons),
            "shared": self.shared,
        }
        return out

    def close(self) -> None:
        if isinstance(self.base, LiveSchedule):
            self.base.close()
