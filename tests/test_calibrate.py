"""``simulate --calibrate`` and ``--idle-kw``: figures read from a run directory; errors name the flag."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from greenswarm.errors import ConfigError
from greenswarm.scheduler.policy import Window, noticed_late_s
from greenswarm.simulation.calibrate import calibrate
from greenswarm.simulation.policies import load_policy
from greenswarm.simulation.report import simulate
from greenswarm.traces.trace import Trace

pytestmark = pytest.mark.deadline

H = 3600.0


def _site(
    root: Path, name: str, *, blocked: list[float], speedup: float = 100.0, idle_h: float = 2.0
) -> None:
    site = root / name
    site.mkdir(parents=True)
    summary = {
        "seconds_by_state": {"IDLE": idle_h * H, "SOLO": 1 * H, "FEDERATED": 3 * H},
        "kwh_by_state": {"IDLE": 0.3 * idle_h, "SOLO": 2.5, "FEDERATED": 7.5},
        "clock_speedup": speedup,
        "sync_interval_s": 600.0,
    }
    (site / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"action": "apply", "round_s": 2.0, "blocked_s": b}) for b in blocked]
    lines += [json.dumps({"action": "solo", "round_s": None, "blocked_s": 9.0}), '{"torn']
    (site / "rounds.jsonl").write_text("\n".join(lines))


def test_calibration_pools_the_sites_of_a_run(tmp_path: Path) -> None:
    _site(tmp_path, "a", blocked=[0.01, 0.02, 0.03])
    _site(tmp_path, "b", blocked=[0.05, 0.5])
    cal = calibrate(tmp_path)
    assert cal.sites == 2 and cal.federated_rounds == 5
    assert cal.train_kw == pytest.approx(2.5) and cal.idle_kw == pytest.approx(0.3)
    assert cal.round_s == 600.0 and cal.round_overhead_s == pytest.approx(3.0)  # 0.03 s wall x 100
    policy = cal.apply(load_policy("greenswarm"))
    assert (policy.energy.train_kw, policy.energy.idle_kw) == (pytest.approx(2.5), pytest.approx(0.3))
    assert policy.provisioning.round_overhead_s == pytest.approx(3.0)
    assert calibrate(tmp_path / "a").sites == 1  # one site's run_dir works too


def test_a_run_in_which_no_site_released_calibrates_to_the_rule_its_sites_applied(tmp_path: Path) -> None:
    """A replayed node prices a restart at its wall seconds times the speed-up, so at 100x it held
    through gaps the preset (30 s) would release in: the calibrated simulator takes the rule each
    site applied (its summary's ``release``), in clock seconds, and holds where the node held."""
    for name in ("a", "b"):
        _site(tmp_path, name, blocked=[0.01])
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary["release"] = {"mode": "auto", "trust": 0.25, "restart_s": 3000.0, "checkpoint_s": 500.0}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    cal = calibrate(tmp_path)
    assert (cal.release_mode, cal.restart_s, cal.checkpoint_s, cal.restarts) == ("auto", 3000.0, 500.0, 0)
    policy = cal.apply(load_policy("greenswarm"))
    r = policy.release
    assert (r.restart_s, r.checkpoint_s, r.trust) == (3000.0, 500.0, 0.25)
    held = json.loads((tmp_path / "b" / "summary.json").read_text())
    held["release"] = {"mode": "never"}  # a site that held whatever its mode (several ranks, a plan)
    (tmp_path / "b" / "summary.json").write_text(json.dumps(held))
    cal = calibrate(tmp_path)
    assert cal.release_mode is None and any("different release rules" in n for n in cal.notes)
    (tmp_path / "a" / "summary.json").write_text(json.dumps(held))
    assert calibrate(tmp_path).apply(load_policy("greenswarm")).release.mode == "never"
    for name in ("a", "b"):  # an older node's summaries say nothing of releasing: it held
        older = json.loads((tmp_path / name / "summary.json").read_text())
        del older["release"]
        (tmp_path / name / "summary.json").write_text(json.dumps(older))
    assert calibrate(tmp_path).apply(load_policy("greenswarm")).release.mode == "never"


def _history(site: Path, points: list[tuple[str, float | None]]) -> None:
    """A history.jsonl of state-change points (state, late_s), after a start line."""
    lines = [json.dumps({"kind": "start", "site": site.name})]
    for state, late in points:
        point = {"kind": "point", "clock": 0.0, "state": state}
        if late is not None:
            point["late_s"] = late
        lines.append(json.dumps(point))
    (site / "history.jsonl").write_text("\n".join(lines + ['{"torn']))


def test_calibration_takes_how_late_the_node_noticed_its_windows(tmp_path: Path) -> None:
    """The mean lateness of every window entered and left, over the sites; the policy then reacts
    by those delays instead of its polls. Changes that cross no edge (SOLO <-> FEDERATED, the stop)
    carry no late_s and count for nothing."""
    _site(tmp_path, "a", blocked=[0.01])
    _site(tmp_path, "b", blocked=[0.01])
    _history(tmp_path / "a", [("IDLE", None), ("SOLO", 2.0), ("FEDERATED", None), ("IDLE", 40.0)])
    _history(
        tmp_path / "b", [("IDLE", None), ("FEDERATED", 6.0), ("IDLE", 80.0), ("SOLO", 10.0), ("IDLE", None)]
    )
    cal = calibrate(tmp_path)
    assert cal.window_edges == 5
    assert cal.enter_delay_s == pytest.approx(6.0) and cal.leave_delay_s == pytest.approx(60.0)
    prov = cal.apply(load_policy("greenswarm")).provisioning
    assert (prov.at_polls, prov.enter_delay_s, prov.leave_delay_s) == (False, pytest.approx(6.0), 60.0)
    assert prov.round_overhead_power == "train"  # measured on a node: its ledger books the pause so
    described = cal.apply(load_policy("curtail-llm")).describe()
    assert "starts 6 s after a window opens, stops 60 s after it closes" in described
    assert "reacts instantly" in described and "at train power" in described


def test_calibration_takes_how_long_a_trainer_took_to_finish_after_its_last_window(tmp_path: Path) -> None:
    """The mean of the journals' ``finish`` lines (what each ledger booked IDLE from leaving its last
    window to its end); a run without one (sites that held to the end, ended released or were
    stopped) keeps the policy's 0."""
    for name, idle_s in (("a", 200.0), ("b", 400.0), ("c", None)):
        _site(tmp_path, name, blocked=[0.01])
        if idle_s is not None:
            line = {"event": "finish", "clock": 9000.0, "idle_s": idle_s}
            (tmp_path / name / "releases.jsonl").write_text(json.dumps(line) + "\n")
    cal = calibrate(tmp_path)
    assert cal.finish_s == pytest.approx(300.0) and cal.describe()["finish_s"] == pytest.approx(300.0)
    policy = cal.apply(load_policy("greenswarm"))
    assert policy.provisioning.finish_s == pytest.approx(300.0)
    assert calibrate(tmp_path / "c").finish_s is None
    assert calibrate(tmp_path / "c").apply(load_policy("greenswarm")).provisioning.finish_s == 0.0


def test_noticed_late_s_is_measured_only_at_an_edge_the_site_passed() -> None:
    window = Window(100.0, 200.0)
    assert noticed_late_s(103.0, True, window, None) == pytest.approx(3.0)  # entered 3 s after it opened
    assert noticed_late_s(230.0, False, None, window) == pytest.approx(30.0)  # left 30 s after it closed
    assert noticed_late_s(150.0, False, window, window) is None  # SOLO -> FEDERATED inside the window
    assert noticed_late_s(150.0, False, None, None) is None  # no window was held (a stop)
    assert noticed_late_s(230.0, False, None, window, signal_end=200.0) is None  # the trace ended


def test_a_run_that_cannot_say_keeps_the_policys_figures(tmp_path: Path) -> None:
    _site(tmp_path, "a", blocked=[], idle_h=0.0)
    cal = calibrate(tmp_path)
    assert cal.idle_kw is None and cal.round_overhead_s is None and cal.leave_delay_s is None
    assert any("round pause kept" in n for n in cal.notes) and any("idle_kw kept" in n for n in cal.notes)
    assert any("polls kept" in n for n in cal.notes)
    policy = cal.apply(load_policy("greenswarm"))
    assert policy.energy.idle_kw == 0.468 and policy.provisioning.round_overhead_s == 1.0
    assert policy.provisioning.at_polls


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p / "missing", "is not a directory"),
        (lambda p: p, "holds no summary.json"),
        (lambda p: (p / "s").mkdir() or (p / "s" / "summary.json").write_text("{}") and p, "kwh_by_state"),
    ],
)
def test_calibrate_errors_name_the_flag(tmp_path: Path, make, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        calibrate(make(tmp_path))
    assert err.value.where == "--calibrate"


def test_a_deadline_site_that_holds_its_gpus_pays_for_the_wait() -> None:
    times = H * np.arange(6)
    trace = Trace(times, {"A": np.array([300.0, 300.0, 300.0, 10.0, 10.0, 300.0])}, H, "t")
    plain = simulate(trace, ["A"], "deadline", work_h=2.0, forecast="oracle").report
    held = simulate(trace, ["A"], "deadline", work_h=2.0, forecast="oracle", idle_kw=0.5).report
    assert plain["emissions_kg"] == pytest.approx(2.024 * 10 * 2 / 1000)
    # idle from the start until the clean hours, 3 h at 300 g
    assert held["emissions_kg"] == pytest.approx(plain["emissions_kg"] + 0.5 * 300 * 3 / 1000)
