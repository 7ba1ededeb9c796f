"""Forecasts as they were issued, read from a file: the only honest input for a forecast-driven policy.

A forecast is usable only from the time it was issued. WattTime's historical forecasts come in a
long shape, one row per (issue time, forecast instant)::

    generated_at,point_time,value
    2023-06-08T00:00:00Z,2023-06-08T00:05:00Z,412.3
    ...

with an optional region column (``region``, ``ba``, ``zone``...) for several regions in one file.
A wide file has one row per issue time instead: the time, optionally a region, the realized value,
then ``f1..fN``, the forecast for 1..N steps ahead at the file's own resolution (the median step
between its issue times)::

    time,value,f1,f2,f3
    2023-06-08T00:00:00Z,410.2,412.3,415.0,409.9

:func:`read_forecast_file` reads it -- plain or compressed, with the trace reader's ``tz`` and
``units`` -- into :class:`IssuedForecasts`, which answers only "what was the latest forecast issued
at or before ``now``" (:meth:`IssuedForecasts.latest`), so a policy cannot see a later one. Every
error names the file and line.
"""

from __future__ import annotations

import csv
import math
import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import tzinfo
from pathlib import Path
from typing import Any

import numpy as np

from greenswarm.errors import TraceError
from greenswarm.traces.compressed import open_text, reading_errors
from greenswarm.traces.readers import REGION_COLUMNS, UNITS, VALUE_COLUMNS, _zone, parse_timestamp

#: header names (lower case) of the issue-time and forecast-instant columns
ISSUED_COLUMNS = ("generated_at", "issued_at", "issue_time", "forecast_time")
POINT_COLUMNS = ("point_time", "target_time", "valid_time", "datetime", "timestamp")
#: the region of a file without a region column
ANY_REGION = ""
#: a wide file's forecast columns: ``f1`` .. ``fN``, the forecast N steps after the row's time
_HORIZON = re.compile(r"f(\d+)")
#: region -> issue time -> (forecast instant, value, line)
_Rows = dict[str, dict[float, list[tuple[float, float, int]]]]


@dataclass
class Issue:
    """One issued forecast: when it was issued, and its instants and values (gCO2/kWh)."""

    generated_at: float
    times: np.ndarray
    values: np.ndarray


@dataclass
class IssuedForecasts:
    """Every forecast in a file, per region, in order of issue."""

    source: str
    issues: dict[str, list[Issue]] = field(default_factory=dict)

    @property
    def regions(self) -> list[str]:
        return list(self.issues)

    def latest(self, region: str, now: float) -> Issue | None:
        """The last forecast for ``region`` issued at or before ``now`` (None: none issued yet). A file
        without a region column serves every region."""
        issues = self.issues.get(region, self.issues.get(ANY_REGION))
        if issues is None:
            raise TraceError(
                f"region '{region}' has no forecasts in {self.source}; it has: {', '.join(self.regions)}"
            )
        k = bisect_right([i.generated_at for i in issues], now) - 1
        return issues[k] if k >= 0 else None


def _column(keys: list[str], names: tuple[str, ...]) -> int | None:
    return next((keys.index(n) for n in names if n in keys), None)


def read_forecast_file(path: str | Path, tz: str | None = None, *, units: str = "g/kWh") -> IssuedForecasts:
    """Read a forecast file, long or wide (see the module doc); ``tz`` for naive timestamps,
    ``units`` of its values."""
    name = str(path)
    if units not in UNITS:
        raise TraceError(f"{name}: unknown units '{units}'; known units: {', '.join(UNITS)}")
    factor = UNITS[units]
    zone = _zone(tz) if tz is not None else None
    handle, compression = open_text(Path(path).expanduser(), name, "forecast file")
    rows: dict[str, dict[float, list[tuple[float, float, int]]]] = {}
    with handle:
        reader = csv.reader(handle)
        with reading_errors(name, compression, lambda: reader.line_num):
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{name}: empty forecast file")
            keys = [h.strip().lower() for h in header]
            horizons = [(int(m.group(1)), i) for i, k in enumerate(keys) if (m := _HORIZON.fullmatch(k))]
            if horizons:
                _read_wide(reader, header, keys, horizons, rows, zone, factor, name)
            else:
                _read_long(reader, header, keys, rows, zone, factor, name)
    if not rows:
        raise TraceError(f"{name}: no forecast rows after the header")
    forecasts = IssuedForecasts(name)
    for key, by_issue in rows.items():
        issues = []
        for generated in sorted(by_issue):
            points = sorted(by_issue[generated])
            for (a, _, _), (b, _, line) in zip(points, points[1:], strict=False):
                if a == b:
                    raise TraceError(
                        f"{name}:{line}: a second value for the same instant of the same forecast"
                    )
            times = np.array([p[0] for p in points])
            values = np.array([p[1] for p in points])
            issues.append(Issue(generated, times, values))
        forecasts.issues[key] = issues
    return forecasts


