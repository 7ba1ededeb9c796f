"""Reading traces from files.

Traces come from many exporters (WattTime, Electricity Maps, Vessim, curtail-llm, hand-made
spreadsheets). They are all CSV, so :func:`read_csv_trace` reads the header once, recognises the
layout from it (:func:`_sniff`) and then reads every layout with one loop into a :class:`Trace`;
:func:`load_trace` is the single entry point that configs and the CLI use. Recognised layouts:

* **wide**: a time column first, then one column per region (curtail-llm's ``mci.csv``, WattTime
  wide exports, Vessim CSVs such as ``oootime,Caiso_North``, ``timestamp,<region>,...``);
* **long**: one row per (time, region) with a region column (``region``, ``ba``, ``zone``...) and a
  value column (``value``, ``moer``, ``carbon_intensity``...); other columns are ignored
  (WattTime's ``frequency``, ``market``, ``version``...);
* **Electricity Maps**: ``Datetime (UTC),Country,Zone Name,Zone Id,Carbon Intensity gCO₂eq/kWh
  (direct),Carbon Intensity gCO₂eq/kWh (LCA),...``; the region is the ``Zone Id`` value and the
  ``variant`` option picks the direct (default) or life-cycle column.

Header names match case-insensitively. A time column whose header says UTC (``Datetime (UTC)``,
``time_utc``) makes naive timestamps UTC; other naive timestamps need ``tz``. A time cell that is a
plain number is an offset in seconds from the ``start`` option (Vessim-style relative traces;
``start=0`` reads unix seconds).

A file may be gzip'ed, xz'ed or bzip2'ed (``mci.csv.gz``): it is recognised from its first bytes
and read as it is decompressed (:mod:`greenswarm.traces.compressed`).

Every error names the file and line, because a user staring at a 9000-row export needs to know
exactly where the bad cell is.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np

from greenswarm.errors import TraceError
from greenswarm.timefmt import NaiveTimeError, parse_iso
from greenswarm.traces.builtin import BUILTIN_TRACES, DEFAULT_BUILTIN
from greenswarm.traces.compressed import open_text, reading_errors
from greenswarm.traces.merge import merge_traces, trace_files
from greenswarm.traces.trace import Trace, median_resolution

if TYPE_CHECKING:
    from _csv import Reader as CsvReader

#: How many median steps a gap between samples may span before the trace is rejected. A longer
#: hole would silently hold one stale value for hours, which is worse than refusing the file.
DEFAULT_MAX_GAP_STEPS = 3.0

#: Units a file's intensities may be in, and the factor that turns them into gCO2/kWh
#: (WattTime's marginal rates are lbs/MWh: 453.592 g per lb / 1000 kWh per MWh).
UNITS: dict[str, float] = {"g/kWh": 1.0, "kg/kWh": 1000.0, "lbs/MWh": 0.453592}

#: Electricity Maps intensity variants, and the header markers of their columns.
VARIANTS: dict[str, tuple[str, ...]] = {"direct": ("(direct)",), "lca": ("(lca)", "(life cycle)")}

#: How :func:`load_trace` reads intensity between samples (see its docstring).
INTERPOLATIONS = ("hold", "linear")

#: Header names (lower case) of a long file's region, value and time columns.
REGION_COLUMNS = ("region", "ba", "zone", "zone id", "zone_id", "zoneid")
VALUE_COLUMNS = ("value", "moer", "carbon_intensity", "carbon intensity", "intensity")
TIME_COLUMNS = ("point_time", "timestamp", "datetime", "time", "date")

#: A time cell that is a plain number: an offset in seconds from ``start``.
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
#: A "UTC" marker at the end of a time column's header: ``Datetime (UTC)``, ``time_utc``.
_UTC_SUFFIX = re.compile(r"[\s_-]*(\(utc\)|utc)$")

#: A reader takes a path and keyword options (``tz``, ``units``...) and returns a trace.
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
        return parse_iso(text, zone)
    except NaiveTimeError:
        raise TraceError(f"{where}: naive timestamp '{text}'; pass a timezone (--tz)") from None
    except ValueError:
        raise TraceError(f"{where}: cannot parse timestamp '{text}' (expected ISO 8601)") from None


def _parse_time(text: str, zone: tzinfo | None, start: float | None, where: str) -> float:
    """Parse a time cell: ISO 8601 (see :func:`parse_timestamp`) or offset seconds from ``start``."""
    cell = text.strip()
    if _NUMBER.fullmatch(cell):
        if start is None:
            raise TraceError(
                f"{where}: time '{cell}' is an offset in seconds; pass the start instant (start=...)"
            )
        return start + float(cell)
    return parse_timestamp(cell, zone, where)


def _parse_start(start: str | float | None, zone: tzinfo | None, name: str) -> float | None:
    """The ``start`` option as unix seconds: a number, or an ISO 8601 instant."""
    if start is None or isinstance(start, int | float):
        if start is not None and not math.isfinite(start):
            raise TraceError(f"{name}: start {start} is not a finite number of seconds")
        return None if start is None else float(start)
    text = str(start).strip()
    if _NUMBER.fullmatch(text):
        return float(text)
    return parse_timestamp(text, zone, f"{name}: start")


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


def _key(header: str) -> str:
    """A header cell normalised for matching: lower case, single spaces, ``₂`` as ``2``."""
    return " ".join(header.replace("₂", "2").lower().split())


def _find(keys: list[str], names: tuple[str, ...]) -> int | None:
    """Index of the first header key in ``names``, or None."""
    for i, key in enumerate(keys):
        if key in names:
            return i
    return None


@dataclass(frozen=True)
class _Layout:
    """How to read the rows of one file, worked out from its header by :func:`_sniff`."""

    kind: str  # "wide", "long" or "electricitymaps"
    header: list[str]
    time_col: int
    utc: bool  # the time column's header says naive timestamps are UTC
    wide_columns: list[tuple[int, str]] = field(default_factory=list)  # wide: (column, region)
    region_col: int = -1  # long: the column naming the region
    value_col: int = -1  # long: the column holding the intensity


#: a wide forecast file's horizon columns (see :mod:`greenswarm.traces.forecast_file`)
_FORECAST_COLUMN = re.compile(r"f\d+")


def _time_column(keys: list[str], default: int) -> tuple[int, bool]:
    """The time column (first with a known name, else ``default``) and whether it says UTC."""
    for i, key in enumerate(keys):
        if _UTC_SUFFIX.sub("", key) in TIME_COLUMNS:
            return i, _UTC_SUFFIX.search(key) is not None
    return default, _UTC_SUFFIX.search(keys[default]) is not None


def _sniff(header: list[str], where: str, variant: str) -> _Layout:
    """Recognise a file's layout from its (stripped) header row; ``where`` is its ``file:line``."""
    if len(header) < 2:
        raise TraceError(f"{where}: need a timestamp column and at least one region column")
    keys = [_key(cell) for cell in header]
    zone_col = _find(keys, ("zone id",))
    all_markers = [marker for markers in VARIANTS.values() for marker in markers]
    intensity_cols = [
        i
        for i, key in enumerate(keys)
        if key.startswith("carbon intensity") and any(m in key for m in all_markers)
    ]
    if zone_col is not None and intensity_cols:
        markers = VARIANTS[variant]
        value_col = next((i for i in intensity_cols if any(m in keys[i] for m in markers)), None)
        if value_col is None:
            have = ", ".join(f"'{header[i]}'" for i in intensity_cols)
            raise TraceError(
                f"{where}: Electricity Maps export has no '{variant}' carbon-intensity column; it has: {have}"
            )
        time_col, utc = _time_column(keys, 0)
        return _Layout("electricitymaps", header, time_col, utc, region_col=zone_col, value_col=value_col)
    if variant != "direct":
        raise TraceError(f"{where}: variant '{variant}' applies only to Electricity Maps exports")
    region_col = _find(keys, REGION_COLUMNS)
    value_col = _find(keys, VALUE_COLUMNS)
    if region_col is not None and value_col is not None:
        default = next(i for i in range(len(keys)) if i not in (region_col, value_col))
        time_col, utc = _time_column(keys, default)
        return _Layout("long", header, time_col, utc, region_col=region_col, value_col=value_col)
    seen: set[str] = set()
    for region in header[1:]:
        if not region:
            raise TraceError(f"{where}: a region column has an empty name")
        if region in seen:
            raise TraceError(f"{where}: region column '{region}' appears twice")
        seen.add(region)
    # a wide forecast file (time, value, f1..fN) is also the trace of its realized values: its
    # forecast columns are not regions
    columns = list(enumerate(header))[1:]
    wide = [(i, name) for i, name in columns if not _FORECAST_COLUMN.fullmatch(keys[i])] or columns
    return _Layout("wide", header, 0, _UTC_SUFFIX.search(keys[0]) is not None, wide_columns=wide)


