"""Configuration of the scheduler, the clock and the energy model.

:class:`TraceSource` holds where a site's intensity comes from and how the file is read;
:class:`SchedulerConfig` adds the window rule and the clock to it. A site YAML writes both in one
flat ``scheduler:`` section, as it always has.

Each dataclass validates itself and names the offending field by its own name only; a parent
prefixes its path with :meth:`ConfigError.located`, and the file loader adds the file and line. So a
bad value surfaces as ``site.yaml:12: scheduler.clock.speedup: must be > 0`` however deep it sits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from greenswarm.configuration import check_number, validate_section
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.scheduler.forecast import FILE_PREFIX, FORECASTERS, Forecaster, forecaster_from_spec
from greenswarm.scheduler.policy import HysteresisPolicy, PercentilePolicy, WindowPolicy
from greenswarm.signals.config import ON_SIGNAL_LOSS, SignalConfig
from greenswarm.timefmt import NaiveTimeError, parse_instant, parse_iso
from greenswarm.traces.builtin import BUILTIN_TRACES
from greenswarm.traces.readers import INTERPOLATIONS, UNITS, VARIANTS

ClockKind = Literal["wall", "replay"]
CLOCK_KINDS: tuple[str, ...] = get_args(ClockKind)
#: Where a site's power draw comes from (see :class:`EnergyConfig`).
PowerSource = Literal["auto", "config", "nvml"]
POWER_SOURCES: tuple[str, ...] = get_args(PowerSource)

#: ``scheduler.policy``: a window rule, or a plan to finish the work by a deadline
POLICIES = ("threshold", "deadline")
#: forecasters a running site can use (the rest read the trace's future)
PAST_ONLY = ("profile", "climatology", "seasonal", "persistence")

#: kW a site draws while training unless its config says otherwise: the curtail-llm anchor's
#: figure, which its paper's kWh and kg and every greenswarm comparison with it use.
ANCHOR_TRAIN_KW = 2.024
#: kW the anchor's sites drew while provisioned but not training (its ``curtail-llm`` policy's idle).
ANCHOR_IDLE_KW = 0.468


def _choice(value: object, choices: tuple[str, ...] | list[str], name: str) -> None:
    """Check that ``value`` is one of ``choices``, ignoring case as the trace readers do (so these
    fields stay ``str``: a ``Literal`` field matches exactly)."""
    if not isinstance(value, str) or value.strip().lower() not in {c.lower() for c in choices}:
        raise ConfigError(f"must be one of {', '.join(choices)}, got {value!r}", field=name)


def _offset_origin(start: object, timezone: str | None) -> None:
    """Check the ``start`` of offset-seconds traces: unix seconds or an ISO 8601 instant; a naive
    instant only with a ``timezone`` (the reader resolves it there, as it does naive cells)."""
    text = str(start).strip()
    try:
        seconds: float | None = float(text)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not math.isfinite(seconds):
            raise ConfigError(f"must be finite seconds or an ISO 8601 instant, got {start!r}", field="start")
        return
    try:
        parse_iso(text)
    except NaiveTimeError:
        if timezone is None:
            raise ConfigError(
                f"{start!r} has no UTC offset; add Z or +HH:MM, or set timezone", field="start"
            ) from None
    except ValueError:
        raise ConfigError(
            f"cannot parse {start!r} as unix seconds or an ISO 8601 time such as 2026-01-11T17:00:00Z",
            field="start",
        ) from None


@dataclass
class ClockConfig:
    """``wall`` in production; ``replay`` runs trace time ``speedup`` x faster than real time.

    ``start`` is the ISO instant in trace time where a replay begins (default: the trace's start);
    ``start_wall`` the unix wall time at which it begins (default: when the clock is made). Sites of
    one replay must share ``start_wall`` to agree on clock time. ``start_file`` instead of
    ``start_wall``: a file that will hold the shared start (Unix seconds); each site joins the swarm,
    then waits for it, so whoever launches the sites starts the replay once all of them are ready
    (the demo does). All of these are ignored by the wall clock.
    """

    kind: ClockKind = "wall"
    start: str | None = None
    speedup: float = 1.0
    start_wall: float | None = None
    start_file: str | None = None

    def validate(self) -> None:
        if self.kind not in CLOCK_KINDS:
            raise ConfigError(f"must be one of {', '.join(CLOCK_KINDS)}, got {self.kind!r}", field="kind")
        check_number(self.speedup, "speedup", minimum=0.0, inclusive=False)
        if self.start is not None:
            try:
                parse_instant(self.start)
            except ConfigError as err:
                raise err.located("start") from None
        if self.start_wall is not None:
            check_number(self.start_wall, "start_wall", minimum=0.0, inclusive=True)
        if self.start_file is not None:
            if not isinstance(self.start_file, str) or not self.start_file.strip():
                raise ConfigError(f"must be a file path, got {self.start_file!r}", field="start_file")
            if self.start_wall is not None:
                raise ConfigError("give start_wall or start_file, not both", field="start_file")


@dataclass
class TraceSource:
    """Where a site's intensity comes from and how the trace file is read.

    ``trace`` is ``builtin``, ``builtin:<name>``, a file path (plain or gzip/xz/bzip2-compressed CSV)
    or a directory of one-zone exports, merged into one trace; ``timezone`` (IANA) applies to naive
    timestamps in the file. The reader's options: ``units`` of the file's values (g/kWh, kg/kWh,
    lbs/MWh), ``variant`` of an Electricity Maps export (direct or lca), ``start`` (unix seconds or
    ISO instant) that plain-number time cells count from in offset-seconds traces (Vessim-style; not
    the replay start, which is ``clock.start``), ``max_gap_s`` the longest hole allowed between
    samples (default a few median steps), and ``interpolate``: ``hold`` keeps the published step
    function, as a live controller sees it; ``linear`` interpolates onto a ``grid_s`` grid, the
    curtail-llm anchor's convention, for replays that should match its accounting.

    ``units``, ``variant`` and ``interpolate`` match case-insensitively, as the reader does, so they
    are plain strings checked here rather than ``Literal`` fields.
    """

    trace: str = "builtin"
    timezone: str | None = None
    units: str = "g/kWh"
    variant: str = "direct"
    start: str | None = None
    interpolate: str = "hold"
    grid_s: float = 60.0
    max_gap_s: float | None = None

    def validate(self) -> None:
        """Checked here so a typo stops the site at start-up with the config's file and line instead
        of inside the reader."""
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
        _choice(self.units, list(UNITS), "units")
        _choice(self.variant, list(VARIANTS), "variant")
        _choice(self.interpolate, INTERPOLATIONS, "interpolate")
        check_number(self.grid_s, "grid_s", minimum=0.0, inclusive=False)
        if self.max_gap_s is not None:
            check_number(self.max_gap_s, "max_gap_s", minimum=0.0, inclusive=False)
        if self.start is not None:
            _offset_origin(self.start, self.timezone)

    def trace_options(self) -> dict[str, Any]:
        """Keyword options for :func:`~greenswarm.traces.load_trace`, so every caller that loads a
        site's trace reads it the same way."""
        return {
            "tz": self.timezone,
            "units": self.units,
            "variant": self.variant,
            "start": self.start,
            "max_gap_s": self.max_gap_s,
            "interpolate": self.interpolate,
            "grid_s": self.grid_s,
        }


@dataclass
class SchedulerConfig(TraceSource):
    """When a site may train: its :class:`TraceSource` (inherited, so a site YAML keeps one flat
    ``scheduler:`` section), the window rule and the clock.

    A site is in a window while intensity < ``threshold`` gCO2/kWh (100: the anchor's); windows
    shorter than ``min_window_s`` are skipped; while idle the site rechecks every ``poll_s`` seconds
    of clock time.

    The window rule (see :mod:`greenswarm.scheduler.policy`): a site enters below ``threshold`` and
    leaves once intensity has been >= ``leave_above`` (default: ``threshold``) for ``dwell_s``
    seconds; with ``lookahead`` (a forecaster: oracle, seasonal, persistence, climatology, noisy) it
    leaves at once when the forecast says the dirty spell will outlast the dwell. The anchor's rule
    is ``threshold: 100, dwell_s: 600``. Alternatively ``percentile`` (0-100) opens windows below
    that percentile of the region's own trace, rolling over the last ``percentile_period_s`` seconds
    when set; it does not combine with ``leave_above``/``dwell_s``/``lookahead``.

    ``signal`` (see :mod:`greenswarm.signals.config`) makes the site read its intensity live -- a trace
    replayed sample by sample, a file a cron job rewrites, Electricity Maps or WattTime -- and decide
    its windows as samples arrive (:mod:`greenswarm.scheduler.live`). When the signal stops,
    ``on_signal_loss`` says what happens: ``pause`` training, ``hold-last`` value or follow the last
    ``forecast``, for at most ``max_staleness_s`` past the last sample's interval, then pause.

    ``policy: deadline`` replaces the window rule by a plan (:mod:`greenswarm.scheduler.deadline`):
    finish ``work_hours`` site-hours, or ``work_tokens`` tokens, by ``deadline`` (an ISO 8601 instant)
    in the cleanest hours that ``forecast`` (a past-only forecaster: profile, climatology, seasonal,
    persistence, or ``file:PATH`` of issued forecasts) sees, planning ``(1 + margin)`` x the work
    left; ``threshold`` caps the plan and is the rule while there is under a day of history. With
    ``shared: true`` the deadline and ``work_tokens`` are the swarm's: every site publishes what it can
    still train and how clean (its forecast, in its progress record), and the sites divide the tokens
    left so that the cleanest forecast site-hours of all regions are used.
    """

    threshold: float = 100.0
    min_window_s: float = 0.0
    poll_s: float = 10.0
    leave_above: float | None = None
    dwell_s: float = 0.0
    lookahead: str | None = None
    percentile: float | None = None
    percentile_period_s: float | None = None
    clock: ClockConfig = field(default_factory=ClockConfig)
    signal: SignalConfig | None = None
    on_signal_loss: str = "hold-last"
    max_staleness_s: float = 3600.0
    policy: str = "threshold"
    deadline: str | None = None
    work_hours: float | None = None
    work_tokens: int | None = None
    forecast: str = "profile"
    margin: float = 0.0
    shared: bool = False

    def validate(self) -> None:
        super().validate()
        check_number(self.threshold, "threshold", minimum=0.0, inclusive=False)
        check_number(self.min_window_s, "min_window_s", minimum=0.0, inclusive=True)
        check_number(self.poll_s, "poll_s", minimum=0.0, inclusive=False)
        self._validate_rule()
        validate_section(self.clock, ClockConfig, "clock")
        self._validate_signal()
        self._validate_deadline()

    def _validate_deadline(self) -> None:
        """``policy: deadline``: an instant, exactly one kind of work, a forecaster that needs no future."""
        if self.policy not in POLICIES:
            raise ConfigError(f"must be one of {', '.join(POLICIES)}, got {self.policy!r}", field="policy")
        deadline_fields = ("deadline", "work_hours", "work_tokens")
        if not isinstance(self.shared, bool):
            raise ConfigError(f"must be true or false, got {self.shared!r}", field="shared")
        if self.policy != "deadline":
            for name in deadline_fields:
                if getattr(self, name) is not None:
                    raise ConfigError("needs policy: deadline", field=name)
            if self.shared:
                raise ConfigError("needs policy: deadline", field="shared")
            return
        if self.deadline is None:
            raise ConfigError("policy: deadline needs the instant to finish by", field="deadline")
        try:
            parse_instant(self.deadline)
        except ConfigError as err:
            raise ConfigError(str(err), field="deadline") from None
        if (self.work_hours is None) == (self.work_tokens is None):
            raise ConfigError(
                "policy: deadline needs exactly one of work_hours (site-hours) and work_tokens",
                field="work_hours",
            )
        if self.work_hours is not None:
            check_number(self.work_hours, "work_hours", minimum=0.0, inclusive=False)
        if self.work_tokens is not None and (
            isinstance(self.work_tokens, bool)
            or not isinstance(self.work_tokens, int)
            or self.work_tokens < 1
        ):
            raise ConfigError(
                f"must be a whole number of tokens >= 1, got {self.work_tokens!r}", field="work_tokens"
            )
        check_number(self.margin, "margin", minimum=0.0, inclusive=True)
        if self.shared and self.work_tokens is None:
            raise ConfigError(
                "a swarm shares a token target: give work_tokens (the same at every site, as the deadline)",
                field="shared",
            )
        forecaster = self.deadline_forecaster()
        if not getattr(forecaster, "past_only", True):
            raise ConfigError(
                f"{self.forecast} reads the future, which a running site does not have; "
                f"use one of {', '.join(PAST_ONLY)} or file:PATH",
                field="forecast",
            )
        for name, default in (
            ("lookahead", None),
            ("percentile", None),
            ("leave_above", None),
            ("dwell_s", 0.0),
        ):
            if getattr(self, name) != default:
                raise ConfigError("is a window rule; policy: deadline plans instead", field=name)
        if self.min_window_s:
            raise ConfigError("is a window rule; policy: deadline plans instead", field="min_window_s")

    def deadline_forecaster(self) -> Forecaster:
        """The forecaster the deadline plan uses: by name, or forecasts as issued in a file."""
        spec = str(self.forecast).strip()
        if spec.startswith(FILE_PREFIX):
            try:
                return forecaster_from_spec(spec, tz=self.timezone, units=self.units)
            except GreenswarmError as err:
                raise ConfigError(str(err), field="scheduler.forecast") from None
        _choice(spec.lower(), list(FORECASTERS), "forecast")
        return forecaster_from_spec(spec.lower())

    def _validate_signal(self) -> None:
        """The live signal and what a site does when it fails (see :mod:`greenswarm.scheduler.live`)."""
        # exact, unlike _choice: the schedule compares the value as written
        if self.on_signal_loss not in ON_SIGNAL_LOSS:
            raise ConfigError(
                f"must be one of {', '.join(ON_SIGNAL_LOSS)}, got {self.on_signal_loss!r}",
                field="on_signal_loss",
            )
        check_number(self.max_staleness_s, "max_staleness_s", minimum=0.0, inclusive=True)
        if self.signal is None:
            return
        validate_section(self.signal, SignalConfig, "signal")
        if self.on_signal_loss == "forecast" and not self.signal.forecast:
            raise ConfigError(
                "needs a signal that reads forecasts (signal.forecast: true)", field="on_signal_loss"
            )
        if self.signal.is_api and self.clock.kind == "replay" and self.clock.start is None:
            raise ConfigError(
                f"a replayed {self.signal.kind} feed needs clock.start (there is no trace to start from)",
                field="clock.start",
            )
        # what needs the future, or the whole trace, which a live signal does not have
        if self.lookahead is not None:
            raise ConfigError(
                "look-ahead reads a whole trace; a live signal has no future", field="lookahead"
            )
        if self.min_window_s:
            raise ConfigError(
                "a live site cannot know how long a window will last; leave it 0 with a signal",
                field="min_window_s",
            )
        if self.percentile is not None and self.percentile_period_s is None:
            raise ConfigError(
                "a live signal has no whole trace to take a percentile of: set percentile_period_s",
                field="percentile",
            )

    def _validate_rule(self) -> None:
        """The window rule's fields, including the combinations that make no sense."""
        if self.leave_above is not None:
            check_number(self.leave_above, "leave_above", minimum=0.0, inclusive=False)
            if self.leave_above < self.threshold:
                raise ConfigError(
                    f"must be >= threshold ({self.threshold:g}), got {self.leave_above!r}",
                    field="leave_above",
                )
        check_number(self.dwell_s, "dwell_s", minimum=0.0, inclusive=True)
        if self.lookahead is not None and not str(self.lookahead).startswith(FILE_PREFIX):
            _choice(self.lookahead, [*FORECASTERS, "file:PATH"], "lookahead")
        elif self.lookahead is not None and not self.lookahead[len(FILE_PREFIX) :].strip():
            raise ConfigError("file: needs the path of a forecast file", field="lookahead")
        if self.percentile is not None:
            check_number(self.percentile, "percentile", minimum=0.0, inclusive=False)
            if self.percentile > 100:
                raise ConfigError(f"must be <= 100, got {self.percentile!r}", field="percentile")
            for name in ("leave_above", "lookahead"):
                if getattr(self, name) is not None:
                    raise ConfigError("does not combine with percentile", field=name)
            if self.dwell_s:
                raise ConfigError("does not combine with percentile", field="dwell_s")
        if self.percentile_period_s is not None:
            check_number(self.percentile_period_s, "percentile_period_s", minimum=0.0, inclusive=False)
            if self.percentile is None:
                raise ConfigError("needs percentile to be set", field="percentile_period_s")

    def _lookahead(self) -> Forecaster | None:
        """The look-ahead forecaster: by name, or forecasts as issued in a file (read like the trace)."""
        if self.lookahead is None:
            return None
        spec = self.lookahead.strip()
        if spec.startswith(FILE_PREFIX):
            try:
                return forecaster_from_spec(spec, tz=self.timezone, units=self.units)
            except GreenswarmError as err:
                raise ConfigError(str(err), field="scheduler.lookahead") from None
        return forecaster_from_spec(spec.lower())

    def window_policy(self) -> WindowPolicy:
        """The window rule these fields describe; the node and ``greenswarm simulate`` both use it,
        so a simulated policy and a running site are configured the same way."""
        if self.percentile is not None:
            return PercentilePolicy(self.percentile, self.min_window_s, self.percentile_period_s)
        return HysteresisPolicy(
            self.threshold,
            self.leave_above,
            dwell_s=self.dwell_s,
            min_window_s=self.min_window_s,
            lookahead=self._lookahead(),
        )


@dataclass
class EnergyConfig:
    """The site's power model. :data:`ANCHOR_TRAIN_KW` while training and :data:`ANCHOR_IDLE_KW` while
    idle are the anchor's (curtail-llm) figures for its machines, training and provisioned but not
    training. A site's node keeps its process, and its model and optimizer state on the GPUs, while
    IDLE (it does not release them), so an idle site draws what a provisioned machine draws; set
    ``idle_kw: 0`` only where the GPUs do other work, or are powered down, while the site waits.

    ``source`` says where the training draw comes from: ``config`` always uses ``train_kw``;
    ``nvml`` measures the GPUs this process sees through NVML (and refuses to start without it);
    ``auto`` measures when NVML and a GPU are there and uses ``train_kw`` otherwise, so one config
    serves a GPU site and a CPU replay alike. A measured draw covers the GPUs only, so it is
    multiplied by ``nvml_overhead`` (>= 1) for the rest of the machine: CPUs, fans, PSU losses.
    A measured draw is measured in every state: while IDLE it is what the GPUs draw holding the model.

    ``released_kw`` is what a site is charged while it has given its GPUs back between windows
    (:mod:`greenswarm.scheduler.release`): 0 by default, since released GPUs do other work (whose
    draw is that work's) or sleep; set it to what a sleeping machine still draws where it is the
    site's to pay.
    """

    train_kw: float = ANCHOR_TRAIN_KW
    idle_kw: float = ANCHOR_IDLE_KW
    released_kw: float = 0.0
    source: PowerSource = "auto"
    nvml_overhead: float = 1.0

    def validate(self) -> None:
        check_number(self.train_kw, "train_kw", minimum=0.0, inclusive=True)
        check_number(self.idle_kw, "idle_kw", minimum=0.0, inclusive=True)
        check_number(self.released_kw, "released_kw", minimum=0.0, inclusive=True)
        if self.source not in POWER_SOURCES:
            raise ConfigError(
                f"must be one of {', '.join(POWER_SOURCES)}, got {self.source!r}", field="source"
            )
        # Below 1 would book less than the GPUs alone draw: almost surely "0.2" meant "+20 %".
        check_number(self.nvml_overhead, "nvml_overhead", minimum=1.0, inclusive=True)
