"""Scheduler: window policies and schedules, clocks, the site state and the configs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from greenswarm.errors import ConfigError
from greenswarm.scheduler import (
    ClockConfig,
    EnergyConfig,
    ReplayClock,
    SchedulerConfig,
    SiteState,
    ThresholdPolicy,
    WallClock,
    Window,
    WindowSchedule,
    decide_state,
    make_clock,
    parse_instant,
)
from greenswarm.scheduler import clock as clock_module
from greenswarm.scheduler.clock import write_start_file
from greenswarm.traces import Trace, builtin_trace, read_csv_trace
from tests._shared import shared_path

# Samples every 60 s from t=1000; below 100 at indices 1-2, 4, 7-8 (the last, running to the trace end).
HAND = Trace(
    np.arange(9) * 60.0 + 1000.0,
    {"A": np.array([150.0, 50.0, 99.9, 100.0, 0.0, 300.0, 120.0, 80.0, 10.0])},
    60.0,
    "hand",
)


# --- policies and schedules -----------------------------------------------------------------------------


def test_threshold_windows_on_hand_made_trace():
    windows = ThresholdPolicy(100.0).windows(HAND, "A")
    assert windows == [Window(1060.0, 1180.0), Window(1240.0, 1300.0), Window(1420.0, 1540.0)]
    assert [w.duration for w in windows] == [120.0, 60.0, 120.0]


def test_all_or_nothing_below():
    assert ThresholdPolicy(1000.0).windows(HAND, "A") == [Window(1000.0, 1540.0)]
    assert ThresholdPolicy(1e-9).windows(HAND, "A") == [Window(1240.0, 1300.0)]
    assert ThresholdPolicy(0.0 + 1e-12, min_window_s=61).windows(HAND, "A") == []


def test_min_window_drops_short_windows():
    assert ThresholdPolicy(100.0, min_window_s=61.0).windows(HAND, "A") == [
        Window(1060.0, 1180.0),
        Window(1420.0, 1540.0),
    ]
    assert len(ThresholdPolicy(100.0, min_window_s=60.0).windows(HAND, "A")) == 3
    assert ThresholdPolicy(100.0, min_window_s=121.0).windows(HAND, "A") == []


@pytest.mark.parametrize(("threshold", "min_window_s"), [(0.0, 0.0), (-1.0, 0.0), (100.0, -1.0)])
def test_policy_rejects_bad_parameters(threshold, min_window_s):
    with pytest.raises(ValueError):
        ThresholdPolicy(threshold, min_window_s)


def test_schedule_lookups():
    schedule = WindowSchedule(HAND, "A", ThresholdPolicy(100.0))
    first, second, third = schedule.windows
    assert not schedule.in_window(999.0)
    assert not schedule.in_window(1059.9)
    assert schedule.current(1060.0) == first and schedule.in_window(1179.9)
    assert schedule.current(1180.0) is None
    assert schedule.current(1539.0) == third
    assert schedule.current(1540.0) is None  # the trace is over
    assert schedule.next_window(0.0) == first
    assert schedule.next_window(1060.0) == second  # strictly after; current() covers "containing"
    assert schedule.next_window(1200.0) == second
    assert schedule.next_window(1420.0) is None
    assert schedule.share_in_window() == pytest.approx(300.0 / 540.0)


def test_schedule_with_unknown_region_fails():
    from greenswarm.errors import TraceError

    with pytest.raises(TraceError, match="region 'B' is not in hand"):
        WindowSchedule(HAND, "B", ThresholdPolicy(100.0))


def test_builtin_windows_are_staggered_like_the_anchor():
    """CAISO_NORTH first (~0-5.2 h), NEM_SA in the middle (~5.5-13.5 h), SPP_TX last (~11-18 h)."""
    for seed in range(5):
        trace = builtin_trace(seed=seed)
        policy = ThresholdPolicy(100.0)
        schedules = {r: WindowSchedule(trace, r, policy) for r in trace.regions}
        hours = {
            r: [(w.start - trace.start) / 3600, (w.end - trace.start) / 3600]
            for r, s in schedules.items()
            for w in s.windows
        }
        assert all(len(s.windows) == 1 for s in schedules.values()), hours
        (c0, c1), (n0, n1), (s0, s1) = (hours[r] for r in ("CAISO_NORTH", "NEM_SA", "SPP_TX"))
        assert c0 == 0.0 and 5.0 <= c1 <= 6.0
        assert 5.2 <= n0 <= 6.0 and 13.0 <= n1 <= 14.0
        assert 10.5 <= s0 <= 11.5 and s1 == 18.0
        counts = {
            sum(s.in_window(t) for s in schedules.values()) for t in np.arange(trace.start, trace.end, 60.0)
        }
        assert counts == {0, 1, 2}


@pytest.mark.shared
def test_anchor_trace_windows_at_100():
    trace = read_csv_trace(shared_path("traces/curtail-llm/mci.csv"))
    policy = ThresholdPolicy(100.0)
    for region, below in {"CAISO_NORTH": 73, "SPP_TX": 82, "NEM_SA": 126, "DE": 0}.items():
        schedule = WindowSchedule(trace, region, policy)
        assert sum(w.duration for w in schedule.windows) == below * 300.0
        assert schedule.share_in_window() == pytest.approx(below / 217)


# --- clocks ------------------------------------------------------------------------------------------


class FakeTime:
    """Stands in for time.time / time.sleep: sleeping advances the fake wall clock exactly."""

    def __init__(self, now: float):
        self.now = now
        self.naps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime(1_000_000.0)
    monkeypatch.setattr(clock_module.time, "time", fake.time)
    monkeypatch.setattr(clock_module.time, "sleep", fake.sleep)
    return fake


def test_replay_clock_arithmetic(fake_time):
    clock = ReplayClock(start=5000.0, speedup=60.0, start_wall=1_000_010.0)
    assert clock.now() == 5000.0 - 10 * 60  # before start_wall: before start
    fake_time.now = 1_000_010.0
    assert clock.now() == 5000.0
    fake_time.now += 2.5
    assert clock.now() == 5000.0 + 150.0
    assert clock.wall_seconds(600.0) == 10.0


def test_replay_clock_defaults_start_wall_to_now(fake_time):
    clock = ReplayClock(start=0.0, speedup=2.0)
    assert clock.start_wall == fake_time.now and clock.now() == 0.0


def test_two_replay_clocks_with_shared_start_agree(fake_time):
    a = ReplayClock(start=5000.0, speedup=30.0, start_wall=1_000_000.0)
    fake_time.now += 7.0
    b = ReplayClock(start=5000.0, speedup=30.0, start_wall=1_000_000.0)
    assert a.now() == b.now() == 5210.0


def test_sleep_until_reaches_target(fake_time):
    clock = ReplayClock(start=0.0, speedup=100.0, start_wall=fake_time.now)
    clock.sleep_until(1000.0)
    assert clock.now() >= 1000.0
    assert sum(fake_time.naps) == pytest.approx(10.0)
    naps = len(fake_time.naps)
    clock.sleep_until(500.0)  # already past: no sleep
    assert len(fake_time.naps) == naps


def test_sleep_until_respects_wall_budget(fake_time):
    clock = ReplayClock(start=0.0, speedup=100.0, start_wall=fake_time.now)
    clock.sleep_until(1000.0, max_wall_s=3.0)
    assert clock.now() == pytest.approx(300.0)
    clock.sleep_until(1000.0, max_wall_s=0.0)
    assert clock.now() == pytest.approx(300.0)


def test_wall_clock_is_wall_time(fake_time):
    clock = WallClock()
    assert clock.now() == fake_time.now
    assert clock.wall_seconds(42.0) == 42.0
    clock.sleep_until(fake_time.now + 5.0, max_wall_s=2.0)
    assert fake_time.naps == [2.0]


def test_replay_clock_rejects_bad_speedup():
    with pytest.raises(ValueError):
        ReplayClock(start=0.0, speedup=0.0, start_wall=0.0)


def test_make_clock(fake_time):
    assert isinstance(make_clock(ClockConfig(), trace_start=123.0), WallClock)
    replay = make_clock(ClockConfig(kind="replay", speedup=60.0), trace_start=123.0)
    assert isinstance(replay, ReplayClock)
    assert replay.now() == 123.0 and replay.start_wall == fake_time.now
    cfg = ClockConfig(kind="replay", start="1970-01-01T00:10:00Z", speedup=10.0, start_wall=5.0)
    replay = make_clock(cfg, trace_start=123.0)
    assert (replay.start, replay.speedup, replay.start_wall) == (600.0, 10.0, 5.0)


def test_a_replay_with_a_start_file_waits_for_it(fake_time, tmp_path):
    """Sites launched at different moments (or slowly, on a busy machine) share the start whoever
    launched them writes once all are ready; until then the clock stands at the replay's start."""
    start_file = tmp_path / "start"
    cfg = ClockConfig(kind="replay", speedup=60.0, start_file=str(start_file))
    clock = make_clock(cfg, trace_start=5000.0)
    assert not clock.started and clock.now() == 5000.0
    assert not clock.wait_for_start(timeout_s=0.0)  # nobody wrote it: the wait gives up on time
    stop = threading.Event()
    stop.set()
    assert not clock.wait_for_start(stop=stop)  # a stop request ends the wait
    write_start_file(start_file, fake_time.now + 10.0)
    assert clock.wait_for_start() and clock.started
    assert clock.now() == 5000.0 - 10 * 60  # the start lies ahead: before the trace's start
    fake_time.now += 12.0
    late = make_clock(cfg, trace_start=5000.0)  # a site restarted later reads the same start
    assert late.now() == clock.now() == 5000.0 + 2 * 60


