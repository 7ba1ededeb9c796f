"""The curtail-llm anchor: reading its event and loss logs, accounting its run with greenswarm's ledger
(``greenswarm reproduce``), and simulating its trace against the numbers the paper published."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import TraceError
from greenswarm.simulation.anchor import (
    PUBLISHED,
    anchor_runs,
    infer_region,
    provisioned,
    read_events,
    read_training,
)
from greenswarm.simulation.policies import load_policy
from greenswarm.simulation.report import simulate
from greenswarm.simulation.reproduce import reproduce
from greenswarm.traces.readers import load_trace
from greenswarm.traces.trace import Trace
from tests._shared import shared_path

TIMEOUT_S = 120
T0 = 1767225600.0  # 2026-01-01T00:00:00Z
ANCHOR_REGIONS = ["CAISO_NORTH", "SPP_TX", "NEM_SA"]
MCI = "traces/curtail-llm/mci.csv"
EVENTS = "reference/curtail-llm/exp1_events.csv"

# --- small logs of a two-client run, written per test ----------------------------------------------------

EVENTS_CSV = """wall_time,elapsed_s,event_type,round,client,details
2026-01-01 00:00:00,0.0,EXPERIMENT_START,,,"client_0, client_1"
2026-01-01 00:00:00,0.0,PROVISION_DECISION,,client_0,mci=60.0
2026-01-01 00:00:00,0.0,PROVISION_START,,client_0,
2026-01-01 00:10:00,600.0,PROVISION_DECISION,,client_1,mci=502.0
2026-01-01 00:10:00,600.0,PROVISION_START,,client_1,
2026-01-01 01:00:00,3600.0,DEPROVISION,,client_0,
2026-01-01 01:30:00,5400.0,EXPERIMENT_END,,,
"""


def _loss_log(*stretches: tuple[int, int, int]) -> str:
    times = [t for a, b, step in stretches for t in range(a, b + 1, step)]
    return "time,step,loss,perplexity\n" + "".join(f"{t},{i},3.0,20.0\n" for i, t in enumerate(times))


CLIENT_0 = _loss_log((300, 1500, 10), (1700, 3000, 10))  # a 200 s pause between the stretches
CLIENT_1 = _loss_log((900, 5000, 20))


def _trace_csv() -> str:
    """3 h of 5-minute samples: A at 60, 61, ..., B at 500, 501, ... (every value tells its region)."""
    rows = [f"2026-01-01T{i * 5 // 60:02d}:{i * 5 % 60:02d}:00Z,{60 + i},{500 + i}" for i in range(36)]
    return "timestamp,A,B\n" + "\n".join(rows) + "\n"


@pytest.fixture
def logs(tmp_path: Path) -> dict[str, Path]:
    """The two-client run: events, both loss logs beside them, and the trace."""
    files = {
        "events": ("exp1_events.csv", EVENTS_CSV),
        "client_0": ("exp1_client_0.csv", CLIENT_0),
        "client_1": ("exp1_client_1.csv", CLIENT_1),
        "trace": ("trace.csv", _trace_csv()),
    }
    out = {}
    for key, (name, text) in files.items():
        out[key] = tmp_path / name
        out[key].write_text(text)
    return out


def rel(intervals: np.ndarray) -> list[list[float]]:
    return (np.asarray(intervals) - T0).tolist()


def test_anchor_runs_on_small_logs(logs: dict[str, Path]) -> None:
    """Clients train while their loss logs advance (split at pauses over gap_s), are idle for the rest
    of their provisioned time, a client never deprovisioned runs to the last event, and each region
    is read off the logged mci= value."""
    trace = load_trace(str(logs["trace"]))
    runs, start, end = anchor_runs(logs["events"], trace)
    assert (start, end) == (T0, T0 + 5400.0)
    assert [(r.name, r.region) for r in runs] == [("client_0", "A"), ("client_1", "B")]
    c0 = {s.kind: s for s in runs[0].segments}
    assert rel(c0["train"].intervals) == [[300, 1500], [1700, 3000]]
    assert rel(c0["idle"].intervals) == [[0, 300], [1500, 1700], [3000, 3600]]
    assert (c0["train"].kw, c0["idle"].kw) == (2.024, 0.468)
    c1 = {s.kind: s for s in runs[1].segments}
    assert rel(c1["train"].intervals) == [[900, 5000]]
    assert rel(c1["idle"].intervals) == [[600, 900], [5000, 5400]]
    # a longer gap_s bridges client_0's pause
    runs, _, _ = anchor_runs(logs["events"], trace, gap_s=300.0)
    assert rel(runs[0].segments[0].intervals) == [[300, 3000]]


def test_anchor_regions_override_and_offset(logs: dict[str, Path]) -> None:
    """Named regions skip inference; offset_s moves the whole run later on the trace."""
    trace = load_trace(str(logs["trace"]))
    runs, start, end = anchor_runs(
        logs["events"], trace, regions={"client_0": "B", "client_1": "A"}, offset_s=600.0
    )
    assert [r.region for r in runs] == ["B", "A"]
    assert (start, end) == (T0 + 600.0, T0 + 6000.0)
    assert rel(runs[0].segments[0].intervals) == [[900, 2100], [2300, 3600]]


def test_reproduce_on_small_logs(logs: dict[str, Path]) -> None:
    """The ledger on the small run: kWh and kg follow from the stretches and the trace exactly."""
    trace = load_trace(str(logs["trace"]))
    report = reproduce(logs["events"], trace)
    ours = report["ours"]
    assert report["clients"] == {"client_0": "A", "client_1": "B"}
    assert ours["wall_hours"] == 1.5
    assert ours["site_hours"] == pytest.approx((1200 + 1300 + 4100) / 3600)
    assert ours["energy_kwh"] == pytest.approx((2.024 * 6600 + 0.468 * 1800) / 3600)
    assert ours["in_window_share"] == pytest.approx(
        (2.024 * 2500 + 0.468 * 1100) / (2.024 * 6600 + 0.468 * 1800)
    )  # A (60-95) is below 100 all the time, B never
    assert set(ours["baselines_kg"]) == {"A", "B"}
    quantities = [row["quantity"] for row in report["rows"]]
    assert "emissions_kg" in quantities and any(q.startswith("baseline A") for q in quantities)


def test_provisioned_and_infer_region(logs: dict[str, Path]) -> None:
    """Powered spans pair PROVISION_START with DEPROVISION; the region vote uses mci= values only."""
    events = read_events(logs["events"])
    assert provisioned(events, "client_0", 5400.0).tolist() == [[0, 3600]]
    assert provisioned(events, "client_1", 5400.0).tolist() == [[600, 5400]]
    assert provisioned(events, "nobody", 5400.0).shape == (0, 2)
    trace = load_trace(str(logs["trace"]))
    assert infer_region(events, "client_1", trace, 0.0) == "B"
    assert infer_region(events, "client_1", trace, 3600.0) is None  # at another time, no region matches


def test_read_training_edge_cases(tmp_path: Path) -> None:
    """A log with fewer than two steps has no training stretch; equal times are allowed."""
    path = tmp_path / "log.csv"
    path.write_text("time,step\n5,0\n")
    assert read_training(path, 60.0).shape == (0, 2)
    path.write_text("time,step\n5,0\n5,1\n9,2\n")
    assert read_training(path, 60.0).tolist() == [[5, 9]]


# --- malformed inputs -----------------------------------------------------------------------------------

HEADER = "wall_time,elapsed_s,event_type,round,client,details\n"

#: case: (file to break, its new text or None to delete it, the message's start)
BAD = {
    "events missing columns": (
        "events",
        "wall_time,elapsed_s,event_type\n0,0.0,EXPERIMENT_START\n",
        "{events}:1: an anchor event log needs columns client, details",
    ),
    "elapsed_s not a number": (
        "events",
        EVENTS_CSV.replace("600.0,PROVISION_START", "soon,PROVISION_START"),
        "{events}:6: elapsed_s 'soon' is not a number",
    ),
    "elapsed_s nan": (
        "events",
        EVENTS_CSV.replace("3600.0,DEPROVISION", "nan,DEPROVISION"),
        "{events}:7: elapsed_s 'nan' is not a number",
    ),
    "no events": ("events", HEADER, "{events}: the event log has no events"),
    "no clients": (
        "events",
        HEADER + "0,0.0,EXPERIMENT_START,,,\n",
        "{events}: no client appears in the event log",
    ),
    "region not inferable": (
        "events",
        EVENTS_CSV.replace("mci=60.0", "mci=12345"),
        "{events}: cannot tell client_0's region from its mci= values; name it with --regions",
    ),
    "loss log backwards": (
        "client_0",
        "time,step\n300,0\n310,1\n305,2\n",
        "{client_0}:4: time goes backwards (310 -> 305)",
    ),
    "loss log time not a number": (
        "client_0",
        "time,step\n300,0\nnoon,1\n",
        "{client_0}:3: time 'noon' is not a number",
    ),
    "loss log time inf": (
        "client_1",
        "time,step\n300,0\ninf,1\n",
        "{client_1}:3: time 'inf' is not a number",
    ),
    "loss log without time": (
        "client_0",
        "t,step\n300,0\n",
        "{client_0}:1: a loss log needs a 'time' column (seconds since the start)",
    ),
    "loss log missing": ("client_1", None, "{client_1}: cannot read the loss log"),
    "events missing": ("events", None, "{events}: cannot read the event log"),
}


def _break(logs: dict[str, Path], case: str) -> str:
    """Apply ``case`` to the good logs; return the message it must produce."""
    key, text, message = BAD[case]
    if text is None:
        logs[key].unlink()
    else:
        logs[key].write_text(text)
    return message.format(**{k: str(v) for k, v in logs.items()})


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_logs_raise_trace_error(logs: dict[str, Path], case: str) -> None:
    """Each malformed log is a TraceError naming the file (and line, where there is one)."""
    message = _break(logs, case)
    trace = load_trace(str(logs["trace"]))
    with pytest.raises(TraceError) as info:
        reproduce(logs["events"], trace)
    assert str(info.value).startswith(message), str(info.value)


def _reproduce(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "greenswarm", "reproduce", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, no traceback, no output, and one ``greenswarm reproduce: error:`` line naming every needle."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("greenswarm reproduce: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("case", list(BAD))
def test_cli_malformed_logs_are_one_line(logs: dict[str, Path], case: str) -> None:
    """Via the command, each malformed log prints one line and exits 2."""
    message = _break(logs, case)
    result = _reproduce("--events", str(logs["events"]), "--trace", str(logs["trace"]))
    assert_one_error_line(result, message)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--regions", "client_0"], "--regions: expected CLIENT=REGION pairs, got 'client_0'"),
        (["--regions", "client_0=Z"], "region 'Z' is not in"),
        (["--gap-s", "0"], "--gap-s: must be a number of seconds > 0, got 0"),
        (["--gap-s", "-5"], "--gap-s: must be a number of seconds > 0, got -5"),
        (["--offset-s", "nan"], "--offset-s: must be a finite number of seconds"),
    ],
)
def test_cli_bad_options_are_one_line(logs: dict[str, Path], args: list[str], needle: str) -> None:
    """Bad --regions, --gap-s and --offset-s values are named in one line."""
    result = _reproduce("--events", str(logs["events"]), "--trace", str(logs["trace"]), *args)
    assert_one_error_line(result, needle)


def test_cli_reproduce_small_logs(logs: dict[str, Path]) -> None:
    """The command on good logs prints the table, or one JSON object with --json."""
    args = ["--events", str(logs["events"]), "--trace", str(logs["trace"])]
    table = _reproduce(*args)
    assert table.returncode == 0, table.stderr
    assert "client_0 = A, client_1 = B" in table.stdout
    result = _reproduce(*args, "--regions", "client_0=B,client_1=A", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["clients"] == {"client_0": "B", "client_1": "A"}


# --- the real anchor ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mci_hold() -> Trace:
    return load_trace(str(shared_path(MCI)))


@pytest.fixture(scope="module")
def mci_linear() -> Trace:
    return load_trace(str(shared_path(MCI)), interpolate="linear")


@pytest.mark.shared
def test_reproduce_matches_the_paper(mci_linear) -> None:
    """greenswarm's ledger on the anchor's own logs and (linearly read) trace is within 1 % of every
    number the paper published, and it reads each client's region from the log."""
    report = reproduce(shared_path(EVENTS), mci_linear)
    assert report["clients"] == {"client_0": "CAISO_NORTH", "client_1": "SPP_TX", "client_2": "NEM_SA"}
    ours = report["ours"]
    expected = {
        "energy_kwh": 37.7,
        "emissions_kg": 1.38,
        "in_window_share": 0.97,
        "wall_hours": 14.78,
        "site_hours": 17.78,
    }
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, rel=0.01), key
        assert PUBLISHED[key] == value
    baselines = {"CAISO_NORTH": 11.41, "SPP_TX": 14.55, "NEM_SA": 12.33, "DE": 27.07}
    assert ours["baselines_kg"] == pytest.approx(baselines, rel=0.01)
    assert report["max_abs_error"] < 0.01


