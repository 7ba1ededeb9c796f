"""Window rules and forecasts: hysteresis with dwell and look-ahead, the rolling percentile, the
forecasters they consult, and the scheduler config fields that choose among them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import ConfigError
from greenswarm.node.config import load_site_config
from greenswarm.scheduler.config import SchedulerConfig
from greenswarm.scheduler.forecast import (
    DAY_S,
    FORECASTERS,
    ClimatologyForecaster,
    NoisyForecaster,
    OracleForecaster,
    PersistenceForecaster,
    SeasonalForecaster,
    make_forecaster,
    values_at,
)
from greenswarm.scheduler.policy import (
    HysteresisPolicy,
    PercentilePolicy,
    ThresholdPolicy,
    Window,
    runs_to_windows,
)
from greenswarm.traces.trace import Trace

T0 = 1767225600.0  # 2026-01-01T00:00:00Z
STEP = 300.0

# Five-minute samples: a one-sample dirty spell at 2, a three-sample one at 5..7.
SPELLS = [50, 50, 150, 50, 50, 150, 150, 150, 50, 50]


def trace_of(values, step: float = STEP, **more) -> Trace:
    """A trace with region A (and any regions in ``more``) on a regular grid from T0."""
    times = T0 + np.arange(len(values)) * step
    columns = {"A": np.asarray(values, dtype=float)}
    columns.update({k: np.asarray(v, dtype=float) for k, v in more.items()})
    return Trace.from_columns(times, columns, source="test")


def steps(windows: list[Window], step: float = STEP) -> list[tuple[float, float]]:
    """Windows as (start, end) in steps since T0, for readable expectations."""
    return [((w.start - T0) / step, (w.end - T0) / step) for w in windows]


def random_trace(seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    times = T0 + np.cumsum(rng.choice([60.0, 300.0, 900.0], n))
    values = rng.choice([20.0, 60.0, 90.0, 100.0, 110.0, 140.0, 300.0], n)
    return Trace.from_columns(times, {"A": values}, source=f"random-{seed}")


# --- hysteresis ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(25))
def test_hysteresis_without_dwell_is_threshold(seed: int) -> None:
    """leave_above == enter_below with no dwell is exactly the threshold rule, min_window_s included
    (ties at the threshold count as dirty in both)."""
    trace = random_trace(seed)
    for threshold in (60.0, 100.0, 141.0):
        for min_window in (0.0, 600.0):
            assert HysteresisPolicy(threshold, threshold, min_window_s=min_window).windows(
                trace, "A"
            ) == ThresholdPolicy(threshold, min_window).windows(trace, "A")
            assert HysteresisPolicy(threshold).windows(trace, "A") == ThresholdPolicy(threshold).windows(
                trace, "A"
            )


def test_dwell_bridges_short_spells_and_leaves_late_on_long_ones() -> None:
    """A 5-minute dirty spell is ridden out under a 10-minute dwell; a 15-minute one ends the window
    10 minutes after it began (the anchor's controller)."""
    windows = HysteresisPolicy(100.0, dwell_s=600.0).windows(trace_of(SPELLS), "A")
    assert steps(windows) == [(0.0, 7.0), (8.0, 10.0)]
    # no dwell: every dirty sample ends a window
    assert steps(HysteresisPolicy(100.0).windows(trace_of(SPELLS), "A")) == [
        (0.0, 2.0),
        (3.0, 5.0),
        (8.0, 10.0),
    ]


def test_dwell_longer_than_every_spell_keeps_one_window() -> None:
    """With a dwell longer than every dirty spell the site never leaves once it has entered."""
    assert steps(HysteresisPolicy(100.0, dwell_s=3600.0).windows(trace_of(SPELLS), "A")) == [(0.0, 10.0)]
    # but it still has to enter below the threshold first
    late = [150, 150, 50, 150, 50]
    assert steps(HysteresisPolicy(100.0, dwell_s=3600.0).windows(trace_of(late), "A")) == [(2.0, 5.0)]


def test_window_never_outlasts_the_trace() -> None:
    """A dwell that would run past the trace's end is cut there."""
    windows = HysteresisPolicy(100.0, dwell_s=3600.0).windows(trace_of([50, 50, 150, 150]), "A")
    assert steps(windows) == [(0.0, 4.0)]


def test_leave_above_band_keeps_the_site_in_between() -> None:
    """Between enter_below and leave_above a site stays in (hysteresis) but does not enter."""
    trace = trace_of([50, 120, 120, 200, 120, 50, 120])
    assert steps(HysteresisPolicy(100.0, 150.0).windows(trace, "A")) == [(0.0, 3.0), (5.0, 7.0)]
    # the plain threshold leaves at the first 120
    assert steps(ThresholdPolicy(100.0).windows(trace, "A")) == [(0.0, 1.0), (5.0, 6.0)]


def test_min_window_drops_short_windows() -> None:
    """Windows shorter than min_window_s are dropped, longer ones kept whole."""
    policy = HysteresisPolicy(100.0, dwell_s=600.0, min_window_s=700.0)
    assert steps(policy.windows(trace_of(SPELLS), "A")) == [(0.0, 7.0)]  # (8, 10) is 600 s


def test_oracle_lookahead_leaves_at_once_on_long_spells_and_bridges_short_ones() -> None:
    """With a perfect forecast the dwell costs nothing: leave when the long spell starts, ride out
    the short one."""
    policy = HysteresisPolicy(100.0, dwell_s=600.0, lookahead=OracleForecaster())
    assert steps(policy.windows(trace_of(SPELLS), "A")) == [(0.0, 5.0), (8.0, 10.0)]


def test_persistence_lookahead_leaves_at_every_spell_start() -> None:
    """Persistence always predicts the spell lasts, so the site leaves at every dirty sample."""
    policy = HysteresisPolicy(100.0, dwell_s=600.0, lookahead=PersistenceForecaster())
    assert (
        steps(policy.windows(trace_of(SPELLS), "A"))
        == steps(ThresholdPolicy(100.0).windows(trace_of(SPELLS), "A"))
        == [(0.0, 2.0), (3.0, 5.0), (8.0, 10.0)]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enter_below": 100.0, "leave_above": 90.0}, "leave_above (90.0) must be >= enter_below (100.0)"),
        ({"enter_below": 0.0}, "enter_below must be a finite number > 0"),
        ({"enter_below": 100.0, "leave_above": float("nan")}, "leave_above must be a finite number > 0"),
        ({"enter_below": 100.0, "dwell_s": -1.0}, "dwell_s must be a finite number >= 0"),
        ({"enter_below": 100.0, "min_window_s": float("inf")}, "min_window_s must be a finite number >= 0"),
    ],
)
def test_hysteresis_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    """Nonsense parameters fail at construction with a message naming the parameter."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HysteresisPolicy(**kwargs)


def test_runs_to_windows_uses_hold_last_bounds() -> None:
    """A run of flags maps to [its first sample, the sample after its last); the last sample ends at
    the trace's end."""
    trace = trace_of([1, 1, 1, 1])
    assert steps(runs_to_windows(trace, np.array([True, False, True, True]))) == [(0.0, 1.0), (2.0, 4.0)]
    assert runs_to_windows(trace, np.zeros(4, dtype=bool)) == []