def test_a_start_file_must_hold_a_time(tmp_path):
    start_file = tmp_path / "start"
    start_file.write_text("soon")
    clock = ReplayClock(start=0.0, speedup=1.0, start_file=start_file)
    with pytest.raises(ConfigError, match="expected the replay's start as Unix seconds"):
        clock.wait_for_start()
    with pytest.raises(ValueError, match="not both"):
        ReplayClock(start=0.0, speedup=1.0, start_wall=1.0, start_file=start_file)


def test_parse_instant():
    assert parse_instant("1970-01-01T00:01:00Z") == 60.0
    assert parse_instant("1970-01-01 01:00:00+01:00") == 0.0
    with pytest.raises(ConfigError, match="no UTC offset"):
        parse_instant("2026-01-11T17:00:00")
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_instant("tomorrow")


# --- state -----------------------------------------------------------------------------------------


def test_decide_state():
    assert decide_state(False, 0) is SiteState.IDLE
    assert decide_state(False, 3) is SiteState.IDLE
    assert decide_state(True, 0) is SiteState.SOLO
    assert decide_state(True, 1) is SiteState.FEDERATED
    assert SiteState.FEDERATED == "FEDERATED" and SiteState("SOLO") is SiteState.SOLO


# --- configs -----------------------------------------------------------------------------------------


