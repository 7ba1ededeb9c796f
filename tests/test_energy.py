"""Energy and emissions accounting against hand-made and real traces."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.scheduler import EnergyConfig, EnergyLedger, PowerModel, SiteState, baseline_emissions_g
from greenswarm.scheduler.energy import NvmlUnavailable, make_power_model, visible_gpu_indices
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
    assert ledger.seconds == {
        "IDLE": 1800.0,
        "SOLO": 1800.0,
        "FEDERATED": 3600.0,
        "RELEASED": 0.0,
        "RESTARTING": 0.0,
    }


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


# --- where the power comes from ----------------------------------------------------------------------


def _has_nvml_gpu() -> bool:
    """Whether this machine can measure a GPU through NVML (then "auto" measures, not configures)."""
    from greenswarm.scheduler.energy import NvmlPower

    try:
        NvmlPower()
    except NvmlUnavailable:
        return False
    return True


def test_config_source_is_the_configured_model():
    power = make_power_model(EnergyConfig(train_kw=2.5, idle_kw=0.25, source="config"))
    assert power == PowerModel(2.5, 0.25)
    assert power.kw(SiteState.SOLO) == 2.5 and power.kw(SiteState.IDLE) == 0.25


def test_auto_source_without_a_gpu_is_the_configured_model():
    if _has_nvml_gpu():
        pytest.skip("this machine has an NVML GPU, so auto measures it")
    power = make_power_model(EnergyConfig(train_kw=2.024, source="auto"))
    assert power.meter is None
    assert power.kw(SiteState.FEDERATED) == 2.024


def test_auto_source_for_a_cpu_site_never_measures():
    """A site training on the CPU of a GPU machine must not book the draw of GPUs it does not use."""
    assert make_power_model(EnergyConfig(train_kw=1.5), on_gpu=False).meter is None


def test_nvml_source_without_nvml_is_a_one_line_error():
    if _has_nvml_gpu():
        pytest.skip("this machine has an NVML GPU")
    with pytest.raises(ConfigError) as info:
        make_power_model(EnergyConfig(source="nvml"))
    message = str(info.value)
    assert isinstance(info.value, GreenswarmError)
    assert message.startswith("energy.source: ")
    assert "\n" not in message
    assert "nvidia-ml-py" in message or "NVML" in message
    assert "set energy.source to config" in message


def test_released_time_is_booked_at_the_released_draw_and_never_metered():
    """A released site has no process of its own reading a meter: its draw is ``released_kw``; its
    restart is booked at training power (or what the meter reads while the trainer starts)."""
    power = PowerModel(train_kw=2.0, idle_kw=0.5, meter=lambda: 3.0, released_kw=0.1)
    ledger = EnergyLedger(HOURLY, "R", power, start=0.0)
    ledger.advance(3600.0, SiteState.RELEASED)  # 0.1 kW x 1 h at 50 g/kWh
    ledger.advance(5400.0, SiteState.RESTARTING)  # metered 3 kW x 0.5 h at 200
    assert ledger.kwh["RELEASED"] == pytest.approx(0.1) and ledger.grams["RELEASED"] == pytest.approx(5.0)
    assert ledger.kwh["RESTARTING"] == pytest.approx(1.5)
    assert make_power_model(EnergyConfig(source="config", released_kw=0.2)).kw(SiteState.RELEASED) == 0.2


def test_make_power_model_validates_the_config():
    with pytest.raises(ConfigError, match=r"energy\.source: must be one of auto, config, nvml, got 'gpu'"):
        make_power_model(EnergyConfig(source="gpu"))


def test_a_meter_sets_the_draw_in_every_state():
    readings = iter([3.0, 0.4, 1.0])
    power = PowerModel(train_kw=2.0, idle_kw=0.5, meter=lambda: next(readings))
    ledger = EnergyLedger(HOURLY, "R", power, start=0.0)
    ledger.advance(3600.0, SiteState.SOLO)  # 3 kW x 1 h at 50 g/kWh
    ledger.advance(5400.0, SiteState.IDLE)  # idle: what the GPUs draw holding the model, 0.4 kW
    ledger.advance(7200.0, SiteState.FEDERATED)  # 1 kW x 0.5 h at 200 g/kWh
    assert ledger.energy_kwh == pytest.approx(3.0 + 0.2 + 0.5)
    assert ledger.emissions_g == pytest.approx(150.0 + 0.4 * 0.5 * 200.0 + 0.5 * 200.0)
    assert ledger.kwh == pytest.approx(
        {"SOLO": 3.0, "IDLE": 0.2, "FEDERATED": 0.5, "RELEASED": 0.0, "RESTARTING": 0.0}
    )
    configured = EnergyLedger(HOURLY, "R", PowerModel(train_kw=2.0, idle_kw=0.5), start=0.0)
    configured.advance(3600.0, SiteState.SOLO)
    assert configured.energy_kwh == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("env", "count", "expected"),
    [
        (None, 3, [0, 1, 2]),
        ("", 3, []),
        ("-1", 3, []),
        ("2,0", 3, [2, 0]),
        (" 1 , 1 ", 3, [1]),
        ("0,7,1", 3, [0]),  # CUDA stops at the first index out of range
        ("0", 0, []),
    ],
)
def test_visible_gpu_indices_follow_cuda_visible_devices(env, count, expected):
    assert visible_gpu_indices(env, count) == expected


def test_visible_gpu_indices_refuses_uuids():
    with pytest.raises(NvmlUnavailable, match="'GPU-1234' is not a GPU index"):
        visible_gpu_indices("GPU-1234", 2)