@pytest.mark.shared
def test_simulated_policies_on_the_anchor_trace(mci_hold) -> None:
    """On the hold-last trace at the anchor's 17.78 site-hours: the simulated anchor controller is
    within 5 % of its published 1.38 kg. A greenswarm node that keeps its model on the GPUs while
    IDLE (``release.mode=never``) pays the provisioned idle draw between windows; with GPUs that do
    other work meanwhile (``energy.idle_kw=0``) it is within 1 % of the threshold ideal (1.017 kg);
    the preset as it is, releasing them by the break-even rule, is within 5 % of it (docs/release.md:
    1.046 kg, 5 restarts) and below the anchor's controller."""
    curtail = simulate(mci_hold, ANCHOR_REGIONS, load_policy("curtail-llm"), work_h=17.78).report
    assert curtail["finished"] is True
    assert curtail["emissions_kg"] == pytest.approx(1.38, rel=0.05)
    preset = simulate(mci_hold, ANCHOR_REGIONS, load_policy("greenswarm"), work_h=17.78).report
    assert preset["restarts"] > 0 and preset["emissions_kg"] <= 1.05 * preset["ideal_kg"]
    assert preset["emissions_kg"] < curtail["emissions_kg"]
    holding = load_policy("greenswarm", ["release.mode=never"])
    green = simulate(mci_hold, ANCHOR_REGIONS, holding, work_h=17.78).report
    released = load_policy("greenswarm", ["energy.idle_kw=0", "release.mode=never"])
    freed = simulate(mci_hold, ANCHOR_REGIONS, released, work_h=17.78).report
    assert green["ideal_kg"] == pytest.approx(1.017, rel=0.01)
    assert freed["emissions_kg"] == pytest.approx(green["ideal_kg"], rel=0.01)
    assert freed["emissions_kg"] < curtail["emissions_kg"] < green["emissions_kg"]
    held = sum(s["idle_hours"] for s in green["sites"]) * 0.468  # kWh idle, about 10
    assert green["energy_kwh"] == pytest.approx(freed["energy_kwh"] + held, rel=0.01)
    assert set(green["baselines"]) == set(mci_hold.regions)


