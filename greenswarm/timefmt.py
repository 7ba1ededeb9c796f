"""Time as people read it in logs, tables and reports (UTC, always marked ``Z``), and the one
ISO 8601 parser that configs, trace files, certificates and the CLI share.

A leaf module: it imports nothing from greenswarm but :mod:`greenswarm.errors`, so the scheduler,
the traces, the node, the simulator and the CLI can all use it without importing one another.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, tzinfo

from greenswarm.errors import ConfigError

#: the example every "cannot parse" message gives
ISO_EXAMPLE = "2026-01-11T17:00:00Z"


def utc_minute(t: float) -> str:
    """Unix seconds as ``2026-01-11 17:00Z`` (log lines, window ends, the demo's replay clock)."""
    return time.strftime("%Y-%m-%d %H:%MZ", time.gmtime(t))


def utc_second(t: float) -> str:
    """Unix seconds as ``2026-01-11 17:00:05Z`` (certificate validity)."""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def utc_short(t: float | None) -> str:
    """Unix seconds as ``01-11 17:00Z`` for narrow table columns; ``-`` for no time."""
    return "-" if t is None else time.strftime("%m-%d %H:%MZ", time.gmtime(t))


def iso_utc(t: float, *, milliseconds: bool = False) -> str:
    """Unix seconds as an ISO 8601 UTC instant, ``2026-01-11T17:05:00Z``.

    Whole seconds by default (a fraction is dropped); with ``milliseconds`` a time with a fraction
    keeps it to the millisecond (``...T17:05:00.250Z``), and a whole second is still written without.
    """
    stamp = datetime.fromtimestamp(t, tz=UTC)
    spec = "milliseconds" if milliseconds and stamp.microsecond else "seconds"
    return stamp.isoformat(timespec=spec).replace("+00:00", "Z")


def naive_utc(t: float) -> datetime:
    """Unix seconds as a naive UTC :class:`datetime` (what matplotlib's date axis wants)."""
    return datetime.fromtimestamp(float(t), tz=UTC).replace(tzinfo=None)


class NaiveTimeError(ValueError):
    """An ISO 8601 time without a UTC offset where no zone was given to place it."""


def parse_iso(text: str, zone: tzinfo | None = None) -> float:
    """Parse an ISO 8601 time (surrounding blanks ignored) to unix seconds.

    A time with an offset or ``Z`` is taken as written. A naive one is placed in ``zone``; without a
    zone it raises :class:`NaiveTimeError` (guessing UTC or the machine's zone would shift every
    window by hours without a visible error). Unparseable text raises :class:`ValueError`. Callers
    turn both into their own error, naming their field or file.
    """
    stamp = datetime.fromisoformat(text.strip())
    if stamp.tzinfo is None:
        if zone is None:
            raise NaiveTimeError(f"{text!r} has no UTC offset")
        stamp = stamp.replace(tzinfo=zone)
    return stamp.timestamp()


def parse_instant(text: str) -> float:
    """Parse an ISO 8601 instant with an offset or ``Z`` to unix seconds (config fields, ``--start``).

    A naive time is refused: in a config it would mean a different instant on every machine.
    """
    if not isinstance(text, str):
        raise ConfigError(f"expected an ISO 8601 time such as {ISO_EXAMPLE}, got {text!r}")
    try:
        return parse_iso(text)
    except NaiveTimeError:
        raise ConfigError(f"'{text}' has no UTC offset; add Z or +HH:MM") from None
    except ValueError:
        raise ConfigError(f"cannot parse '{text}' as an ISO 8601 time such as {ISO_EXAMPLE}") from None