def _read_header(rows: CsvReader, name: str) -> list[str]:
    """Return the stripped header row (skipping blank lines before it)."""
    for header in rows:
        if any(cell.strip() for cell in header):
            return [cell.strip() for cell in header]
    raise TraceError(f"{name}:1: empty file")


@dataclass
class _Series:
    """One region's samples as read, with the line each came from."""

    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


def _check_options(name: str, units: str, variant: str) -> tuple[float, str]:
    """Validate ``units`` and ``variant`` (case-insensitively); return the factor to gCO2/kWh and
    the canonical variant name."""
    factor = next((f for known, f in UNITS.items() if known.lower() == str(units).strip().lower()), None)
    if factor is None:
        raise TraceError(f"{name}: unknown units '{units}'; known units: {', '.join(UNITS)}")
    canonical = str(variant).strip().lower()
    if canonical not in VARIANTS:
        raise TraceError(f"{name}: unknown variant '{variant}'; known variants: {', '.join(VARIANTS)}")
    return factor, canonical


def read_csv_trace(
    path: str | Path,
    tz: str | None = None,
    max_gap_s: float | None = None,
    *,
    units: str = "g/kWh",
    variant: str = "direct",
    start: str | float | None = None,
) -> Trace:
    """Read a CSV trace in any recognised layout (wide, long, Electricity Maps; see the module doc).

    ``tz`` is the IANA zone of naive timestamps (ignored for ones with an offset, and for a time
    column whose header says UTC). ``units`` is what the file's numbers are in (``g/kWh``,
    ``kg/kWh`` or WattTime's ``lbs/MWh``); the trace is always gCO2/kWh. ``variant`` picks the
    Electricity Maps column: ``direct`` (default) or ``lca`` (life cycle). ``start`` (ISO 8601 or
    unix seconds) is the instant that numeric time cells count seconds from.

    ``max_gap_s`` bounds the step between consecutive samples; by default 3 x the median step.
    Timestamps must strictly increase (per region in long files): a duplicate usually means a DST
    fall-back hour read in the wrong zone or two exports concatenated, and either would corrupt
    the windows. In a long file every region must have the same timestamps.
    """
    name = str(path)
    factor, variant = _check_options(name, units, variant)
    zone = _zone(tz) if tz is not None else None
    start_s = _parse_start(start, zone, name)
    handle, compression = open_text(Path(path), name)
    series: dict[str, _Series] = {}
    with handle:
        rows = csv.reader(handle)
        with reading_errors(name, compression, lambda: rows.line_num):
            header = _read_header(rows, name)
            layout = _sniff(header, f"{name}:{rows.line_num}", variant)
            row_zone = UTC if layout.utc else zone
            if layout.kind == "wide":
                series = {region: _Series() for _, region in layout.wide_columns}
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                _read_row(row, layout, series, row_zone, start_s, factor, name, rows.line_num)
    if not series or not next(iter(series.values())).times:
        raise TraceError(f"{name}:{rows.line_num}: no data rows after the header")
    regions = list(series)
    first = series[regions[0]]
    for region in regions[1:]:
        _check_same_times(series[region], first, region, regions[0], name)
    time_axis = np.array(first.times, dtype=np.float64)
    _check_gaps(time_axis, first.lines, name, max_gap_s)
    values = {region: np.array(s.values, dtype=np.float64) for region, s in series.items()}
    return Trace(time_axis, values, median_resolution(time_axis), name)


