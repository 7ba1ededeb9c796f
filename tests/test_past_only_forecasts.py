"""Forecasters that use only the past: the seasonal naive one over any horizon, and the weekly profile.

A forecast used for a decision at ``now`` must not depend on anything after ``now``: every
past-only forecaster gives the same answer on the trace cut at ``now`` as on the whole trace.
"""

from __future__ import annotations

import numpy as np
import pytest

from greenswarm.scheduler.forecast import (
    DAY_S,
    WEEK_S,
    ClimatologyForecaster,
    PersistenceForecaster,
    ProfileForecaster,
    SeasonalForecaster,
    make_forecaster,
    values_at,
)
from greenswarm.traces.trace import Trace

pytestmark = pytest.mark.deadline

MONDAY = 1767571200.0  # 2026-01-05T00:00:00Z, a Monday
HOUR = 3600.0
PAST_ONLY = [PersistenceForecaster, SeasonalForecaster, ClimatologyForecaster, ProfileForecaster]


def weeks_of(n: int, noise: float = 0.0, seed: int = 0) -> Trace:
    """Hourly samples for ``n`` weeks: a solar dip at midday every day, dirtier on weekdays."""
    hours = np.arange(n * 168)
    day, hour = (hours // 24) % 7, hours % 24
    values = 300.0 - 200.0 * np.exp(-(((hour - 12) / 3.0) ** 2)) + np.where(day < 5, 80.0, 0.0)
    values = values + noise * np.random.default_rng(seed).standard_normal(values.shape)
    return Trace.from_columns(MONDAY + HOUR * hours, {"A": np.maximum(values, 0.0)}, "weeks")


def cut_at(trace: Trace, now: float) -> Trace:
    keep = trace.times <= now
    return Trace(trace.times[keep], {"A": trace.series("A")[keep]}, trace.resolution_s, "cut")


@pytest.mark.parametrize("forecaster", PAST_ONLY, ids=lambda f: f.name)
@pytest.mark.parametrize("now_h", [5.5, 30.0, 200.25, 600.0])
def test_a_trace_cut_at_now_gives_the_same_forecast(forecaster: type, now_h: float) -> None:
    """Nothing after ``now`` is read, at horizons from zero to three weeks."""
    trace = weeks_of(5, noise=20.0)
    now = MONDAY + now_h * HOUR
    times = now + np.arange(0, 3 * 168) * HOUR
    whole = forecaster().predict(trace, "A", now, times)
    cut = forecaster().predict(cut_at(trace, now), "A", now, times)
    np.testing.assert_allclose(whole, cut, rtol=0, atol=1e-9)


def test_seasonal_follows_the_day_at_every_horizon() -> None:
    """Beyond a day it reads the same hour on the latest day already known (48 h back for 24-48 h
    ahead, ...), so a week ahead it still has the daily cycle; persistence there was flat."""
    trace = weeks_of(2)
    now = MONDAY + 8 * 24 * HOUR + 6 * HOUR  # a Tuesday, 06:00
    f = SeasonalForecaster(tau_s=HOUR)
    for ahead_h in (6, 30, 54, 150):
        t = now + ahead_h * HOUR
        days_back = max(1, int(np.ceil(ahead_h / 24)))
        expected = values_at(trace, "A", np.array([t - days_back * DAY_S]))[0]
        # (the present's weight exp(-h / tau_s) is under 0.3 % from six hours on)
        assert f.predict(trace, "A", now, np.array([t]))[0] == pytest.approx(expected, rel=1e-2)
    far = f.predict(trace, "A", now, now + np.arange(100, 124) * HOUR)
    assert far.max() - far.min() > 150  # the midday dip, five days ahead


def test_profile_forecasts_the_usual_week() -> None:
    """With weeks of history, the next week's forecast is the weekly shape: weekdays and weekend."""
    trace = weeks_of(4, noise=5.0)
    now = MONDAY + 21 * 24 * HOUR  # Monday 00:00 of week four
    times = now + np.arange(24, 168) * HOUR  # a day ahead onwards: the present level has faded
    got = ProfileForecaster().predict(trace, "A", now, times)
    truth = values_at(weeks_of(4), "A", times)
    assert np.abs(got - truth).max() < 15.0
    assert np.argmin(got[:24]) == 12 - 0  # Tuesday's dip at 12:00 UTC (index 0 is Tuesday 00:00)


def test_profile_before_a_week_and_before_a_day() -> None:
    """Less than a day known: persistence. One to seven days: the daily profile, no weekday shape."""
    trace = weeks_of(2)
    early = MONDAY + 10 * HOUR
    f = ProfileForecaster()
    flat = f.predict(trace, "A", early, early + np.arange(1, 48) * HOUR)
    assert np.all(flat == trace.series("A")[10])
    three_days = MONDAY + 72 * HOUR
    daily = f.predict(trace, "A", three_days, three_days + np.arange(48, 72) * HOUR)
    hours = trace.series("A")[:73].reshape(-1)[:72].reshape(3, 24).mean(axis=0)
    np.testing.assert_allclose(daily, hours, atol=1.0)


def test_profile_shifts_to_the_present_level_then_fades() -> None:
    """A dirtier-than-usual now is the forecast for now; hours on, the lift is its difference from the
    usual (which the spike itself is a third of: one of three Tuesdays known), fading with tau_s."""
    base = weeks_of(3)
    values = base.series("A").copy()
    now_i = 2 * 168 + 30
    values[now_i] += 200.0
    trace = Trace(base.times, {"A": values}, base.resolution_s, "spike")
    now = float(trace.times[now_i])
    f = ProfileForecaster(tau_s=6 * HOUR)
    lift = f.predict(trace, "A", now, now + np.array([0.0, 6 * HOUR, 72 * HOUR])) - f.predict(
        base, "A", now, now + np.array([0.0, 6 * HOUR, 72 * HOUR])
    )
    assert lift[0] == pytest.approx(200.0)
    assert lift[1] == pytest.approx(200.0 * (1 - 1 / 3) * np.exp(-1), rel=0.05)
    assert abs(lift[2]) < 10.0


def test_profile_is_a_named_forecaster_with_checked_arguments() -> None:
    assert isinstance(make_forecaster("profile"), ProfileForecaster)
    with pytest.raises(ValueError, match="weeks"):
        ProfileForecaster(weeks=0)
    with pytest.raises(ValueError, match="tau_s"):
        ProfileForecaster(tau_s=-1.0)
    assert WEEK_S == 7 * DAY_S
