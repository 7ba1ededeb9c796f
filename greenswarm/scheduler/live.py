"""Windows from a live signal, decided as the samples arrive, and what a site does when they stop.

:class:`~greenswarm.scheduler.policy.WindowSchedule` computes a static trace's windows once, up front.
A live signal has no future to compute from: :class:`LiveSchedule` runs the same window policy on
what the feed has *observed* so far, whenever that changes. The window rules only ever look back
(threshold, hysteresis with dwell, a rolling percentile), so a feed that delivered every sample of a
trace gives exactly the windows of that trace read from a file -- only decided at the poll that
brought each sample instead of at its instant.

Past the last sample's interval the signal is *stale*. For one poll (``grace_s``: the time it takes
to fetch the next sample) the last value holds, as a grid operator's published interval does. After
that ``on_signal_loss`` decides:

* ``pause``: not in a window until fresh samples come;
* ``hold-last``: the last value holds for up to ``max_staleness_s`` after its interval ended;
* ``forecast``: the newest forecast the feed fetched stands in for the missing samples, for up to
  ``max_staleness_s`` and never past the forecast's own end.

Then the site pauses. Energy is booked against the same extended signal (the last value or the
forecast), so the accounting says what the site knew.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from greenswarm.scheduler.policy import Window, WindowPolicy
from greenswarm.signals.feed import LiveFeed, Observed
from greenswarm.timefmt import utc_minute
from greenswarm.traces.trace import Trace

FRESH, STALE, LOST = "fresh", "stale", "lost"


def loss_phrase(on_loss: str, max_staleness_s: float) -> str:
    """What a site does while its signal fails, in the words of the line that reports the failure."""
    minutes = f"{max_staleness_s / 60:g} min"
    return {
        "pause": "training pauses once the last sample is out of date (on_signal_loss: pause)",
        "hold-last": f"the site holds the last value for up to {minutes} (on_signal_loss: hold-last)",
        "forecast": f"the site follows the last forecast for up to {minutes} (on_signal_loss: forecast)",
    }[on_loss]


class LiveSchedule:
    """The lookups of :class:`WindowSchedule` (``current``, ``in_window``, ``next_window``), answered
    from a :class:`LiveFeed` at the time asked. ``end``: when the signal ends (a replayed trace's end;
    inf for a live feed)."""

    def __init__(
        self,
        feed: LiveFeed,
        region: str,
        policy: WindowPolicy,
        *,
        on_loss: str,
        max_staleness_s: float,
        grace_s: float,
        log: logging.Logger,
    ):
        self.feed, self.region, self.policy = feed, region, policy
        self.on_loss, self.max_staleness_s, self.grace_s = on_loss, float(max_staleness_s), float(grace_s)
        self.log = log
        self.end = feed.source.end
        self.windows: list[Window] = []
        self.trace: Trace | None = (
            None  # the observed signal, extended past its last sample as the policy says
        )
        self.usable_until = -math.inf
        self.status = ""  # none yet: the first fresh sample is no news
        self._key: tuple[int, int] | None = None
        self._starts: list[float] = []

    # ------------------------------------------------------------------ WindowSchedule's lookups

    def current(self, t: float) -> Window | None:
        self.refresh(t)
        if t >= self.usable_until:
            return None
        i = int(np.searchsorted(self._starts, t, side="right")) - 1
        return self.windows[i] if i >= 0 and self.windows[i].contains(t) else None

    def in_window(self, t: float) -> bool:
        return self.current(t) is not None

    def next_window(self, t: float) -> Window | None:
        """Unknown for a live signal: the site polls (``scheduler.poll_s``) instead of sleeping to it."""
        return None

    # ------------------------------------------------------------------ recomputing

    def refresh(self, now: float) -> None:
        """Recompute the windows when the feed observed something new or the extension grew a step."""
        observed = self.feed.observed()
        if observed.empty:
            self._set_status(LOST, now, observed)
            self.windows, self._starts, self.trace, self.usable_until = [], [], None, -math.inf
            return
        covered = observed.covered_until
        usable = self._usable_until(observed)
        horizon = min(max(now, covered), usable)
        steps = (
            max(0, math.ceil((horizon - covered) / observed.resolution_s) + 1) if horizon >= covered else 0
        )
        status = FRESH if now < covered + self.grace_s else (STALE if now < usable else LOST)
        self._set_status(status, now, observed)
        key = (observed.version, steps)
        if key == self._key:
            return
        trace = self._extended(observed, steps)
        found = self.policy.windows(trace, self.region)
        self.windows = [Window(w.start, min(w.end, usable)) for w in found if w.start < usable]
        self._starts = [w.start for w in self.windows]
        self.trace, self.usable_until = trace, usable
        self._key = key  # (only once all of it is computed)

    def _usable_until(self, observed: Observed) -> float:
        covered = observed.covered_until
        grace = covered + self.grace_s
        if self.on_loss == "pause":
            return grace
        limit = max(grace, covered + self.max_staleness_s)
        if self.on_loss == "forecast":
            issue = observed.forecast
            if issue is None or not issue.times.size:
                return grace
            forecast_end = float(issue.times[-1]) + observed.resolution_s
            return max(grace, min(limit, forecast_end))
        return limit

    def _extended(self, observed: Observed, steps: int) -> Trace:
        """The observed samples, plus ``steps`` samples past them: the last value held, or the forecast
        where the policy follows one and it covers the instant."""
        extra = observed.covered_until + observed.resolution_s * np.arange(steps, dtype=np.float64)
        values = np.full(steps, observed.values[-1])
        issue = observed.forecast
        if self.on_loss == "forecast" and issue is not None and issue.times.size and steps:
            idx = np.searchsorted(issue.times, extra, side="right") - 1
            inside = (idx >= 0) & (extra < float(issue.times[-1]) + observed.resolution_s)
            values = np.where(inside, issue.values[np.clip(idx, 0, issue.times.size - 1)], values)
        times = np.concatenate([observed.times, extra])
        return Trace(
            times,
            {self.region: np.concatenate([observed.values, values])},
            observed.resolution_s,
            self.feed.source.name,
        )

    def _set_status(self, status: str, now: float, observed: Observed) -> None:
        """Say when the signal goes stale, is lost to the policy, or is fresh again (one line each)."""
        if status == self.status:
            return
        old, self.status = self.status, status
        if status == FRESH:
            if old and not observed.empty:
                self.log.info(
                    "signal fresh again: sample of %s in hand", utc_minute(float(observed.times[-1]))
                )
            return
        if observed.empty:
            self.log.info("no signal yet: the site stays IDLE until the first sample arrives")
            return
        last = utc_minute(float(observed.times[-1]))
        if status == STALE:
            what = (
                "the last forecast" if self.on_loss == "forecast" and observed.forecast else "the last value"
            )
            self.log.info(
                "signal stale at %s (newest sample %s): following %s until %s",
                utc_minute(now), last, what, utc_minute(self._usable_until(observed)),
            )  # fmt: skip
        else:
            self.log.info(
                "signal lost at %s (newest sample %s): IDLE until fresh samples arrive (on_signal_loss: %s)",
                utc_minute(now), last, self.on_loss,
            )  # fmt: skip

    def describe(self) -> dict:
        """For the site's summary: the signal, how it went, and the windows it gave."""
        stats = self.feed.stats
        return {
            "source": self.feed.source.name,
            "on_signal_loss": self.on_loss,
            "polls": stats.polls,
            "failed_polls": stats.failed_polls,
            "outages": stats.outages,
            "failures": dict(stats.failures),
            "dropped_values": stats.dropped_values,
            "samples": stats.samples,
            "windows": [[w.start, w.end] for w in self.windows],
        }

    def close(self) -> None:
        self.feed.stop()
