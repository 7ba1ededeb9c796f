"""Several trace files as one multi-region trace: exports as operators hold them, one file per zone.

Electricity Maps and WattTime export one zone per file (``GB_2023_hourly.csv``,
``DE-LU_2023_hourly.csv``...). A swarm, ``simulate`` and the demo want every region on one time
axis, so :func:`merge_traces` puts the files' regions on a common grid: the span every file covers
(the latest start to the earliest end) at the finest of their resolutions, each region read as the
step function its file publishes (the value in force at each grid instant, what a live site would
have seen). Files that share no instant cannot be merged, and the error says what each covers;
a region named in two files is refused rather than silently taken from one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from greenswarm.errors import TraceError
from greenswarm.timefmt import iso_utc
from greenswarm.traces.trace import Trace

#: names of the files a directory contributes (a CSV, plain or compressed)
TRACE_SUFFIXES = (".csv", ".csv.gz", ".csv.gzip", ".csv.xz", ".csv.bz2")


def trace_files(directory: Path) -> list[Path]:
    """The trace files in ``directory`` (not its subdirectories), in name order."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.lower().endswith(TRACE_SUFFIXES))
    if not files:
        raise TraceError(f"{directory}: a directory of traces, but no {', '.join(TRACE_SUFFIXES)} file in it")
    return files


def merge_traces(traces: Sequence[Trace]) -> Trace:
    """One trace with every region of ``traces`` on their common span and finest resolution."""
    if len(traces) == 1:
        return traces[0]
    owner: dict[str, str] = {}
    for trace in traces:
        for region in trace.regions:
            if region in owner:
                raise TraceError(
                    f"region '{region}' is in both {owner[region]} and {trace.source}; "
                    "merge files of different regions only"
                )
            owner[region] = trace.source
    start = max(t.start for t in traces)
    end = min(t.end for t in traces)
    if start >= end:
        spans = "; ".join(f"{t.source} covers {iso_utc(t.start)} to {iso_utc(t.end)}" for t in traces)
        raise TraceError(f"these traces share no instant, so they cannot be merged: {spans}")
    step = min(t.resolution_s for t in traces)
    grid = _common_grid(traces, start, end, step)
    values: dict[str, np.ndarray] = {}
    for trace in traces:
        at = np.searchsorted(trace.times, grid, side="right") - 1  # the sample in force (>= 0: grid >= start)
        for region in trace.regions:
            values[region] = trace.series(region)[at]
    return Trace(grid, values, step, " + ".join(t.source for t in traces))


def _common_grid(traces: Sequence[Trace], start: float, end: float, step: float) -> np.ndarray:
    """The files' own shared time axis when they all have the same one within the span (no
    resampling at all), else ``start, start + step, ...`` before ``end``."""
    axes = [t.times[(t.times >= start) & (t.times < end)] for t in traces]
    if all(len(a) == len(axes[0]) and np.array_equal(a, axes[0]) for a in axes[1:]) and len(axes[0]):
        if axes[0][0] == start:
            return axes[0].copy()
    n = max(1, int(np.ceil(round((end - start) / step, 9))))
    return start + step * np.arange(n, dtype=np.float64)
