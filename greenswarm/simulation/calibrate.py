"""What a node run measured, for the simulator: ``greenswarm simulate --calibrate RUN_DIR``.

A site's ``run_dir`` holds its ``summary.json`` (the ledger's clock seconds and kWh in each state, the
replay's speed-up, the round interval) and ``rounds.jsonl`` (every round it ended: how long training
waited for it, ``blocked_s``, in wall seconds). From them:

* ``train_kw``: kWh booked while SOLO or FEDERATED / the hours spent so;
* ``idle_kw``: kWh booked while IDLE / the hours spent so (what the site drew waiting);
* ``round_overhead_s``: the median ``blocked_s`` of the rounds the site averaged with others, in
  clock seconds (x the replay's speed-up), paid once per ``round_s`` = ``averaging.sync_interval_s``.

``RUN_DIR`` is one site's run directory or a folder of them; figures from several sites are pooled
(kWh and hours summed, the median over every site's rounds). A figure the run cannot give (no idle
time, no federated round) keeps the policy's own and says so.
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
    federated_rounds: int = 0
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
        if self.round_overhead_s is not None:
            prov = replace(prov, round_overhead_s=self.round_overhead_s)
        return replace(policy, energy=energy, provisioning=prov)

    def describe(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "sites": self.sites,
            "train_kw": self.train_kw,
            "idle_kw": self.idle_kw,
            "round_s": self.round_s,
            "round_overhead_s": self.round_overhead_s,
            "federated_rounds": self.federated_rounds,
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
    kwh = {"train": 0.0, "idle": 0.0}
    hours = {"train": 0.0, "idle": 0.0}
    blocked: list[float] = []
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
            key = "train" if state in TRAINING else "idle"
            hours[key] += float(s) / 3600.0
            kwh[key] += float(by_state.get(state, 0.0))
        if summary.get("sync_interval_s"):
            intervals.add(float(summary["sync_interval_s"]))
        for entry in read_json_lines(site / "rounds.jsonl"):
            if entry.get("action") in FEDERATED_ACTIONS and entry.get("round_s") is not None:
                blocked.append(float(entry.get("blocked_s", 0.0)) * speedup)
    cal = Calibration(str(root), len(sites), federated_rounds=len(blocked))
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
    return cal
