"""Reading traces from files.

Traces come from many exporters (WattTime, Electricity Maps, Vessim, curtail-llm, hand-made
spreadsheets). Each format gets one ``read_*`` function returning a :class:`Trace`; :func:`load_trace`
is the single entry point that configs and the CLI use, so adding a format means adding a reader and
teaching :func:`_reader_for` to recognise it, nothing else.

Every error names the file and line, because a user staring at a 9000-row export needs to know
exactly where the bad cell is.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from datetime import datetime, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np

from greenswarm.errors import TraceError
from greenswarm.traces.builtin import BUILTIN_TRACES, DEFAULT_BUILTIN
from greenswarm.traces.trace import Trace, median_resolution

if TYPE_CHECKING:
    from _csv import Reader as CsvReader

#: How many median steps a gap between samples may span before the trace is rejected. A longer
#: hole would silently hold one stale value for hours, which is worse than refusing the file.
DEFAULT_MAX_GAP_STEPS = 3.0

#: A reader takes a path and the timezone for naive timestamps and returns a trace.
TraceReader = Callable[..., Trace]


def _zone(tz: str) -> tzinfo:
    """Resolve an IANA timezone name, with an error that says what was expected."""
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise TraceError(f"unknown timezone '{tz}' (expected an IANA name such as Europe/Berlin)") from None


def parse_timestamp(text: str, zone: tzinfo | None, where: str) -> float:
    """Parse one ISO 8601 timestamp to unix seconds.

    Timestamps with an offset or ``Z`` are taken as written. Naive ones are only accepted with an
    explicit ``zone``: guessing UTC (or the machine's zone) would shift every window by hours
    without any visible error. ``where`` is the ``file:line`` prefix for messages.
    """
    text = text.strip()
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(f"{where}: cannot parse timestamp '{text}' (expected ISO 8601)") from None
    if stamp.tzinfo is None:
        if zone is None:
            raise TraceError(f"{where}: naive timestamp '{text}'; pass a timezone (--tz)")
        stamp = stamp.replace(tzinfo=zone)
    return stamp.timestamp()


def _parse_value(text: str, column: str, where: str) -> float:
    """Parse one intensity cell; must be a finite number >= 0."""
    cell = text.strip()
    if not cell:
        raise TraceError(f"{where}: empty value in column '{column}'")
    try:
        value = float(cell)
    except ValueError:
        raise TraceError(f"{where}: non-numeric value '{cell}' in column '{column}'") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: value '{cell}' in column '{column}' is not a finite number")
    if value < 0:
        raise TraceError(f"{where}: negative value {cell} in column '{column}'")
    return value


def _read_header(rows: CsvReader, name: str) -> list[str]:
    """Return the region names from the header row (skipping blank lines before it)."""
    for header in rows:
        if not any(cell.strip() for cell in header):
            continue
        where = f"{name}:{rows.line_num}"
        if len(header) < 2:
            raise TraceError(f"{where}: need a timestamp column and at least one region column")
        regions = [cell.strip() for cell in header[1:]]
        seen: set[str] = set()
        for region in regions:
            if not region:
                raise TraceError(f"{where}: a region column has an empty name")
            if region in seen:
                raise TraceError(f"{where}: region column '{region}' appears twice")
            seen.add(region)
        return regions
    raise TraceError(f"{name}:1: empty file")


def read_csv_trace(path: str | Path, tz: str | None = None, max_gap_s: float | None = None) -> Trace:
    """Read a *wide* CSV trace: a timestamp column, then one gCO2/kWh column per region.

    The first column's header can be anything (``point_time``, ``datetime``...); every other header
    names a region. ``tz`` is the IANA zone of naive timestamps (ignored for ones with an offset).
    ``max_gap_s`` bounds the step between consecutive samples; by default 3 x the median step.
    Timestamps must strictly increase: a duplicate usually means a DST fall-back hour read in the
    wrong zone or two exports concatenated, and either would corrupt the windows.
    """
    name = str(path)
    zone = _zone(tz) if tz is not None else None
    try:
        handle = open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"{name}: no such trace file") from None
    except OSError as err:
        raise TraceError(f"{name}: cannot read trace file ({err.strerror or err})") from None
    times: list[float] = []
    lines: list[int] = []
    with handle:
        rows = csv.reader(handle)
        try:
            regions = _read_header(rows, name)
            columns: list[list[float]] = [[] for _ in regions]
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                where = f"{name}:{rows.line_num}"
                if len(row) != len(regions) + 1:
                    raise TraceError(f"{where}: expected {len(regions) + 1} columns, found {len(row)}")
                t = parse_timestamp(row[0], zone, where)
                if times and t <= times[-1]:
                    what = "duplicate" if t == times[-1] else "non-increasing"
                    raise TraceError(
                        f"{where}: {what} timestamp '{row[0].strip()}' (previous sample on line {lines[-1]})"
                    )
                for column, region, cell in zip(columns, regions, row[1:], strict=True):
                    column.append(_parse_value(cell, region, where))
                times.append(t)
                lines.append(rows.line_num)
        except csv.Error as err:
            raise TraceError(f"{name}:{rows.line_num}: malformed CSV ({err})") from None
        except UnicodeDecodeError:
            raise TraceError(f"{name}: not a UTF-8 text file") from None
    if not times:
        raise TraceError(f"{name}:{rows.line_num}: no data rows after the header")
    time_axis = np.array(times, dtype=np.float64)
    _check_gaps(time_axis, lines, name, max_gap_s)
    values = {region: np.array(col, dtype=np.float64) for region, col in zip(regions, columns, strict=True)}
    return Trace(time_axis, values, median_resolution(time_axis), name)


def _check_gaps(times: np.ndarray, lines: list[int], name: str, max_gap_s: float | None) -> None:
    """Reject a step longer than ``max_gap_s`` (default: a few median steps), naming its line."""
    if len(times) < 2:
        return
    steps = np.diff(times)
    limit = DEFAULT_MAX_GAP_STEPS * float(np.median(steps)) if max_gap_s is None else float(max_gap_s)
    too_long = np.flatnonzero(steps > limit)
    if too_long.size:
        i = int(too_long[0])
        raise TraceError(
            f"{name}:{lines[i + 1]}: gap of {steps[i]:g} s since the previous sample "
            f"(line {lines[i]}); at most {limit:g} s allowed"
        )


def _reader_for(path: Path) -> TraceReader:
    """Pick the reader for a file. Only the wide CSV format exists so far; sniffing the header to
    recognise WattTime, Electricity Maps and Vessim exports goes here."""
    return read_csv_trace


def load_trace(spec: str, tz: str | None = None) -> Trace:
    """Load the trace named by a config's ``trace`` field or the CLI's ``--trace``.

    ``builtin`` or ``builtin:<name>`` is the offline model (no files needed, so the demo always
    runs); anything else is a path. ``tz`` applies to naive timestamps in files.
    """
    if spec == "builtin" or spec.startswith("builtin:"):
        _, _, model = spec.partition(":")
        model = model or DEFAULT_BUILTIN
        factory = BUILTIN_TRACES.get(model)
        if factory is None:
            raise TraceError(f"no builtin trace '{model}'; available: {', '.join(BUILTIN_TRACES)}")
        return factory()
    path = Path(spec).expanduser()
    return _reader_for(path)(path, tz=tz)
