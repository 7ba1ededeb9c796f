"""``greenswarm windows``: the curtailment windows a policy finds in one region of a trace.

Before a site joins a swarm its operator wants to know how much training time a grid and a rule
would give: how many windows, how long, how clean. :func:`windows_report` answers that as a plain
dict (what ``--json`` prints), :func:`print_windows` as a table, :func:`plot_windows` as a PNG, and
:func:`run_windows` is the CLI's glue.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from greenswarm.console import pyplot, save_figure, wide_console
from greenswarm.errors import ConfigError
from greenswarm.scheduler.policy import PercentilePolicy, ThresholdPolicy, Window, WindowPolicy
from greenswarm.timefmt import iso_utc, naive_utc
from greenswarm.traces.readers import load_trace
from greenswarm.traces.trace import Trace


def effective_threshold(policy: WindowPolicy, trace: Trace, region: str) -> float | None:
    """The gCO2/kWh below which ``policy`` opens a window in ``region``, if it has a single one."""
    if isinstance(policy, ThresholdPolicy):
        return policy.threshold
    if isinstance(policy, PercentilePolicy):
        return policy.threshold(trace, region)
    return None


def describe_policy(policy: WindowPolicy) -> str:
    """A short human description of a policy (the report's ``policy`` field)."""
    if isinstance(policy, ThresholdPolicy):
        text = f"intensity < {policy.threshold:g} gCO2/kWh"
    elif isinstance(policy, PercentilePolicy):
        period = "" if policy.period_s is None else f" over the last {policy.period_s / 3600:g} h"
        text = f"intensity < p{policy.percentile:g} of the region's trace{period}"
    else:
        return repr(policy)
    min_window_s = getattr(policy, "min_window_s", 0.0)
    if min_window_s:
        text += f", windows >= {min_window_s:g} s"
    return text


def _mean(trace: Trace, region: str, windows: list[Window]) -> float | None:
    """Time-weighted mean intensity over ``windows`` (hold-last), or None if they are empty."""
    seconds = sum(w.duration for w in windows)
    if seconds <= 0:
        return None
    return sum(trace.integral(region, w.start, w.end) for w in windows) / seconds


def windows_report(trace: Trace, region: str, policy: WindowPolicy) -> dict[str, Any]:
    """What ``policy`` makes of ``region`` in ``trace``, as a JSON-ready dict.

    Keys: ``region``, ``trace`` (its source), ``policy`` (text), ``threshold`` (effective gCO2/kWh;
    None for a policy without one), ``windows`` (``start``/``end`` ISO UTC, ``hours``),
    ``share_in_window`` (0..1 of the trace's span), ``count``, ``longest_hours``,
    ``mean_intensity_in_window`` (None without windows) and ``mean_intensity`` (time-weighted).
    """
    trace.series(region)  # an unknown region fails here, listing the trace's regions
    windows = sorted(policy.windows(trace, region), key=lambda w: w.start)
    span = trace.end - trace.start
    threshold = effective_threshold(policy, trace, region)
    return {
        "region": region,
        "trace": trace.source,
        "policy": describe_policy(policy),
        "threshold": threshold,
        "windows": [
            {
                "start": iso_utc(w.start, milliseconds=True),
                "end": iso_utc(w.end, milliseconds=True),
                "hours": w.duration / 3600.0,
            }
            for w in windows
        ],
        "share_in_window": sum(w.duration for w in windows) / span,
        "count": len(windows),
        "longest_hours": max((w.duration for w in windows), default=0.0) / 3600.0,
        "mean_intensity_in_window": _mean(trace, region, windows),
        "mean_intensity": trace.integral(region, trace.start, trace.end) / span,
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_windows(report: dict[str, Any]) -> None:
    """Print a report as a table of windows and a one-line summary."""
    from rich.table import Table

    table = Table(title=f"{report['region']}: {report['policy']} ({report['trace']})")
    table.add_column("#", justify="right")
    table.add_column("start (UTC)")
    table.add_column("end (UTC)")
    table.add_column("hours", justify="right")
    for i, w in enumerate(report["windows"], 1):
        table.add_row(str(i), w["start"], w["end"], f"{w['hours']:.2f}")
    console = wide_console()
    if report["windows"]:
        console.print(table)
    plural = "" if report["count"] == 1 else "s"
    console.print(
        f"{report['count']} window{plural}, {report['share_in_window']:.1%} of the trace in window, "
        f"longest {report['longest_hours']:.2f} h; threshold {_fmt(report['threshold'])} gCO2/kWh; "
        f"mean intensity {_fmt(report['mean_intensity_in_window'])} in windows vs "
        f"{_fmt(report['mean_intensity'])} overall gCO2/kWh",
        highlight=False,
    )


def to_dates(times: Any) -> Any:
    """Unix seconds as matplotlib date numbers (UTC), for a time axis."""
    import matplotlib.dates as mdates

    return mdates.date2num([naive_utc(float(t)) for t in times])


def utc_time_axis(ax: Any, start: float, end: float) -> None:
    """Concise UTC dates on ``ax``'s x axis, from ``start`` to ``end`` (unix seconds)."""
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlim(*to_dates([start, end]))


def draw_intensity(
    ax: Any,
    trace: Trace,
    region: str,
    threshold: float | None,
    start: float | None = None,
    end: float | None = None,
) -> None:
    """The region's intensity as the step function a site reads (hold-last), from ``start`` to ``end``
    (default: the whole trace), and the threshold as a dashed line; on a UTC date axis. Shared by
    ``greenswarm windows --plot`` and the run report."""
    import numpy as np

    t0 = trace.start if start is None else max(float(start), trace.start)
    t1 = trace.end if end is None else min(float(end), trace.end)
    series = trace.series(region)
    first = max(int(np.searchsorted(trace.times, t0, side="right")) - 1, 0)
    last = int(np.searchsorted(trace.times, t1, side="left"))
    times = np.concatenate(([t0], trace.times[first + 1 : last], [t1]))
    values = (
        np.concatenate((series[first:last], [series[last - 1]])) if last > first else series[[first, first]]
    )
    ax.step(to_dates(times), values, where="post", color="tab:blue", linewidth=1.0, label="intensity")
    if threshold is not None:
        ax.axhline(
            threshold, color="tab:red", linestyle="--", linewidth=1.0, label=f"threshold {threshold:.1f}"
        )
    utc_time_axis(ax, t0, t1)
    ax.set_ylim(bottom=0)


def plot_windows(trace: Trace, region: str, policy: WindowPolicy, path: str | Path) -> Path:
    """Write a PNG: the region's intensity, the threshold line and the windows shaded, on UTC time."""
    plt = pyplot()

    windows = policy.windows(trace, region)
    threshold = effective_threshold(policy, trace, region)
    out = Path(path).expanduser()

    fig, ax = plt.subplots(figsize=(11, 4.5), layout="constrained")
    try:
        draw_intensity(ax, trace, region, threshold)
        for i, w in enumerate(windows):
            start, end = to_dates([w.start, w.end])
            ax.axvspan(
                start, end, color="tab:green", alpha=0.2, linewidth=0, label="window" if i == 0 else None
            )
        ax.set_xlabel("time (UTC)")
        ax.set_ylabel("carbon intensity (gCO2/kWh)")
        share = sum(w.duration for w in windows) / (trace.end - trace.start)
        plural = "" if len(windows) == 1 else "s"
        ax.set_title(
            f"{region}: {describe_policy(policy)}; {len(windows)} window{plural}, {share:.1%} in window"
        )
        ax.legend(loc="best")
        save_figure(fig, out)
    finally:
        plt.close(fig)
    return out


def run_windows(
    trace: str | Sequence[str],
    region: str,
    *,
    threshold: float | None = None,
    percentile: float | None = None,
    period_h: float | None = None,
    tz: str | None = None,
    units: str = "g/kWh",
    variant: str = "direct",
    min_window_s: float = 0.0,
    plot: str | None = None,
    as_json: bool = False,
    interpolate: str = "hold",
    grid_s: float = 60.0,
) -> int:
    """``greenswarm windows``: load the trace, find the windows, print them (table or one JSON
    object) and optionally plot them. Give ``threshold`` (default 100) or ``percentile``, not both.
    ``interpolate="linear"`` reads the trace as the curtail-llm anchor did (linear onto a ``grid_s``
    grid), to compare its windows with the default hold-last reading a live site makes."""
    policy: WindowPolicy
    if threshold is not None and percentile is not None:
        raise ConfigError("give a threshold or a percentile, not both")
    if period_h is not None and percentile is None:
        raise ConfigError("a rolling period needs a percentile", where="--period-h")
    try:
        if percentile is not None:
            policy = PercentilePolicy(
                percentile, min_window_s, None if period_h is None else period_h * 3600.0
            )
        else:
            policy = ThresholdPolicy(100.0 if threshold is None else threshold, min_window_s)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    loaded = load_trace(trace, tz, units=units, variant=variant, interpolate=interpolate, grid_s=grid_s)
    report = windows_report(loaded, region, policy)
    if plot:
        report["plot"] = str(plot_windows(loaded, region, policy, plot))
    if as_json:
        print(json.dumps(report))
    else:
        print_windows(report)
        if plot:
            print(f"plot written to {report['plot']}")
    return 0
