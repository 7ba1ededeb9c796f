"""Clocks: what time it is in the trace, and how long that takes in wall time.

A site asks its clock for "now" and looks the answer up in its windows. In production the clock is
the wall clock; in demos, tests and simulations it replays trace time faster than real time. Both
are the same :class:`ScaledClock` (clock time = ``start + (wall - start_wall) * speedup``; the wall
clock is the case start = start_wall = 0, speedup = 1), so the code that production runs is the code
every replay exercises; there is no test-only branch.

Several processes replaying one trace agree on clock time as long as they share ``start`` and
``start_wall`` (they read the same system clock), which is how the demo's sites stay in step.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from greenswarm.errors import ConfigError
from greenswarm.timefmt import parse_instant

if TYPE_CHECKING:
    from greenswarm.scheduler.config import ClockConfig


#: what a site logs once it has joined the swarm and waits for its replay's start file: whoever
#: launched the sites writes the file when every one of them has said so
WAITING_FOR_START = "ready: waiting for the replay to start"


class Clock(Protocol):
    """The time source a site schedules against."""

    def now(self) -> float:
        """Unix seconds in clock time (trace time for replays)."""
        ...

    def wall_seconds(self, clock_seconds: float) -> float:
        """Wall seconds that ``clock_seconds`` of clock time take."""
        ...

    def sleep_until(self, t: float, max_wall_s: float | None = None) -> None:
        """Sleep (wall) until ``now() >= t``, but at most ``max_wall_s`` wall seconds."""
        ...

    @property
    def started(self) -> bool:
        """Whether clock time runs yet (False only for a replay still waiting for its start file)."""
        ...

    def wait_for_start(
        self, stop: threading.Event | None = None, timeout_s: float | None = None, poll_s: float = 0.05
    ) -> bool:
        """Block until clock time runs (a replay can wait for its start file); whether it does."""
        ...


class ScaledClock:
    """Clock time runs ``speedup`` times faster than the wall clock, from ``start`` at ``start_wall``.

    Before ``start_wall`` (a replay whose start lies in the future) ``now()`` is before ``start``,
    so sites launched a little early simply wait for the shared start.
    """

    def __init__(self, start: float, speedup: float, start_wall: float):
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
        self.start = float(start)
        self.speedup = float(speedup)
        self.start_wall = float(start_wall)

    def now(self) -> float:
        return self.start + (time.time() - self.start_wall) * self.speedup

    def wall_seconds(self, clock_seconds: float) -> float:
        return clock_seconds / self.speedup

    def sleep_until(self, t: float, max_wall_s: float | None = None) -> None:
        """Sleep until clock time ``t``, or for ``max_wall_s`` wall seconds, whichever comes first.

        Loops because ``time.sleep`` can return early on some platforms and the wall clock can be
        stepped (NTP); the budget counts the wall seconds asked of ``time.sleep``, so a caller that
        polls with a short ``max_wall_s`` gets control back on time.
        """
        budget = math.inf if max_wall_s is None else max(0.0, float(max_wall_s))
        while True:
            remaining = self.wall_seconds(t - self.now())
            if remaining <= 0 or budget <= 0:
                return
            nap = min(remaining, budget)
            time.sleep(nap)
            budget -= nap

    @property
    def started(self) -> bool:
        """Whether clock time runs (a replay may still wait for its start file)."""
        return True

    def wait_for_start(
        self, stop: threading.Event | None = None, timeout_s: float | None = None, poll_s: float = 0.05
    ) -> bool:
        """Block until clock time runs; a clock with a fixed start runs from the outset."""
        return True

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(start={self.start}, speedup={self.speedup}, start_wall={self.start_wall})"


class WallClock(ScaledClock):
    """Production clock: clock time is wall time."""

    def __init__(self) -> None:
        super().__init__(start=0.0, speedup=1.0, start_wall=0.0)


class ReplayClock(ScaledClock):
    """Replays trace time from ``start`` at ``speedup`` x real time, beginning at wall time ``start_wall``.

    ``start_wall`` defaults to the moment of construction; sites of one replay must share it. With
    ``start_file`` instead, the start is not known yet: whoever launched the sites writes the shared
    start time into that file once all of them are ready (the demo and the tests do), and each site
    waits for it (:meth:`wait_for_start`). A fixed start guesses how long sites take to come up, and
    on a loaded machine a late site misses the windows it was meant to train in; a start file waits
    for the event itself. Until the start is known the clock stands at ``start``.
    """

    def __init__(
        self,
        start: float,
        speedup: float,
        start_wall: float | None = None,
        start_file: str | Path | None = None,
    ):
        if start_file is not None and start_wall is not None:
            raise ValueError("give a replay's start_wall or its start_file, not both")
        wall = time.time() if start_wall is None and start_file is None else start_wall
        super().__init__(start=start, speedup=speedup, start_wall=math.nan if wall is None else wall)
        self.start_file = None if start_file is None else Path(start_file)

    @property
    def started(self) -> bool:
        """Whether the replay's start is known (always, unless it comes from a start file)."""
        return not math.isnan(self.start_wall) or self._read_start_file()

    def now(self) -> float:
        return super().now() if self.started else self.start

    def sleep_until(self, t: float, max_wall_s: float | None = None) -> None:
        if not self.started:  # nothing moves until the start is known: wait for it, within the budget
            self.wait_for_start(timeout_s=max_wall_s)
        if self.started:
            super().sleep_until(t, max_wall_s)

    def wait_for_start(
        self, stop: threading.Event | None = None, timeout_s: float | None = None, poll_s: float = 0.05
    ) -> bool:
        """Block until the start is known (the start file appeared), ``stop`` is set or ``timeout_s``
        wall seconds pass; returns whether the replay has a start."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while not self.started:
            if (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def _read_start_file(self) -> bool:
        """Take the start from the start file if it is there (it holds Unix seconds, written whole)."""
        if self.start_file is None:
            return False
        try:
            text = self.start_file.read_text()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise ConfigError(f"cannot read the replay's start file {self.start_file}: {e}") from None
        try:
            wall = float(text.strip())
        except ValueError:
            wall = math.nan
        if not math.isfinite(wall) or wall < 0:
            raise ConfigError(
                f"{self.start_file}: expected the replay's start as Unix seconds, got {text.strip()[:40]!r}"
            )
        self.start_wall = wall
        return True


def write_start_file(path: str | Path, start_wall: float) -> None:
    """Write a replay's start (Unix seconds) into ``path`` whole: readers see all of it or nothing."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(repr(float(start_wall)))
    os.replace(partial, path)


def make_clock(cfg: ClockConfig, trace_start: float) -> Clock:
    """Build the clock a config asks for; a replay starts at ``cfg.start`` or else the trace's start."""
    cfg.validate()
    if cfg.kind == "wall":
        return WallClock()
    start = trace_start if cfg.start is None else parse_instant(cfg.start)
    return ReplayClock(start=start, speedup=cfg.speedup, start_wall=cfg.start_wall, start_file=cfg.start_file)
