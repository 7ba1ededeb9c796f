"""The deadline plan (``scheduler.policy: deadline``): one planner for the node and the simulator,
decisions that read nothing after now, the threshold while there is no history, and a schedule that
the node's loop follows to the same emissions the simulator books."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import ConfigError
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.progress_view import progress_table
from greenswarm.scheduler.config import SchedulerConfig
from greenswarm.scheduler.deadline import (
    FALLBACK,
    FORCED,
    PLAN,
    PLAN_RETENTION_S,
    DeadlinePlanner,
    known_until,
)
from greenswarm.scheduler.deadline_schedule import DeadlineSchedule, Work
from greenswarm.scheduler.forecast import DAY_S, ProfileForecaster, make_forecaster
from greenswarm.scheduler.live import LiveSchedule
from greenswarm.scheduler.policy import HysteresisPolicy
from greenswarm.signals.feed import LiveFeed
from greenswarm.signals.sources import TraceSignal
from greenswarm.simulation.deadline import deadline_runs
from greenswarm.simulation.engine import account
from greenswarm.traces.trace import Trace

pytestmark = pytest.mark.deadline

HOUR = 3600.0
T0 = 1_700_000_000.0 - (1_700_000_000.0 % DAY_S)  # a midnight, UTC


def _trace(days: int, seed: int = 0, regions: tuple[str, ...] = ("A",)) -> Trace:
    """Hourly intensity with a solar dip at noon, a weekly swing and noise (never negative)."""
    rng = np.random.default_rng(seed)
    t = T0 + HOUR * np.arange(days * 24)
    hour = (t % DAY_S) / HOUR
    values = {}
    for k, r in enumerate(regions):
        solar = 150 * np.clip(np.cos((hour - 12) / 24 * 2 * np.pi), 0, None)
        weekly = 60 * np.sin(2 * np.pi * t / (7 * DAY_S) + k)
        values[r] = np.clip(300 + 40 * k - solar + weekly + rng.normal(0, 25, t.size), 5, None)
    return Trace(t, values, HOUR, "synthetic")


class Peeking:
    """A forecaster that notes the newest sample it was handed (what a decision could have read)."""

    name = "peeking"

    def __init__(self) -> None:
        self.inner = ProfileForecaster()
        self.overreach = 0.0

    def predict(self, trace: Trace, region: str, now: float, times: np.ndarray) -> np.ndarray:
        self.overreach = max(self.overreach, float(trace.times[-1]) - now)
        return self.inner.predict(trace, region, now, times)


def test_no_decision_reads_the_trace_after_now() -> None:
    trace = _trace(30)
    start = T0 + 20 * DAY_S
    peek = Peeking()
    runs = deadline_runs(trace, ["A"], 30 * HOUR, start, start + 96 * HOUR, peek, 1.0, cap=None)
    assert peek.overreach <= 0.0
    # handed the whole trace, the forecaster decides the same: a trace cut at now changes nothing
    whole = ProfileForecaster()
    whole.past_only = False  # type: ignore[attr-defined]  (the planner then hands it everything)
    full = deadline_runs(trace, ["A"], 30 * HOUR, start, start + 96 * HOUR, whole, 1.0, cap=None)
    np.testing.assert_array_equal(runs[0].segments[0].intervals, full[0].segments[0].intervals)


def test_known_until_cuts_at_now() -> None:
    trace = _trace(3)
    cut = known_until(trace, T0 + 5.5 * HOUR)
    assert cut.times[-1] == T0 + 5 * HOUR and len(cut.times) == 6
    assert known_until(trace, trace.times[-1] + 10) is trace


@pytest.mark.parametrize("seed", range(6))
def test_the_work_is_always_done_by_the_deadline(seed: int) -> None:
    rng = np.random.default_rng(seed)
    trace = _trace(40, seed, regions=("A", "B"))
    start = T0 + DAY_S * float(rng.integers(0, 30))
    span = float(rng.integers(6, 150)) * HOUR
    work = float(rng.uniform(0.05, 1.0)) * 2 * span  # up to every site-hour there is
    for name in ("persistence", "profile", "climatology", "seasonal"):
        runs = deadline_runs(
            trace, ["A", "B"], work, start, start + span, make_forecaster(name), 1.0, cap=200
        )
        done = sum(b - a for r in runs for s in r.segments for a, b in s.intervals)
        assert done == pytest.approx(work, rel=1e-9), name
        assert max(b for r in runs for s in r.segments for _, b in s.intervals) <= start + span + 1e-6


def test_under_a_day_of_history_the_plan_is_the_threshold() -> None:
    trace = _trace(2)
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], T0 + 40 * HOUR, threshold=250.0)
    for h in range(0, 20):
        d = planner.decide(trace, T0 + h * HOUR, 10 * HOUR)
        assert d.reason == FALLBACK
        assert d.trains() == (trace.series("A")[h] < 250.0)
    assert planner.decide(trace, T0 + 25 * HOUR, 5 * HOUR).reason == PLAN
    assert planner.decide(trace, T0 + 36 * HOUR, 5 * HOUR).reason == FORCED  # 4 h left, 5 h to do


def test_the_next_start_is_the_first_planned_step() -> None:
    trace = _trace(10)
    now = T0 + 8 * DAY_S + 18 * HOUR  # evening: dirty; the plan waits for tomorrow's noon
    d = DeadlinePlanner(ProfileForecaster(), ["A"], now + 30 * HOUR).decide(trace, now, 3 * HOUR)
    assert not d.trains() and d.next_start[0] is not None
    assert 9 <= (d.next_start[0] % DAY_S) / HOUR <= 15


class FakeProgress:
    def __init__(self, tokens_per_s: float = 0.0) -> None:
        self.trained, self.rate = 0.0, tokens_per_s

    def __call__(self) -> tuple[float, int]:
        return self.trained, int(self.trained * self.rate)


def _follow(schedule: DeadlineSchedule, progress: FakeProgress, start: float, stop: float, dt: float) -> list:
    """The node's loop in miniature: ask, then train (or not) for ``dt`` of clock time."""
    trained = []
    t = start
    while t < stop and not schedule.finished():
        window = schedule.current(t)
        step = min(dt, stop - t)
        if window is not None:
            step = min(step, window.end - t)
            trained.append((t, t + step))
            progress.trained += step
        t += step
    schedule.current(t)
    return trained