def test_config_defaults_validate():
    SchedulerConfig().validate()
    EnergyConfig().validate()
    assert SchedulerConfig().threshold == 100.0 and SchedulerConfig().clock.kind == "wall"
    assert EnergyConfig().train_kw == 2.024 and EnergyConfig().idle_kw == 0.468  # the model stays on the GPUs


@pytest.mark.parametrize(
    ("cfg", "field", "match"),
    [
        (SchedulerConfig(threshold=0), "threshold", "must be > 0"),
        (SchedulerConfig(threshold=True), "threshold", "must be a number"),
        (SchedulerConfig(min_window_s=-1), "min_window_s", "must be >= 0"),
        (SchedulerConfig(poll_s=0.0), "poll_s", "must be > 0"),
        (SchedulerConfig(trace=""), "trace", "builtin"),
        (SchedulerConfig(trace="builtin:nope"), "trace", "no builtin trace 'nope'"),
        (SchedulerConfig(timezone="Mars/Olympus"), "timezone", "unknown timezone"),
        (SchedulerConfig(clock=ClockConfig(kind="lunar")), "clock.kind", "must be one of wall, replay"),
        (SchedulerConfig(clock=ClockConfig(speedup=0)), "clock.speedup", "must be > 0"),
        (SchedulerConfig(clock=ClockConfig(speedup=float("nan"))), "clock.speedup", "must be a number"),
        (SchedulerConfig(clock=ClockConfig(start="2026-01-11")), "clock.start", "no UTC offset"),
        (SchedulerConfig(clock=ClockConfig(start_wall=-5)), "clock.start_wall", "must be >= 0"),
        (SchedulerConfig(clock=ClockConfig(start_wall=5, start_file="s")), "clock.start_file", "not both"),
        (SchedulerConfig(clock=ClockConfig(start_file="")), "clock.start_file", "must be a file path"),
        (EnergyConfig(train_kw=-1), "train_kw", "must be >= 0"),
        (EnergyConfig(idle_kw="x"), "idle_kw", "must be a number"),
    ],
)
def test_config_validation_names_the_field(cfg, field, match):
    with pytest.raises(ConfigError, match=match) as info:
        cfg.validate()
    assert info.value.field == field
