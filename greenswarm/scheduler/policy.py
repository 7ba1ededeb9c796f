"""Window policies: when is a site allowed to train?

A policy turns one region's trace into a list of curtailment windows, computed once up front. That
keeps the per-poll question ("am I in a window now, and when does it end?") a lookup, lets a site
publish its window end to the swarm, and lets every policy (threshold, percentile, hysteresis with
dwell and look-ahead) plug in behind the one :class:`WindowPolicy` interface.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from greenswarm.scheduler.forecast import Forecaster
from greenswarm.traces.trace import Trace


@dataclass(frozen=True)
class Window:
    """A half-open interval ``[start, end)`` of clock time (unix seconds) in which a site may train."""

    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def contains(self, t: float) -> bool:
        return self.start <= t < self.end


class WindowPolicy(Protocol):
    """Anything that can turn a region's trace into sorted, disjoint windows."""

    def windows(self, trace: Trace, region: str) -> list[Window]: ...


def runs_to_windows(trace: Trace, mask: np.ndarray) -> list[Window]:
    """Maximal windows where ``mask`` (one flag per sample) is true, under hold-last semantics.

    Sample ``i`` covers ``[times[i], times[i+1])`` and the last one ``[times[-1], trace.end)``. Shared
    so that later policies only have to compute a mask.
    """
    flags = np.concatenate(([False], np.asarray(mask, dtype=bool), [False]))
    edges = np.flatnonzero(np.diff(flags.astype(np.int8)))
    bounds = np.append(trace.times, trace.end)
    return [Window(float(bounds[a]), float(bounds[b])) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class ThresholdPolicy:
    """In a window while intensity < ``threshold`` (gCO2/kWh); the curtail-llm anchor's rule.

    Windows shorter than ``min_window_s`` are dropped: spinning up for a few minutes of clean power
    costs more in start-up and synchronisation than it saves.
    """

    def __init__(self, threshold: float, min_window_s: float = 0.0):
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be a finite number > 0, got {threshold}")
        if not (math.isfinite(min_window_s) and min_window_s >= 0):
            raise ValueError(f"min_window_s must be a finite number >= 0, got {min_window_s}")
        self.threshold = float(threshold)
        self.min_window_s = float(min_window_s)

    def windows(self, trace: Trace, region: str) -> list[Window]:
        found = runs_to_windows(trace, trace.series(region) < self.threshold)
        return [w for w in found if w.duration >= self.min_window_s]

    def __repr__(self) -> str:
        return f"ThresholdPolicy(threshold={self.threshold}, min_window_s={self.min_window_s})"


class PercentilePolicy:
    """In a window while intensity < the ``percentile``-th percentile of the region's own trace.

    A fixed threshold suits one grid but not another (100 gCO2/kWh is most of the year in France and
    rarely reached in Poland); a percentile asks for "the cleanest P % of this grid's hours" wherever a
    site is. Without ``period_s`` the percentile is taken over the *whole* trace (numpy's linear
    interpolation), which is what an offline study of a year-long export wants. With ``period_s``
    it is a rolling percentile of the samples in ``(t - period_s, t]`` -- only the past, so a live
    site can compute it, and it follows the seasons. Ties at the cut-off count as outside the window,
    so the share in window is at most about P %. Windows shorter than ``min_window_s`` are dropped.
    """

    def __init__(self, percentile: float, min_window_s: float = 0.0, period_s: float | None = None):
        if not (math.isfinite(percentile) and 0 < percentile <= 100):
            raise ValueError(f"percentile must be a number in (0, 100], got {percentile}")
        if not (math.isfinite(min_window_s) and min_window_s >= 0):
            raise ValueError(f"min_window_s must be a finite number >= 0, got {min_window_s}")
        if period_s is not None and not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"period_s must be a finite number > 0, got {period_s}")
        self.percentile = float(percentile)
        self.min_window_s = float(min_window_s)
        self.period_s = None if period_s is None else float(period_s)

    def threshold(self, trace: Trace, region: str) -> float:
        """The whole-trace threshold (gCO2/kWh) for ``region``: its ``percentile``-th percentile.

        With a rolling period this is the threshold at the trace's last sample; use
        :meth:`thresholds` for the per-sample values.
        """
        return float(self.thresholds(trace, region)[-1])

    def thresholds(self, trace: Trace, region: str) -> np.ndarray:
        """The threshold in force at each sample: constant without a period, rolling with one."""
        series = trace.series(region)
        if self.period_s is None:
            return np.full(series.shape, np.percentile(series, self.percentile))
        first = np.searchsorted(trace.times, trace.times - self.period_s, side="right")
        return np.array([np.percentile(series[lo : i + 1], self.percentile) for i, lo in enumerate(first)])

    def windows(self, trace: Trace, region: str) -> list[Window]:
        series = trace.series(region)
        found = runs_to_windows(trace, series < self.thresholds(trace, region))
        return [w for w in found if w.duration >= self.min_window_s]

    def __repr__(self) -> str:
        return (
            f"PercentilePolicy(percentile={self.percentile}, min_window_s={self.min_window_s}, "
            f"period_s={self.period_s})"
        )


