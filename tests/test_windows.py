"""``greenswarm windows``: the percentile policy, the report, the plot and the command itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import ConfigError, TraceError
from greenswarm.scheduler.policy import PercentilePolicy, ThresholdPolicy, Window, WindowSchedule
from greenswarm.scheduler.windows_report import plot_windows, run_windows, windows_report
from greenswarm.traces import Trace, load_trace
from tests._shared import shared_path

TIMEOUT_S = 120

# Ten hourly samples from 2026-01-01T00:00Z: 10, 20, ..., 100 in a shuffled order.
T0 = 1767225600.0
VALUES = np.array([50.0, 10.0, 20.0, 90.0, 100.0, 30.0, 80.0, 70.0, 40.0, 60.0])
TEN = Trace(T0 + np.arange(10) * 3600.0, {"A": VALUES, "B": VALUES[::-1].copy()}, 3600.0, "ten")

WIDE_CSV = """timestamp,A,B
2026-01-01T00:00:00Z,150,10
2026-01-01T01:00:00Z,50,10
2026-01-01T02:00:00Z,60,10
2026-01-01T03:00:00Z,200,10
2026-01-01T04:00:00Z,90,10
2026-01-01T05:00:00Z,300,10
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "greenswarm", "windows", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture
def wide_csv(tmp_path: Path) -> Path:
    path = tmp_path / "wide.csv"
    path.write_text(WIDE_CSV)
    return path


# --- the percentile policy ------------------------------------------------------------------------------


def test_percentile_windows_on_known_trace():
    policy = PercentilePolicy(35.0)
    # p35 of 10..100 (linear interpolation) is 41.5: samples 10, 20, 30, 40 are below.
    assert policy.threshold(TEN, "A") == pytest.approx(41.5)
    h = 3600.0
    assert policy.windows(TEN, "A") == [
        Window(T0 + 1 * h, T0 + 3 * h),
        Window(T0 + 5 * h, T0 + 6 * h),
        Window(T0 + 8 * h, T0 + 9 * h),
    ]
    assert WindowSchedule(TEN, "A", policy).share_in_window() == pytest.approx(0.4)


def test_percentile_is_per_region_and_honours_min_window():
    assert PercentilePolicy(35.0, min_window_s=3601.0).windows(TEN, "A") == [
        Window(T0 + 3600.0, T0 + 3 * 3600.0)
    ]
    # B is A reversed: same threshold, mirrored windows.
    assert PercentilePolicy(35.0).threshold(TEN, "B") == pytest.approx(41.5)
    assert Window(T0 + 7 * 3600.0, T0 + 9 * 3600.0) in PercentilePolicy(35.0).windows(TEN, "B")


def test_percentile_extremes_and_ties():
    assert PercentilePolicy(100.0).windows(TEN, "A") == ThresholdPolicy(100.0).windows(TEN, "A")
    flat = Trace(T0 + np.arange(4) * 60.0, {"F": np.full(4, 50.0)}, 60.0, "flat")
    assert PercentilePolicy(50.0).windows(flat, "F") == []  # ties at the cut-off are outside


@pytest.mark.parametrize(
    ("percentile", "min_window_s"), [(0.0, 0.0), (-5.0, 0.0), (100.1, 0.0), (float("nan"), 0.0), (50.0, -1.0)]
)
def test_percentile_rejects_bad_arguments(percentile, min_window_s):
    with pytest.raises(ValueError):
        PercentilePolicy(percentile, min_window_s)


def test_percentile_unknown_region_lists_regions():
    with pytest.raises(TraceError, match="it has: A, B"):
        PercentilePolicy(20.0).windows(TEN, "Z")


# --- the report and the plot ----------------------------------------------------------------------------


def test_windows_report_on_known_trace():
    report = windows_report(TEN, "A", ThresholdPolicy(45.0))
    assert report["region"] == "A"
    assert report["trace"] == "ten"
    assert report["threshold"] == 45.0
    assert "45" in report["policy"]
    assert report["windows"] == [
        {"start": "2026-01-01T01:00:00Z", "end": "2026-01-01T03:00:00Z", "hours": 2.0},
        {"start": "2026-01-01T05:00:00Z", "end": "2026-01-01T06:00:00Z", "hours": 1.0},
        {"start": "2026-01-01T08:00:00Z", "end": "2026-01-01T09:00:00Z", "hours": 1.0},
    ]
    assert report["count"] == 3
    assert report["share_in_window"] == pytest.approx(0.4)
    assert report["longest_hours"] == 2.0
    assert report["mean_intensity_in_window"] == pytest.approx(25.0)
    assert report["mean_intensity"] == pytest.approx(55.0)
    json.dumps(report)  # JSON-ready as is


def test_windows_report_percentile_threshold_and_empty():
    report = windows_report(TEN, "A", PercentilePolicy(35.0))
    assert report["threshold"] == pytest.approx(41.5)
    assert report["count"] == 3
    empty = windows_report(TEN, "A", ThresholdPolicy(5.0))
    assert empty["windows"] == [] and empty["count"] == 0
    assert empty["share_in_window"] == 0.0 and empty["longest_hours"] == 0.0
    assert empty["mean_intensity_in_window"] is None


def test_windows_report_unknown_region():
    with pytest.raises(TraceError, match="'Z' is not in ten; it has: A, B"):
        windows_report(TEN, "Z", ThresholdPolicy(100.0))


