"""How each policy turns a site's trace into powered and training stretches.

* ``greenswarm``: the node's own behaviour. Windows are intensity < threshold; the site notices a
  change at its next poll; entering a window costs ``startup_s`` of joining the swarm (catching up
  with the swarm's state) during which it draws nothing extra because its GPUs were never released
  to anyone else and its process kept running; outside windows it releases the GPUs (0 kW).
* ``curtail-llm``: the anchor's controller, as its paper and event log describe it: enter below
  100, leave only after 600 s continuously above, 300 s of provisioning before training at 0.468 kW,
  the same 0.468 kW while provisioned but not training, and synchronous 600 s rounds that stop
  training for 130 s of aggregation and evaluation whenever two or more sites take part.
* ``ideal``: training exactly inside each site's threshold windows, nothing outside: the yardstick.

Each is one :class:`PolicySpec`, so a new policy is data, not a new code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from greenswarm.scheduler.policy import HysteresisPolicy, WindowPolicy
from greenswarm.simulation.engine import Segments, SiteRun, split_federated
from greenswarm.simulation.intervals import as_intervals, subtract
from greenswarm.traces.trace import Trace


@dataclass(frozen=True)
class PolicySpec:
    """Everything that decides when a simulated site draws power and when it makes progress."""

    name: str
    threshold: float = 100.0
    dwell_s: float = 0.0
    lookahead: str | None = None
    min_window_s: float = 0.0
    poll_s: float = 10.0
    startup_s: float = 0.0
    train_kw: float = 2.024
    idle_kw: float = 0.0
    round_s: float = 600.0
    round_overhead_s: float = 0.0

    def window_policy(self) -> WindowPolicy:
        from greenswarm.scheduler.forecast import make_forecaster

        ahead = make_forecaster(self.lookahead) if self.lookahead else None
        return HysteresisPolicy(
            self.threshold, dwell_s=self.dwell_s, min_window_s=self.min_window_s, lookahead=ahead
        )

    def describe(self) -> str:
        parts = [f"enter < {self.threshold:g} gCO2/kWh"]
        parts.append(f"leave after {self.dwell_s:g} s above" if self.dwell_s else "leave when above")
        if self.lookahead:
            parts.append(f"look-ahead: {self.lookahead}")
        if self.poll_s:
            parts.append(f"poll {self.poll_s:g} s")
        if self.startup_s:
            parts.append(f"start-up {self.startup_s:g} s")
        if self.idle_kw:
            parts.append(f"{self.idle_kw:g} kW while powered and idle")
        if self.round_overhead_s:
            parts.append(f"{self.round_overhead_s:g} s pause per {self.round_s:g} s federated round")
        return ", ".join(parts)


POLICIES: dict[str, PolicySpec] = {
    "greenswarm": PolicySpec("greenswarm", poll_s=10.0, startup_s=30.0),
    "curtail-llm": PolicySpec(
        "curtail-llm", dwell_s=600.0, poll_s=10.0, startup_s=300.0, idle_kw=0.468, round_overhead_s=130.0
    ),
    "ideal": PolicySpec("ideal", poll_s=0.0),
}


def policy_spec(name: str, **overrides: float) -> PolicySpec:
    """The preset called ``name`` with ``overrides`` (None values ignored) applied."""
    try:
        spec = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


def _to_poll(t: np.ndarray, start: float, poll_s: float) -> np.ndarray:
    """The first poll at or after each of ``t`` (polls at ``start + k * poll_s``)."""
    if poll_s <= 0:
        return t
    return start + np.ceil((t - start) / poll_s - 1e-9) * poll_s


def site_run(name: str, region: str, trace: Trace, spec: PolicySpec, start: float) -> SiteRun:
    """The stretches one site spends powered and training under ``spec`` from ``start`` onwards."""
    windows = spec.window_policy().windows(trace, region)
    raw = np.array([(w.start, w.end) for w in windows]).reshape(-1, 2)
    raw = raw[raw[:, 1] > start]
    enter = _to_poll(np.maximum(raw[:, 0], start), start, spec.poll_s)
    leave = np.minimum(_to_poll(raw[:, 1], start, spec.poll_s), trace.end)
    powered = as_intervals(np.column_stack([enter, leave]))
    training = as_intervals(np.column_stack([enter + spec.startup_s, leave]))
    run = SiteRun(name, region)
    run.segments.append(Segments("train", training, spec.train_kw, 1.0))
    run.segments.append(Segments("idle", subtract(powered, training), spec.idle_kw, 0.0))
    return run


def simulate_policy(trace: Trace, regions: list[str], spec: PolicySpec, start: float) -> list[SiteRun]:
    """Every site's schedule under ``spec``; synchronous-round costs applied across sites."""
    runs = [site_run(_site_name(i, r), r, trace, spec, start) for i, r in enumerate(regions)]
    split_federated(runs, spec.round_s, spec.round_overhead_s, spec.idle_kw)
    return runs


def _site_name(i: int, region: str) -> str:
    return f"site{i}-{region}"


def check_spec(spec: PolicySpec) -> None:
    """Reject impossible numbers with the field's name."""
    for name in ("threshold", "train_kw", "round_s"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be > 0, got {value}")
    for name in ("dwell_s", "min_window_s", "poll_s", "startup_s", "idle_kw", "round_overhead_s"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be >= 0, got {value}")