def _read_row(
    row: list[str],
    layout: _Layout,
    series: dict[str, _Series],
    zone: tzinfo | None,
    start: float | None,
    factor: float,
    name: str,
    line: int,
) -> None:
    """Append one data row's samples to ``series``, checking order per region."""
    where = f"{name}:{line}"
    width = len(layout.header)
    if len(row) != width:
        raise TraceError(f"{where}: expected {width} columns, found {len(row)}")
    t = _parse_time(row[layout.time_col], zone, start, where)
    if layout.kind == "wide":
        cells = [(region, row[i], region) for i, region in layout.wide_columns]
        per_region = ""
    else:
        region = row[layout.region_col].strip()
        if not region:
            raise TraceError(f"{where}: empty region in column '{layout.header[layout.region_col]}'")
        cells = [(region, row[layout.value_col], layout.header[layout.value_col])]
        per_region = f" for region '{region}'"
    for region, cell, column in cells:
        samples = series.setdefault(region, _Series())
        if samples.times and t <= samples.times[-1]:
            what = "duplicate" if t == samples.times[-1] else "non-increasing"
            raise TraceError(
                f"{where}: {what} timestamp '{row[layout.time_col].strip()}'{per_region} "
                f"(previous sample on line {samples.lines[-1]})"
            )
        samples.values.append(_parse_value(cell, column, where) * factor)
        samples.times.append(t)
        samples.lines.append(line)