def test_the_schedule_trains_what_the_simulator_books(caplog: pytest.LogCaptureFixture) -> None:
    trace = _trace(30)
    start, deadline, work = T0 + 21 * DAY_S + 7 * HOUR, T0 + 21 * DAY_S + 79 * HOUR, 20 * HOUR
    sim = deadline_runs(trace, ["A"], work, start, deadline, ProfileForecaster(), 1.0, cap=250.0)
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], deadline, threshold=250.0)
    schedule = DeadlineSchedule(trace, "A", planner, Work(hours=20.0), logging.getLogger("test.deadline"))
    progress = FakeProgress()
    schedule.bind(progress)
    with caplog.at_level(logging.INFO, logger="test.deadline"):
        node = _follow(schedule, progress, start, deadline, 60.0)
    assert schedule.finished() and progress.trained == pytest.approx(work)
    booked = account(sim, trace, 250.0)[0].emissions_g
    followed = sum(trace.integral("A", a, b) for a, b in node) / 3600.0
    assert followed == pytest.approx(booked, rel=1e-6)
    said = caplog.text
    assert "deadline plan at" in said and "below the plan's price" in said and "work done" in said
    assert schedule.plan()["met_deadline"] and schedule.plan()["reasons"][PLAN] >= 1


def test_a_token_target_measures_the_rate_then_plans() -> None:
    trace = _trace(30)
    start = T0 + 21 * DAY_S + 20 * HOUR  # a dirty hour: the plan would wait
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], start + 48 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(trace, "A", planner, Work(tokens=36_000), logging.getLogger("test.tokens"))
    progress = FakeProgress(tokens_per_s=1.0)  # 36,000 tokens = 10 site-hours
    schedule.bind(progress)
    assert schedule.in_window(start)  # no rate yet: it trains to measure one
    progress.trained = 60.0
    decision = schedule.decision
    schedule.in_window(start + 60.0)  # a rate: the plan is made again at once
    assert schedule.decision is not decision and schedule.decision.left_s == pytest.approx(10 * HOUR - 60)
    _follow(schedule, progress, start + 60.0, start + 48 * HOUR, 60.0)
    assert schedule.finished() and progress()[1] >= 36_000


