"""Window policies: when is a site allowed to train?

A policy turns one region's trace into a list of curtailment windows, computed once up front. That
keeps the per-poll question ("am I in a window now, and when does it end?") a lookup, lets a site
publish its window end to the swarm, and lets every policy (threshold and percentile now; hysteresis
and look-ahead later) plug in behind the one :class:`WindowPolicy` interface.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

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
    site is. The percentile is taken over the *whole* trace (numpy's linear interpolation), which is
    what an offline replay or a year-long export needs; a rolling period (the last N days, so that a
    live site adapts to the season) comes later. Ties at the cut-off count as outside the window, so
    the share in window is at most about P %. Windows shorter than ``min_window_s`` are dropped.
    """

    def __init__(self, percentile: float, min_window_s: float = 0.0):
        if not (math.isfinite(percentile) and 0 < percentile <= 100):
            raise ValueError(f"percentile must be a number in (0, 100], got {percentile}")
        if not (math.isfinite(min_window_s) and min_window_s >= 0):
            raise ValueError(f"min_window_s must be a finite number >= 0, got {min_window_s}")
        self.percentile = float(percentile)
        self.min_window_s = float(min_window_s)

    def threshold(self, trace: Trace, region: str) -> float:
        """The effective threshold (gCO2/kWh) for ``region``: its trace's ``percentile``-th percentile."""
        return float(np.percentile(trace.series(region), self.percentile))

    def windows(self, trace: Trace, region: str) -> list[Window]:
        series = trace.series(region)
        found = runs_to_windows(trace, series < self.threshold(trace, region))
        return [w for w in found if w.duration >= self.min_window_s]

    def __repr__(self) -> str:
        return f"PercentilePolicy(percentile={self.percentile}, min_window_s={self.min_window_s})"


class WindowSchedule:
    """One site's windows, with the lookups its control loop needs at every poll."""

    def __init__(self, trace: Trace, region: str, policy: WindowPolicy):
        self.trace = trace
        self.region = region
        self.policy = policy
        self.windows: list[Window] = sorted(policy.windows(trace, region), key=lambda w: w.start)
        self._starts = [w.start for w in self.windows]

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
