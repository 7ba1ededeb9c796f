"""One file per zone, merged into one multi-region trace: common span, finest resolution, the step
function each file publishes; and the errors for files that cannot be merged."""

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
from greenswarm.traces import load_trace
from tests._shared import shared_path

EM_HEADER = (
    "Datetime (UTC),Country,Zone Name,Zone Id,Carbon Intensity gCO₂eq/kWh (direct),"
    "Carbon Intensity gCO₂eq/kWh (LCA),Low Carbon Percentage,Renewable Percentage,Data Source,"
    "Data Estimated,Data Estimation Method\n"
)
T0 = datetime(2023, 1, 1)


def em_file(path: Path, zone: str, first_h: float, samples: int, step_min: int = 60, base: int = 100) -> Path:
    """An Electricity Maps export for ``zone``: ``samples`` rows every ``step_min`` minutes from hour
    ``first_h`` of 2023-01-01, value ``base + i``."""
    rows = []
    for i in range(samples):
        t = T0 + timedelta(hours=first_h, minutes=i * step_min)
        rows.append(f"{t:%Y-%m-%d %H:%M:%S},X,X,{zone},{base + i},{base + i + 50},80,70,src,false,\n")
    path.write_text(EM_HEADER + "".join(rows), encoding="utf-8")
    return path


def utc(hours: float) -> float:
    return (T0 + timedelta(hours=hours)).replace(tzinfo=UTC).timestamp()


def test_files_on_the_same_hours_merge_without_resampling(tmp_path: Path) -> None:
    a = em_file(tmp_path / "GB.csv", "GB", 0, 24, base=100)
    b = em_file(tmp_path / "DE.csv", "DE", 0, 24, base=300)
    merged = load_trace([str(a), str(b)])
    assert merged.regions == ["GB", "DE"]
    assert np.array_equal(merged.times, load_trace(str(a)).times)
    assert merged.series("GB").tolist() == list(range(100, 124))
    assert merged.series("DE").tolist() == list(range(300, 324))
    assert merged.resolution_s == 3600.0


def test_merge_takes_the_common_span_at_the_finest_resolution(tmp_path: Path) -> None:
    gb = em_file(tmp_path / "GB.csv", "GB", 0, 24)  # hourly, hours 0-24
    de = em_file(tmp_path / "DE.csv", "DE", 6, 48, step_min=30, base=500)  # half-hourly, hours 6-30
    merged = load_trace([str(gb), str(de)])
    assert merged.start == utc(6) and merged.end == utc(24)
    assert merged.resolution_s == 1800.0
    assert len(merged.times) == 36  # 18 h of half hours
    # each region is the step function its file publishes, read at every grid instant
    for t in merged.times[::7]:
        for region, source in (("GB", gb), ("DE", de)):
            assert merged.intensity(region, t) == load_trace(str(source)).intensity(region, t)
    assert merged.series("GB")[:3].tolist() == [106, 106, 107]  # GB's 06:00 value holds to 07:00


def test_traces_that_share_no_instant_say_what_each_covers(tmp_path: Path) -> None:
    gb = em_file(tmp_path / "GB.csv", "GB", 0, 24)
    de = em_file(tmp_path / "DE.csv", "DE", 24, 24)  # starts where GB ends
    with pytest.raises(TraceError, match="share no instant") as info:
        load_trace([str(gb), str(de)])
    message = str(info.value)
    assert f"{gb} covers 2023-01-01T00:00:00Z to 2023-01-02T00:00:00Z" in message
    assert f"{de} covers 2023-01-02T00:00:00Z to 2023-01-03T00:00:00Z" in message


def test_a_region_in_two_files_is_refused(tmp_path: Path) -> None:
    one = em_file(tmp_path / "GB-a.csv", "GB", 0, 24)
    two = em_file(tmp_path / "GB-b.csv", "GB", 0, 24)
    with pytest.raises(TraceError, match=f"region 'GB' is in both {one} and {two}"):
        load_trace([str(one), str(two)])


def test_a_directory_merges_its_trace_files_plain_and_compressed(tmp_path: Path) -> None:
    em_file(tmp_path / "GB.csv", "GB", 0, 24)
    packed = em_file(tmp_path / "DE.tmp", "DE", 0, 24, base=300)
    (tmp_path / "DE.csv.gz").write_bytes(gzip.compress(packed.read_bytes()))
    packed.unlink()
    (tmp_path / "README.md").write_text("not a trace")
    merged = load_trace(str(tmp_path))
    assert merged.regions == ["DE", "GB"]  # name order
    assert merged.series("DE")[0] == 300


def test_a_directory_without_traces_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(TraceError, match="a directory of traces, but no .csv"):
        load_trace(str(tmp_path))


@pytest.mark.shared
def test_simulate_merges_three_electricitymaps_exports() -> None:
    """``greenswarm simulate --trace GB.csv --trace DE-LU.csv --trace US-CAL-CISO.csv``: one site per zone."""
    folder = "traces/electricitymaps-2023"
    files = [shared_path(f"{folder}/{n}_2023_hourly.csv") for n in ("GB", "DE-LU", "US-CAL-CISO")]
    traces = [arg for f in files for arg in ("--trace", str(f))]
    command = ["simulate", *traces, "--regions", "GB,DE,US-CAL-CISO", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "greenswarm", *command], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(site["region"] for site in report["sites"]) == ["DE", "GB", "US-CAL-CISO"]
    merged = load_trace([str(f) for f in files])
    assert len(merged.times) == 8760 and merged.resolution_s == 3600.0
    for f, region in zip(files, ("GB", "DE", "US-CAL-CISO"), strict=True):
        assert np.array_equal(merged.series(region), load_trace(str(f)).series(region))