def test_a_plan_shows_its_next_start_in_the_progress_table() -> None:
    base = dict(site="s", region="A", state="IDLE", peer_id="p", outer_round=0, lineage="x", round_index=-1,
                local_steps=0, tokens=0, loss=None, window_end=None, energy_kwh=0.0, emissions_g=0.0,
                clock_time=T0, wall_time=T0)  # fmt: skip
    plain = progress_table([ProgressRecord(**base)])
    assert "next start" not in [c.header for c in plain.columns]
    planned = progress_table([ProgressRecord(**base, next_start=T0 + 3600.0)])
    assert "next start" in [c.header for c in planned.columns]
    assert ProgressRecord.from_wire(ProgressRecord(**base, next_start=1.0).to_wire()).next_start == 1.0


@pytest.mark.parametrize(
    ("fields", "culprit"),
    [
        ({"policy": "deadline", "work_hours": 3.0}, "deadline"),
        ({"policy": "deadline", "deadline": "2023-06-08T00:00:00"}, "deadline"),
        ({"policy": "deadline", "deadline": "2023-06-08T00:00:00Z"}, "work_hours"),
        (
            {"policy": "deadline", "deadline": "2023-06-08T00:00:00Z", "work_hours": 3, "work_tokens": 9},
            "work_hours",
        ),
        ({"policy": "deadline", "deadline": "2023-06-08T00:00:00Z", "work_tokens": 0}, "work_tokens"),
        (
            {"policy": "deadline", "deadline": "2023-06-08T00:00:00Z", "work_hours": 3, "forecast": "oracle"},
            "forecast",
        ),
        (
            {
                "policy": "deadline",
                "deadline": "2023-06-08T00:00:00Z",
                "work_hours": 3,
                "forecast": "crystal",
            },
            "forecast",
        ),
        (
            {"policy": "deadline", "deadline": "2023-06-08T00:00:00Z", "work_hours": 3, "dwell_s": 600},
            "dwell_s",
        ),
        ({"policy": "deadline", "deadline": "2023-06-08T00:00:00Z", "work_hours": 3, "margin": -1}, "margin"),
        ({"policy": "fastest"}, "policy"),
        ({"work_hours": 3.0}, "work_hours"),
    ],
)
def test_a_bad_deadline_config_names_its_field(fields: dict, culprit: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**fields).validate()
    assert err.value.field == culprit, str(err.value)


def test_a_good_deadline_config_validates() -> None:
    cfg = SchedulerConfig(policy="deadline", deadline="2023-06-08T00:00:00Z", work_tokens=10**9, margin=0.1)
    cfg.validate()
    assert cfg.deadline_forecaster().name == "profile"
    assert not math.isnan(cfg.threshold)


def _live(trace: Trace, clock: list[float], on_loss: str = "hold-last") -> LiveSchedule:
    feed = LiveFeed(
        TraceSignal(trace, "A"),
        lambda: clock[0],
        600.0,
        logging.getLogger("test.feed"),
        retention_s=PLAN_RETENTION_S,
    )
    return LiveSchedule(
        feed, "A", HysteresisPolicy(250.0), on_loss=on_loss, max_staleness_s=2 * HOUR, grace_s=600.0,
        log=logging.getLogger("test.live"),
    )  # fmt: skip


