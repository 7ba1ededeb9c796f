"""Forecast files (forecasts as they were issued): reading them, using each only from its issue time,
and a deadline-aware simulation that cannot see a forecast issued after its decision."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import TraceError
from greenswarm.scheduler.forecast import FileForecaster
from greenswarm.simulation.deadline import deadline_runs
from greenswarm.traces import Trace
from greenswarm.traces.forecast_file import IssuedForecasts, read_forecast_file
from tests._shared import shared_path

T0 = datetime(2023, 6, 1, tzinfo=UTC)
HOUR = 3600.0


def iso(hours: float) -> str:
    return (T0 + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")


def at(hours: float) -> float:
    return (T0 + timedelta(hours=hours)).timestamp()


def forecast_csv(path: Path, value_of, issues: int = 24, horizon: int = 24, regions=("A", "B")) -> Path:
    """A long forecast file: an issue every hour, each for the next ``horizon`` hours, value
    ``value_of(issue_hour, point_hour, region)``."""
    lines = ["generated_at,point_time,region,value"]
    for g in range(issues):
        for h in range(g + 1, g + 1 + horizon):
            for r in regions:
                lines.append(f"{iso(g)},{iso(h)},{r},{value_of(g, h, r)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_of(hours: int = 48) -> Trace:
    times = np.array([at(h) for h in range(hours)])
    rng = np.random.default_rng(0)
    return Trace.from_columns(
        times, {"A": rng.uniform(10, 300, hours), "B": rng.uniform(10, 300, hours)}, "synthetic"
    )


def test_the_latest_issue_at_or_before_now_is_used(tmp_path: Path) -> None:
    path = forecast_csv(tmp_path / "f.csv", lambda g, h, r: 100 + g)
    forecasts = read_forecast_file(path)
    assert forecasts.regions == ["A", "B"]
    assert forecasts.latest("A", at(0) - 1) is None  # nothing issued yet
    assert forecasts.latest("A", at(5)).generated_at == at(5)  # issued exactly now: usable
    assert forecasts.latest("A", at(5) + 1800).generated_at == at(5)
    forecaster = FileForecaster(forecasts)
    values = forecaster.predict(trace_of(), "B", at(7.5), np.array([at(h) for h in range(8, 20)]))
    assert set(values.tolist()) == {107.0}


def test_before_any_issue_only_the_present_is_known(tmp_path: Path) -> None:
    forecasts = read_forecast_file(forecast_csv(tmp_path / "f.csv", lambda g, h, r: 5, issues=3))
    trace = trace_of()
    # shift: first issue at hour 0, so ask at hour -1 of a trace that starts earlier
    early = Trace.from_columns(trace.times - 10 * HOUR, dict(trace.values), "early")
    now = at(-2)
    values = FileForecaster(forecasts).predict(early, "A", now, np.array([at(1), at(2)]))
    assert values.tolist() == [early.intensity("A", now)] * 2


def test_a_deadline_plan_never_sees_a_forecast_issued_after_its_decision(tmp_path: Path) -> None:
    """Two files that agree on every issue up to hour 12 and differ wildly after it: every decision
    up to hour 12 is the same. A forecaster that peeked at later issues would change them (checked)."""
    cut = 12
    honest = forecast_csv(tmp_path / "a.csv", lambda g, h, r: (h * 37 + ord(r)) % 200 + 10)
    later = forecast_csv(
        tmp_path / "b.csv",
        lambda g, h, r: ((h * 37 + ord(r)) % 200 + 10) if g <= cut else (5 if r == "B" else 400),
    )
    trace = trace_of()
    runs = {}
    for name, path in (("a", honest), ("b", later)):
        forecaster = FileForecaster(read_forecast_file(path))
        runs[name] = deadline_runs(trace, ["A", "B"], 10 * HOUR, trace.start, at(30), forecaster, 2.0)

    def decided_by(site_runs, hours: float) -> list[list[tuple[float, float]]]:
        return [[tuple(i) for s in r.segments for i in s.intervals if i[0] <= at(hours)] for r in site_runs]

    assert decided_by(runs["a"], cut) == decided_by(runs["b"], cut)

    class Peeking(FileForecaster):  # the bug the test exists for: the newest issue in the file
        def predict(self, trace, region, now, times):
            issue = self.forecasts.issues[region][-1]
            idx = np.clip(np.searchsorted(issue.times, times, side="right") - 1, 0, len(issue.times) - 1)
            return issue.values[idx]

    peeked = [
        deadline_runs(trace, ["A", "B"], 10 * HOUR, trace.start, at(30), Peeking(read_forecast_file(p)), 2.0)
        for p in (honest, later)
    ]
    assert decided_by(peeked[0], cut) != decided_by(peeked[1], cut)


def test_reader_options_compression_and_a_file_without_regions(tmp_path: Path) -> None:
    text = "generated_at,point_time,moer\n2023-06-01 00:00,2023-06-01 01:00,1000\n"
    path = tmp_path / "watttime.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    forecasts = read_forecast_file(path, tz="UTC", units="lbs/MWh")
    issue = forecasts.latest("ANY-REGION", at(0))  # no region column: it serves every region
    assert issue is not None and issue.values.tolist() == [pytest.approx(453.592)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("point_time,value\n", "needs an issue-time column"),
        ("generated_at,point_time,value\n", "no forecast rows"),
        (f"generated_at,point_time,value\n{iso(0)},{iso(1)},abc\n", ":2: value 'abc' is not a number"),
        (f"generated_at,point_time,value\n{iso(0)},{iso(1)},-3\n", ":2: value -3 must be a finite number"),
        ("generated_at,point_time,value\n2023-06-01 00:00,2023-06-01 01:00,3\n", ":2: naive timestamp"),
        (f"generated_at,point_time,value\n{iso(0)},{iso(1)},3\n{iso(0)},{iso(1)},4\n", ":3: a second value"),
        (f"generated_at,point_time,value\n{iso(0)},{iso(1)}\n", ":2: expected 3 columns, found 2"),
    ],
)
def test_bad_forecast_files_are_one_line_naming_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "f.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=match) as info:
        read_forecast_file(path)
    assert str(info.value).startswith(str(path))


def test_a_region_without_forecasts_is_named() -> None:
    with pytest.raises(TraceError, match="region 'C' has no forecasts in f.csv; it has: A, B"):
        IssuedForecasts("f.csv", {"A": [], "B": []}).latest("C", 0.0)


@pytest.mark.shared
def test_simulate_plans_with_a_forecast_file_built_from_a_real_trace(tmp_path: Path) -> None:
    """``simulate --policy deadline --forecast file:PATH`` on a file built by benchmarks/forecast_file.py."""
    repo = Path(__file__).resolve().parents[1]
    trace = shared_path("traces/curtail-llm/mci.csv")
    out = tmp_path / "forecasts.csv.gz"
    build = [
        sys.executable,
        str(repo / "benchmarks" / "forecast_file.py"),
        "--trace",
        str(trace),
        "--out",
        str(out),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    command = [
        "simulate",
        "--trace",
        str(trace),
        "--regions",
        "CAISO_NORTH,SPP_TX,NEM_SA",
        "--policy",
        "deadline",
    ]
    command += ["--work", "17.78", "--forecast", f"file:{out}", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "greenswarm", *command], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["forecast"] == f"file:{out}"
    assert report["work_site_hours"] == pytest.approx(17.78, rel=1e-6)


def test_a_wide_file_reads_as_the_same_forecasts_in_the_long_shape(tmp_path: Path) -> None:
    """``time, value, f1..fN``: row g forecasts g + k steps (the file's own resolution) as fk."""
    wide = ["time,value,f1,f2,f3"]
    long = ["generated_at,point_time,value"]
    for g in range(6):
        forecasts = [100 + 10 * g + k for k in (1, 2, 3)]
        cells = [str(v) if g + k < 6 else "" for k, v in zip((1, 2, 3), forecasts, strict=True)]
        wide.append(",".join([iso(g), str(50 + g), *cells]))  # (past the end: blank cells)
        long += [f"{iso(g)},{iso(g + k)},{v}" for k, v in zip((1, 2, 3), forecasts, strict=True) if g + k < 6]
    (tmp_path / "wide.csv").write_text("\n".join(wide) + "\n")
    (tmp_path / "long.csv").write_text("\n".join(long) + "\n")
    a, b = read_forecast_file(tmp_path / "wide.csv"), read_forecast_file(tmp_path / "long.csv")
    for g in range(5):
        ia, ib = a.latest("X", at(g)), b.latest("X", at(g))
        assert ia.generated_at == ib.generated_at == at(g)
        assert ia.times.tolist() == ib.times.tolist() and ia.values.tolist() == ib.values.tolist()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (f"time,value,f1\n{iso(0)},1,2\n", "needs two issue times to know its step"),
        (f"time,value,f1\n{iso(0)},1,x\n{iso(1)},1,2\n", ":2: value 'x' is not a number"),
        (
            f"time,value,f1\n{iso(0)},1,2\n{iso(0)},1,3\n{iso(1)},1,3\n",
            ":3: a second value for the same instant",
        ),
    ],
)
def test_bad_wide_forecast_files_are_named(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "wide.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=match):
        read_forecast_file(path)


def test_one_wide_file_is_both_the_trace_and_the_forecasts_of_a_site(tmp_path: Path) -> None:
    """``scheduler.trace: F`` and ``scheduler.lookahead: file:F``: the realized column is the trace (the
    f1..fN columns are not regions), and the look-ahead leaves a window at once where the forecast
    issued then says the dirty spell outlasts the dwell."""
    from greenswarm.configuration import config_from_dict
    from greenswarm.scheduler.config import SchedulerConfig
    from greenswarm.scheduler.policy import WindowSchedule
    from greenswarm.traces import load_trace

    realized = [50, 50, 300, 300, 300, 300, 50, 50]
    rows = ["time,value,f1,f2,f3"]
    for h, v in enumerate(realized):
        ahead = [realized[min(h + k, len(realized) - 1)] for k in (1, 2, 3)]
        rows.append(f"{iso(h)},{v}," + ",".join(str(x) for x in ahead))
    path = tmp_path / "gb.csv"
    path.write_text("\n".join(rows) + "\n")
    trace = load_trace(str(path))
    assert trace.regions == ["value"] and list(trace.series("value")) == realized

    base = {"trace": str(path), "threshold": 100, "dwell_s": 2 * HOUR}
    plain = config_from_dict(SchedulerConfig, base)
    ahead = config_from_dict(SchedulerConfig, {**base, "lookahead": f"file:{path}"})
    late = WindowSchedule(trace, "value", plain.window_policy()).windows[0]
    early = WindowSchedule(trace, "value", ahead.window_policy()).windows[0]
    assert (late.start, late.end) == (at(0), at(4))  # the dwell rides two dirty hours
    assert (early.start, early.end) == (at(0), at(2))  # the forecast issued at 02:00 says it lasts
    with pytest.raises(Exception, match="lookahead"):
        config_from_dict(SchedulerConfig, {**base, "lookahead": "file:"})
