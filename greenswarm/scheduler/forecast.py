"""Forecasts of grid intensity: what a site may know about the future at decision time.

Look-ahead window policies and the deadline-aware simulator ask the same question -- "what will the
intensity of this region be at these future instants, given what is known now?" -- so they share one
:class:`Forecaster` interface. Its answers, from no knowledge to full knowledge:

* :class:`PersistenceForecaster`: the value now holds forever. Uses nothing but the present; the
  honest floor every forecast must beat.
* :class:`SeasonalForecaster`: persistence fading into "the same time yesterday" (seasonal naive)
  with a time constant of a few hours. Grid intensity is strongly diurnal (solar), so yesterday is a
  good guess for tomorrow's afternoon; uses only the trace up to now.
* :class:`ProfileForecaster`: the region's usual week (hour of day x day of week over the last four
  weeks), shifted to today's level; uses only the trace up to now.
* :class:`FileForecaster`: forecasts as they were issued, read from a file (``file:PATH``), each
  used only from its issue time on.
* :class:`OracleForecaster`: the trace itself. Not available to a live site; it is the upper bound
  that says how much a perfect forecast would be worth.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from greenswarm.traces.forecast_file import IssuedForecasts, read_forecast_file
from greenswarm.traces.trace import Trace

DAY_S = 86400.0
WEEK_S = 7 * DAY_S


def values_at(trace: Trace, region: str, times: np.ndarray) -> np.ndarray:
    """Hold-last intensity of ``region`` at each of ``times`` (clamped to the trace's ends), vectorised."""
    idx = np.searchsorted(trace.times, np.asarray(times, dtype=np.float64), side="right") - 1
    return trace.series(region)[np.clip(idx, 0, len(trace.times) - 1)]


class Forecaster(Protocol):
    """Predicts ``region``'s intensity at ``times`` (all >= ``now``) using what is known at ``now``."""

    name: str

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray: ...


class OracleForecaster:
    """Perfect foresight: the trace's own future values (an upper bound, not a real forecast)."""

    name = "oracle"
    past_only = False  # the planner hands it the whole trace

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        return values_at(trace, region, times)


class PersistenceForecaster:
    """The intensity now, held for every future instant."""

    name = "persistence"

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        return np.full(np.shape(times), values_at(trace, region, np.array([now]))[0])


class SeasonalForecaster:
    """``w(h) * now + (1 - w(h)) * same_time(t)`` with ``w(h) = exp(-h / tau_s)`` for horizon ``h``.

    Near the present, persistence is the better guess; hours ahead, the diurnal cycle is.
    ``same_time(t)`` is the value at the same time of day on the latest day already known: 24 h
    before ``t`` for a horizon under a day, 48 h before for one under two days, and so on (seasonal
    naive), so a horizon of weeks still follows the daily cycle and never peeks past ``now``. Where
    that day lies before the trace (its first days), it falls back to persistence.
    """

    name = "seasonal"

    def __init__(self, tau_s: float = 3 * 3600.0):
        if not (math.isfinite(tau_s) and tau_s > 0):
            raise ValueError(f"tau_s must be a finite number > 0, got {tau_s}")
        self.tau_s = float(tau_s)

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        times = np.asarray(times, dtype=np.float64)
        current = values_at(trace, region, np.array([now]))[0]
        days_back = np.maximum(1.0, np.ceil((times - now) / DAY_S))  # the latest whole day at or before now
        past = times - days_back * DAY_S
        known = (past >= trace.start) & (past <= now)
        same_time = np.where(known, values_at(trace, region, past), current)
        weight = np.exp(-np.maximum(times - now, 0.0) / self.tau_s)
        return weight * current + (1.0 - weight) * same_time


class ClimatologyForecaster:
    """The future is distributed like the past: the region's values so far, spread over the horizon.

    It says nothing about *when* the clean hours come, only how many there will be -- which is all
    a deadline-aware price needs (the share of remaining time below a given intensity). Uses only
    samples at or before ``now``; with a single sample it is persistence.
    """

    name = "climatology"

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        times = np.asarray(times, dtype=np.float64)
        past = trace.series(region)[: max(int(np.searchsorted(trace.times, now, side="right")), 1)]
        if not times.size:
            return np.zeros(0)
        return np.quantile(past, np.linspace(0.0, 1.0, times.size))


class ProfileForecaster:
    """The region's usual week, shifted to the recent level:
    ``P(t) + fast * exp(-h / tau_s) + slow * exp(-h / slow_s)``.

    ``P`` is the mean intensity of each hour of the week (UTC hour of day x day of week) over the last
    ``weeks`` weeks up to ``now``; while fewer than seven days are known it is the mean of each hour of
    the day, and with less than a day it is persistence. Two departures from ``P`` carry on into the
    forecast: ``slow``, the mean departure over the last ``level_s`` (a windy or a still spell lasts
    days), fading with time constant ``slow_s``; and ``fast``, the present hour's departure beyond
    that, fading with ``tau_s`` (a windy afternoon says something about tonight, little about next
    week). Uses only samples at or before ``now``.

    On the Electricity Maps 2023 grid (``benchmarks/carbon_policies.py``) the slow level lifts the
    10th percentile of the share of foresight's saving that the deadline policy captures on 24 h
    jobs from 0.01 to 0.30 (100 h jobs: 0.34 to 0.36; medians 0.90 to 0.92 and 0.91).
    """

    name = "profile"

    def __init__(
        self,
        weeks: int = 4,
        tau_s: float = 6 * 3600.0,
        slow_s: float = 24 * 3600.0,
        level_s: float = 24 * 3600.0,
    ):
        if isinstance(weeks, bool) or not isinstance(weeks, int) or weeks < 1:
            raise ValueError(f"weeks must be an integer >= 1, got {weeks!r}")
        for name, value in (("tau_s", tau_s), ("slow_s", slow_s), ("level_s", level_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        self.weeks, self.tau_s, self.slow_s, self.level_s = weeks, float(tau_s), float(slow_s), float(level_s)

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        times = np.asarray(times, dtype=np.float64)
        current = values_at(trace, region, np.array([now]))[0]
        lo = int(np.searchsorted(trace.times, now - self.weeks * WEEK_S, side="left"))
        hi = int(np.searchsorted(trace.times, now, side="right"))
        if hi - lo < 2 or now - trace.times[lo] < DAY_S:
            return np.full(times.shape, current)
        past_t, past_v = trace.times[lo:hi], trace.series(region)[lo:hi]
        weekly = now - trace.times[lo] >= WEEK_S
        slot = _hour_of_week if weekly else _hour_of_day
        slots = 168 if weekly else 24
        counts = np.bincount(slot(past_t), minlength=slots)
        sums = np.bincount(slot(past_t), weights=past_v, minlength=slots)
        profile = np.where(counts > 0, sums / np.maximum(counts, 1), float(np.mean(past_v)))
        departure = past_v - profile[slot(past_t)]
        recent = past_t > now - self.level_s
        slow = float(departure[recent].mean()) if recent.any() else 0.0
        fast = current - profile[slot(np.array([now]))[0]] - slow
        lead = np.maximum(times - now, 0.0)
        shift = fast * np.exp(-lead / self.tau_s) + slow * np.exp(-lead / self.slow_s)
        return np.maximum(profile[slot(times)] + shift, 0.0)


def _hour_of_day(t: np.ndarray) -> np.ndarray:
    return (np.floor(t / 3600.0) % 24).astype(np.int64)


def _hour_of_week(t: np.ndarray) -> np.ndarray:
    """0 .. 167 from Monday 00:00 UTC (1970-01-01 was a Thursday)."""
    return ((np.floor(t / 3600.0) + 72) % 168).astype(np.int64)


class NoisyForecaster:
    """A commercial day-ahead forecast, modelled: the true value times log-normal noise whose
    spread grows with the horizon, ``sigma(h) = sigma_day * sqrt(h / 24 h)``.

    WattTime and Electricity Maps both sell such forecasts; ``sigma_day = 0.3`` (about 30 % error a
    day ahead) is a deliberately pessimistic stand-in for their published accuracy. Seeded, so a
    simulation is reproducible; every call draws fresh noise, as a re-issued forecast would.
    """

    name = "noisy"
    past_only = False

    def __init__(self, sigma_day: float = 0.3, seed: int = 0):
        if not (math.isfinite(sigma_day) and sigma_day >= 0):
            raise ValueError(f"sigma_day must be a finite number >= 0, got {sigma_day}")
        self.sigma_day = float(sigma_day)
        self.rng = np.random.default_rng(seed)

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        times = np.asarray(times, dtype=np.float64)
        sigma = self.sigma_day * np.sqrt(np.maximum(times - now, 0.0) / DAY_S)
        noise = np.exp(sigma * self.rng.standard_normal(times.shape) - sigma**2 / 2)
        return values_at(trace, region, times) * noise


class FileForecaster:
    """Forecasts as they were issued (:mod:`greenswarm.traces.forecast_file`): at ``now``, the latest
    forecast issued at or before ``now``, read as a step function (before its first instant its first
    value, after its last its last value holds). Before any forecast was issued only the present is
    known: persistence. Never a forecast issued after ``now``."""

    def __init__(self, forecasts: IssuedForecasts):
        self.forecasts = forecasts
        self.name = f"file:{forecasts.source}"

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        times = np.asarray(times, dtype=np.float64)
        issue = self.forecasts.latest(region, now)
        if issue is None:
            return PersistenceForecaster().predict(trace, region, now, times)
        idx = np.searchsorted(issue.times, times, side="right") - 1
        return issue.values[np.clip(idx, 0, len(issue.times) - 1)]


FORECASTERS: dict[str, type] = {
    "climatology": ClimatologyForecaster,
    "noisy": NoisyForecaster,
    "oracle": OracleForecaster,
    "persistence": PersistenceForecaster,
    "profile": ProfileForecaster,
    "seasonal": SeasonalForecaster,
}


def make_forecaster(name: str) -> Forecaster:
    """The forecaster called ``name``; a ValueError listing the known ones otherwise."""
    try:
        return FORECASTERS[name]()
    except KeyError:
        raise ValueError(f"unknown forecaster {name!r}; known: {', '.join(FORECASTERS)}") from None


#: the prefix of a forecast spec that names a file of issued forecasts
FILE_PREFIX = "file:"


def forecaster_from_spec(spec: str, *, tz: str | None = None, units: str = "g/kWh") -> Forecaster:
    """A forecaster by name, or ``file:PATH``: forecasts as they were issued, read with the trace's
    options (``tz``, ``units``) -- the same file as the trace, if it holds both. A TraceError names
    the file and line; a ValueError lists the known names."""
    if spec.startswith(FILE_PREFIX):
        return FileForecaster(read_forecast_file(spec[len(FILE_PREFIX) :], tz, units=units))
    return make_forecaster(spec)