def test_over_a_live_feed_the_plan_trains_the_hours_it_trains_over_the_file() -> None:
    trace = _trace(30)
    start, deadline = T0 + 21 * DAY_S + 7 * HOUR, T0 + 21 * DAY_S + 79 * HOUR
    plans = []
    for base in ("file", "live"):
        clock = [start]
        planner = DeadlinePlanner(ProfileForecaster(), ["A"], deadline, threshold=250.0)
        source = trace if base == "file" else _live(trace, clock)
        schedule = DeadlineSchedule(source, "A", planner, Work(hours=20.0), logging.getLogger("test.live"))
        progress = FakeProgress()
        schedule.bind(progress)
        trained = []
        while clock[0] < deadline and not schedule.finished():
            if base == "live":
                source.feed.poll()  # the feed's thread, in step with the clock
            window = schedule.current(clock[0])
            step = min(600.0, deadline - clock[0]) if window is None else min(600.0, window.end - clock[0])
            if window is not None:
                trained.append((clock[0], clock[0] + step))
                progress.trained += step
            clock[0] += step
        plans.append(trained)
        assert schedule.finished(), base
    assert plans[0] == plans[1]


def test_a_lost_signal_waits_until_the_deadline_forces_it() -> None:
    trace = _trace(22)  # the feed ends at day 22: nothing after
    start = trace.end - 2 * HOUR
    clock = [start]
    live = _live(trace, clock, on_loss="pause")
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], trace.end + 6 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(live, "A", planner, Work(hours=3.0), logging.getLogger("test.lost"))
    progress = FakeProgress()
    schedule.bind(progress)
    reasons = []
    while clock[0] < trace.end + 6 * HOUR and not schedule.finished():
        live.feed.poll()
        if (window := schedule.current(clock[0])) is not None:
            progress.trained += min(600.0, window.end - clock[0])
        reasons.append(schedule.decision.reason if schedule.decision else None)
        clock[0] += 600.0
    schedule.current(clock[0])
    assert "signal-lost" in reasons and reasons[-1] == FORCED
    assert schedule.finished() and schedule.plan()["met_deadline"]


def _pair(trace: Trace, target: int, deadline: float) -> tuple[dict, dict]:
    """Sites A and B sharing ``target`` tokens by ``deadline``, each reading the other's record."""
    progress = {r: FakeProgress(tokens_per_s=1.0) for r in "AB"}
    schedules: dict[str, DeadlineSchedule] = {}
    for r, other in (("A", "B"), ("B", "A")):
        planner = DeadlinePlanner(ProfileForecaster(), [r], deadline, threshold=250.0)
        schedules[r] = DeadlineSchedule(
            trace, r, planner, Work(tokens=target), logging.getLogger(f"t.{r}"), shared=True
        )
        peer = lambda other=other: [(other, progress[other]()[1], schedules[other].share)]  # noqa: E731
        schedules[r].bind(progress[r], peers=peer)
    return schedules, progress


def test_sites_sharing_a_target_train_the_cleanest_hours_of_all_regions() -> None:
    """Two sites, one token target and one deadline: each prices the swarm's work with the other's
    published supply, so the cleaner region trains more, the target is met by the deadline, and
    the swarm emits what the simulator's joint plan (spatial and temporal) emits, within 3 %."""
    trace = _trace(30, regions=("A", "B"))
    start, deadline = T0 + 21 * DAY_S + 7 * HOUR, T0 + 21 * DAY_S + 55 * HOUR
    target = 24 * 3600  # tokens, at one token a second: 24 site-hours between them
    schedules, progress = _pair(trace, target, deadline)
    trained: dict[str, list] = {"A": [], "B": []}
    t = start
    while t < deadline and not all(s.finished() for s in schedules.values()):
        for r, schedule in schedules.items():
            window = schedule.current(t)
            if window is not None:
                step = min(60.0, window.end - t)
                trained[r].append((t, t + step))
                progress[r].trained += step
        t += 60.0
    for schedule in schedules.values():
        schedule.current(t)
    assert all(s.finished() for s in schedules.values())
    assert sum(p()[1] for p in progress.values()) >= target
    hours = {r: sum(b - a for a, b in trained[r]) / HOUR for r in "AB"}
    assert hours["A"] > hours["B"] > 0, hours  # A's grid is the cleaner one
    assert schedules["A"].share is not None and schedules["A"].plan()["shared"]
    swarm_g = sum(trace.integral(r, a, b) for r in "AB" for a, b in trained[r]) / 3600.0
    joint = deadline_runs(trace, ["A", "B"], target, start, deadline, ProfileForecaster(), 1.0, cap=250.0)
    joint_g = sum(t.emissions_g for t in account(joint, trace, 250.0))
    assert swarm_g == pytest.approx(joint_g, rel=0.03)


