"""What a node run measured, for the simulator: ``greenswarm simulate --calibrate RUN_DIR``.

A site's ``run_dir`` holds its ``summary.json`` (the ledger's clock seconds and kWh in each state, the
replay's speed-up, the round interval) and ``rounds.jsonl`` (every round it ended: how long training
waited for it, ``blocked_s``, in wall seconds). From them:

* ``train_kw``: kWh booked while SOLO or FEDERATED / the hours spent so;
* ``idle_kw``: kWh booked while IDLE / the hours spent so (what the site drew waiting);
* ``round_overhead_s``: the median ``blocked_s`` of the rounds the site averaged with others, in
  clock seconds (x the replay's speed-up), paid once per ``round_s`` = ``averaging.sync_interval_s``,
  at training power: the ledger books a site that a round holds up as FEDERATED;
* ``enter_delay_s`` / ``leave_delay_s``: how late after a window opened (closed) the node noticed and
  started (stopped) training -- the mean ``late_s`` of the points in ``history.jsonl`` that record
  those changes, in clock seconds. A node wakes for a window it knows is coming and checks its window
  after every inner step and round, not at ``scheduler.poll_s`` polls, so where the run crossed
  edges both ways the simulator takes these delays instead of its polls. They are real: at a
  replay's speed-up an inner step of 0.1 s is a minute of clock time trained past the window's end,
  at the window's end's intensity. (The mean, not the median: every crossing is booked, so the
  total is what must match.) A window entered by a restart after a release is not an edge here:
  its delay is the restart's.
* ``finish_s``: how long a trainer that finished after its last window (a releasing site's: the run
  had nothing left for it) booked IDLE from leaving that window to the end of its ledger, in clock
  seconds (its journal's ``finish`` line; the mean over the sites that did). A second of wall time,
  it is minutes of a replay's trace at the dirty hour after the window (test_release_node: 1.5-8
  minutes at 360x, 3 % of its sites' emissions when it was left out).
* for a site that released its trainer between windows (``releases.jsonl``): ``release.mode`` as
  the node had it, ``released_kw`` (kWh booked RELEASED / its hours), ``restart_s`` (the clock
  seconds booked RESTARTING / the restarts) and ``checkpoint_s`` (the mean clock seconds the
  release's checkpoint took); for a run in which no site released, the rule its sites applied
  (their summaries' ``release``: the mode, ``never`` for a site that held whatever its mode, and
  the restart and checkpoint in clock seconds -- a replay prices a restart at its wall seconds times
  the speed-up, and seldom releases), so the simulator holds where the node held.

``RUN_DIR`` is one site's run directory or a folder of them; figures from several sites are pooled
(kWh and hours summed, the median over every site's rounds, the mean over every site's window
edges). A figure the run cannot give (no idle time, no federated round, no edge crossed) keeps the
policy's own and says so.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from greenswarm.errors import ConfigError
from greenswarm.jsonlines import read_json_lines
from greenswarm.simulation.policies import PolicyConfig

TRAINING = ("SOLO", "FEDERATED")
RESTARTED = ("RELEASED", "RESTARTING")  # a window entered from these was entered by a restart
HISTORY = "history.jsonl"  # (greenswarm.node.history.FILE: the simulator does not import the node)
RELEASES = "releases.jsonl"  # (greenswarm.node.releasing.JOURNAL)
FEDERATED_ACTIONS = ("apply", "resync", "fail")


@dataclass
class Calibration:
    """Figures measured by a run (None: the run could not say)."""

    source: str
    sites: int
    train_kw: float | None = None
    idle_kw: float | None = None
    round_s: float | None = None
    round_overhead_s: float | None = None
    enter_delay_s: float | None = None
    leave_delay_s: float | None = None
    finish_s: float | None = None
    federated_rounds: int = 0
    window_edges: int = 0
    release_mode: str | None = None
    released_kw: float | None = None
    restart_s: float | None = None
    checkpoint_s: float | None = None
    trust: float | None = None
    restarts: int = 0
    notes: list[str] = field(default_factory=list)

    def apply(self, policy: PolicyConfig) -> PolicyConfig:
        """``policy`` with every figure this run measured put in its place."""
        energy, prov = policy.energy, policy.provisioning
        if self.train_kw is not None:
            energy = replace(energy, train_kw=self.train_kw)
        if self.idle_kw is not None:
            energy = replace(energy, idle_kw=self.idle_kw)
        if self.round_s is not None:
            prov = replace(prov, round_s=self.round_s)
        if self.round_overhead_s is not None:  # (measured on a node, whose ledger books the pause so)
            prov = replace(prov, round_overhead_s=self.round_overhead_s, round_overhead_power="train")
        if self.enter_delay_s is not None and self.leave_delay_s is not None:
            prov = replace(
                prov, at_polls=False, enter_delay_s=self.enter_delay_s, leave_delay_s=self.leave_delay_s
            )
        if self.finish_s is not None:
            prov = replace(prov, finish_s=self.finish_s)
        release = policy.release
        if self.release_mode is not None:
            release = replace(release, mode=self.release_mode)  # type: ignore[arg-type]
            if self.released_kw is not None:
                energy = replace(energy, released_kw=self.released_kw)
            if self.restart_s is not None:
                release = replace(release, restart_s=self.restart_s)
            if self.checkpoint_s is not None:
                release = replace(release, checkpoint_s=self.checkpoint_s)
            if self.trust is not None:
                release = replace(release, trust=self.trust)
        return replace(policy, energy=energy, provisioning=prov, release=release)

    def describe(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "sites": self.sites,
            "train_kw": self.train_kw,
            "idle_kw": self.idle_kw,
            "round_s": self.round_s,
            "round_overhead_s": self.round_overhead_s,
            "enter_delay_s": self.enter_delay_s,
            "leave_delay_s": self.leave_delay_s,
            "finish_s": self.finish_s,
            "federated_rounds": self.federated_rounds,
            "window_edges": self.window_edges,
            "release_mode": self.release_mode,
            "released_kw": self.released_kw,
            "restart_s": self.restart_s,
            "checkpoint_s": self.checkpoint_s,
            "restarts": self.restarts,
            "notes": list(self.notes),
        }


def _site_dirs(run_dir: Path) -> list[Path]:
    if (run_dir / "summary.json").is_file():
        return [run_dir]
    return sorted(p.parent for p in run_dir.glob("*/summary.json"))


def calibrate(run_dir: str | Path) -> Calibration:
    """Read every site under ``run_dir`` (see module doc); a ConfigError naming ``--calibrate`` when
    there is nothing to read."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory", where="--calibrate")
    sites = _site_dirs(root)
    if not sites:
        raise ConfigError(
            f"{root} holds no summary.json (a site's run_dir, or a folder of them)", where="--calibrate"
        )
    kwh = {"train": 0.0, "idle": 0.0, "released": 0.0, "restart": 0.0}
    hours = {"train": 0.0, "idle": 0.0, "released": 0.0, "restart": 0.0}
    modes: set[str] = set()
    checkpoints: list[float] = []
    restarts = 0
    applied: list[dict[str, Any]] = []  # each site's release rule as it applied it (its summary)
    blocked: list[float] = []
    enter: list[float] = []
    leave: list[float] = []
    finishes: list[float] = []
    intervals: set[float] = set()
    for site in sites:
        try:
            summary = json.loads((site / "summary.json").read_text())
            by_state, seconds = summary["kwh_by_state"], summary["seconds_by_state"]
            speedup = float(summary.get("clock_speedup", 1.0))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"{site / 'summary.json'} is not a node summary with kwh_by_state ({err})",
                where="--calibrate",
            ) from None
        for state, s in seconds.items():
            key = {"RELEASED": "released", "RESTARTING": "restart"}.get(state, "idle")
            key = "train" if state in TRAINING else key
            hours[key] += float(s) / 3600.0
            kwh[key] += float(by_state.get(state, 0.0))
        if isinstance(summary.get("release"), dict):
            applied.append(summary["release"])
        for entry in read_json_lines(site / RELEASES):
            if entry.get("event") == "release":
                modes.add(str(entry.get("mode")))
                if isinstance(entry.get("released_clock"), int | float):
                    checkpoints.append(float(entry["released_clock"]) - float(entry["clock"]))
            elif entry.get("event") == "restart":
                restarts += 1
            elif entry.get("event") == "finish" and isinstance(entry.get("idle_s"), int | float):
                finishes.append(float(entry["idle_s"]))
        if summary.get("sync_interval_s"):
            intervals.add(float(summary["sync_interval_s"]))
        for entry in read_json_lines(site / "rounds.jsonl"):
            if entry.get("action") in FEDERATED_ACTIONS and entry.get("round_s") is not None:
                blocked.append(float(entry.get("blocked_s", 0.0)) * speedup)
        site_enter, site_leave = _edge_delays(site / HISTORY)
        enter += site_enter
        leave += site_leave
    cal = Calibration(str(root), len(sites), federated_rounds=len(blocked))
    cal.window_edges = len(enter) + len(leave)
    if enter and leave:
        cal.enter_delay_s, cal.leave_delay_s = statistics.fmean(enter), statistics.fmean(leave)
    else:
        cal.notes.append("the run did not both enter and leave a window: the polls kept")
    if finishes:
        cal.finish_s = statistics.fmean(finishes)
    cal.train_kw = kwh["train"] / hours["train"] if hours["train"] > 0 else None
    cal.idle_kw = kwh["idle"] / hours["idle"] if hours["idle"] > 0 else None
    if len(intervals) == 1:
        cal.round_s = intervals.pop()
    elif intervals:
        cal.notes.append(f"sites used different round intervals {sorted(intervals)}: round_s kept")
    if blocked:
        cal.round_overhead_s = statistics.median(blocked)
    else:
        cal.notes.append("no round averaged with others: the round pause kept")
    for key, name in (("train", "train_kw"), ("idle", "idle_kw")):
        if hours[key] <= 0:
            cal.notes.append(f"no time {'training' if key == 'train' else 'idle'}: {name} kept")
    _releases(cal, modes, kwh, hours, checkpoints, restarts)
    if not modes:
        _held(cal, applied)
    return cal


