"""``greenswarm simulate --policy greenswarm --calibrate RUN_DIR`` books what a real run of the node booked.

Two sites replay 8 hours of a two-region trace at 600x (windows that overlap for three hours, so
rounds are federated there and solo elsewhere), with the node's default power model: 2.024 kW while
training, 0.468 kW while IDLE with the model kept. The simulator, calibrated from their run
directories (power per state from the ledgers, the round pause from the round logs, how late each
node noticed its windows open and close from their histories), must book the swarm's emissions
within 1 % of the two ledgers together.

At 600x a node that finishes an inner step of 0.1 s after its window closed trains a minute of
clock time at the dirty grid's intensity, and on a loaded machine a round holds training up for
minutes of clock time: a simulator that reacted at its polls and idled through the pause was off by
4 % on a run beside two busy processes, this one by 0.1 % (docs/deadline.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from greenswarm.simulation.calibrate import calibrate
from greenswarm.simulation.policies import load_policy
from greenswarm.simulation.report import simulate
from greenswarm.traces import load_trace
from tests.conftest import Swarm, site_config, write_trace

pytestmark = [pytest.mark.deadline, pytest.mark.swarm]

REGIONS = {
    "A": [50.0, 50.0, 300.0, 300.0, 50.0, 50.0, 50.0, 300.0],
    "B": [300.0, 50.0, 50.0, 300.0, 300.0, 50.0, 50.0, 50.0],
}
SPEEDUP = 600.0


def test_the_calibrated_simulator_books_what_the_nodes_booked(swarm: Swarm, tmp_path: Path) -> None:
    trace_path = write_trace(tmp_path / "trace.csv", REGIONS, step_s=3600)
    start_file = tmp_path / "start"
    peers = swarm.bootstrap()
    runs = tmp_path / "runs"
    for region in REGIONS:
        name = f"site-{region.lower()}"
        cfg = site_config(
            name,
            region,
            trace_path,
            peers,
            runs / name,
            speedup=SPEEDUP,
            start_file=start_file,
            sync_s=1800.0,
        )
        swarm.node(name, swarm.write_config(name, cfg))
    swarm.start_replay([f"site-{r.lower()}" for r in REGIONS], start_file)
    for region in REGIONS:
        name = f"site-{region.lower()}"
        assert swarm.wait(name, timeout=8 * 3600 / SPEEDUP + 120) == 0, swarm.log(name)[-3000:]

    summaries = [json.loads((runs / f"site-{r.lower()}" / "summary.json").read_text()) for r in REGIONS]
    booked_kg = sum(s["emissions_g"] for s in summaries) / 1000.0
    assert all(s["seconds_by_state"]["IDLE"] > 0 and s["kwh_by_state"]["IDLE"] > 0 for s in summaries)

    measured = calibrate(runs)
    assert measured.sites == 2 and measured.federated_rounds > 0
    assert measured.train_kw == pytest.approx(2.024) and measured.idle_kw == pytest.approx(0.468)
    trace = load_trace(str(trace_path))
    sim = simulate(trace, list(REGIONS), measured.apply(load_policy("greenswarm")), start=trace.start).report
    assert measured.window_edges >= 6 and measured.leave_delay_s is not None  # (7 edges: see REGIONS)
    assert sim["emissions_kg"] == pytest.approx(booked_kg, rel=0.01), (sim["emissions_kg"], booked_kg)

    # and the command line says what it took from the run
    out = subprocess.run(
        [sys.executable, "-m", "greenswarm", "simulate", "--trace", str(trace_path), "--regions", "A,B",
         "--policy", "greenswarm", "--calibrate", str(runs), "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["calibrated"]["sites"] == 2 and report["calibrated"]["round_overhead_s"] is not None
    assert report["emissions_kg"] == pytest.approx(sim["emissions_kg"])
