"""Energy and emissions accounting against hand-made and real traces."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from greenswarm.scheduler import EnergyLedger, PowerModel, SiteState, baseline_emissions_g
from greenswarm.traces import Trace, read_csv_trace
from tests._shared import shared_path

# Hourly samples: 50 g/kWh for the first hour, 200 for the second, 10 for the third (to 10800 s).
HOURLY = Trace(np.array([0.0, 3600.0, 7200.0]), {"R": np.array([50.0, 200.0, 10.0])}, 3600.0, "hourly")


def test_power_model():
    power = PowerModel(train_kw=2.0, idle_kw=0.5)
    assert power.kw(SiteState.IDLE) == 0.5
    assert power.kw(SiteState.SOLO) == power.kw(SiteState.FEDERATED) == 2.0
    assert PowerModel(3.0).kw(SiteState.IDLE) == 0.0


def test_two_kw_for_one_hour_at_fifty():
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0), start=0.0)
    ledger.advance(3600.0, SiteState.SOLO)
    assert ledger.energy_kwh == pytest.approx(2.0)
    assert ledger.emissions_g == pytest.approx(100.0)
    assert ledger.t == 3600.0


def test_ledger_totals_across_states_and_samples():
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0, idle_kw=0.5), start=1800.0)
    ledger.advance(5400.0, SiteState.FEDERATED)  # half an hour at 50, half at 200, training
    ledger.advance(7200.0, SiteState.IDLE)  # half an hour at 200, idle
    ledger.advance(9000.0, SiteState.SOLO)  # half an hour at 10, training
    assert ledger.energy_kwh == pytest.approx(2.0 * 1.0 + 0.5 * 0.5 + 2.0 * 0.5)
    expected_g = 2.0 * (0.5 * 50 + 0.5 * 200) + 0.5 * 0.5 * 200 + 2.0 * 0.5 * 10
    assert ledger.emissions_g == pytest.approx(expected_g)
    assert ledger.seconds == {"IDLE": 1800.0, "SOLO": 1800.0, "FEDERATED": 3600.0}


def test_ledger_ignores_time_going_backwards():
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0), start=0.0)
    ledger.advance(3600.0, SiteState.SOLO)
    ledger.advance(1800.0, SiteState.SOLO)
    ledger.advance(3600.0, SiteState.SOLO)
    assert ledger.t == 3600.0 and ledger.energy_kwh == pytest.approx(2.0)
    assert ledger.seconds["SOLO"] == 3600.0


def test_ledger_is_independent_of_poll_interval():
    coarse = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.024), start=100.0)
    fine = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.024), start=100.0)
    coarse.advance(10_000.0, SiteState.SOLO)
    for t in np.linspace(100.0, 10_000.0, 997)[1:]:
        fine.advance(float(t), SiteState.SOLO)
    assert fine.emissions_g == pytest.approx(coarse.emissions_g, rel=1e-12)
    assert fine.energy_kwh == pytest.approx(coarse.energy_kwh, rel=1e-12)


def test_state_dict_round_trip():
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0, idle_kw=0.5), start=0.0)
    ledger.advance(4000.0, SiteState.SOLO)
    ledger.advance(5000.0, SiteState.IDLE)
    saved = json.loads(json.dumps(ledger.state_dict()))
    restored = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0, idle_kw=0.5), start=0.0)
    restored.load_state_dict(saved)
    assert restored.state_dict() == ledger.state_dict()
    for each in (ledger, restored):
        each.advance(8000.0, SiteState.FEDERATED)
    assert restored.state_dict() == ledger.state_dict()


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"t": 0.0, "energy_kwh": 0.0, "emissions_g": "x", "seconds": {}},
        {"t": 0.0, "energy_kwh": 0.0, "emissions_g": 0.0, "seconds": None},
    ],
)
def test_load_state_dict_rejects_malformed(bad):
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0), start=0.0)
    with pytest.raises(ValueError, match="malformed energy ledger state"):
        ledger.load_state_dict(bad)


def test_baseline():
    assert baseline_emissions_g(HOURLY, "R", 0.0, 10800.0, 1.0) == pytest.approx(50 + 200 + 10)
    ledger = EnergyLedger(HOURLY, "R", PowerModel(train_kw=3.0), start=900.0)
    ledger.advance(9999.0, SiteState.SOLO)
    assert ledger.emissions_g == pytest.approx(baseline_emissions_g(HOURLY, "R", 900.0, 9999.0, 3.0))


@pytest.mark.shared
def test_anchor_baseline_matches_sample_sum():
    path = shared_path("traces/curtail-llm/mci.csv")
    trace = read_csv_trace(path)
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 217
    for region in trace.regions:
        expected = sum(2.024 * 300 / 3600 * float(row[region]) for row in rows)
        got = baseline_emissions_g(trace, region, trace.start, trace.end, 2.024)
        assert got == pytest.approx(expected, rel=1e-12)
    # Continuous training over the whole 18 h trace (the paper's 17.8 h gives 11.41 kg, 27.07 kg).
    assert baseline_emissions_g(trace, "CAISO_NORTH", trace.start, trace.end, 2.024) / 1000 == pytest.approx(
        11.67, abs=0.01
    )