def test_a_shared_target_no_site_could_meet_alone_is_met_once() -> None:
    """70 % of both sites' hours: alone each would be forced from the start; together they plan, and
    stop at the target rather than each training its whole horizon."""
    start = T0 + 21 * DAY_S + 7 * HOUR
    deadline = start + 24 * HOUR
    target = int(0.7 * 2 * 24 * 3600)
    schedules, progress = _pair(_trace(30, regions=("A", "B")), target, deadline)
    t = start
    while t < deadline + HOUR and not all(s.finished() for s in schedules.values()):
        for r, schedule in schedules.items():
            if (window := schedule.current(t)) is not None:
                progress[r].trained += min(60.0, window.end - t)
        t += 60.0
    for schedule in schedules.values():
        schedule.current(t)
    assert all(s.finished() and s.plan()["met_deadline"] for s in schedules.values())
    total = sum(p()[1] for p in progress.values())
    assert target <= total <= target + 2 * 120, total  # at most a minute per site beyond it


def test_a_peer_that_leaves_keeps_the_tokens_it_trained() -> None:
    trace = _trace(30)
    start = T0 + 21 * DAY_S
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], start + 48 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(
        trace, "A", planner, Work(tokens=10_000), logging.getLogger("t.l"), shared=True
    )
    plan = {
        "deadline": start + 48 * HOUR,
        "target": 10_000,
        "values": [100.0],
        "work_tokens": 5e4,
        "at": start,
    }
    seen = [[("B", 9_000, plan), ("B", 4_000, plan)]]  # a restart: an old record beside the new one
    schedule.bind(FakeProgress(tokens_per_s=1.0), peers=lambda: seen[0])
    assert schedule._left(100.0, 100, start)[0] == pytest.approx(900.0)  # 10,000 - 100 - 9,000 tokens
    seen[0] = []  # B's records expired
    assert schedule._left(100.0, 100, start)[0] == pytest.approx(900.0)


class StaleView:
    """The others' records as a background-polled view holds them: ``live`` changes at once, what the
    schedule reads only when it asks for a read."""

    def __init__(self, live: list) -> None:
        self.live, self.seen, self.reads = live, list(live), 0

    def refresh(self) -> None:
        self.seen, self.reads = list(self.live), self.reads + 1

    def __call__(self) -> list:
        return self.seen


def test_a_shared_plan_decides_on_the_others_records_as_they_are_then() -> None:
    """Row 95: at 3600x the background view is an hour of the trace old; a site that decided at its
    deadline on it trained past the deadline for a target its partner had met. Each decision at a
    step of the plan reads the records afresh (once per step, not at every lookup; none once the
    work is done)."""
    trace = _trace(30)
    start = T0 + 21 * DAY_S
    deadline = start + HOUR
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], deadline, threshold=250.0)
    plan = {"deadline": deadline, "target": 10_000, "values": [100.0], "work_tokens": 5e3, "at": start}
    view = StaleView([("B", 9_000, plan)])
    schedule = DeadlineSchedule(
        trace, "A", planner, Work(tokens=10_000), logging.getLogger("t.r"), shared=True
    )
    progress = FakeProgress(tokens_per_s=1.0)
    progress.trained = 100.0  # 100 tokens: the rate is measured
    schedule.bind(progress, peers=view, refresh_peers=view.refresh)
    for minute in range(0, 60, 5):
        schedule.current(start + minute * 60.0)
    assert view.reads == 1 and not schedule.finished()
    view.live = [("B", 9_900, plan)]  # B's last step, after the view's last read
    assert schedule.current(deadline) is None  # the decision at the deadline: done, not late
    assert view.reads == 2 and schedule.finished_at == deadline and schedule.plan()["met_deadline"]
    assert "late" not in schedule.plan()["reasons"]
    schedule.current(deadline + HOUR)
    assert view.reads == 2