def _check_same_times(samples: _Series, first: _Series, region: str, first_region: str, name: str) -> None:
    """In a long file, every region must be sampled at the first region's timestamps."""
    if samples.times == first.times:
        return
    n = min(len(samples.times), len(first.times))
    i = next((k for k in range(n) if samples.times[k] != first.times[k]), n)
    line = samples.lines[i] if i < len(samples.lines) else samples.lines[-1]
    raise TraceError(
        f"{name}:{line}: region '{region}' is not sampled at the same times as region '{first_region}' "
        f"({len(samples.times)} vs {len(first.times)} samples, first difference at sample {i + 1}); "
        "every region needs the same timestamps"
    )


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
    """Pick the reader for a file. Every supported export is CSV, and :func:`read_csv_trace`
    recognises the exporter from the header; a non-CSV format would get its own reader here."""
    return read_csv_trace


def _check_interpolation(spec: str, interpolate: str, grid_s: float) -> str:
    """Validate ``interpolate`` (case-insensitively) and ``grid_s`` before any file is read, so a
    typo in either fails at once rather than after parsing a large export; returns the method."""
    method = str(interpolate).strip().lower()
    if method not in INTERPOLATIONS:
        raise TraceError(
            f"{spec}: unknown interpolation '{interpolate}'; choices: {', '.join(INTERPOLATIONS)}"
        )
    try:
        grid = float(grid_s)
    except (TypeError, ValueError):
        raise TraceError(f"{spec}: grid_s must be a number of seconds, got {grid_s!r}") from None
    if not (math.isfinite(grid) and grid > 0):
        raise TraceError(f"{spec}: grid_s must be a finite number of seconds > 0, got {grid_s!r}")
    return method


def _load_builtin(spec: str) -> Trace:
    """The offline model named by ``builtin`` or ``builtin:<name>``."""
    _, _, model = spec.partition(":")
    model = model or DEFAULT_BUILTIN
    factory = BUILTIN_TRACES.get(model)
    if factory is None:
        raise TraceError(f"no builtin trace '{model}'; available: {', '.join(BUILTIN_TRACES)}")
    return factory()


def load_trace(
    spec: str | Trace | Sequence[str | Trace],
    tz: str | None = None,
    *,
    units: str = "g/kWh",
    variant: str = "direct",
    start: str | float | None = None,
    max_gap_s: float | None = None,
    interpolate: str = "hold",
    grid_s: float = 60.0,
) -> Trace:
    """Load the trace named by a config's ``trace`` field or the CLI's ``--trace``.

    ``builtin`` or ``builtin:<name>`` is the offline model (no files needed, so the demo always
    runs); anything else is a path, read with the options of :func:`read_csv_trace` (``tz``
    applies to naive timestamps in files). Several specs, or a directory (its CSV files, plain or
    compressed), are read alike and merged into one multi-region trace
    (:func:`~greenswarm.traces.merge.merge_traces`: their common span, the finest resolution).
    A :class:`Trace` among them (one fetched from an API, say) is taken as it is.

    ``interpolate`` says how intensity between samples is read. ``hold`` (the default) keeps the
    published step function: what a live controller sees, since it only knows the latest value.
    ``linear`` interpolates onto a ``grid_s`` grid (:meth:`Trace.resampled`), the convention of
    the curtail-llm anchor (60 s), for replays that should match its accounting.
    """
    specs = [spec] if isinstance(spec, str | Trace) else list(spec)
    if not specs:
        raise TraceError("no trace given")
    method = _check_interpolation(", ".join(map(str, specs)), interpolate, grid_s)
    sources: list[str | Path | Trace] = []
    for one in specs:
        if isinstance(one, Trace):
            sources.append(one)
            continue
        path = Path(one).expanduser()
        builtin = one == "builtin" or one.startswith("builtin:")
        sources.extend(trace_files(path) if not builtin and path.is_dir() else [one])
    traces = []
    for source in sources:
        name = str(source)
        if isinstance(source, Trace):
            trace = source
        elif name == "builtin" or name.startswith("builtin:"):
            trace = _load_builtin(name)
        else:
            path = Path(source).expanduser()
            reader = _reader_for(path)
            trace = reader(path, tz=tz, units=units, variant=variant, start=start, max_gap_s=max_gap_s)
        traces.append(trace if method == "hold" else trace.resampled(float(grid_s), method))
    return merge_traces(traces)