# --- rolling percentile ---------------------------------------------------------------------------------


def test_rolling_percentile_uses_only_the_past() -> None:
    """With period_s the threshold at each sample comes from (t - period_s, t]: changing later samples
    changes neither earlier thresholds nor the windows before them."""
    rng = np.random.default_rng(7)
    values = rng.uniform(10.0, 500.0, 48)
    trace = trace_of(values, step=3600.0)
    policy = PercentilePolicy(30.0, period_s=6 * 3600.0)
    thresholds = policy.thresholds(trace, "A")
    for i in range(48):
        assert thresholds[i] == pytest.approx(np.percentile(values[max(0, i - 5) : i + 1], 30.0))
    cut = 30
    changed = values.copy()
    changed[cut:] = rng.uniform(10.0, 500.0, 48 - cut)
    other = trace_of(changed, step=3600.0)
    np.testing.assert_array_equal(policy.thresholds(other, "A")[:cut], thresholds[:cut])

    def before(windows: list[Window]) -> list[tuple[float, float]]:
        edge = T0 + cut * 3600.0
        return [(w.start, min(w.end, edge)) for w in windows if w.start < edge]

    assert before(policy.windows(other, "A")) == before(policy.windows(trace, "A"))


def test_rolling_percentile_without_period_is_whole_trace() -> None:
    """Without period_s the threshold is the whole trace's percentile at every sample."""
    values = np.arange(10.0, 110.0, 10.0)
    trace = trace_of(values, step=3600.0)
    assert np.all(PercentilePolicy(35.0).thresholds(trace, "A") == pytest.approx(41.5))
    # a period longer than the trace is the expanding (past-only) percentile, not the whole trace's
    rolling = PercentilePolicy(35.0, period_s=100 * 3600.0).thresholds(trace, "A")
    assert rolling[0] == 10.0 and rolling[-1] == pytest.approx(41.5)


