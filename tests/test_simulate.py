"""``greenswarm simulate``: interval arithmetic, the engine's accounting, the policy presets, the
deadline and foresight planners, the report, the shipped example policies and the command itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import ConfigError
from greenswarm.scheduler.forecast import OracleForecaster
from greenswarm.simulation.deadline import deadline_runs, foresight_runs
from greenswarm.simulation.engine import (
    Segments,
    SiteRun,
    account,
    integrals,
    occupancy_hours,
    split_federated,
    time_to_finish,
    truncate,
)
from greenswarm.simulation.intervals import (
    EMPTY,
    as_intervals,
    clip,
    coverage,
    intersect,
    subtract,
    total,
    where_count,
)
from greenswarm.simulation.policies import POLICIES, load_policy, simulate_policy, site_run
from greenswarm.simulation.report import simulate
from greenswarm.traces.trace import Trace

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
T0 = 1767225600.0  # 2026-01-01T00:00:00Z
H = 3600.0

#: Hourly A/B/C: A is clean (50) in hours 0, 1 and 4; B in 0, 2, 3; C never below 100 but 80 at 2-3.
WIDE_CSV = """timestamp,A,B,C
2026-01-01T00:00:00Z,50,20,300
2026-01-01T01:00:00Z,50,200,300
2026-01-01T02:00:00Z,200,30,80
2026-01-01T03:00:00Z,200,10,80
2026-01-01T04:00:00Z,50,250,90
2026-01-01T05:00:00Z,200,250,300
"""

REPORT_KEYS = {
    "emissions_kg",
    "energy_kwh",
    "in_window_share",
    "wall_hours",
    "baselines",
    "ideal_kg",
    "foresight_kg",
    "hours_by_sites",
    "finished",
}


def hourly(**regions) -> Trace:
    n = len(next(iter(regions.values())))
    return Trace.from_columns(
        T0 + np.arange(n) * H, {k: np.asarray(v, dtype=float) for k, v in regions.items()}, "hand"
    )


def five_minute(**regions) -> Trace:
    n = len(next(iter(regions.values())))
    return Trace.from_columns(
        T0 + np.arange(n) * 300.0, {k: np.asarray(v, dtype=float) for k, v in regions.items()}, "hand5"
    )


def run_of(name: str, region: str, *segments: tuple[str, list, float, float]) -> SiteRun:
    run = SiteRun(name, region)
    for kind, pairs, kw, rate in segments:
        run.segments.append(Segments(kind, as_intervals(pairs), kw, rate))
    return run


def rel(intervals: np.ndarray) -> list[list[float]]:
    """Intervals in hours since T0."""
    return ((np.asarray(intervals) - T0) / H).tolist()


# --- intervals ------------------------------------------------------------------------------------------


def test_as_intervals_sorts_merges_and_drops_empty() -> None:
    """Overlapping and touching intervals merge; empty and reversed ones vanish."""
    got = as_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (8, 6)])
    assert got.tolist() == [[0, 4], [5, 7]]
    assert total(got) == 6.0
    assert as_intervals([]).shape == (0, 2)
    assert total(EMPTY) == 0.0
    assert as_intervals([(0, 10), (2, 3), (4, 5)]).tolist() == [[0, 10]]  # nested ones vanish too


def test_clip_intersect_subtract() -> None:
    """The set operations on a small case worked by hand."""
    a = as_intervals([(0, 4), (5, 7)])
    b = as_intervals([(2, 6)])
    assert clip(a, 3, 6).tolist() == [[3, 4], [5, 6]]
    assert clip(a, 10, 20).shape == (0, 2)
    assert intersect(a, b).tolist() == [[2, 4], [5, 6]]
    assert subtract(a, b).tolist() == [[0, 2], [6, 7]]
    assert subtract(b, a).tolist() == [[4, 5]]
    assert subtract(a, EMPTY).tolist() == a.tolist()
    assert intersect(a, EMPTY).shape == (0, 2)
    assert subtract(EMPTY, a).shape == (0, 2)


def test_coverage_counts_and_weights() -> None:
    """Coverage counts how many sets hold on each stretch; weights sum instead."""
    sets = [as_intervals([(0, 2)]), as_intervals([(1, 3)]), as_intervals([(1, 2), (5, 6)])]
    edges, counts = coverage(sets)
    assert edges.tolist() == [0, 1, 2, 3, 5, 6]
    assert counts.tolist() == [1, 3, 1, 0, 1]
    edges, weighted = coverage(sets, [1.0, 0.5, 0.25])
    assert weighted.tolist() == [1.0, 1.75, 0.5, 0.0, 0.25]
    assert where_count(edges, counts, lambda c: c >= 1).tolist() == [[0, 3], [5, 6]]
    assert where_count(edges, counts, lambda c: c >= 2).tolist() == [[1, 2]]
    assert coverage([])[0].shape == (0,)
    assert where_count(np.zeros(0), np.zeros(0), lambda c: c > 0).shape == (0, 2)


# --- engine ---------------------------------------------------------------------------------------------


def test_time_to_finish_with_two_sites() -> None:
    """Work accrues at the summed rate of the sites training; None when it never completes."""
    runs = [
        run_of("a", "A", ("train", [(0, 100)], 1.0, 1.0)),
        run_of("b", "B", ("train", [(50, 150)], 1.0, 1.0)),
    ]
    assert time_to_finish(runs, 50, 0) == 50
    assert time_to_finish(runs, 100, 0) == 75  # 50 alone, then 25 s at rate 2
    assert time_to_finish(runs, 200, 0) == 150
    assert time_to_finish(runs, 200.5, 0) is None
    assert time_to_finish(runs, 100, 60) == 120  # 80 by t=100 (both), then B alone
    assert time_to_finish(runs, 0, 0) == 0
    # idle stretches do no work
    idle = [run_of("c", "A", ("idle", [(0, 100)], 1.0, 0.0), ("train", [(100, 200)], 1.0, 1.0))]
    assert time_to_finish(idle, 10, 0) == 110
    assert time_to_finish([run_of("d", "A")], 10, 0) is None


def test_truncate_clips_every_segment() -> None:
    """The experiment stops when its work is done: nothing after the stop is kept."""
    runs = [run_of("a", "A", ("train", [(0, 100), (200, 300)], 1.0, 1.0), ("idle", [(100, 150)], 0.5, 0.0))]
    truncate(runs, 50, 220)
    assert runs[0].segments[0].intervals.tolist() == [[50, 100], [200, 220]]
    assert runs[0].segments[1].intervals.tolist() == [[100, 150]]


def test_account_on_a_constant_trace_is_exact() -> None:
    """Energy is kW x h; grams are kW x h x g/kWh, exactly; in-window energy follows the threshold."""
    trace = hourly(A=[250.0] * 5)
    run = run_of(
        "a", "A", ("train", [(T0, T0 + 3 * H)], 2.0, 1.0), ("idle", [(T0 + 3 * H, T0 + 4 * H)], 0.5, 0.0)
    )
    (inside,) = account([run], trace, threshold=300.0)
    assert inside.energy_kwh == 6.5
    assert inside.emissions_g == 6.5 * 250.0
    assert inside.in_window_kwh == 6.5
    assert (inside.train_s, inside.idle_s, inside.federated_s, inside.work_s) == (3 * H, H, 0.0, 3 * H)
    (outside,) = account([run], trace, threshold=250.0)  # 250 is not below 250
    assert outside.in_window_kwh == 0.0 and outside.emissions_g == 1625.0


def test_integrals_match_the_trace() -> None:
    """The vectorised integral agrees with Trace.integral on arbitrary stretches."""
    trace = hourly(A=[10.0, 40.0, 20.0, 70.0])
    pieces = np.array([[T0, T0 + 4 * H], [T0 + 1800.0, T0 + 2.5 * H], [T0 + 3 * H, T0 + 3.5 * H]])
    expected = [trace.integral("A", a, b) for a, b in pieces]
    np.testing.assert_allclose(integrals(trace, "A", pieces), expected)
    assert integrals(trace, "A", EMPTY).shape == (0,)


def test_split_federated_duty_cycle() -> None:
    """Where two sites train at once, each trains round/(round+overhead) of the time and pauses the rest
    (at the pause's power); outside that stretch nothing changes."""
    runs = [
        run_of("a", "A", ("train", [(0, 3600)], 2.0, 1.0)),
        run_of("b", "B", ("train", [(1800, 5400)], 2.0, 1.0), ("idle", [(0, 1800)], 0.5, 0.0)),
    ]
    split_federated(runs, round_s=600.0, overhead_s=150.0, pause_kw=0.5)
    duty = 600.0 / 750.0
    a = {s.kind: s for s in runs[0].segments}
    assert a["train"].intervals.tolist() == [[0, 1800]] and a["train"].rate == 1.0
    assert a["federated"].intervals.tolist() == [[1800, 3600]]
    assert a["federated"].rate == pytest.approx(duty)
    assert a["federated"].kw == pytest.approx(duty * 2.0 + (1 - duty) * 0.5)
    b = {s.kind: s for s in runs[1].segments}
    assert b["train"].intervals.tolist() == [[3600, 5400]]
    assert b["idle"].intervals.tolist() == [[0, 1800]]  # idle segments pass through
    assert time_to_finish(runs, 1800 + 2 * 1800 * duty + 1800, 0) == pytest.approx(5400)


def test_split_federated_without_overhead_changes_nothing() -> None:
    """No overhead, no federated segments."""
    runs = [
        run_of("a", "A", ("train", [(0, 10)], 1.0, 1.0)),
        run_of("b", "B", ("train", [(0, 10)], 1.0, 1.0)),
    ]
    split_federated(runs, 600.0, 0.0, 0.0)
    assert [s.kind for r in runs for s in r.segments] == ["train", "train"]


def test_occupancy_hours_sum_to_the_span() -> None:
    """Hours with 0/1/2/3+ sites training partition the wall span."""
    runs = [
        run_of("a", "A", ("train", [(0, 3600)], 1.0, 1.0)),
        run_of("b", "B", ("train", [(1800, 5400)], 1.0, 1.0)),
        run_of("c", "C", ("train", [(2000, 2500)], 1.0, 1.0), ("idle", [(5400, 7200)], 1.0, 0.0)),
    ]
    hours = occupancy_hours(runs, 0, 7200)
    assert hours == pytest.approx({"0": 0.5, "1": 1.0, "2": 1300 / H, "3+": 500 / H})
    assert sum(hours.values()) == pytest.approx(2.0)
    assert occupancy_hours([], 0, 7200) == {"0": 2.0, "1": 0.0, "2": 0.0, "3+": 0.0}


# --- presets --------------------------------------------------------------------------------------------

CLEAN_DIRTY = hourly(A=[50, 50, 200, 200, 50, 200])


def test_ideal_trains_exactly_inside_windows() -> None:
    """The ideal yardstick trains in [0, 2h) and [4h, 5h) at 2.024 kW and nothing else."""
    rep = simulate(CLEAN_DIRTY, ["A"], load_policy("ideal")).report
    assert rep["energy_kwh"] == pytest.approx(2.024 * 3)
    assert rep["emissions_kg"] == pytest.approx(2.024 * 50 * 3 / 1000)
    assert rep["in_window_share"] == 1.0
    assert rep["wall_hours"] == 6.0 and rep["site_hours"] == pytest.approx(3.0)
    assert rep["finished"] is True
    rep = simulate(CLEAN_DIRTY, ["A"], load_policy("ideal"), work_h=2.0).report
    assert rep["emissions_kg"] == pytest.approx(2.024 * 50 * 2 / 1000)
    assert rep["wall_hours"] == pytest.approx(2.0) and rep["ideal_kg"] == pytest.approx(rep["emissions_kg"])


def test_greenswarm_pays_ten_seconds_per_window() -> None:
    """The node's preset holding its GPUs (``release.mode=never``; it releases them by default, see
    tests/test_release.py): 10 s of start-up at training power per window, so 2 site-hours of work
    need 20 s of the second window; and between windows the node idles with its model on the GPUs
    at 0.468 kW (2 dirty hours at 200 g)."""
    sim = simulate(CLEAN_DIRTY, ["A"], load_policy("greenswarm", ["release.mode=never"]), work_h=2.0)
    rep = sim.report
    assert rep["finished"] is True
    assert rep["wall_hours"] == pytest.approx(4 + 20 / H)
    assert rep["energy_kwh"] == pytest.approx(2.024 * 7220 / H + 0.468 * 2)
    assert rep["emissions_kg"] == pytest.approx((2.024 * 50 * 7220 / H + 0.468 * 200 * 2) / 1000)
    assert rep["ideal_kg"] == pytest.approx(2.024 * 50 * 2 / 1000)
    (site,) = rep["sites"]
    assert site["idle_hours"] == pytest.approx(2 + 20 / H) and site["work_site_hours"] == pytest.approx(2.0)
    # a site whose GPUs do other work while it waits: the windows' cost alone
    released = load_policy("greenswarm", ["energy.idle_kw=0", "release.mode=never"])
    rep = simulate(CLEAN_DIRTY, ["A"], released, work_h=2.0).report
    assert rep["emissions_kg"] == pytest.approx(2.024 * 50 * 7220 / H / 1000)
    assert rep["vs_ideal"] == pytest.approx(7220 / 7200 - 1)


def test_curtail_llm_startup_and_dwell() -> None:
    """The anchor's preset: 300 s provisioning at 0.468 kW, then training until 600 s after the grid
    went dirty (the dwell), at 200 g/kWh for those 600 s."""
    trace = five_minute(A=[50.0] * 12 + [200.0] * 24)
    rep = simulate(trace, ["A"], load_policy("curtail-llm")).report
    idle_kwh = 0.468 * 300 / H
    train_kwh = 2.024 * 3900 / H
    assert rep["energy_kwh"] == pytest.approx(idle_kwh + train_kwh)
    grams = 0.468 * 50 * 300 / H + 2.024 * (50 * 3300 + 200 * 600) / H
    assert rep["emissions_kg"] == pytest.approx(grams / 1000)
    clean_kwh = idle_kwh + 2.024 * 3300 / H
    assert rep["in_window_share"] == pytest.approx(clean_kwh / (idle_kwh + train_kwh))
    (site,) = rep["sites"]
    assert site["idle_hours"] == pytest.approx(300 / H)
    assert site["train_hours"] == pytest.approx(3900 / H)


def test_curtail_llm_rounds_cost_when_sites_overlap() -> None:
    """Two sites training at once pay 130 s per 600 s round; the same sites apart do not."""
    together = simulate(hourly(A=[50, 200], B=[50, 200]), ["A", "B"], load_policy("curtail-llm")).report
    apart = simulate(
        hourly(A=[50, 200, 200], B=[200, 200, 50]), ["A", "B"], load_policy("curtail-llm")
    ).report
    duty = 600 / 730
    assert together["site_hours"] == pytest.approx(2 * (3600 + 600 - 300) * duty / H)
    assert apart["site_hours"] == pytest.approx((3600 + 600 - 300 + 3600 - 300) / H)


def test_presets_are_not_mutated_by_overrides() -> None:
    """--set on a preset changes the loaded copy, never the preset itself."""
    tweaked = load_policy("curtail-llm", ["scheduler.dwell_s=300", "energy.idle_kw=0"])
    assert (tweaked.scheduler.dwell_s, tweaked.energy.idle_kw) == (300.0, 0.0)
    assert POLICIES["curtail-llm"].scheduler.dwell_s == 600.0
    assert load_policy("curtail-llm").energy.idle_kw == 0.468


def test_site_run_polls_and_clips_to_start() -> None:
    """A site notices a window at its next poll and never trains before the simulation starts (a site
    that holds its trainer: a released one's agent wakes at the window's very start)."""
    trace = five_minute(A=[200.0, 50.0, 50.0, 200.0])
    held = ["scheduler.poll_s=120", "provisioning.startup_s=0", "release.mode=never"]
    policy = load_policy("greenswarm", held)
    run = site_run("s", "A", trace, policy, start=T0 + 7.0)
    train = run.segments[0].intervals - T0
    # window [300, 900); polls at 7 + 120 k: enter at 367, leave at 967
    assert train.tolist() == [[367.0, 967.0]]
    late = site_run("s", "A", trace, load_policy("ideal"), start=T0 + 600.0)
    assert (late.segments[0].intervals - T0).tolist() == [[600.0, 900.0]]


def test_site_run_takes_a_nodes_measured_delays_instead_of_polls() -> None:
    """With measured delays a site starts that long after its window opens and trains that long past
    its end (idle until it notices; never past the trace's end, never in a window shorter than the
    delay to enter it)."""
    trace = five_minute(A=[200.0, 50.0, 50.0, 200.0, 50.0, 200.0])
    overrides = ["provisioning.startup_s=0", "provisioning.at_polls=false", "release.mode=never"]  # (held)
    delays = ["provisioning.enter_delay_s=30", "provisioning.leave_delay_s=45"]
    run = site_run("s", "A", trace, load_policy("greenswarm", overrides + delays), start=T0)
    train = {s.kind: s.intervals - T0 for s in run.segments}
    # windows [300, 900) and [1200, 1500): trained [330, 945) and [1230, 1545), idle (powered) around them
    assert train["train"].tolist() == [[330.0, 945.0], [1230.0, 1500.0 + 45.0]]
    short = ["provisioning.enter_delay_s=400", "provisioning.leave_delay_s=0"]
    run = site_run("s", "A", trace, load_policy("greenswarm", overrides + short), start=T0)
    assert (run.segments[0].intervals - T0).tolist() == [[700.0, 900.0]]  # the 300 s window is missed


def test_a_round_pause_at_training_power_books_what_training_would() -> None:
    """The greenswarm preset pauses at training power (its node stays FEDERATED while a round holds it
    up), so the pause changes the work done but not the energy; the anchor's pause idles."""
    trace = hourly(A=[50.0, 50.0], B=[50.0, 50.0])
    paused = ["provisioning.round_overhead_s=150", "provisioning.startup_s=0"]
    node = simulate(trace, ["A", "B"], load_policy("greenswarm", paused)).report
    free = simulate(trace, ["A", "B"], load_policy("greenswarm", paused[1:])).report
    assert node["energy_kwh"] == pytest.approx(free["energy_kwh"])
    assert node["site_hours"] < free["site_hours"]
    idle = simulate(
        trace, ["A", "B"], load_policy("greenswarm", paused + ["provisioning.round_overhead_power=idle"])
    )
    assert idle.report["energy_kwh"] < node["energy_kwh"]
    with pytest.raises(ConfigError, match="round_overhead_power"):
        load_policy("greenswarm", ["provisioning.round_overhead_power=half"]).provisioning.validate()


# --- the report -----------------------------------------------------------------------------------------

THREE = hourly(A=[50, 50, 200, 200, 50, 200], B=[20, 200, 30, 10, 250, 250], C=[300, 300, 80, 80, 90, 300])


def test_report_has_the_promised_keys() -> None:
    """Every report carries the totals, the yardsticks and a baseline for every region of the trace."""
    rep = simulate(THREE, ["A", "B"], load_policy("greenswarm"), work_h=3.0).report
    assert REPORT_KEYS <= rep.keys()
    assert set(rep["baselines"]) == {"A", "B", "C"}
    assert set(rep["hours_by_sites"]) == {"0", "1", "2", "3+"}
    assert sum(rep["hours_by_sites"].values()) == pytest.approx(rep["wall_hours"])
    assert [s["name"] for s in rep["sites"]] == ["site0-A", "site1-B"]
    assert rep["finished"] is True and rep["site_hours"] == pytest.approx(3.0)
    json.dumps(rep)  # plain data


def test_baselines_are_continuous_single_sites_at_equal_work() -> None:
    """A region's baseline is one site at 2.024 kW from the start for the work's hours."""
    rep = simulate(THREE, ["A", "B"], load_policy("ideal"), work_h=3.0).report
    assert rep["baselines"]["C"] == pytest.approx(2.024 * (300 + 300 + 80) / 1000)
    assert rep["baselines"]["A"] == pytest.approx(2.024 * (50 + 50 + 200) / 1000)
    assert rep["baseline_ratios"]["C"] == pytest.approx(rep["emissions_kg"] / rep["baselines"]["C"])


def test_two_sites_in_one_region_stay_apart() -> None:
    """Sites are named by position, so the same region twice gives two sites and twice the work."""
    rep = simulate(THREE, ["A", "A"], load_policy("ideal")).report
    assert [s["name"] for s in rep["sites"]] == ["site0-A", "site1-A"]
    assert rep["site_hours"] == pytest.approx(6.0)


def test_unfinished_work_is_reported() -> None:
    """Work the windows cannot hold leaves finished False and the sites stopped at the trace's end."""
    rep = simulate(THREE, ["A"], load_policy("greenswarm"), work_h=10.0).report
    assert rep["finished"] is False
    assert rep["site_hours"] < 3.0
    assert rep["wall_hours"] == 6.0
    rep = simulate(THREE, ["A", "B"], "deadline", work_h=5.0, deadline_h=2.0).report
    assert rep["finished"] is False and rep["site_hours"] == pytest.approx(4.0)


def test_compare_reports_each_policy() -> None:
    """--compare runs each policy on the same terms; ideal compared equals the ideal yardstick."""
    rep = simulate(
        THREE, ["A", "B"], load_policy("curtail-llm"), work_h=3.0, compare=(load_policy("ideal"),)
    ).report
    assert rep["compare"]["ideal"]["emissions_kg"] == pytest.approx(rep["ideal_kg"])
    assert rep["compare"]["ideal"]["finished"] is True


def test_threshold_and_start_overrides() -> None:
    """--threshold moves the windows; --start begins later; a start outside the trace is refused."""
    rep = simulate(THREE, ["C"], load_policy("ideal"), threshold=85.0).report
    assert rep["threshold"] == 85.0 and rep["site_hours"] == pytest.approx(2.0)
    rep = simulate(THREE, ["A"], load_policy("ideal"), start=T0 + 3 * H).report
    assert rep["start"] == "2026-01-01T03:00:00Z" and rep["site_hours"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="is outside the trace"):
        simulate(THREE, ["A"], load_policy("ideal"), start=T0 + 6 * H)


# --- foresight and deadline -----------------------------------------------------------------------------


def test_foresight_picks_the_cleanest_cells() -> None:
    """Perfect foresight takes cells cheapest first, the last one in part."""
    trace = hourly(A=[30, 10, 80], B=[20, 90, 5])
    runs = foresight_runs(trace, ["A", "B"], 3 * H, trace.start, trace.end, 2.0)
    assert rel(runs[0].segments[0].intervals) == [[1, 2]]
    assert rel(runs[1].segments[0].intervals) == [[0, 1], [2, 3]]
    runs = foresight_runs(trace, ["A", "B"], 3.5 * H, trace.start, trace.end, 2.0)
    assert rel(runs[0].segments[0].intervals) == [[0, 0.5], [1, 2]]
    runs = foresight_runs(trace, ["A", "B"], 3.5 * H, trace.start + H, trace.end, 2.0)  # after 1 h
    assert rel(runs[0].segments[0].intervals) == [[1, 3]]
    assert rel(runs[1].segments[0].intervals) == [[1, 1.5], [2, 3]]
    rep = simulate(trace, ["A", "B"], "foresight", work_h=3.0).report
    assert rep["emissions_kg"] == pytest.approx(2.024 * (10 + 20 + 5) / 1000)
    assert rep["foresight_kg"] == pytest.approx(rep["emissions_kg"])


@pytest.mark.parametrize("work_h", [0.3, 1.0, 2.5, 4.75, 7.9])
def test_deadline_with_oracle_is_foresight(work_h: float) -> None:
    """Planned with a perfect forecast, the deadline policy emits exactly what foresight does: the
    marginal cell is taken only in part, as foresight takes it."""
    rng = np.random.default_rng(int(work_h * 100))
    trace = hourly(A=rng.uniform(0, 300, 8), B=rng.uniform(0, 300, 8), C=rng.uniform(0, 300, 8))
    rep = simulate(trace, ["A", "B", "C"], "deadline", work_h=work_h, forecast="oracle").report
    assert rep["finished"] is True
    assert rep["emissions_kg"] == pytest.approx(rep["foresight_kg"], rel=1e-6)
    assert rep["forecast"] == "oracle" and rep["deadline"] == "2026-01-01T08:00:00Z"


def test_deadline_with_oracle_on_a_known_case() -> None:
    """A at 48/98, B at 96/72, 2.5 site-hours: A's first hour, B's cheap second hour and only the
    half hour still missing of B's dear first hour -- not all of it just because it is at the price
    now, which would leave B's cheap hour half unused."""
    trace = hourly(A=[48.0, 98.0], B=[96.0, 72.0])
    runs = deadline_runs(
        trace, ["A", "B"], 2.5 * H, trace.start, trace.end, OracleForecaster(), 2.0, margin=0.0
    )
    assert rel(runs[0].segments[0].intervals) == [[0, 1]]
    assert rel(runs[1].segments[0].intervals) == [[0, 0.5], [1, 2]]
    foresight = foresight_runs(trace, ["A", "B"], 2.5 * H, trace.start, trace.end, 2.0)
    assert [rel(r.segments[0].intervals) for r in foresight] == [[[0, 1]], [[0, 0.5], [1, 2]]]


def test_deadline_runs_everyone_without_slack() -> None:
    """When the remaining work fills every site until the deadline, every site trains."""
    trace = hourly(A=[300, 300], B=[10, 10])
    runs = deadline_runs(trace, ["A", "B"], 4 * H, trace.start, trace.end, OracleForecaster(), 2.0)
    assert [rel(r.segments[0].intervals) for r in runs] == [[[0, 2]], [[0, 2]]]


def test_deadline_default_forecast_finishes_in_time() -> None:
    """With the noisy forecast and a deadline, the work is done by the deadline."""
    rep = simulate(THREE, ["A", "B", "C"], "deadline", work_h=4.0, deadline_h=3.0).report
    assert rep["finished"] is True and rep["wall_hours"] <= 3.0 + 1e-9
    assert rep["site_hours"] == pytest.approx(4.0)
    assert rep["deadline"] == "2026-01-01T03:00:00Z"


def test_deadline_without_work_is_an_error() -> None:
    """The deadline and foresight planners need to know how much work there is."""
    for policy in ("deadline", "foresight"):
        with pytest.raises(ValueError, match="needs the work to do"):
            simulate(THREE, ["A"], policy)


# --- example policy files -------------------------------------------------------------------------------

EXAMPLES = sorted((REPO / "examples" / "policies").glob("*.yaml"))


def test_examples_exist() -> None:
    assert EXAMPLES, "examples/policies/*.yaml is empty"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_policy_loads_and_simulates(path: Path) -> None:
    """Each shipped policy YAML loads, validates and simulates on a small trace."""
    policy = load_policy(str(path))
    assert policy.name == path.stem
    rep = simulate(THREE, ["A", "B", "C"], policy, work_h=3.0).report
    assert rep["policy"] == path.stem
    assert rep["finished"] is True and rep["site_hours"] == pytest.approx(3.0)
    assert rep["emissions_kg"] > 0 and rep["description"]


def test_curtail_llm_example_is_the_preset() -> None:
    """The commented YAML of the anchor's controller says exactly what the built-in preset does."""
    assert load_policy(str(REPO / "examples/policies/curtail-llm.yaml")) == load_policy("curtail-llm")


def test_lookahead_example_beats_the_dwell_on_a_long_spell() -> None:
    """The look-ahead example leaves at the start of a long dirty spell, so it emits no more than the
    same policy without look-ahead (both idle through the spell at the node's idle draw)."""
    path = str(REPO / "examples/policies/greenswarm-lookahead.yaml")
    trace = five_minute(A=[50.0] * 12 + [400.0] * 12 + [50.0] * 12)
    ahead = simulate(trace, ["A"], load_policy(path), work_h=1.5).report
    blind = simulate(trace, ["A"], load_policy(path, ["scheduler.lookahead=null"]), work_h=1.5).report
    assert ahead["in_window_share"] > blind["in_window_share"]
    released = load_policy(path, ["energy.idle_kw=0"])
    assert simulate(trace, ["A"], released, work_h=1.5).report["in_window_share"] == 1.0
    assert ahead["emissions_kg"] < blind["emissions_kg"]


def test_policy_yaml_errors_name_file_line_and_field(tmp_path: Path) -> None:
    """A bad field in a policy file is a ConfigError at its line; a missing file is a clear error."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: p\nscheduler:\n  threshold: 100\n  dwell_s: -5\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:4: scheduler.dwell_s: must be >= 0"):
        load_policy(str(bad))
    with pytest.raises(ConfigError, match="no policy 'nope': give one of greenswarm, curtail-llm, ideal"):
        load_policy("nope")


def test_simulate_policy_shares_windows_per_region() -> None:
    """simulate_policy gives one run per listed region, in order."""
    runs = simulate_policy(THREE, ["B", "A", "B"], load_policy("ideal"), THREE.start)
    assert [r.name for r in runs] == ["site0-B", "site1-A", "site2-B"]
    assert rel(runs[0].training()) == rel(runs[2].training()) == [[0, 1], [2, 4]]


# --- the command ----------------------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "greenswarm", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture
def wide_csv(tmp_path: Path) -> Path:
    path = tmp_path / "wide.csv"
    path.write_text(WIDE_CSV)
    return path


def test_cli_json(wide_csv: Path) -> None:
    """--json prints one JSON object with the report's keys."""
    result = _run("--trace", str(wide_csv), "--regions", "A,B,C", "--work", "3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert REPORT_KEYS <= report.keys()
    assert set(report["baselines"]) == {"A", "B", "C"}
    assert report["policy"] == "greenswarm" and report["finished"] is True


def test_cli_deadline_compare_and_table(wide_csv: Path) -> None:
    """The deadline policy with a forecast, a comparison and the human-readable table all run."""
    result = _run(
        "--trace", str(wide_csv), "--regions", "A,B", "--policy", "deadline", "--forecast", "oracle",
        "--work", "2", "--compare", "curtail-llm,ideal", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["emissions_kg"] == pytest.approx(report["foresight_kg"], rel=1e-6)
    assert set(report["compare"]) == {"curtail-llm", "ideal"}
    table = _run("--trace", str(wide_csv), "--regions", "A,B", "--policy", "curtail-llm", "--work", "2")
    assert table.returncode == 0, table.stderr
    assert "threshold ideal" in table.stdout and "site-hours" in table.stdout


def test_cli_plot(wide_csv: Path, tmp_path: Path) -> None:
    """--plot writes a PNG and says where."""
    out = tmp_path / "out.png"
    result = _run("--trace", str(wide_csv), "--regions", "A,B", "--work", "2", "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    assert f"plot written to {out}" in result.stdout


@pytest.fixture
def bad_policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text("name: p\nscheduler:\n  threshold: 100\n  dwel_s: 600\n")
    return path


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--regions", "A,Z"], ["region 'Z' is not in", "it has: A, B, C"]),
        (["--regions", "A", "--policy", "nope"], ["--policy: no policy 'nope'", "greenswarm, curtail-llm"]),
        (["--regions", "A", "--compare", "ideal,nope"], ["--compare: no policy 'nope'"]),
        (["--regions", "A", "--policy", "BAD"], [":4: scheduler.dwel_s: unknown field", "dwell_s"]),
        (["--regions", "A", "--work", "0"], ["--work: must be a number > 0, got 0"]),
        (["--regions", "A", "--work", "-1"], ["--work: must be a number > 0, got -1"]),
        (["--regions", "A", "--work", "nan"], ["--work: must be a number > 0"]),
        (["--regions", "A", "--deadline", "0", "--work", "1"], ["--deadline: must be a number > 0"]),
        (["--regions", "A", "--threshold", "-3"], ["--threshold: must be a number > 0"]),
        (["--regions", "A", "--forecast", "crystal"], ["--forecast: unknown forecast 'crystal'", "oracle"]),
        (["--regions", "A", "--start", "2027-01-01T00:00:00Z"], ["2027-01-01T00:00:00Z is outside"]),
        (["--regions", "A", "--start", "soon"], ["--start: cannot parse 'soon'"]),
        (["--regions", ""], ["--regions: name at least one region"]),
        (["--regions", " , "], ["--regions: name at least one region"]),
        (["--regions", "A", "--set", "scheduler.nope=1"], ["--set scheduler.nope=1", "unknown field"]),
        (["--regions", "A", "--set", "nope"], ["--set: expected key=value, got 'nope'"]),
        (["--regions", "A", "--set", "scheduler.dwell_s=-3"], ["scheduler.dwell_s: must be >= 0"]),
        (["--regions", "A", "--set", "scheduler.percentile=30", "--set", "scheduler.dwell_s=60"],
         ["scheduler.dwell_s: does not combine with percentile"]),
        (["--regions", "A", "--policy", "deadline"], ["the deadline policy", "--work SITE_HOURS"]),
        (["--regions", "A", "--policy", "foresight"], ["the foresight policy", "--work SITE_HOURS"]),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line(
    wide_csv: Path, bad_policy: Path, args: list[str], needles: list[str]
) -> None:
    """Each malformed input gives one line naming the culprit, exit code 2, no traceback, no output."""
    args = [str(bad_policy) if a == "BAD" else a for a in args]
    result = _run("--trace", str(wide_csv), *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("greenswarm simulate: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


def test_cli_missing_trace(tmp_path: Path) -> None:
    """A trace that does not exist is named in one line."""
    result = _run("--trace", str(tmp_path / "nope.csv"), "--regions", "A")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"greenswarm simulate: error: {tmp_path / 'nope.csv'}: no such trace file"
    ]


def test_scale_benchmark_runs_small() -> None:
    """benchmarks/simulate_scale.py keeps working (a tiny run; the real figure is 1000 sites)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "simulate_scale.py"),
            "--sites",
            "12",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["sites"] == 12 and out["hours"] >= 8760
    assert set(out["median_s"]) == {"numpy pass", "greenswarm", "curtail-llm"}
    assert out["foresight_kg"] <= out["ideal_kg"] <= out["emissions_kg"]["curtail-llm"]