def test_plot_windows_writes_png(tmp_path):
    out = plot_windows(TEN, "A", PercentilePolicy(35.0), tmp_path / "a.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_windows_rejects_both_rules_and_bad_values(wide_csv):
    with pytest.raises(ConfigError, match="not both"):
        run_windows(str(wide_csv), "A", threshold=100.0, percentile=20.0)
    with pytest.raises(ConfigError, match="percentile"):
        run_windows(str(wide_csv), "A", percentile=0.0)
    with pytest.raises(ConfigError, match="threshold"):
        run_windows(str(wide_csv), "A", threshold=-1.0)


# --- the command ----------------------------------------------------------------------------------------


def test_cli_json(wide_csv):
    result = _run("--trace", str(wide_csv), "--region", "A", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # exactly one JSON object
    assert report["threshold"] == 100.0
    assert report["windows"] == [
        {"start": "2026-01-01T01:00:00Z", "end": "2026-01-01T03:00:00Z", "hours": 2.0},
        {"start": "2026-01-01T04:00:00Z", "end": "2026-01-01T05:00:00Z", "hours": 1.0},
    ]
    assert report["share_in_window"] == pytest.approx(0.5)
    assert report["mean_intensity_in_window"] == pytest.approx(200.0 / 3)


def test_cli_units_and_min_window(wide_csv):
    result = _run(
        "--trace", str(wide_csv), "--region", "A", "--units", "kg/kWh", "--threshold", "95000",
        "--min-window-s", "3601", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [w["hours"] for w in report["windows"]] == [2.0]


def test_cli_table(wide_csv):
    result = _run("--trace", str(wide_csv), "--region", "A", "--percentile", "50")
    assert result.returncode == 0, result.stderr
    assert "2026-01-01T01:00:00Z" in result.stdout
    assert "in window" in result.stdout


def test_cli_plot_writes_png(wide_csv, tmp_path):
    out = tmp_path / "w.png"
    result = _run("--trace", str(wide_csv), "--region", "A", "--plot", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plot"] == str(out)
    assert out.stat().st_size > 1000
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--region", "Z"], "region 'Z' is not in .*; it has: A, B"),
        (["--region", "A", "--units", "tons"], "unknown units 'tons'; known units: g/kWh, kg/kWh, lbs/MWh"),
        (["--region", "A", "--percentile", "0"], "percentile must be"),
    ],
)
def test_cli_errors_are_one_line(wide_csv, args, message):
    result = _run("--trace", str(wide_csv), *args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("greenswarm windows: error: ")
    assert __import__("re").search(message, lines[0])
    assert result.stdout == ""


def test_cli_missing_file(tmp_path):
    result = _run("--trace", str(tmp_path / "nope.csv"), "--region", "A")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"greenswarm windows: error: {tmp_path / 'nope.csv'}: no such trace file"
    ]


def test_cli_threshold_and_percentile_are_exclusive(wide_csv):
    result = _run("--trace", str(wide_csv), "--region", "A", "--threshold", "5", "--percentile", "5")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_cli_linear_interpolation(wide_csv):
    """Read linearly onto a 30 min grid, A's hourly 150, 50, 60, 200, 90, 300 dips below 100 later and
    leaves earlier than the published steps do (compare test_cli_json)."""
    result = _run(
        "--trace", str(wide_csv), "--region", "A", "--interpolate", "linear", "--grid", "1800", "--json"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["trace"] == f"{wide_csv} (linear, 1800 s grid)"
    assert report["windows"] == [
        {"start": "2026-01-01T01:00:00Z", "end": "2026-01-01T02:30:00Z", "hours": 1.5},
        {"start": "2026-01-01T04:00:00Z", "end": "2026-01-01T04:30:00Z", "hours": 0.5},
    ]
    assert report["mean_intensity_in_window"] == pytest.approx((50 + 55 + 60 + 90) / 4)


def test_run_windows_interpolation_options(wide_csv, capsys):
    assert run_windows(str(wide_csv), "A", interpolate="hold", grid_s=1.0, as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["trace"] == str(wide_csv)
    with pytest.raises(TraceError, match="unknown interpolation 'cubic'; choices: hold, linear"):
        run_windows(str(wide_csv), "A", interpolate="cubic")


def test_cli_interpolation_errors(wide_csv):
    result = _run("--trace", str(wide_csv), "--region", "A", "--interpolate", "linear", "--grid", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"greenswarm windows: error: {wide_csv}: grid_s must be a finite number of seconds > 0, got 0.0"
    ]
    result = _run("--trace", str(wide_csv), "--region", "A", "--interpolate", "cubic")
    assert result.returncode == 2
    assert "invalid choice: 'cubic'" in result.stderr


# --- real traces ----------------------------------------------------------------------------------------


@pytest.mark.shared
def test_mci_caiso_north_threshold_100():
    trace = load_trace(str(shared_path("traces/curtail-llm/mci.csv")))
    report = windows_report(trace, "CAISO_NORTH", ThresholdPolicy(100.0))
    assert len(trace.times) == 217
    assert report["share_in_window"] == pytest.approx(73 / 217)
    span_hours = (trace.end - trace.start) / 3600.0
    assert sum(w["hours"] for w in report["windows"]) == pytest.approx(73 / 217 * span_hours)
    assert report["count"] == len(report["windows"])
    assert report["longest_hours"] == max(w["hours"] for w in report["windows"])
    assert report["mean_intensity_in_window"] < 100.0 < report["mean_intensity"]


@pytest.mark.shared
def test_electricitymaps_gb_percentile_20():
    path = shared_path("traces/electricitymaps-2023/GB_2023_hourly.csv")
    result = _run("--trace", str(path), "--region", "GB", "--percentile", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["share_in_window"] == pytest.approx(0.2, abs=0.02)
    assert report["mean_intensity_in_window"] < report["threshold"] < report["mean_intensity"]
