"""Traces: the Trace type's hold-last semantics, the wide-CSV reader and its errors, the builtin model."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import TraceError
from greenswarm.traces import BUILTIN_TRACES, Trace, builtin_trace, load_trace, read_csv_trace
from tests._shared import shared_path

T0 = datetime(2026, 1, 11, 17, 0, tzinfo=UTC).timestamp()


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def small_trace() -> Trace:
    """Samples at 0, 60, 120 s with 10, 20, 30 g/kWh; the last covers [120, 180)."""
    return Trace(np.array([0.0, 60.0, 120.0]), {"A": np.array([10.0, 20.0, 30.0])}, 60.0, "hand-made")


# --- Trace ----------------------------------------------------------------------------------------


def test_trace_basic_properties():
    trace = small_trace()
    assert trace.regions == ["A"]
    assert trace.start == 0.0
    assert trace.end == 180.0
    assert trace.series("A").tolist() == [10.0, 20.0, 30.0]


def test_trace_arrays_are_read_only():
    trace = small_trace()
    with pytest.raises(ValueError):
        trace.series("A")[0] = 1.0
    with pytest.raises(ValueError):
        trace.times[0] = 1.0


def test_unknown_region_lists_the_regions():
    trace = Trace(np.array([0.0]), {"A": np.array([1.0]), "B": np.array([2.0])}, 3600.0, "x.csv")
    with pytest.raises(TraceError, match=r"region 'C' is not in x\.csv; it has: A, B"):
        trace.series("C")
    with pytest.raises(TraceError, match="region 'C'"):
        trace.intensity("C", 0.0)


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (-100.0, 10.0),
        (0.0, 10.0),
        (59.999, 10.0),
        (60.0, 20.0),
        (119.0, 20.0),
        (120.0, 30.0),
        (179.0, 30.0),
        (180.0, 30.0),
        (1e9, 30.0),
    ],
)
def test_intensity_holds_last_value_and_clamps(t, expected):
    assert small_trace().intensity("A", t) == expected


@pytest.mark.parametrize(
    ("t0", "t1", "expected"),
    [
        (0.0, 180.0, 10 * 60 + 20 * 60 + 30 * 60),
        (30.0, 90.0, 10 * 30 + 20 * 30),
        (60.0, 120.0, 20 * 60),
        (61.5, 62.0, 20 * 0.5),
        (-60.0, 0.0, 10 * 60),  # before the trace: first value holds
        (180.0, 240.0, 30 * 60),  # after the trace: last value holds
        (-30.0, 200.0, 10 * 90 + 20 * 60 + 30 * 80),
        (50.0, 50.0, 0.0),
        (90.0, 30.0, -(10 * 30 + 20 * 30)),  # signed
    ],
)
def test_integral_is_exact(t0, t1, expected):
    assert small_trace().integral("A", t0, t1) == pytest.approx(expected, rel=1e-15, abs=1e-12)


def test_integral_is_additive():
    trace = builtin_trace(hours=2.0)
    a, b, c = trace.start + 17.3, trace.start + 1234.5, trace.end - 1.0
    total = trace.integral("SPP_TX", a, c)
    assert trace.integral("SPP_TX", a, b) + trace.integral("SPP_TX", b, c) == pytest.approx(total, rel=1e-12)


def test_single_sample_trace_resolution():
    trace = Trace.from_columns(np.array([100.0]), {"A": np.array([5.0])}, "one")
    assert trace.resolution_s == 3600.0
    assert trace.end == 3700.0
    assert trace.integral("A", 100.0, 3700.0) == 5.0 * 3600


@pytest.mark.parametrize(
    ("times", "values", "match"),
    [
        ([], [], "at least one sample"),
        ([0.0, 0.0], [1.0, 1.0], "strictly increasing"),
        ([0.0, 60.0], [1.0], "has 1 values for 2 timestamps"),
        ([0.0, 60.0], [1.0, -1.0], "negative or non-finite"),
        ([0.0, 60.0], [1.0, np.nan], "negative or non-finite"),
    ],
)
def test_trace_rejects_bad_arrays(times, values, match):
    with pytest.raises(TraceError, match=match):
        Trace(np.array(times), {"A": np.array(values)}, 60.0, "bad")


# --- read_csv_trace: good files -------------------------------------------------------------------


def test_read_wide_csv_with_offsets(tmp_path):
    path = write(
        tmp_path,
        "point_time,CAISO_NORTH,SPP_TX\n"
        "2026-01-11 17:00:00+00:00,463.5,617.7\n"
        "2026-01-11 17:05:00+00:00,68.9,631.8\n"
        "2026-01-11T17:10:00Z,70,600\n"
        "2026-01-11T09:15:00-08:00,71.5,0\n"
        "\n",
    )
    trace = read_csv_trace(path)
    assert trace.regions == ["CAISO_NORTH", "SPP_TX"]
    assert trace.source == str(path)
    assert trace.times.tolist() == [T0, T0 + 300, T0 + 600, T0 + 900]
    assert trace.resolution_s == 300.0
    assert trace.end == T0 + 1200
    assert trace.series("CAISO_NORTH").tolist() == [463.5, 68.9, 70.0, 71.5]
    assert trace.series("SPP_TX").tolist() == [617.7, 631.8, 600.0, 0.0]


def test_read_naive_timestamps_with_timezone(tmp_path):
    path = write(tmp_path, "Datetime,DE\n2026-01-11 18:00:00,721.1\n2026-01-11 19:00:00,720.7\n")
    trace = read_csv_trace(path, tz="Europe/Berlin")
    assert trace.start == T0
    assert trace.resolution_s == 3600.0


def test_read_handles_bom_and_crlf(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufefftime , A \r\n2026-01-11T17:00:00Z, 5 \r\n".encode())
    trace = read_csv_trace(path)
    assert trace.regions == ["A"]
    assert trace.series("A").tolist() == [5.0]
    assert trace.resolution_s == 3600.0


def test_explicit_max_gap_allows_longer_gaps(tmp_path):
    path = write(
        tmp_path,
        "t,A\n2026-01-11T17:00:00Z,1\n2026-01-11T17:05:00Z,1\n2026-01-11T17:10:00Z,1\n2026-01-11T18:00:00Z,1\n",
    )
    with pytest.raises(TraceError):
        read_csv_trace(path)
    assert len(read_csv_trace(path, max_gap_s=3600).times) == 4


# --- read_csv_trace: errors name file and line ----------------------------------------------------

GOOD_ROW = "2026-01-11T17:00:00Z,1,2\n"


@pytest.mark.parametrize(
    ("body", "line", "match"),
    [
        ("t,A,B\nyesterday,1,2\n", 2, "cannot parse timestamp 'yesterday'"),
        (
            "t,A,B\n2026-01-11 17:00:00,1,2\n",
            2,
            r"naive timestamp '2026-01-11 17:00:00'; pass a timezone \(--tz\)",
        ),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,1,abc\n", 3, "non-numeric value 'abc' in column 'B'"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,nan,2\n", 3, "'nan' in column 'A' is not a finite"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,inf,2\n", 3, "column 'A' is not a finite"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,1,-3\n", 3, "negative value -3 in column 'B'"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,,2\n", 3, "empty value in column 'A'"),
        ("t,A,B\n" + GOOD_ROW + GOOD_ROW, 3, r"duplicate timestamp .*previous sample on line 2"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T16:55:00Z,1,2\n", 3, "non-increasing timestamp"),
        ("t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,1\n", 3, "expected 3 columns, found 2"),
        (
            "t,A,B\n" + GOOD_ROW + "2026-01-11T17:05:00Z,1,2\n2026-01-11T17:10:00Z,1,2\n"
            "2026-01-11T17:30:00Z,1,2\n",
            5,
            r"gap of 1200 s since the previous sample \(line 4\); at most 900 s",
        ),
        ("", 1, "empty file"),
        ("\n\n", 1, "empty file"),
        ("t,A,B\n", 1, "no data rows"),
        ("time\n" + "2026-01-11T17:00:00Z\n", 1, "at least one region column"),
        ("t,A,A\n" + GOOD_ROW, 1, "region column 'A' appears twice"),
        ("t,A,\n" + GOOD_ROW, 1, "empty name"),
    ],
)
def test_reader_errors_name_file_and_line(tmp_path, body, line, match):
    path = write(tmp_path, body)
    with pytest.raises(TraceError, match=match) as info:
        read_csv_trace(path)
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.csv"
    with pytest.raises(TraceError, match="no such trace file") as info:
        read_csv_trace(path)
    assert str(path) in str(info.value)


def test_unknown_timezone(tmp_path):
    path = write(tmp_path, "t,A\n2026-01-11 17:00:00,1\n")
    with pytest.raises(TraceError, match="unknown timezone 'Mars/Olympus'"):
        read_csv_trace(path, tz="Mars/Olympus")


# --- resampling -----------------------------------------------------------------------------------


def test_resampled_linear_interpolates_and_holds_the_last_sample():
    grid = small_trace().resampled(30.0)
    assert grid.times.tolist() == [0.0, 30.0, 60.0, 90.0, 120.0, 150.0]
    assert grid.series("A").tolist() == [10.0, 15.0, 20.0, 25.0, 30.0, 30.0]
    assert grid.resolution_s == 30.0
    assert grid.end == 180.0
    assert grid.source == "hand-made (linear, 30 s grid)"
    # Still hold-last between grid points: the integral is the sum of grid values x step.
    assert grid.integral("A", 0.0, 180.0) == pytest.approx(30.0 * (10 + 15 + 20 + 25 + 30 + 30))
    assert grid.intensity("A", 44.0) == 15.0


def test_resampled_hold_keeps_the_step_function():
    trace = small_trace()
    grid = trace.resampled(30.0, "hold")
    assert grid.series("A").tolist() == [10.0, 10.0, 20.0, 20.0, 30.0, 30.0]
    assert grid.integral("A", 0.0, 180.0) == trace.integral("A", 0.0, 180.0)
    assert "hold" in grid.source


def test_resampled_grid_covers_the_span_without_an_extra_point():
    trace = small_trace()
    assert len(trace.resampled(60.0).times) == 3  # 180 s / 60 s exactly: no fourth point at the end
    uneven = trace.resampled(50.0, "hold")
    assert uneven.times.tolist() == [0.0, 50.0, 100.0, 150.0]  # < end (180); the new end is 200
    assert uneven.end == 200.0
    many = Trace(np.arange(217) * 300.0, {"A": np.ones(217)}, 300.0, "x")
    assert len(many.resampled(60.0).times) == 217 * 5


def test_resampled_keeps_regions_and_a_single_sample():
    two = Trace(
        np.array([0.0, 100.0]), {"B": np.array([0.0, 100.0]), "A": np.array([4.0, 4.0])}, 100.0, "two"
    )
    grid = two.resampled(25.0)
    assert grid.regions == ["B", "A"]
    assert grid.series("B").tolist() == [0.0, 25.0, 50.0, 75.0, 100.0, 100.0, 100.0, 100.0]
    one = Trace(np.array([0.0]), {"A": np.array([7.0])}, 3600.0, "one").resampled(900.0)
    assert one.series("A").tolist() == [7.0] * 4


@pytest.mark.parametrize("step", [0, -60.0, float("nan"), float("inf"), "soon"])
def test_resampled_rejects_bad_steps(step):
    with pytest.raises(TraceError, match=r"hand-made: resampling step must be a .*number of seconds"):
        small_trace().resampled(step)


def test_resampled_rejects_unknown_method():
    with pytest.raises(TraceError, match="unknown resampling method 'cubic'; choices: hold, linear"):
        small_trace().resampled(30.0, "cubic")


# --- load_trace -----------------------------------------------------------------------------------


def test_load_trace_dispatch(tmp_path):
    assert load_trace("builtin").source == "builtin:anchor3"
    assert load_trace("builtin:anchor3").source == "builtin:anchor3"
    with pytest.raises(TraceError, match="no builtin trace 'nope'; available: anchor3"):
        load_trace("builtin:nope")
    path = write(tmp_path, "t,A\n2026-01-11 17:00:00,1\n")
    assert load_trace(str(path), tz="UTC").start == T0


def test_load_trace_interpolation(tmp_path):
    path = write(tmp_path, "t,A\n2026-01-11T17:00:00Z,10\n2026-01-11T17:05:00Z,40\n")
    held = load_trace(str(path))
    assert held.times.tolist() == [T0, T0 + 300]  # the default: the file as published
    assert load_trace(str(path), interpolate="hold", grid_s=1.0).series("A").tolist() == [10.0, 40.0]
    linear = load_trace(str(path), interpolate="linear", grid_s=100.0)
    assert linear.series("A").tolist() == [10.0, 20.0, 30.0, 40.0, 40.0, 40.0]
    assert linear.resolution_s == 100.0 and linear.end == held.end
    assert len(load_trace(str(path), interpolate="Linear").times) == 10  # 60 s grid by default
    builtin = load_trace("builtin", interpolate="linear")
    assert builtin.resolution_s == 60.0 and builtin.regions == load_trace("builtin").regions


def test_load_trace_interpolation_errors(tmp_path):
    path = write(tmp_path, "t,A\n2026-01-11T17:00:00Z,10\n")
    with pytest.raises(TraceError, match=r"trace\.csv: unknown interpolation 'cubic'; choices: hold, linear"):
        load_trace(str(path), interpolate="cubic")
    with pytest.raises(TraceError, match="grid_s must be a finite number of seconds > 0, got 0"):
        load_trace(str(path), interpolate="linear", grid_s=0)
    with pytest.raises(TraceError, match="builtin: unknown interpolation 'spline'"):
        load_trace("builtin", interpolate="spline")
    # Options are checked before the file is read, so a bad one wins over a missing file.
    with pytest.raises(TraceError, match="grid_s"):
        load_trace(str(tmp_path / "nope.csv"), grid_s=float("nan"))


# --- builtin model --------------------------------------------------------------------------------


def test_builtin_shape_and_ranges():
    trace = builtin_trace()
    assert trace.regions == ["CAISO_NORTH", "SPP_TX", "NEM_SA"]
    assert len(trace.times) == 216
    assert trace.resolution_s == 300.0
    assert trace.start == T0
    assert trace.end - trace.start == 18 * 3600
    for region, (low, high) in {"CAISO_NORTH": (30, 500), "SPP_TX": (0, 700), "NEM_SA": (0, 1000)}.items():
        series = trace.series(region)
        assert low <= series.min() and series.max() <= high
    assert set(BUILTIN_TRACES) == {"anchor3"}


def test_builtin_is_deterministic_per_seed():
    a, b, c = builtin_trace(seed=3), builtin_trace(seed=3), builtin_trace(seed=4)
    for region in a.regions:
        np.testing.assert_array_equal(a.series(region), b.series(region))
        assert not np.array_equal(a.series(region), c.series(region))


def test_builtin_parameters():
    trace = builtin_trace(start="2026-06-01T00:00:00+02:00", hours=1.0, step_s=60.0)
    assert len(trace.times) == 60
    assert trace.start == datetime(2026, 5, 31, 22, tzinfo=UTC).timestamp()
    with pytest.raises(TraceError, match="has no UTC offset"):
        builtin_trace(start="2026-06-01T00:00:00")
    with pytest.raises(TraceError, match="step_s must be > 0"):
        builtin_trace(step_s=0)
    with pytest.raises(TraceError, match="no builtin trace"):
        builtin_trace("nope")


# --- the anchor's real trace ----------------------------------------------------------------------


@pytest.mark.shared
def test_read_anchor_trace():
    trace = read_csv_trace(shared_path("traces/curtail-llm/mci.csv"))
    assert trace.regions == ["CAISO_NORTH", "SPP_TX", "NEM_SA", "DE"]
    assert len(trace.times) == 217
    assert trace.resolution_s == 300.0
    assert trace.start == T0
    assert trace.end == T0 + 217 * 300
    assert trace.series("CAISO_NORTH")[0] == pytest.approx(463.571024)


@pytest.mark.shared
def test_anchor_baseline_is_the_same_with_both_interpolations():
    """The anchor integrated intensity interpolated linearly onto a 60 s grid; greenswarm holds the
    published 5-minute steps. Over the anchor's 17.78 h both give its 11.40 kg for CAISO_NORTH."""
    path = str(shared_path("traces/curtail-llm/mci.csv"))
    for interpolate in ("hold", "linear"):
        trace = load_trace(path, interpolate=interpolate)
        grams = 2.024 / 3600 * trace.integral("CAISO_NORTH", trace.start, trace.start + 17.78 * 3600)
        assert grams / 1000 == pytest.approx(11.40, abs=0.005), interpolate
    linear = load_trace(path, interpolate="linear")
    assert len(linear.times) == 217 * 5 and linear.resolution_s == 60.0
    assert linear.series("CAISO_NORTH")[1] == pytest.approx(463.571024 + (68.945984 - 463.571024) / 5)
