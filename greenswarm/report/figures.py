"""The run report's figures, drawn with matplotlib (Agg) and returned as PNG bytes to embed.

Every function takes the sites as :mod:`~greenswarm.report.runs` read them and returns ``None`` when
no site has what the figure needs (the page then says so). Intensity, the threshold and the UTC time
axis are drawn by the helpers ``greenswarm windows --plot`` uses, so both read the same.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from greenswarm.console import pyplot
from greenswarm.report.runs import SiteRun
from greenswarm.scheduler.windows_report import draw_intensity, to_dates, utc_time_axis

#: colours of the states behind each site's intensity
STATE_COLOURS = {
    "IDLE": "#bdbdbd",
    "RELEASED": "tab:blue",
    "RESTARTING": "tab:purple",
    "SOLO": "tab:orange",
    "FEDERATED": "tab:green",
}
STATE_ALPHA = {"IDLE": 0.18, "RELEASED": 0.08, "RESTARTING": 0.3, "SOLO": 0.3, "FEDERATED": 0.3}
#: how each round's outcome is marked at its site: (marker, colour, label)
ACTIONS = {
    "apply": ("o", "tab:green", "averaged (apply)"),
    "solo": ("s", "tab:orange", "alone (solo)"),
    "resync": ("D", "tab:purple", "took the majority's state (resync)"),
    "fail": ("X", "tab:red", "failed"),
}
DPI = 100


def site_colour(index: int) -> str:
    return f"C{index % 10}"


def png(fig: Any) -> bytes:
    """The figure as PNG bytes (closed afterwards)."""
    plt = pyplot()
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def span(runs: list[SiteRun]) -> tuple[float, float] | None:
    """Clock time from the first site's start to the last site's last point."""
    starts = [r.t0 for r in runs if r.t0 is not None and r.points]
    ends = [r.t1 for r in runs if r.t1 is not None]
    if not starts or not ends:
        return None
    t0, t1 = min(starts), max(ends)
    return (t0, t1) if t1 > t0 else (t0, t0 + 60.0)


def loss_figure(runs: list[SiteRun]) -> bytes | None:
    """Training loss (the node's moving average) against the tokens each site trained, and the global
    model's held-out loss where the sites evaluated it."""
    drawn = [(i, r) for i, r in enumerate(runs) if any(p.get("loss") is not None for p in r.points)]
    if not drawn:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2), layout="constrained")
    for i, run in drawn:
        trained = [p for p in run.points if p.get("loss") is not None]
        ax.plot(
            [p["tokens"] for p in trained],
            [p["loss"] for p in trained],
            color=site_colour(i),
            linewidth=1.6,
            label=f"{run.label} ({run.region})",
        )
        held_out = [p for p in run.points if p.get("eval_loss") is not None]
        if held_out:
            ax.plot(
                [p["tokens"] for p in held_out],
                [p["eval_loss"] for p in held_out],
                linestyle="none",
                marker=".",
                color=site_colour(i),
                label=f"{run.label}: held-out loss",
            )
    ax.set_xlabel("tokens trained by the site")
    ax.set_ylabel("training loss (moving average)")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    return png(fig)


def _state_spans(run: SiteRun) -> list[tuple[str, float, float]]:
    """(state, from, to) in clock time: each point's state holds until the next point."""
    spans: list[tuple[str, float, float]] = []
    points = run.points
    for here, after in zip(points, points[1:] + points[-1:], strict=True):
        t0, t1 = float(here["clock"]), float(after["clock"])
        if spans and spans[-1][0] == here["state"] and spans[-1][2] >= t0:
            spans[-1] = (spans[-1][0], spans[-1][1], max(t1, spans[-1][2]))
        elif t1 > t0:
            spans.append((here["state"], t0, t1))
    return spans


def _thresholds(run: SiteRun) -> tuple[float | None, bool]:
    """The threshold the site's points recorded: (the one value, True) if it never changed, else
    (None, False): a rolling rule, drawn as steps."""
    values = {p.get("threshold") for p in run.points} - {None}
    if len(values) == 1:
        return values.pop(), True
    return None, not values