@pytest.mark.parametrize("hours", [0.37, 1.11, 2.5, 3.33, 4.07, 5.9, 7.77])
def test_a_site_always_finishes_what_it_can(hours: float) -> None:
    trace = _trace(30)
    start = T0 + 21 * DAY_S + 3 * HOUR + 17.3
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], start + 30 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(trace, "A", planner, Work(hours=hours), logging.getLogger("t.f"))
    progress = FakeProgress()
    schedule.bind(progress)
    _follow(schedule, progress, start, start + 30 * HOUR, 37.0)
    assert schedule.finished() and progress.trained == pytest.approx(hours * HOUR)


def test_past_the_deadline_with_work_left_the_site_trains_until_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = _trace(30)
    start = T0 + 21 * DAY_S
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], start + 3 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(trace, "A", planner, Work(hours=5.0), logging.getLogger("t.late"))
    progress = FakeProgress()
    schedule.bind(progress)
    with caplog.at_level(logging.INFO, logger="t.late"):
        _follow(schedule, progress, start, start + 10 * HOUR, 60.0)
    assert schedule.finished() and progress.trained == pytest.approx(5 * HOUR)
    assert schedule.plan()["met_deadline"] is False and schedule.plan()["reasons"]["late"] >= 2
    assert "the deadline has passed with work left" in caplog.text


def test_without_any_signal_only_the_deadline_makes_a_site_train() -> None:
    class Silent:
        name, resolution_s, end = "silent", 3600.0, math.inf

        def read(self, since, now):  # noqa: ANN001, ANN201
            raise ConnectionError("no answer")

        def history(self, start, end):  # noqa: ANN001, ANN201
            raise ConnectionError("no answer")

        def close(self) -> None:
            pass

    clock = [T0]
    feed = LiveFeed(Silent(), lambda: clock[0], 600.0, logging.getLogger("t.silent"))  # type: ignore[arg-type]
    live = LiveSchedule(
        feed, "A", HysteresisPolicy(250.0), on_loss="pause", max_staleness_s=HOUR, grace_s=600.0,
        log=logging.getLogger("t.silent"),
    )  # fmt: skip
    planner = DeadlinePlanner(ProfileForecaster(), ["A"], T0 + 5 * HOUR, threshold=250.0)
    schedule = DeadlineSchedule(live, "A", planner, Work(hours=2.0), logging.getLogger("t.silent"))
    progress = FakeProgress()
    schedule.bind(progress)
    trained = _follow(schedule, progress, T0, T0 + 5 * HOUR, 60.0)
    assert schedule.finished() and trained[0][0] == pytest.approx(T0 + 3 * HOUR, abs=61.0)


def test_the_policy_grid_benchmark_reports_its_keys(tmp_path: Path) -> None:
    """``benchmarks/carbon_policies.py`` on two small zone files: every documented key, per forecaster."""
    import subprocess
    import sys

    from tests.conftest import write_trace

    rng = np.random.default_rng(1)
    for zone in ("XA", "XB"):
        hours = 60 * 24
        values = 300 - 150 * np.clip(np.cos(np.arange(hours) % 24 / 24 * 2 * np.pi - np.pi), 0, None)
        write_trace(tmp_path / f"{zone}.csv", {zone: list(values + rng.normal(0, 20, hours))},
                    start="2023-01-01T00:00:00Z", step_s=3600)  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "benchmarks/carbon_policies.py"), "--trace-dir",
         str(tmp_path), "--shapes", "24h-in-72h", "--forecasters", "persistence,profile", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    for name in ("persistence", "profile"):
        got = result["forecasters"][name]
        assert got["cases"] == 4 and got["missed_deadlines"] == 0  # 2 zones x Jan 15, Feb 15
        for key in ("median_captured", "p10_captured", "worst_captured", "worst_vs_run_at_once",
                    "median_vs_run_at_once", "worse_than_run_at_once", "worse_by_2pct"):  # fmt: skip
            assert key in got, key
    assert result["forecasters"]["persistence"]["worst_vs_run_at_once"] == pytest.approx(1.0)
