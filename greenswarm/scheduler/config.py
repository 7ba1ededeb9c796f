"""Configuration of the scheduler, the clock and the energy model.

Each dataclass validates itself and names the offending field by its own name only; a parent
prefixes its path with :meth:`ConfigError.located`, and the file loader adds the file and line. So a
bad value surfaces as ``site.yaml:12: scheduler.clock.speedup: must be > 0`` however deep it sits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from greenswarm.errors import ConfigError
from greenswarm.scheduler.clock import parse_instant
from greenswarm.traces.builtin import BUILTIN_TRACES

CLOCK_KINDS = ("wall", "replay")


def _number(value: object, name: str, *, minimum: float, inclusive: bool) -> None:
    """Check that ``value`` is a finite real number above ``minimum`` (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"must be a number, got {value!r}", field=name)
    if value < minimum or (not inclusive and value == minimum):
        raise ConfigError(f"must be {'>=' if inclusive else '>'} {minimum:g}, got {value!r}", field=name)


@dataclass
class ClockConfig:
    """``wall`` in production; ``replay`` runs trace time ``speedup`` x faster than real time.

    ``start`` is the ISO instant in trace time where a replay begins (default: the trace's start);
    ``start_wall`` the unix wall time at which it begins (default: when the clock is made). Sites of
    one replay must share ``start_wall`` to agree on clock time. Both are ignored by the wall clock.
    """

    kind: str = "wall"
    start: str | None = None
    speedup: float = 1.0
    start_wall: float | None = None

    def validate(self) -> None:
        if self.kind not in CLOCK_KINDS:
            raise ConfigError(f"must be one of {', '.join(CLOCK_KINDS)}, got {self.kind!r}", field="kind")
        _number(self.speedup, "speedup", minimum=0.0, inclusive=False)
        if self.start is not None:
            try:
                parse_instant(self.start)
            except ConfigError as err:
                raise err.located("start") from None
        if self.start_wall is not None:
            _number(self.start_wall, "start_wall", minimum=0.0, inclusive=True)


@dataclass
class SchedulerConfig:
    """Where the intensity comes from and when a site may train.

    ``trace`` is ``builtin``, ``builtin:<name>`` or a file path; ``timezone`` (IANA) applies to naive
    timestamps in the file. A site is in a window while intensity < ``threshold`` gCO2/kWh (100:
    the anchor's); windows shorter than ``min_window_s`` are skipped; while idle the site rechecks
    every ``poll_s`` seconds of clock time.
    """

    trace: str = "builtin"
    timezone: str | None = None
    threshold: float = 100.0
    min_window_s: float = 0.0
    poll_s: float = 10.0
    clock: ClockConfig = field(default_factory=ClockConfig)

    def validate(self) -> None:
        if not isinstance(self.trace, str) or not self.trace.strip():
            raise ConfigError("must be 'builtin', 'builtin:<name>' or a trace file path", field="trace")
        if self.trace.startswith("builtin:") and self.trace.partition(":")[2] not in BUILTIN_TRACES:
            raise ConfigError(
                f"no builtin trace '{self.trace.partition(':')[2]}'; available: {', '.join(BUILTIN_TRACES)}",
                field="trace",
            )
        if self.timezone is not None:
            try:
                ZoneInfo(self.timezone)
            except (ZoneInfoNotFoundError, ValueError, TypeError):
                raise ConfigError(
                    f"unknown timezone {self.timezone!r} (expected an IANA name such as Europe/Berlin)",
                    field="timezone",
                ) from None
        _number(self.threshold, "threshold", minimum=0.0, inclusive=False)
        _number(self.min_window_s, "min_window_s", minimum=0.0, inclusive=True)
        _number(self.poll_s, "poll_s", minimum=0.0, inclusive=False)
        if not isinstance(self.clock, ClockConfig):
            raise ConfigError("must be a mapping of clock settings", field="clock")
        try:
            self.clock.validate()
        except ConfigError as err:
            raise err.located("clock") from None


@dataclass
class EnergyConfig:
    """The site's power model. 2.024 kW while training is the anchor's (curtail-llm) figure; idle
    draw is 0 because greenswarm releases GPUs outside windows instead of keeping them provisioned."""

    train_kw: float = 2.024
    idle_kw: float = 0.0

    def validate(self) -> None:
        _number(self.train_kw, "train_kw", minimum=0.0, inclusive=True)
        _number(self.idle_kw, "idle_kw", minimum=0.0, inclusive=True)
