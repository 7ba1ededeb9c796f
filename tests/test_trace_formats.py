"""Trace formats: WattTime (wide and long), Electricity Maps, Vessim-style and generic CSVs, options
(tz, units, variant, start) and their errors, plus the real exports under ../shared."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import TraceError
from greenswarm.traces import load_trace, read_csv_trace
from tests._shared import shared_path

T0 = datetime(2023, 1, 1, tzinfo=UTC).timestamp()

EM_HEADER = (
    "Datetime (UTC),Country,Zone Name,Zone Id,Carbon Intensity gCO₂eq/kWh (direct),"
    "Carbon Intensity gCO₂eq/kWh (LCA),Low Carbon Percentage,Renewable Percentage,Data Source,"
    "Data Estimated,Data Estimation Method\n"
)


def em_row(hour: int, direct: str = "100", lca: str = "150", zone: str = "DE") -> str:
    return f"2023-01-01 {hour:02d}:00:00,Germany,Germany,{zone},{direct},{lca},80,70,entsoe.eu,false,\n"


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def fails(path: Path, line: int, match: str, **options) -> None:
    with pytest.raises(TraceError, match=match) as info:
        read_csv_trace(path, **options)
    assert str(info.value).startswith(f"{path}:{line}: ")


# --- Electricity Maps -----------------------------------------------------------------------------


def test_electricitymaps_direct_by_default(tmp_path):
    path = write(tmp_path, EM_HEADER + em_row(0, "140.5", "185.8") + em_row(1, "140.4", "185.7"))
    trace = load_trace(str(path))  # naive, but the header says UTC: no tz needed
    assert trace.regions == ["DE"]
    assert trace.times.tolist() == [T0, T0 + 3600]
    assert trace.series("DE").tolist() == [140.5, 140.4]
    assert trace.resolution_s == 3600.0


@pytest.mark.parametrize("variant", ["lca", "LCA"])
def test_electricitymaps_lca_variant(tmp_path, variant):
    path = write(tmp_path, EM_HEADER + em_row(0, "1", "185.8") + em_row(1, "1", "185.7"))
    assert read_csv_trace(path, variant=variant).series("DE").tolist() == [185.8, 185.7]


def test_electricitymaps_life_cycle_header_and_case(tmp_path):
    header = (
        "datetime (utc),country,zone name,ZONE ID,carbon intensity gCO2eq/kWh (Direct),"
        "carbon intensity gCO₂eq/kWh (Life cycle)\n"
    )
    path = write(tmp_path, header + "2023-01-01T00:00:00,USA,CAISO,US-CAL-CISO,10,20\n")
    assert read_csv_trace(path).series("US-CAL-CISO").tolist() == [10.0]
    assert read_csv_trace(path, variant="lca").series("US-CAL-CISO").tolist() == [20.0]


def test_electricitymaps_header_utc_wins_over_tz(tmp_path):
    path = write(tmp_path, EM_HEADER + em_row(0))
    assert read_csv_trace(path, tz="Europe/Berlin").start == T0


def test_electricitymaps_several_zones(tmp_path):
    body = EM_HEADER + em_row(0, "1", zone="DE") + em_row(0, "2", zone="FR") + em_row(1, "3", zone="DE")
    body += em_row(1, "4", zone="FR")
    trace = read_csv_trace(path := write(tmp_path, body))
    assert trace.regions == ["DE", "FR"]
    assert trace.series("FR").tolist() == [2.0, 4.0]
    with pytest.raises(TraceError, match=rf"region 'XX' is not in {path}; it has: DE, FR"):
        trace.series("XX")


def test_electricitymaps_missing_variant_column(tmp_path):
    header = "Datetime (UTC),Zone Id,Carbon Intensity gCO₂eq/kWh (direct)\n"
    path = write(tmp_path, header + "2023-01-01 00:00:00,DE,1\n")
    fails(
        path,
        1,
        r"no 'lca' carbon-intensity column; it has: 'Carbon Intensity gCO₂eq/kWh \(direct\)'",
        variant="lca",
    )


@pytest.mark.parametrize(
    ("rows", "line", "match"),
    [
        (
            em_row(0) + em_row(0),
            3,
            r"duplicate timestamp '2023-01-01 00:00:00' for region 'DE' \(previous sample on line 2\)",
        ),
        (em_row(1) + em_row(0), 3, "non-increasing timestamp .* for region 'DE'"),
        (em_row(0) + em_row(1, direct=""), 3, "empty value in column 'Carbon Intensity"),
        (em_row(0) + em_row(1, direct="nan"), 3, "is not a finite number"),
        (em_row(0) + em_row(1, direct="-1"), 3, "negative value -1"),
        (
            em_row(0) + em_row(1) + em_row(2) + em_row(9),
            5,
            r"gap of 25200 s since the previous sample \(line 4\)",
        ),
        (em_row(0, zone=""), 2, "empty region in column 'Zone Id'"),
        (em_row(0) + "2023-01-01 01:00:00,Germany\n", 3, "expected 11 columns, found 2"),
    ],
)
def test_electricitymaps_errors(tmp_path, rows, line, match):
    fails(write(tmp_path, EM_HEADER + rows), line, match)


# --- WattTime -------------------------------------------------------------------------------------


def test_watttime_wide_in_lbs_per_mwh(tmp_path):
    path = write(
        tmp_path,
        "point_time,CAISO_NORTH,SPP_TX\n2023-01-01T00:00:00+00:00,1000,0\n2023-01-01T00:05:00Z,500,2\n",
    )
    trace = load_trace(str(path), units="lbs/MWh")
    assert trace.series("CAISO_NORTH").tolist() == pytest.approx([453.592, 226.796])
    assert trace.series("SPP_TX").tolist() == pytest.approx([0.0, 0.907184])
    assert trace.resolution_s == 300.0


def test_watttime_long_format_ignores_extra_columns(tmp_path):
    path = write(
        tmp_path,
        "point_time,value,frequency,market,version,region\n"
        "2023-01-01T00:00:00+00:00,1000,300,RTM,3.2,CAISO_NORTH\n"
        "2023-01-01T00:00:00+00:00,800,300,RTM,3.2,SPP_TX\n"
        "2023-01-01T00:05:00+00:00,900,300,RTM,3.2,CAISO_NORTH\n"
        "2023-01-01T00:05:00+00:00,700,300,RTM,3.2,SPP_TX\n",
    )
    trace = read_csv_trace(path, units="lbs/MWh")
    assert trace.regions == ["CAISO_NORTH", "SPP_TX"]
    assert trace.times.tolist() == [T0, T0 + 300]
    np.testing.assert_allclose(trace.series("SPP_TX"), [800 * 0.453592, 700 * 0.453592])


def test_watttime_v2_long_with_ba_column(tmp_path):
    path = write(tmp_path, "timestamp,MOER,ba\n2023-01-01T00:00:00Z,1,CAISO\n2023-01-01T01:00:00Z,2,CAISO\n")
    trace = read_csv_trace(path)
    assert trace.regions == ["CAISO"]
    assert trace.series("CAISO").tolist() == [1.0, 2.0]


# --- generic and Vessim-style CSVs ----------------------------------------------------------------


def test_generic_long_csv(tmp_path):
    path = write(
        tmp_path,
        "timestamp,region,value\n2023-01-01 00:00,A,1\n2023-01-01 00:00,B,2\n"
        "2023-01-01 01:00,A,3\n2023-01-01 01:00,B,4\n",
    )
    trace = read_csv_trace(path, tz="UTC")
    assert trace.regions == ["A", "B"]
    assert trace.series("A").tolist() == [1.0, 3.0]
    assert trace.series("B").tolist() == [2.0, 4.0]


def test_long_columns_in_any_order(tmp_path):
    path = write(tmp_path, "Region,Value,Time_UTC\nA,1,2023-01-01 00:00\nA,2,2023-01-01 01:00\n")
    trace = read_csv_trace(path)  # the time header says UTC
    assert trace.start == T0
    assert trace.series("A").tolist() == [1.0, 2.0]


def test_generic_wide_csv_kg_per_kwh(tmp_path):
    path = write(tmp_path, "timestamp,A,B\n2023-01-01T00:00:00Z,0.5,0.25\n")
    assert read_csv_trace(path, units="kg/kWh").series("A").tolist() == [500.0]


def test_vessim_naive_timestamps_need_tz(tmp_path):
    path = write(tmp_path, "oootime,Caiso_North\n2023-01-01 00:00:00,425.0\n2023-01-01 00:05:00,432.2\n")
    fails(path, 2, r"naive timestamp '2023-01-01 00:00:00'; pass a timezone \(--tz\)")
    trace = load_trace(str(path), tz="UTC")
    assert trace.regions == ["Caiso_North"]
    assert trace.start == T0


@pytest.mark.parametrize("start", ["2023-01-01T00:00:00Z", T0, str(T0)])
def test_offset_seconds_with_start(tmp_path, start):
    path = write(tmp_path, "time,A\n0,1\n300,2\n600.0,3\n")
    trace = read_csv_trace(path, start=start)
    assert trace.times.tolist() == [T0, T0 + 300, T0 + 600]
    assert trace.series("A").tolist() == [1.0, 2.0, 3.0]


def test_offset_seconds_naive_start_uses_tz(tmp_path):
    path = write(tmp_path, "time,A\n0,1\n")
    assert read_csv_trace(path, tz="UTC", start="2023-01-01 00:00").start == T0
    with pytest.raises(TraceError, match=r"start: naive timestamp '2023-01-01 00:00'; pass a timezone"):
        read_csv_trace(path, start="2023-01-01 00:00")


def test_offset_seconds_without_start(tmp_path):
    fails(
        write(tmp_path, "time,A\n0,1\n"),
        2,
        r"time '0' is an offset in seconds; pass the start instant \(start=...\)",
    )


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "line", "match"),
    [
        (
            "timestamp,region,value\n2023-01-01T00:00Z,A,1\n2023-01-01T00:00Z,A,2\n",
            3,
            "duplicate timestamp .* for region 'A'",
        ),
        (
            "timestamp,region,value\n2023-01-01T01:00Z,A,1\n2023-01-01T00:00Z,A,2\n",
            3,
            "non-increasing timestamp .* for region 'A'",
        ),
        (
            "timestamp,region,value\n2023-01-01T00:00Z,A,nan\n",
            2,
            "'nan' in column 'value' is not a finite number",
        ),
        ("timestamp,region,value\n2023-01-01T00:00Z,A,-2\n", 2, "negative value -2 in column 'value'"),
        ("timestamp,region,value\n2023-01-01T00:00Z,A,x\n", 2, "non-numeric value 'x' in column 'value'"),
        (
            "timestamp,region,value\n2023-01-01T00:00Z,A,1\n2023-01-01T00:00Z,B,1\n2023-01-01T01:00Z,A,1\n",
            3,
            "region 'B' is not sampled at the same times as region 'A'",
        ),
        (
            "timestamp,region,value\n2023-01-01T00:00Z,A,1\n2023-01-01T00:05Z,A,1\n2023-01-01T00:10Z,A,1\n"
            "2023-01-01T01:00Z,A,1\n",
            5,
            r"gap of 3000 s since the previous sample \(line 4\); at most 900 s allowed",
        ),
        ("timestamp,region,value\n", 1, "no data rows"),
    ],
)
def test_long_format_errors(tmp_path, body, line, match):
    fails(write(tmp_path, body), line, match)


def test_unknown_units_names_value_and_known_ones(tmp_path):
    path = write(tmp_path, "t,A\n2023-01-01T00:00:00Z,1\n")
    with pytest.raises(
        TraceError, match=r"unknown units 'lb/MWh'; known units: g/kWh, kg/kWh, lbs/MWh"
    ) as info:
        load_trace(str(path), units="lb/MWh")
    assert str(path) in str(info.value)


def test_unknown_variant_and_variant_on_other_formats(tmp_path):
    path = write(tmp_path, "t,A\n2023-01-01T00:00:00Z,1\n")
    with pytest.raises(TraceError, match="unknown variant 'marginal'; known variants: direct, lca"):
        read_csv_trace(path, variant="marginal")
    fails(path, 1, "variant 'lca' applies only to Electricity Maps exports", variant="lca")


def test_units_are_case_insensitive(tmp_path):
    path = write(tmp_path, "t,A\n2023-01-01T00:00:00Z,1\n")
    assert read_csv_trace(path, units="KG/kwh").series("A").tolist() == [1000.0]


# --- the real exports -----------------------------------------------------------------------------

EM_FILES = {
    "AU-NSW_2023_hourly.csv": "AU-NSW",
    "DE-LU_2023_hourly.csv": "DE",  # the DE-LU export's Zone Id column says DE
    "GB_2023_hourly.csv": "GB",
    "US-CAL-CISO_2023_hourly.csv": "US-CAL-CISO",
    "US-TEX-ERCO_2023_hourly.csv": "US-TEX-ERCO",
}


@pytest.mark.shared
@pytest.mark.parametrize(("filename", "zone"), sorted(EM_FILES.items()))
def test_real_electricitymaps_exports(filename, zone):
    path = shared_path(f"traces/electricitymaps-2023/{filename}")
    direct = load_trace(str(path))
    lca = load_trace(str(path), variant="lca")
    for trace in (direct, lca):
        assert trace.regions == [zone]
        assert len(trace.times) == 8760
        assert trace.resolution_s == 3600.0
        assert trace.start == T0
        assert trace.end == datetime(2024, 1, 1, tzinfo=UTC).timestamp()
    assert np.all(lca.series(zone) >= direct.series(zone))
    assert np.any(lca.series(zone) > direct.series(zone))


@pytest.mark.shared
def test_real_electricitymaps_values():
    trace = load_trace(str(shared_path("traces/electricitymaps-2023/US-CAL-CISO_2023_hourly.csv")))
    assert trace.series("US-CAL-CISO")[:2].tolist() == [238.69, 220.25]
    lca = load_trace(
        str(shared_path("traces/electricitymaps-2023/US-CAL-CISO_2023_hourly.csv")), variant="lca"
    )
    assert lca.series("US-CAL-CISO")[-1] == 321.33


@pytest.mark.shared
def test_real_vessim_trace_with_utc():
    path = shared_path("traces/vessim/watttime_example.csv")
    with pytest.raises(TraceError, match="naive timestamp"):
        load_trace(str(path))
    trace = load_trace(str(path), tz="UTC")
    assert trace.regions == ["Caiso_North"]
    assert len(trace.times) == 8928
    assert trace.resolution_s == 300.0
    assert trace.start == datetime(2023, 6, 8, tzinfo=UTC).timestamp()
    assert trace.series("Caiso_North")[0] == pytest.approx(425.01605069)


@pytest.mark.shared
def test_real_anchor_trace_loads_identically():
    path = shared_path("traces/curtail-llm/mci.csv")
    trace = load_trace(str(path))
    direct = read_csv_trace(path)
    assert trace.regions == direct.regions == ["CAISO_NORTH", "SPP_TX", "NEM_SA", "DE"]
    np.testing.assert_array_equal(trace.times, direct.times)
    for region in trace.regions:
        np.testing.assert_array_equal(trace.series(region), direct.series(region))
    assert len(trace.times) == 217
    assert trace.resolution_s == 300.0
    assert trace.start == datetime(2026, 1, 11, 17, tzinfo=UTC).timestamp()
    assert trace.series("CAISO_NORTH")[0] == 463.57102399999997
    assert trace.series("DE")[-1] == 728.6955479999999
