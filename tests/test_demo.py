"""``greenswarm demo`` end to end: built-in trace (offline, no ../shared) and the anchor's real trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._shared import shared_path

pytestmark = pytest.mark.swarm


def _demo(tmp_path: Path, *args: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "greenswarm",
            "demo",
            "--minutes",
            "1",
            "--json",
            "--workdir",
            str(tmp_path / "demo"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _check(report: dict, regions: list[str]) -> None:
    assert [s["region"] for s in report["sites"]] == regions
    for site in report["sites"]:
        assert site["tokens"] > 0 and site["loss"] < 5.0, site
        assert site["energy_kwh"] > 0 and site["emissions_g"] > 0, site
    assert report["total"]["federated_rounds"] >= 2, report["total"]
    # training only in windows emits less than the same site training around the clock
    for site in report["sites"]:
        assert site["emissions_g"] < report["baseline_continuous_g"][site["region"]], site


def test_demo_on_the_builtin_trace(tmp_path: Path) -> None:
    report = _demo(tmp_path)
    _check(report, ["CAISO_NORTH", "SPP_TX", "NEM_SA"])
    assert report["trace"] == "builtin:anchor3"


@pytest.mark.shared
def test_demo_on_the_curtail_llm_trace(tmp_path: Path) -> None:
    trace = shared_path("traces/curtail-llm/mci.csv")
    report = _demo(
        tmp_path, "--trace", str(trace), "--regions", "CAISO_NORTH,SPP_TX,NEM_SA", "--threshold", "100"
    )
    _check(report, ["CAISO_NORTH", "SPP_TX", "NEM_SA"])
    # windows at 100 gCO2/kWh: 73, 82 and 126 of the 217 five-minute samples
    shares = {s["region"]: s["share_in_window"] for s in report["sites"]}
    assert shares == pytest.approx({"CAISO_NORTH": 73 / 217, "SPP_TX": 82 / 217, "NEM_SA": 126 / 217})