def states_figure(runs: list[SiteRun]) -> bytes | None:
    """One panel per site: its region's intensity (the trace where it can be read, else the site's own
    samples) and threshold, with the state the site was in shaded behind them."""
    drawn = [(i, r) for i, r in enumerate(runs) if r.points]
    window = span(runs)
    if not drawn or window is None:
        return None
    t0, t1 = window
    plt = pyplot()
    fig, axes = plt.subplots(
        len(drawn), 1, figsize=(11, 1.0 + 2.1 * len(drawn)), sharex=True, layout="constrained", squeeze=False
    )
    legend: dict[str, tuple[Any, str]] = {}
    for ax, (_, run) in zip(axes[:, 0], drawn, strict=True):
        threshold, constant = _thresholds(run)
        if run.trace is not None:
            draw_intensity(ax, run.trace, run.region, threshold, t0, t1)
        else:
            sampled = [p for p in run.points if p.get("intensity") is not None]
            if sampled:
                ax.step(
                    to_dates([p["clock"] for p in sampled]),
                    [p["intensity"] for p in sampled],
                    where="post",
                    color="tab:blue",
                    linewidth=1.0,
                    label="intensity (the site's samples)",
                )
            if threshold is not None:
                ax.axhline(
                    threshold,
                    color="tab:red",
                    linestyle="--",
                    linewidth=1.0,
                    label=f"threshold {threshold:.1f}",
                )
            ax.set_ylim(bottom=0)
        if not constant:
            marked = [p for p in run.points if p.get("threshold") is not None]
            ax.step(
                to_dates([p["clock"] for p in marked]),
                [p["threshold"] for p in marked],
                where="post",
                color="tab:red",
                linestyle="--",
                linewidth=1.0,
                label="threshold",
            )
        seen: set[str] = set()
        for state, a, b in _state_spans(run):
            start, end = to_dates([a, b])
            ax.axvspan(
                start,
                end,
                color=STATE_COLOURS.get(state, "white"),
                alpha=STATE_ALPHA.get(state, 0.2),
                linewidth=0,
                label=state if state not in seen else None,
            )
            seen.add(state)
        ax.set_ylabel("gCO2/kWh")
        ax.set_title(f"{run.label} ({run.region})", loc="left", fontsize=10)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label.split(" ")[0], (handle, label))
    order = ["intensity", "threshold", *STATE_COLOURS]  # one legend for every panel, in this order
    shown = [legend[k] for k in order if k in legend] + [v for k, v in legend.items() if k not in order]
    fig.legend(*zip(*shown, strict=True), loc="outside upper center", ncols=len(shown), fontsize=9)
    utc_time_axis(axes[-1, 0], t0, t1)
    axes[-1, 0].set_xlabel("clock time (UTC)")
    return png(fig)


@dataclass
class RoundMarks:
    """What :func:`rounds_figure` draws, as plain data (tests read it instead of pixels).

    Runs are told apart by their index in ``runs``, never by site name: two runs of one site (which
    :func:`~greenswarm.report.runs.read_runs` allows) share a name but are two rows.
    """

    rows: list[int]  # each run's row on the figure, by index in ``runs`` (the first run on top)
    marks: dict[tuple[int, str], list[float]]  # (row, action): the boundaries (clock s) it ended so
    groups: list[tuple[float, int, int]]  # an averaged group: (boundary, lowest row, highest row)