def test_percentile_rejects_bad_period() -> None:
    """A period must be a finite number of seconds > 0."""
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match="period_s must be a finite number > 0"):
            PercentilePolicy(30.0, period_s=bad)


# --- forecasters ----------------------------------------------------------------------------------------

THREE_DAYS = trace_of(200.0 + 150.0 * np.sin(np.arange(72) * 2 * np.pi / 24) + np.arange(72), step=3600.0)


def future_changed(trace: Trace, now: float, seed: int = 3) -> Trace:
    """``trace`` with every sample after ``now`` replaced by noise."""
    rng = np.random.default_rng(seed)
    values = trace.series("A").copy()
    after = trace.times > now
    values[after] = rng.uniform(0.0, 1000.0, int(after.sum()))
    return Trace(trace.times, {"A": values}, trace.resolution_s, "changed")


def test_values_at_is_hold_last_and_clamped() -> None:
    """Between samples the earlier one holds; before and after the trace its ends hold."""
    trace = trace_of([10, 20, 30])
    at = T0 + np.array([-100.0, 0.0, 299.0, 300.0, 750.0, 1e6])
    np.testing.assert_array_equal(values_at(trace, "A", at), [10, 10, 10, 20, 30, 30])


def test_persistence_is_constant() -> None:
    """Persistence repeats the value in force now at every horizon."""
    now = T0 + 30.5 * 3600.0
    times = now + np.arange(0, 40) * 1800.0
    got = PersistenceForecaster().predict(THREE_DAYS, "A", now, times)
    assert np.all(got == THREE_DAYS.series("A")[30])


def test_oracle_is_the_truth() -> None:
    """The oracle returns the trace's own (hold-last) values."""
    now = T0 + 10 * 3600.0
    times = now + np.arange(0, 50) * 1234.0
    np.testing.assert_array_equal(
        OracleForecaster().predict(THREE_DAYS, "A", now, times), values_at(THREE_DAYS, "A", times)
    )


@pytest.mark.parametrize("now_h", [5.5, 30.0, 47.9, 60.25])
def test_seasonal_never_reads_the_future(now_h: float) -> None:
    """Perturbing every sample after ``now`` leaves the seasonal forecast unchanged at all horizons."""
    now = T0 + now_h * 3600.0
    times = now + np.arange(0, 60) * 1800.0
    forecaster = SeasonalForecaster()
    before = forecaster.predict(THREE_DAYS, "A", now, times)
    after = forecaster.predict(future_changed(THREE_DAYS, now), "A", now, times)
    np.testing.assert_array_equal(before, after)


