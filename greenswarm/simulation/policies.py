"""How a policy turns a site's trace into powered and training stretches.

A policy is configuration, not code: the ``scheduler`` and ``energy`` sections a site's YAML already
has (so a simulated policy and a running node are configured identically), plus a ``provisioning``
section for what only a simulation has to model -- how long a site takes from "go" to its first
step, and what synchronous rounds cost. Presets:

* ``greenswarm``: the node as it is. Enter below the threshold, leave as soon as intensity is
  above it (the next 10 s poll), ``startup_s`` 10 s to rejoin (the node keeps its process and
  model in memory while idle; its first step came 3.2 s after launch in the demo, catching up with
  the swarm adds a state download), charged at full training power. A site is powered for the
  whole run (``powered: always``) and draws the node's default ``energy.idle_kw`` (0.468 kW, a
  provisioned machine's) whenever it is neither training nor released: it releases its GPUs by the
  node's rule (``release``, ``auto`` by default; docs/release.md) and restarts at the next window.
  Averaging overlaps training, but beginning and finishing a round holds training up
  for about a second (``blocked_s`` in the round log: median 0.3-2.6 s in docs/overlap.md), so a
  federated round pauses 1 s. ``greenswarm simulate --calibrate RUN_DIR`` replaces these figures
  by what a run measured (:mod:`greenswarm.simulation.calibrate`).
* ``curtail-llm``: the anchor's controller as its paper and event log describe it. Enter below 100,
  leave only after 600 s continuously above, 300 s of provisioning before training at 0.468 kW,
  the same 0.468 kW while provisioned but not training, and 600 s synchronous rounds that stop
  training for 130 s of aggregation and evaluation whenever two or more sites take part (the
  length of the gaps in its loss logs).
* ``ideal``: training exactly inside each site's threshold windows, nothing outside: the yardstick
  every policy is shown against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from greenswarm.configuration import load_config
from greenswarm.errors import ConfigError
from greenswarm.scheduler.config import ANCHOR_IDLE_KW, EnergyConfig, SchedulerConfig, check_number
from greenswarm.scheduler.release import (
    ReleaseConfig,
    ReleaseRule,
    enter_level,
    expected_gap_s,
    release_forecaster,
)
from greenswarm.simulation.engine import Segments, SiteRun, split_federated
from greenswarm.simulation.intervals import as_intervals, subtract
from greenswarm.traces.trace import Trace

StartupPower = Literal["idle", "train"]
STARTUP_POWER: tuple[str, ...] = get_args(StartupPower)
OverheadPower = StartupPower
Powered = Literal["windows", "always"]
POWERED: tuple[str, ...] = get_args(Powered)


@dataclass
class ProvisioningConfig:
    """What it costs a simulated site to start training and to take part in synchronous rounds.

    ``startup_s``: seconds from deciding to train to the first step, drawn at ``idle_kw``
    (``startup_power: idle``, a machine being provisioned) or ``train_kw`` (``train``: GPUs busy
    loading state). ``round_overhead_s``: seconds of no training after every ``round_s`` seconds of
    training whenever two or more sites train at once, drawn at ``idle_kw``
    (``round_overhead_power: idle``, the anchor's machines waiting for aggregation) or ``train_kw``
    (``train``: what the node's ledger books, since a site held up by its round stays FEDERATED).
    ``at_polls``: the site notices a change at its next ``scheduler.poll_s`` poll (off for the
    ideal yardstick, and where a run measured how late it noticed). ``enter_delay_s`` /
    ``leave_delay_s``: clock seconds after a window opens (closes) before the site starts (stops)
    training, on top of the polls -- idle while it has not noticed, training while it finishes the
    step in hand (``simulate --calibrate`` measures both). ``powered``: ``windows`` -- the site draws
    nothing outside its windows (the anchor deprovisions its machines); ``always`` -- it is powered
    from the start of the run, drawing ``idle_kw`` whenever it is not training (a node that keeps its
    process and model while IDLE). ``finish_s``: clock seconds a releasing site's trainer holds its
    GPUs idle after its last window while it finishes (its last checkpoint, its summary, leaving the
    swarm): 0 by default, seconds for a real site; ``simulate --calibrate`` measures it, since at a
    replay's speed-up a finish of a wall second is minutes of the trace.
    """

    startup_s: float = 0.0
    startup_power: StartupPower = "idle"
    round_s: float = 600.0
    round_overhead_s: float = 0.0
    round_overhead_power: OverheadPower = "idle"
    at_polls: bool = True
    enter_delay_s: float = 0.0
    leave_delay_s: float = 0.0
    powered: Powered = "windows"
    finish_s: float = 0.0

    def validate(self) -> None:
        check_number(self.startup_s, "startup_s", minimum=0.0, inclusive=True)
        _one_of(self.startup_power, STARTUP_POWER, "startup_power")
        check_number(self.round_s, "round_s", minimum=0.0, inclusive=False)
        check_number(self.round_overhead_s, "round_overhead_s", minimum=0.0, inclusive=True)
        _one_of(self.round_overhead_power, STARTUP_POWER, "round_overhead_power")
        check_number(self.enter_delay_s, "enter_delay_s", minimum=0.0, inclusive=True)
        check_number(self.leave_delay_s, "leave_delay_s", minimum=0.0, inclusive=True)
        _one_of(self.powered, POWERED, "powered")
        check_number(self.finish_s, "finish_s", minimum=0.0, inclusive=True)


def _one_of(value: str, choices: tuple[str, ...], name: str) -> None:
    """A choice field set in code (the YAML loader checks a ``Literal`` field itself)."""
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(choices)}, got {value!r}", field=name)


@dataclass
class PolicyConfig:
    """One simulated policy: a name, a site's scheduler and energy sections, provisioning, and the
    release rule for the gaps a site would otherwise hold (``provisioning.powered: always``).

    ``release.mode`` defaults to ``auto`` here, as for the node: a site releases its GPUs when a gap
    is worth more than a restart. A policy that holds them says so (``--set release.mode=never``).
    """

    name: str = "custom"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    energy: EnergyConfig = field(default_factory=lambda: EnergyConfig(source="config"))
    provisioning: ProvisioningConfig = field(default_factory=ProvisioningConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    def describe(self) -> str:
        """One line a person can check against the paper or the site config."""
        s, e, p = self.scheduler, self.energy, self.provisioning
        if s.percentile is not None:
            parts = [f"enter < p{s.percentile:g} of the region's trace"]
        else:
            parts = [f"enter < {s.threshold:g} gCO2/kWh"]
            leave = s.leave_above if s.leave_above is not None else s.threshold
            parts.append(
                f"leave after {s.dwell_s:g} s >= {leave:g}" if s.dwell_s else f"leave when >= {leave:g}"
            )
            if s.lookahead:
                parts.append(f"look-ahead: {s.lookahead}")
        parts.append(f"poll {s.poll_s:g} s" if p.at_polls else "reacts instantly")
        if p.enter_delay_s or p.leave_delay_s:
            parts.append(
                f"starts {p.enter_delay_s:g} s after a window opens, "
                f"stops {p.leave_delay_s:g} s after it closes"
            )
        if p.startup_s:
            parts.append(f"start-up {p.startup_s:g} s at {p.startup_power} power")
        parts.append(f"{e.train_kw:g} kW training, {e.idle_kw:g} kW powered but idle")
        if p.round_overhead_s:
            parts.append(
                f"{p.round_overhead_s:g} s pause per {p.round_s:g} s federated round "
                f"at {p.round_overhead_power} power"
            )
        if p.powered == "always":
            r = self.release
            if r.mode == "never":
                parts.append("powered (idle) outside windows too")
            else:
                rule = ReleaseRule(r, e.train_kw, e.idle_kw, e.released_kw)
                when = (
                    "at each window's end"
                    if r.mode == "idle"
                    else f"by break-even ({rule.break_even_s:.0f} s, forecast {self.scheduler.forecast}, "
                    f"trust {r.trust:g})"
                )
                parts.append(
                    f"releases its GPUs {when} at {e.released_kw:g} kW, "
                    f"restart {r.restart_s:g} s at train power, checkpoint {r.checkpoint_s:g} s at idle"
                    + (f", finish {p.finish_s:g} s at idle after its last window" if p.finish_s else "")
                )
        return ", ".join(parts)


def _preset(name: str, scheduler: dict, energy: dict, provisioning: dict) -> PolicyConfig:
    return PolicyConfig(
        name,
        SchedulerConfig(**scheduler),
        EnergyConfig(source="config", **energy),
        ProvisioningConfig(**provisioning),
    )


POLICIES: dict[str, PolicyConfig] = {
    "greenswarm": _preset(
        "greenswarm",
        {},
        {},
        {
            "startup_s": 10.0,
            "startup_power": "train",
            "round_overhead_s": 1.0,
            "round_overhead_power": "train",
            "powered": "always",
        },
    ),
    "curtail-llm": _preset(
        "curtail-llm",
        {"dwell_s": 600.0},
        {"idle_kw": ANCHOR_IDLE_KW},
        {"startup_s": 300.0, "round_overhead_s": 130.0},
    ),
    "ideal": _preset("ideal", {}, {"idle_kw": 0.0}, {"at_polls": False}),
}


def load_policy(spec: str, overrides: list[str] | None = None, flag: str = "--policy") -> PolicyConfig:
    """A preset by name, or a policy YAML file (sections ``scheduler``, ``energy``,
    ``provisioning``); ``overrides`` are ``--set key=value`` strings as for a site config. ``flag``
    is the command-line option an unknown name is blamed on."""
    if spec in POLICIES:
        from greenswarm.configuration import to_dict

        base = to_dict(POLICIES[spec])
        return load_config(PolicyConfig, None, overrides, base=base)
    path = Path(spec)
    if not path.exists():
        raise ConfigError(
            f"no policy {spec!r}: give one of {', '.join(POLICIES)} or a policy YAML file", where=flag
        )
    cfg = load_config(PolicyConfig, path, overrides)
    return cfg if cfg.name != "custom" else replace(cfg, name=path.stem)


def _to_poll(t: np.ndarray, start: float, poll_s: float) -> np.ndarray:
    """The first poll at or after each of ``t`` (polls at ``start + k * poll_s``)."""
    return start + np.ceil((t - start) / poll_s - 1e-9) * poll_s


def site_run(
    name: str, region: str, decide: Trace, policy: PolicyConfig, start: float, windows: list | None = None
) -> SiteRun:
    """The stretches one site spends powered and training from ``start`` on, deciding on ``decide``.

    ``windows`` (the policy's windows for ``region``) may be passed in when many sites share a region.
    """
    s, e, p = policy.scheduler, policy.energy, policy.provisioning
    if windows is None:
        windows = s.window_policy().windows(decide, region)
    raw = np.array([(w.start, w.end) for w in windows]).reshape(-1, 2)
    raw = raw[raw[:, 1] > start]
    enter, leave = np.maximum(raw[:, 0], start), raw[:, 1]
    if p.at_polls:
        enter, leave = (
            _to_poll(enter, start, s.poll_s),
            np.minimum(_to_poll(leave, start, s.poll_s), decide.end),
        )
    if p.enter_delay_s or p.leave_delay_s:  # (a window shorter than the delay is never trained in)
        enter, leave = enter + p.enter_delay_s, np.minimum(leave + p.leave_delay_s, decide.end)
        leave = np.maximum(leave, enter)
    powered = as_intervals(np.column_stack([enter, leave]))
    startup_kw = e.train_kw if p.startup_power == "train" else e.idle_kw
    run = SiteRun(name, region)
    end = max(start, decide.end)
    if p.powered == "always" and policy.release.mode != "never":
        wake = np.maximum(raw[:, 0], start)  # the agent wakes at a window's very start
        outside = not len(raw) or raw[0, 0] > start  # launched outside a window (not merely before a poll)
        gaps = release_gaps(decide, region, policy, enter, leave, wake, start, end, outside)
        opens = np.where(gaps.restarted, wake, enter)
        starts = opens + np.where(gaps.restarted, policy.release.restart_s, p.startup_s)
        training = as_intervals(np.column_stack([starts, leave]))
        # a restart runs to its end (the node books it RESTARTING until its first decision), even
        # past a window that closed meanwhile
        restarting = as_intervals(np.column_stack([opens, starts])[gaps.restarted])
        powered = as_intervals(np.column_stack([opens, leave]))
        run.segments.append(Segments("train", training, e.train_kw, 1.0))
        run.segments.append(Segments("restart", subtract(restarting, training), e.train_kw, 0.0))
        run.segments.append(
            Segments("idle", subtract(subtract(powered, training), restarting), startup_kw, 0.0)
        )
        run.segments.append(Segments("idle", gaps.held, e.idle_kw, 0.0))
        run.segments.append(Segments("checkpoint", gaps.checkpoint, e.idle_kw, 0.0))  # (GPUs held)
        run.segments.append(Segments("released", gaps.released, e.released_kw, 0.0))
        return run
    training = as_intervals(np.column_stack([enter + p.startup_s, leave]))
    run.segments.append(Segments("train", training, e.train_kw, 1.0))
    run.segments.append(Segments("idle", subtract(powered, training), startup_kw, 0.0))
    if p.powered == "always":  # waiting between windows, process and model kept
        whole = as_intervals(np.array([[start, end]]))
        run.segments.append(Segments("idle", subtract(whole, powered), e.idle_kw, 0.0))
    return run


@dataclass
class ReleaseGaps:
    """How a releasing site spends the gaps between its windows: held (idle), writing the release's
    checkpoint, released; and which windows start with a restart (a trainer started again)."""

    held: np.ndarray
    checkpoint: np.ndarray
    released: np.ndarray
    restarted: np.ndarray  # bool, one per window


def release_gaps(
    decide: Trace,
    region: str,
    policy: PolicyConfig,
    enter: np.ndarray,
    leave: np.ndarray,
    wake: np.ndarray,
    start: float,
    end: float,
    launched_outside: bool = True,
) -> ReleaseGaps:
    """Apply the node's release rule (:class:`~greenswarm.scheduler.release.ReleaseRule`) to each
    gap between the windows ``[enter, leave)`` as the node does (:mod:`greenswarm.node.releasing`):
    deciding at the gap's start with only what the site knows then (its past-only forecaster on the
    trace up to that instant); a released site's agent wakes at the next window's very start
    (``wake``) and restarts the trainer, whose restart runs to its end even past a window that
    closed meanwhile. A site launched outside a window starts its trainer, which releases by the
    same rule; one launched in a window holds until it has noticed it; after the last window the
    trainer finishes (the run has nothing left for it): it holds the GPUs idle for
    ``provisioning.finish_s`` (its last checkpoint and summary; a node books that time IDLE) and
    draws nothing after."""
    e, r = policy.energy, policy.release
    rule = ReleaseRule(r, e.train_kw, e.idle_kw, e.released_kw)
    forecasters = {m: release_forecaster(policy.scheduler, m) for m in (r.mode, "auto")}
    level = enter_level(policy.scheduler.window_policy(), decide, region)
    held, ckpt, released = [], [], []
    restarted = np.zeros(len(enter), dtype=bool)
    last = start  # where the next gap starts: the end of the last window (or of its restart)
    for i in range(len(enter) + 1):
        g0, g1 = last, (enter[i] if i < len(enter) else end)
        if g1 > g0 and i == len(enter) and i:  # after the last window: the trainer's finish
            held.append((g0, min(g0 + policy.provisioning.finish_s, g1)))
        if g1 > g0 and i < len(enter):
            first = i == 0 and g0 == start  # (a gap that follows no window is decided as auto would)
            if first and not launched_outside:
                held.append((g0, g1))  # it has not yet noticed the window it was launched in
            else:
                mode = "auto" if first else r.mode
                hold = rule.break_even_s  # a gap no longer than the least hold is held whatever
                if g1 - g0 > r.trust * hold or mode == "idle":
                    forecaster = forecasters[mode]
                    gap = (
                        None if forecaster is None else expected_gap_s(forecaster, decide, region, g0, level)
                    )
                    hold = rule.decide(gap, mode).hold_s
                if g0 + hold >= g1:
                    held.append((g0, g1))
                else:
                    off = g0 + hold
                    done = min(off + r.checkpoint_s, wake[i])
                    held.append((g0, off))
                    ckpt.append((off, done))
                    released.append((done, wake[i]))
                    restarted[i] = True
        if i < len(enter):
            last = max(last, leave[i], wake[i] + r.restart_s if restarted[i] else leave[i])
    return ReleaseGaps(as_intervals(held), as_intervals(ckpt), as_intervals(released), restarted)


def site_name(i: int, region: str) -> str:
    """Sites are named by position and region, so two sites in one region stay apart."""
    return f"site{i}-{region}"


def simulate_policy(decide: Trace, regions: list[str], policy: PolicyConfig, start: float) -> list[SiteRun]:
    """Every site's schedule under ``policy``, with synchronous-round costs applied across sites."""
    rule = policy.scheduler.window_policy()
    windows = {r: rule.windows(decide, r) for r in dict.fromkeys(regions)}
    runs = [site_run(site_name(i, r), r, decide, policy, start, windows[r]) for i, r in enumerate(regions)]
    p = policy.provisioning
    pause_kw = policy.energy.train_kw if p.round_overhead_power == "train" else policy.energy.idle_kw
    split_federated(runs, p.round_s, p.round_overhead_s, pause_kw)
    return runs