def round_marks(runs: list[SiteRun]) -> RoundMarks | None:
    """Every round each run ended, and the rows each averaging group joins; None without any round.

    A group is the runs that recorded the same boundary and lineage. A member a round log names but
    whose run did not record that round (a truncated rounds.jsonl) is joined too, but only when one
    run alone has that name: with two runs of one site, which of them was meant cannot be told.
    """
    rows = [len(runs) - 1 - i for i in range(len(runs))]
    runs_named: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        runs_named.setdefault(run.name, []).append(i)
    marks: dict[tuple[int, str], list[float]] = {}
    recorded: dict[tuple[float, str], dict[str, set[int]]] = {}  # group: name -> the runs that logged it
    named: dict[tuple[float, str], set[str]] = {}  # group: the members its lines name
    for i, run in enumerate(runs):
        sync = run.sync_interval_s
        if not sync:
            continue
        for entry in run.rounds:
            if "slot" not in entry:
                continue
            t, action = float(entry["slot"]) * sync, str(entry.get("action", "?"))
            marks.setdefault((rows[i], action), []).append(t)
            if action != "solo":
                key = (t, str(entry.get("lineage", "")))
                recorded.setdefault(key, {}).setdefault(run.name, set()).add(i)
                named.setdefault(key, set()).update(str(m) for m in entry.get("members") or [])
    if not marks:
        return None
    groups = []
    for key, logged in recorded.items():
        joined: set[int] = set()
        for name in named[key] | set(logged):
            if name in logged:
                joined.update(rows[i] for i in logged[name])
            elif len(runs_named.get(name, [])) == 1:
                joined.add(rows[runs_named[name][0]])
        if len(joined) > 1:
            groups.append((key[0], min(joined), max(joined)))
    return RoundMarks(rows, marks, sorted(groups))


#: rounds that went wrong drawn over the common ones, so a failure among thousands of rounds shows
MARK_ZORDER = {"solo": 2, "apply": 3, "resync": 4, "fail": 5}
#: marks a row holds before they shrink (at 7 points, about what fits the figure's width side by side)
ROOMY_ROW = 150


def _mark_size(drawn: RoundMarks) -> float:
    """7 points, shrinking (to 2 at the least) as the busiest row fills up: a long run's marks would
    otherwise merge into one band in which the later kinds hide the earlier."""
    busiest: dict[int, int] = {}
    for (row, _), times in drawn.marks.items():
        busiest[row] = busiest.get(row, 0) + len(times)
    most = max(busiest.values())
    return 7.0 if most <= ROOMY_ROW else max(2.0, 7.0 * (ROOMY_ROW / most) ** 0.5)