def test_seasonal_blends_now_into_yesterday() -> None:
    """At horizon 0 it is persistence; hours ahead it tends to the value 24 h earlier; on the first
    day (no yesterday) it stays persistence; over a day ahead it tends to two days earlier."""
    f = SeasonalForecaster(tau_s=3600.0)
    series = THREE_DAYS.series("A")
    now = T0 + 30 * 3600.0
    current = series[30]
    h = 5 * 3600.0
    w = np.exp(-h / 3600.0)
    assert f.predict(THREE_DAYS, "A", now, np.array([now]))[0] == pytest.approx(current)
    assert f.predict(THREE_DAYS, "A", now, np.array([now + h]))[0] == pytest.approx(
        w * current + (1 - w) * series[30 + 5 - 24]
    )
    early = T0 + 3 * 3600.0
    assert f.predict(THREE_DAYS, "A", early, np.array([early + h]))[0] == pytest.approx(series[3])
    assert f.predict(THREE_DAYS, "A", now, np.array([now + DAY_S + h]))[0] == pytest.approx(
        series[30 + 24 + 5 - 48], rel=1e-6
    )
    with pytest.raises(ValueError, match="tau_s"):
        SeasonalForecaster(tau_s=0.0)


def test_climatology_is_quantiles_of_the_past() -> None:
    """Climatology spreads the quantiles of the samples up to now over the horizon, and ignores the
    future; with no horizon it returns nothing."""
    now = T0 + 20.5 * 3600.0
    times = now + np.arange(1, 11) * 3600.0
    got = ClimatologyForecaster().predict(THREE_DAYS, "A", now, times)
    np.testing.assert_allclose(got, np.quantile(THREE_DAYS.series("A")[:21], np.linspace(0, 1, 10)))
    np.testing.assert_array_equal(
        ClimatologyForecaster().predict(future_changed(THREE_DAYS, now), "A", now, times), got
    )
    assert ClimatologyForecaster().predict(THREE_DAYS, "A", now, np.zeros(0)).shape == (0,)
    # before the first sample it knows that sample only: persistence
    assert np.all(
        ClimatologyForecaster().predict(THREE_DAYS, "A", T0 - 10.0, times) == THREE_DAYS.series("A")[0]
    )


def test_noisy_is_reproducible_and_unbiased() -> None:
    """Same seed, same forecasts; exact at horizon 0; mean ratio to the truth ~1 with ~30 % log-spread a
    day ahead."""
    now = T0 + 10 * 3600.0
    times = np.full(20000, now + DAY_S)
    a = NoisyForecaster(seed=5).predict(THREE_DAYS, "A", now, times)
    b = NoisyForecaster(seed=5).predict(THREE_DAYS, "A", now, times)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, NoisyForecaster(seed=6).predict(THREE_DAYS, "A", now, times))
    truth = values_at(THREE_DAYS, "A", times)
    ratio = a / truth
    assert ratio.mean() == pytest.approx(1.0, abs=0.015)
    assert np.log(ratio).std() == pytest.approx(0.3, rel=0.05)
    at_now = NoisyForecaster(seed=1).predict(THREE_DAYS, "A", now, np.array([now, now]))
    np.testing.assert_array_equal(at_now, values_at(THREE_DAYS, "A", np.array([now, now])))
    with pytest.raises(ValueError, match="sigma_day"):
        NoisyForecaster(sigma_day=-0.1)


def test_make_forecaster_knows_every_name() -> None:
    """Every registered name builds its forecaster; an unknown one lists the known names."""
    for name in FORECASTERS:
        assert make_forecaster(name).name == name
    with pytest.raises(ValueError, match="unknown forecaster 'crystal'; known: climatology, noisy"):
        make_forecaster("crystal")


# --- scheduler config -----------------------------------------------------------------------------------


def test_window_policy_defaults_to_threshold_hysteresis() -> None:
    """The default rule is enter and leave at the threshold with no dwell (the threshold rule)."""
    policy = SchedulerConfig(threshold=120.0, min_window_s=60.0).window_policy()
    assert isinstance(policy, HysteresisPolicy)
    assert (policy.enter_below, policy.leave_above, policy.dwell_s, policy.min_window_s) == (
        120.0,
        120.0,
        0.0,
        60.0,
    )
    assert policy.lookahead is None