def _number(text: str, factor: float, where: str) -> float:
    try:
        number = float(text) * factor
    except ValueError:
        raise TraceError(f"{where}: value '{text.strip()}' is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{where}: value {text.strip()} must be a finite number >= 0")
    return number


def _cells(reader: Any, header: list[str], name: str) -> Iterator[tuple[list[str], str]]:
    """The non-blank rows of ``reader``, each with its ``file:line``, checked for length."""
    for row in reader:
        if not any(c.strip() for c in row):
            continue
        where = f"{name}:{reader.line_num}"
        if len(row) < len(header):
            raise TraceError(f"{where}: expected {len(header)} columns, found {len(row)}")
        yield row, where


def _read_long(
    reader: Any,
    header: list[str],
    keys: list[str],
    rows: _Rows,
    zone: tzinfo | None,
    factor: float,
    name: str,
) -> None:
    """``generated_at, point_time[, region], value``: one row per forecast instant."""
    issued, point = _column(keys, ISSUED_COLUMNS), _column(keys, POINT_COLUMNS)
    value, region = _column(keys, VALUE_COLUMNS), _column(keys, REGION_COLUMNS)
    if issued is None or point is None or value is None:
        raise TraceError(
            f"{name}:1: a forecast file needs an issue-time column ({'/'.join(ISSUED_COLUMNS)}), a "
            f"forecast-instant column ({'/'.join(POINT_COLUMNS)}) and a value column "
            f"({'/'.join(VALUE_COLUMNS)}), or forecast columns f1..fN; found: {', '.join(header)}"
        )
    for row, where in _cells(reader, header, name):
        generated = parse_timestamp(row[issued], zone, where)
        at = parse_timestamp(row[point], zone, where)
        key = row[region].strip() if region is not None else ANY_REGION
        rows.setdefault(key, {}).setdefault(generated, []).append(
            (at, _number(row[value], factor, where), reader.line_num)
        )


def _read_wide(
    reader: Any,
    header: list[str],
    keys: list[str],
    horizons: list[tuple[int, int]],
    rows: _Rows,
    zone: tzinfo | None,
    factor: float,
    name: str,
) -> None:
    """``time[, region], realized, f1..fN``: one row per issue time; ``fK`` is the forecast for K
    steps after it, at the file's own resolution (the median step between its issue times). Blank
    ``fK`` cells (past the end of what was forecast) are skipped."""
    time = _column(keys, ISSUED_COLUMNS + POINT_COLUMNS + ("time", "date"))
    region = _column(keys, REGION_COLUMNS)
    if time is None:
        raise TraceError(
            f"{name}:1: a wide forecast file needs a time column first; found: {', '.join(header)}"
        )
    issued: dict[str, list[tuple[float, list[tuple[int, str]], str, int]]] = {}
    for row, where in _cells(reader, header, name):
        key = row[region].strip() if region is not None else ANY_REGION
        cells = [(k, row[i]) for k, i in horizons if row[i].strip()]
        issued.setdefault(key, []).append(
            (parse_timestamp(row[time], zone, where), cells, where, reader.line_num)
        )
    for key, issues in issued.items():
        times = np.unique([g for g, _, _, _ in issues])
        if len(times) < 2:
            raise TraceError(f"{name}: a wide forecast file needs two issue times to know its step")
        step = float(np.median(np.diff(times)))
        for generated, cells, where, line in issues:
            points = rows.setdefault(key, {}).setdefault(generated, [])
            points.extend((generated + k * step, _number(text, factor, where), line) for k, text in cells)