def rounds_figure(runs: list[SiteRun]) -> bytes | None:
    """Every round each site ended, on clock time: a mark per site and outcome, and a line joining the
    members of each averaged group. One artist per (site, outcome) and one for all the group lines, so
    a run of thousands of rounds draws in about the time of a short one."""
    drawn = round_marks(runs)
    if drawn is None:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.55 * len(runs)), layout="constrained")
    size = _mark_size(drawn)
    if drawn.groups:
        ts, lows, highs = zip(*drawn.groups, strict=True)
        width = max(0.5, 2.0 * size / 7.0)
        ax.vlines(to_dates(ts), lows, highs, color="tab:green", alpha=0.5, linewidth=width, zorder=1)
    shown: set[str] = set()
    order = {a: n for n, a in enumerate(ACTIONS)}  # the legend in ACTIONS' order, then any other
    for (row, action), times in sorted(drawn.marks.items(), key=lambda kv: (order.get(kv[0][1], 99), kv[0])):
        marker, colour, label = ACTIONS.get(action, ("*", "black", action))
        ax.plot(
            to_dates(times),
            [row] * len(times),
            linestyle="none",
            marker=marker,
            color=colour,
            markersize=size,
            zorder=MARK_ZORDER.get(action, 5),
            label=label if action not in shown else None,
        )
        shown.add(action)
    window = span(runs)
    times = [t for ts in drawn.marks.values() for t in ts]
    lo, hi = window if window is not None else (min(times), max(times))
    pad = max((hi - lo) * 0.01, 60.0)
    utc_time_axis(ax, min(lo, min(times)) - pad, max(hi, max(times)) + pad)
    ax.set_yticks(drawn.rows, [r.label for r in runs])
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("round boundary, clock time (UTC)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return png(fig)


def _grid(runs: list[SiteRun]) -> np.ndarray | None:
    window = span(runs)
    return None if window is None else np.linspace(window[0], window[1], 400)


def cumulative_g(run: SiteRun, grid: np.ndarray, key: str = "emissions_g") -> np.ndarray:
    """The site's cumulative grams at each instant of ``grid`` (0 before it started, its last after)."""
    clock = np.array([float(p["clock"]) for p in run.points])
    grams = np.array([float(p.get(key) or 0.0) for p in run.points])
    return np.interp(grid, clock, grams, left=0.0, right=grams[-1])


def baseline_g(run: SiteRun, grid: np.ndarray) -> np.ndarray | None:
    """The equal-work baseline's cumulative grams at each instant of ``grid`` (None without a trace)."""
    if run.trace is None or run.t0 is None:
        return None
    return np.array([run.equal_work_g(until=t) for t in grid])


@dataclass
class EmissionCurves:
    """What :func:`emissions_figure` draws, as plain data (tests read it instead of pixels): one entry
    per run with history points, in ``runs`` order. Lists, not dicts keyed by site name: two runs of
    one site are two curves, and both count in the swarm's sums."""

    grid: np.ndarray  # clock seconds
    drawn: list[tuple[int, SiteRun]]  # (index in ``runs``, run)
    actual: list[np.ndarray]  # cumulative grams, idle included
    idle: list[np.ndarray]  # the idle part of them
    baselines: list[np.ndarray | None]  # the same training at once from the run's start (None: no trace)

    @property
    def total(self) -> np.ndarray:
        return np.sum(self.actual, axis=0)

    @property
    def training(self) -> np.ndarray:
        return self.total - np.sum(self.idle, axis=0)

    @property
    def known_baselines(self) -> list[np.ndarray]:
        return [b for b in self.baselines if b is not None]


def emission_curves(runs: list[SiteRun]) -> EmissionCurves | None:
    """Each run's cumulative emissions and baseline on one clock grid; None without history points."""
    grid = _grid(runs)
    drawn = [(i, r) for i, r in enumerate(runs) if r.points]
    if grid is None or not drawn:
        return None
    return EmissionCurves(
        grid,
        drawn,
        [cumulative_g(r, grid) for _, r in drawn],
        [cumulative_g(r, grid, "idle_g") for _, r in drawn],
        [baseline_g(r, grid) for _, r in drawn],
    )


def emissions_figure(runs: list[SiteRun]) -> bytes | None:
    """Cumulative emissions on clock time: each site against the same training run at once from its
    start (left), and the swarm's total, its training part and the baselines' sum (right)."""
    curves = emission_curves(runs)
    if curves is None:
        return None
    grid, known = curves.grid, curves.known_baselines
    peak = max(float(c.max()) for c in [*curves.actual, *known])
    scale, unit = (1000.0, "kgCO2") if peak >= 1000.0 else (1.0, "gCO2")
    xs = to_dates(grid)
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    for (i, run), actual, base in zip(curves.drawn, curves.actual, curves.baselines, strict=True):
        ys = actual / scale
        ax.plot(xs, ys, color=site_colour(i), linewidth=1.8, label=f"{run.label} ({ys[-1]:,.2f})")
        if base is not None:
            ax.plot(
                xs,
                base / scale,
                color=site_colour(i),
                linestyle="--",
                linewidth=1.2,
                label=f"{run.label} at once ({base[-1] / scale:,.2f})",
            )
    total = curves.total / scale
    training = curves.training / scale
    bx.plot(xs, total, color="black", linewidth=1.8, label=f"swarm ({total[-1]:,.2f})")
    bx.plot(
        xs, training, color="tab:green", linewidth=1.4, label=f"swarm, training only ({training[-1]:,.2f})"
    )
    if known:
        summed = np.sum(known, axis=0) / scale
        partial = "" if len(known) == len(curves.drawn) else f", {len(known)} of {len(curves.drawn)} sites"
        bx.plot(
            xs,
            summed,
            color="tab:red",
            linestyle="--",
            linewidth=1.4,
            label=f"at once{partial} ({summed[-1]:,.2f})",
        )
    for axis, title in ((ax, "each site"), (bx, "the swarm")):
        utc_time_axis(axis, grid[0], grid[-1])
        axis.set_ylim(bottom=0)
        axis.set_ylabel(f"cumulative emissions ({unit})")
        axis.set_xlabel("clock time (UTC)")
        axis.set_title(title, loc="left", fontsize=10)
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    return png(fig)