def test_window_policy_hysteresis_with_lookahead() -> None:
    """leave_above, dwell_s and lookahead (any case) reach the hysteresis rule."""
    cfg = SchedulerConfig(threshold=100.0, leave_above=150.0, dwell_s=600.0, lookahead=" Oracle ")
    cfg.validate()
    policy = cfg.window_policy()
    assert isinstance(policy, HysteresisPolicy)
    assert (policy.leave_above, policy.dwell_s) == (150.0, 600.0)
    assert isinstance(policy.lookahead, OracleForecaster)
    assert "lookahead='oracle'" in repr(policy)


def test_window_policy_percentile() -> None:
    """percentile (with or without a rolling period) selects the percentile rule."""
    policy = SchedulerConfig(percentile=25.0, percentile_period_s=86400.0, min_window_s=30.0).window_policy()
    assert isinstance(policy, PercentilePolicy)
    assert (policy.percentile, policy.period_s, policy.min_window_s) == (25.0, 86400.0, 30.0)
    assert SchedulerConfig(percentile=25.0).window_policy().period_s is None


@pytest.mark.parametrize(
    ("fields", "culprit", "message"),
    [
        ({"percentile": 30.0, "dwell_s": 600.0}, "dwell_s", "does not combine with percentile"),
        ({"percentile": 30.0, "leave_above": 150.0}, "leave_above", "does not combine with percentile"),
        ({"percentile": 30.0, "lookahead": "oracle"}, "lookahead", "does not combine with percentile"),
        ({"percentile_period_s": 3600.0}, "percentile_period_s", "needs percentile to be set"),
        ({"threshold": 100.0, "leave_above": 90.0}, "leave_above", "must be >= threshold (100)"),
        ({"lookahead": "crystal"}, "lookahead", "must be one of climatology, noisy, oracle"),
        ({"dwell_s": -1.0}, "dwell_s", "must be >= 0"),
        ({"percentile": 0.0}, "percentile", "must be > 0"),
        ({"percentile": 101.0}, "percentile", "must be <= 100"),
        ({"percentile": 30.0, "percentile_period_s": 0.0}, "percentile_period_s", "must be > 0"),
        ({"leave_above": True}, "leave_above", "must be a number"),
    ],
)
def test_invalid_rule_names_the_field(fields: dict, culprit: str, message: str) -> None:
    """Each nonsensical combination is a ConfigError whose field is the one to change."""
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**fields).validate()
    assert info.value.field == culprit
    assert message in info.value.message


def write(tmp_path: Path, scheduler: str) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text(f"name: s\nregion: DE\nscheduler:\n{scheduler}")
    return path


def test_site_yaml_with_dwell_loads(tmp_path: Path) -> None:
    """A site config's scheduler section carries the new rule fields through to its window policy."""
    path = write(tmp_path, "  threshold: 100\n  dwell_s: 600\n  lookahead: seasonal\n  leave_above: 120\n")
    cfg = load_site_config(path)
    policy = cfg.scheduler.window_policy()
    assert isinstance(policy, HysteresisPolicy)
    assert (policy.enter_below, policy.leave_above, policy.dwell_s) == (100.0, 120.0, 600.0)
    assert isinstance(policy.lookahead, SeasonalForecaster)


@pytest.mark.parametrize(
    ("scheduler", "located"),
    [
        ("  percentile: 30\n  dwell_s: 600\n", ":5: scheduler.dwell_s: does not combine with percentile"),
        ("  threshold: 100\n  leave_above: 50\n", ":5: scheduler.leave_above: must be >= threshold (100)"),
        ("  percentile_period_s: 3600\n", ":4: scheduler.percentile_period_s: needs percentile to be set"),
        ("  lookahead: crystal\n", ":4: scheduler.lookahead: must be one of"),
        ("  dwel_s: 600\n", ":4: scheduler.dwel_s: unknown field (did you mean 'dwell_s'?)"),
    ],
)
def test_invalid_site_yaml_names_file_line_and_field(tmp_path: Path, scheduler: str, located: str) -> None:
    """A bad rule in a site YAML stops the site with file:line and the dotted field."""
    path = write(tmp_path, scheduler)
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert str(info.value).startswith(f"{path}{located}"), str(info.value)