class HysteresisPolicy:
    """Enter below ``enter_below``; leave once intensity has stayed >= ``leave_above`` for ``dwell_s``.

    The general form of every threshold rule in use. ``leave_above == enter_below`` with no dwell is
    :class:`ThresholdPolicy`; the curtail-llm anchor is ``enter_below=leave_above=100``,
    ``dwell_s=600`` (a site is removed only after 10 minutes continuously above). A dwell avoids
    churn on a noisy grid, but every second of it is training on dirty power -- about a third of the
    anchor's emissions. ``lookahead`` fixes that without the churn: when intensity first reaches
    ``leave_above``, the forecaster is asked whether it will stay there for the whole dwell; if so
    the site leaves at once (the window's predicted end), otherwise it rides the blip out. With an
    :class:`~greenswarm.scheduler.forecast.OracleForecaster` that is exact; with a real forecaster
    it can be wrong both ways, and the dwell still bounds the damage.

    Windows are computed on the trace's sample boundaries (where the intensity changes); windows
    shorter than ``min_window_s`` are dropped.
    """

    def __init__(
        self,
        enter_below: float,
        leave_above: float | None = None,
        dwell_s: float = 0.0,
        min_window_s: float = 0.0,
        lookahead: Forecaster | None = None,
    ):
        leave = enter_below if leave_above is None else leave_above
        for name, value in (("enter_below", enter_below), ("leave_above", leave)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if leave < enter_below:
            raise ValueError(f"leave_above ({leave}) must be >= enter_below ({enter_below})")
        for name, value in (("dwell_s", dwell_s), ("min_window_s", min_window_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        self.enter_below = float(enter_below)
        self.leave_above = float(leave)
        self.dwell_s = float(dwell_s)
        self.min_window_s = float(min_window_s)
        self.lookahead = lookahead

    def _predicted_long(self, trace: Trace, region: str, run_starts: np.ndarray) -> np.ndarray:
        """For each above-run start, does the look-ahead forecast say it lasts the whole dwell?"""
        out = np.zeros(len(run_starts), dtype=bool)
        if self.lookahead is None:
            return out
        for k, t in enumerate(run_starts):
            probe = trace.times[(trace.times >= t) & (trace.times < t + self.dwell_s)]
            probe = np.append(t, probe) if probe.size == 0 or probe[0] != t else probe
            out[k] = bool(np.all(self.lookahead.predict(trace, region, t, probe) >= self.leave_above))
        return out

    def windows(self, trace: Trace, region: str) -> list[Window]:
        series = trace.series(region)
        bounds = np.append(trace.times, trace.end)
        below = np.flatnonzero(series < self.enter_below)
        flags = np.concatenate(([False], series >= self.leave_above, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(flags))
        run_a, run_b = edges[::2], edges[1::2]  # above-runs are samples [a, b)
        run_t = bounds[run_a]
        # strictly longer: a spell of exactly dwell_s has ended by the time the dwell is up
        long_run = (bounds[run_b] - run_t) > self.dwell_s
        early = self._predicted_long(trace, region, run_t)
        exits = np.flatnonzero(long_run | early)
        found: list[Window] = []
        cursor = 0
        while True:
            i = int(np.searchsorted(below, cursor))
            if i == len(below):
                break
            j = int(below[i])
            k = int(np.searchsorted(run_a, j))  # first above-run after entering
            e = int(np.searchsorted(exits, k))
            if e == len(exits):
                found.append(Window(float(bounds[j]), trace.end))
                break
            r = int(exits[e])
            leave_t = float(run_t[r]) if early[r] else float(run_t[r]) + self.dwell_s
            found.append(Window(float(bounds[j]), min(leave_t, trace.end)))
            cursor = int(run_b[r])
        return [w for w in found if w.duration >= self.min_window_s]

    def __repr__(self) -> str:
        ahead = self.lookahead.name if self.lookahead is not None else None
        return (
            f"HysteresisPolicy(enter_below={self.enter_below}, leave_above={self.leave_above}, "
            f"dwell_s={self.dwell_s}, min_window_s={self.min_window_s}, lookahead={ahead!r})"
        )


def noticed_late_s(
    now: float, entering: bool, window: Window | None, left: Window | None, signal_end: float = math.inf
) -> float | None:
    """How many clock seconds after its window's edge a site that changed state at ``now`` noticed it:
    after ``window``'s start when ``entering`` it, after the end of the window it ``left`` otherwise.
    None where the change followed no edge the site has passed (a stop, joining or leaving a group
    inside a window, the signal's end at ``signal_end``): the calibrated simulator models a node's
    reaction by these figures (:mod:`greenswarm.simulation.calibrate`), so they must be edges the
    node really crossed."""
    if entering:
        edge = window.start if window is not None else None
    else:
        edge = left.end if left is not None and left.end < signal_end else None
    if edge is None or not 0.0 <= now - edge:
        return None
    return now - edge


class WindowSchedule:
    """One site's windows, with the lookups its control loop needs at every poll."""

    def __init__(self, trace: Trace, region: str, policy: WindowPolicy):
        self.trace = trace
        self.region = region
        self.policy = policy
        self.windows: list[Window] = sorted(policy.windows(trace, region), key=lambda w: w.start)
        self._starts = [w.start for w in self.windows]

    @property
    def end(self) -> float:
        """When the signal ends: the trace's end (a live schedule's may be never)."""
        return self.trace.end

    def current(self, t: float) -> Window | None:
        """The window containing ``t``, if any."""
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= 0 and self.windows[i].contains(t):
            return self.windows[i]
        return None

    def in_window(self, t: float) -> bool:
        return self.current(t) is not None

    def next_window(self, t: float) -> Window | None:
        """The first window starting strictly after ``t`` (use :meth:`current` for one containing ``t``)."""
        i = bisect.bisect_right(self._starts, t)
        return self.windows[i] if i < len(self.windows) else None

    def share_in_window(self) -> float:
        """Fraction of the trace's span ``[start, end)`` covered by windows."""
        span = self.trace.end - self.trace.start
        return sum(w.duration for w in self.windows) / span