@pytest.mark.shared
def test_simulated_policies_on_the_linear_anchor_trace(mci_linear) -> None:
    """Read linearly (the anchor's convention): the ideal is 0.994 kg, greenswarm with its GPUs freed
    while idle within 1 % of it, perfect foresight 0.341 kg."""
    released = load_policy("greenswarm", ["energy.idle_kw=0"])
    green = simulate(mci_linear, ANCHOR_REGIONS, released, work_h=17.78).report
    assert green["ideal_kg"] == pytest.approx(0.994, rel=0.01)
    assert green["emissions_kg"] == pytest.approx(green["ideal_kg"], rel=0.01)
    assert green["foresight_kg"] == pytest.approx(0.341, rel=0.01)


@pytest.mark.shared
@pytest.mark.parametrize("reading", ["hold", "linear"])
def test_deadline_policy_on_the_anchor_trace(reading: str, mci_hold, mci_linear) -> None:
    """The deadline policy, planning with the default noisy forecast, gets within 5 % of perfect
    foresight; with the oracle it is foresight. With only the past to go on it is the threshold
    policy (1.017 kg)."""
    trace = mci_hold if reading == "hold" else mci_linear
    noisy = simulate(trace, ANCHOR_REGIONS, "deadline", work_h=17.78).report
    assert noisy["finished"] is True and noisy["forecast"] == "noisy"
    assert noisy["emissions_kg"] == pytest.approx(noisy["foresight_kg"], rel=0.05)
    oracle = simulate(trace, ANCHOR_REGIONS, "deadline", work_h=17.78, forecast="oracle").report
    assert oracle["emissions_kg"] == pytest.approx(oracle["foresight_kg"], rel=1e-6)
    for past_only in ("profile", "climatology", "seasonal", "persistence"):
        planned = simulate(trace, ANCHOR_REGIONS, "deadline", work_h=17.78, forecast=past_only)
        assert planned.report["emissions_kg"] == pytest.approx(noisy["ideal_kg"], rel=0.01), past_only


@pytest.mark.shared
def test_cli_reproduce_json_on_the_real_logs() -> None:
    """``greenswarm reproduce --json`` on the anchor's files: one JSON object, within 1 % of the paper."""
    result = _reproduce("--events", str(shared_path(EVENTS)), "--trace", str(shared_path(MCI)), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["clients"] == {"client_0": "CAISO_NORTH", "client_1": "SPP_TX", "client_2": "NEM_SA"}
    assert report["trace"].endswith("(linear, 60 s grid)")
    assert report["max_abs_error"] < 0.01
    assert report["ours"]["emissions_kg"] == pytest.approx(1.38, rel=0.01)
