"""When a site gives its GPUs back between windows: one rule, shared by the node and the simulator.

Between two windows a site can **hold** its trainer (process, model and optimizer on the GPUs),
drawing ``energy.idle_kw`` for every second it waits, or **release** it: write a checkpoint, end the
trainer, draw ``energy.released_kw`` (0 by default: the GPUs go back to their cluster or sleep), and
pay a restart when the next window opens (the trainer starts again and loads the checkpoint, at
training power). The restart is paid once; the idle draw grows with the wait. So the question is the
classic power-down problem -- ski rental (Karlin, Manasse, McGeoch and Owicki 1994; for devices,
Irani, Shukla and Gupta 2003) -- and its cost is the switching cost ``beta`` of the online pause and
resume problem (Lechowicz et al. 2023, arXiv 2303.17551). That paper's double-threshold algorithm
decides *which* hours a job runs given ``beta``; here the hours are already decided (the window rule
or the deadline plan) and what is left is how to spend the gaps between them, which is exactly the
power-down problem: its switching cost enters the deadline policy itself (the pause-and-resume
rule's ``beta``) when that policy learns to plan with it.

The break-even wait is ``B = restart energy / (idle_kw - released_kw)``: waiting longer than ``B``
held costs more than one restart. With no forecast, holding for ``B`` and then releasing costs at
most twice the best choice made in hindsight, and no deterministic rule does better. A site usually
has a forecast of when its next window opens (its forecaster), and a forecast is worth following
only as far as it is right, so ``auto`` uses the learning-augmented rule of Purohit, Svitkina and
Kumar (NeurIPS 2018, "Improving online algorithms via ML predictions", Algorithm 2) with trust
``lambda`` (``release.trust``):

* the forecast says the gap lasts at least ``B``: release after ``lambda * B`` of waiting;
* it says shorter (or the window is near): release only after ``B / lambda``.

Its cost is at most ``(1 + lambda)`` x the hindsight optimum when the forecast is right and at most
``(1 + 1 / lambda)`` x whatever the forecast says (with ``lambda = 1`` the forecast is ignored and it is
the classic rule). The default ``lambda = 0.5`` costs at most 1.5x when the forecast is right and 3x
when it is wrong; the restart of a small trainer is a minute or two of training power, so in
practice a site waits about a minute (67 s with the defaults) before giving its GPUs back on a long
dirty spell.

Energy, not carbon: the rule compares kWh. Carbon would weigh the idle kWh at the (dirty) gap's
intensity and the restart's at the (clean) window's, which favours releasing even more; comparing
energy keeps the rule independent of a forecast of intensity levels and never releases where
carbon-weighing would hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np

from greenswarm.configuration import check_number
from greenswarm.errors import ConfigError
from greenswarm.scheduler.forecast import Forecaster
from greenswarm.scheduler.policy import HysteresisPolicy, WindowPolicy
from greenswarm.traces.trace import Trace

if TYPE_CHECKING:
    from greenswarm.scheduler.config import SchedulerConfig

ReleaseMode = Literal["never", "idle", "auto"]
RELEASE_MODES: tuple[str, ...] = get_args(ReleaseMode)

#: seconds from "start the trainer" to its first inner step when a run has not measured it: the
#: issue's goal for the ``small`` preset here (imports, torch, checkpoint load, rejoining the DHT).
ASSUMED_RESTART_S = 30.0
#: seconds to write the checkpoint a release starts with, when not measured
ASSUMED_CHECKPOINT_S = 5.0
#: how far ahead the forecast is searched for the next window (beyond it: "a long gap")
FORECAST_HORIZON_S = 48 * 3600.0
#: the forecast is read on this grid (the finest step of the traces in use)
FORECAST_STEP_S = 300.0


@dataclass
class ReleaseConfig:
    """Whether and when a site gives its GPUs back between windows (see the module's docstring).

    ``mode``: ``never`` holds the trainer through every gap (the node before releasing existed);
    ``idle`` releases at the end of every window; ``auto`` releases once waiting has cost more than
    a restart would, sooner when the site's forecaster expects a long gap. ``trust`` (0-1] is how
    far ``auto`` follows that forecast (1: not at all). ``restart_s`` and ``checkpoint_s`` are the
    seconds a restart and the release's checkpoint take at training power, before a run has measured
    them (``greenswarm simulate --calibrate`` reads the measured ones). The restart is drawn at
    training power, the checkpoint at idle power (the GPUs are held while it is written).
    """

    mode: ReleaseMode = "auto"
    trust: float = 0.5
    restart_s: float = ASSUMED_RESTART_S
    checkpoint_s: float = ASSUMED_CHECKPOINT_S

    def validate(self) -> None:
        if self.mode not in RELEASE_MODES:
            raise ConfigError(f"must be one of {', '.join(RELEASE_MODES)}, got {self.mode!r}", field="mode")
        check_number(self.trust, "trust", minimum=0.0, inclusive=False)
        if self.trust > 1.0:
            raise ConfigError(f"must be in (0, 1], got {self.trust!r}", field="trust")
        check_number(self.restart_s, "restart_s", minimum=0.0, inclusive=True)
        check_number(self.checkpoint_s, "checkpoint_s", minimum=0.0, inclusive=True)


@dataclass(frozen=True)
class ReleaseDecision:
    """What a site will do with the gap that starts now: release after ``hold_s`` seconds of waiting
    (``math.inf``: hold throughout), and why, in words for the log."""

    hold_s: float
    reason: str
    expected_gap_s: float | None = None

    @property
    def releases(self) -> bool:
        return math.isfinite(self.hold_s)


@dataclass(frozen=True)
class ReleaseRule:
    """The break-even rule for one site's power figures."""

    config: ReleaseConfig
    train_kw: float
    idle_kw: float
    released_kw: float = 0.0

    @property
    def restart_kwh(self) -> float:
        """Energy one release costs: its checkpoint, written holding the GPUs (idle power), and the
        restart, at training power."""
        return (self.config.restart_s * self.train_kw + self.config.checkpoint_s * self.idle_kw) / 3600.0

    @property
    def break_even_s(self) -> float:
        """Seconds of holding that cost as much as one restart (inf where holding draws no more
        than releasing)."""
        saved_kw = self.idle_kw - self.released_kw
        if saved_kw <= 0:
            return math.inf
        return self.restart_kwh * 3600.0 / saved_kw

    def decide(self, expected_gap_s: float | None, mode: str | None = None) -> ReleaseDecision:
        """How long to wait before releasing, at the start of a gap the forecaster expects to last
        ``expected_gap_s`` seconds (None: no forecast); ``mode`` in place of the config's (a gap
        that does not follow a window is decided as ``auto`` would: ``idle`` releases at windows'
        ends)."""
        mode, b = mode or self.config.mode, self.break_even_s
        if mode == "never":
            return ReleaseDecision(math.inf, "release.mode is never", expected_gap_s)
        if not math.isfinite(b):
            return ReleaseDecision(
                math.inf,
                f"holding draws {self.idle_kw:g} kW, no more than released ({self.released_kw:g} kW)",
                expected_gap_s,
            )
        if mode == "idle":
            return ReleaseDecision(0.0, "release.mode is idle", expected_gap_s)
        lam = self.config.trust
        if expected_gap_s is None:
            return ReleaseDecision(b, f"no forecast: release after the break-even {b:.0f} s", None)
        if expected_gap_s >= b:
            return ReleaseDecision(
                lam * b,
                f"forecast gap {_hours(expected_gap_s)} >= break-even {b:.0f} s: "
                f"release after {lam * b:.0f} s (trust {lam:g})",
                expected_gap_s,
            )
        return ReleaseDecision(
            b / lam,
            f"forecast gap {_hours(expected_gap_s)} < break-even {b:.0f} s: "
            f"hold, release only after {b / lam:.0f} s",
            expected_gap_s,
        )


def _hours(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 3600 else f"{seconds / 3600.0:.1f} h"


def release_forecaster(scheduler: SchedulerConfig, mode: str) -> Forecaster | None:
    """The forecaster ``auto`` consults: the site's own (``scheduler.forecast``), when it uses only
    the past -- one that reads the future (oracle, noisy) is not one a running site has. None: no
    forecast (``mode`` is not ``auto``, or such a forecaster)."""
    if mode != "auto":
        return None
    forecaster = scheduler.deadline_forecaster()
    return forecaster if getattr(forecaster, "past_only", True) else None


def enter_level(rule: WindowPolicy, trace: Trace, region: str) -> float:
    """The intensity below which ``rule`` opens a window in ``region`` (a percentile rule's level
    over the whole trace: an approximation of its rolling one)."""
    if isinstance(rule, HysteresisPolicy):
        return rule.enter_below
    return float(rule.threshold(trace, region))  # type: ignore[attr-defined]


def expected_gap_s(
    forecaster: Forecaster,
    trace: Trace,
    region: str,
    now: float,
    enter_below: float,
    *,
    horizon_s: float = FORECAST_HORIZON_S,
    step_s: float = FORECAST_STEP_S,
) -> float:
    """Seconds from ``now`` until ``forecaster`` (knowing ``trace`` up to ``now``) expects the
    intensity of ``region`` to fall below ``enter_below`` again; ``horizon_s`` if not within it.
    The first grid point is one step ahead: at ``now`` the site has just left a window."""
    times = now + np.arange(1, int(horizon_s // step_s) + 1) * step_s
    below = np.flatnonzero(forecaster.predict(trace, region, now, times) < enter_below)
    return float(times[below[0]] - now) if below.size else float(horizon_s)