def _held(cal: Calibration, applied: list[dict[str, Any]]) -> None:
    """No site released: the rule the sites applied (from their summaries; the same for all, or it is
    kept), in clock seconds, so the calibrated simulator holds where the node held (a replay prices a
    restart at its wall seconds times the speed-up, and seldom releases)."""
    if not applied:  # summaries of a node from before releasing existed: it held its trainer
        cal.release_mode = "never"
        cal.notes.append("the run's summaries do not say their release rule (an older node): never")
        return
    rules = {json.dumps(rule, sort_keys=True) for rule in applied}
    if len(rules) != 1 or len(applied) != cal.sites:
        cal.notes.append("sites applied different release rules: release kept")
        return
    rule = applied[0]
    cal.release_mode = str(rule.get("mode"))
    if isinstance(rule.get("restart_s"), int | float):
        cal.restart_s = float(rule["restart_s"])
    if isinstance(rule.get("checkpoint_s"), int | float):
        cal.checkpoint_s = float(rule["checkpoint_s"])
    if isinstance(rule.get("trust"), int | float):
        cal.trust = float(rule["trust"])


def _releases(
    cal: Calibration,
    modes: set[str],
    kwh: dict[str, float],
    hours: dict[str, float],
    checkpoints: list[float],
    restarts: int,
) -> None:
    """The release figures of a run whose sites released their trainers (see the module's doc)."""
    if not modes:
        return
    if len(modes) > 1:
        cal.notes.append(f"sites released by different modes {sorted(modes)}: release.mode kept")
        return
    cal.release_mode, cal.restarts = modes.pop(), restarts
    if hours["released"] > 0:
        cal.released_kw = kwh["released"] / hours["released"]
    if restarts:
        cal.restart_s = hours["restart"] * 3600.0 / restarts
    else:
        cal.notes.append("no restart after a release: release.restart_s kept")
    if checkpoints:
        cal.checkpoint_s = statistics.fmean(checkpoints)


def _edge_delays(path: Path) -> tuple[list[float], list[float]]:
    """The ``late_s`` of the history points that record entering a window and leaving one."""
    enter: list[float] = []
    leave: list[float] = []
    state = None
    for point in read_json_lines(path):
        if point.get("kind") != "point":
            continue
        new = point.get("state")
        late = point.get("late_s")
        if isinstance(late, int | float) and new != state:
            if new in TRAINING and state not in TRAINING and state not in RESTARTED:
                enter.append(float(late))
            elif new not in TRAINING and state in TRAINING:
                leave.append(float(late))
        state = new
    return enter, leave
