"""The run report's figures, drawn with matplotlib (Agg) and returned as PNG bytes to embed.

Every function takes the sites as :mod:`~greenswarm.report.runs` read them and returns ``None`` when
no site has what the figure needs (the page then says so). Intensity, the threshold and the UTC time
axis are drawn by the helpers ``greenswarm windows --plot`` uses, so both read the same.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from greenswarm.console import pyplot
from greenswarm.report.runs import SiteRun
from greenswarm.scheduler.windows_report import draw_intensity, to_dates, utc_time_axis

#: colours of the states behind each site's intensity
STATE_COLOURS = {"IDLE": "#bdbdbd", "SOLO": "tab:orange", "FEDERATED": "tab:green"}
STATE_ALPHA = {"IDLE": 0.18, "SOLO": 0.3, "FEDERATED": 0.3}
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


def rounds_figure(runs: list[SiteRun]) -> bytes | None:
    """Every round each site ended, on clock time: a mark per site and outcome, and a line joining the
    members of each averaged group."""
    row_of = {id(r): len(runs) - 1 - i for i, r in enumerate(runs)}  # the first site on top
    rows: dict[str, int] = {}  # a member's row, by the name round logs give it
    for run in runs:
        rows.setdefault(run.name, row_of[id(run)])
    entries = [(run, e) for run in runs if run.sync_interval_s for e in run.rounds if "slot" in e]
    if not entries:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.55 * len(runs)), layout="constrained")
    groups: dict[tuple[float, str], set[str]] = {}  # (boundary, lineage after it): the group's members
    for run, entry in entries:
        if entry.get("action") != "solo":
            key = (float(entry["slot"]) * run.sync_interval_s, str(entry.get("lineage", "")))
            groups.setdefault(key, set()).update(set(entry.get("members") or []) | {run.name})
    for (t, _), members in groups.items():
        ys = [rows[m] for m in members if m in rows]
        if len(ys) > 1:
            x = to_dates([t])[0]
            ax.plot([x, x], [min(ys), max(ys)], color="tab:green", alpha=0.5, linewidth=2, zorder=1)
    shown: set[str] = set()
    for run, entry in entries:
        action = entry.get("action", "?")
        marker, colour, label = ACTIONS.get(action, ("*", "black", action))
        ax.plot(
            to_dates([float(entry["slot"]) * run.sync_interval_s]),
            [row_of[id(run)]],
            linestyle="none",
            marker=marker,
            color=colour,
            markersize=7,
            zorder=2,
            label=label if action not in shown else None,
        )
        shown.add(action)
    window = span(runs)
    times = [float(e["slot"]) * r.sync_interval_s for r, e in entries]
    lo, hi = window if window is not None else (min(times), max(times))
    pad = max((hi - lo) * 0.01, 60.0)
    utc_time_axis(ax, min(lo, min(times)) - pad, max(hi, max(times)) + pad)
    ax.set_yticks([row_of[id(r)] for r in runs], [r.label for r in runs])
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


def emissions_figure(runs: list[SiteRun]) -> bytes | None:
    """Cumulative emissions on clock time: each site against the same training run at once from its
    start (left), and the swarm's total, its training part and the baselines' sum (right)."""
    grid = _grid(runs)
    drawn = [(i, r) for i, r in enumerate(runs) if r.points]
    if grid is None or not drawn:
        return None
    actual = {r.name: cumulative_g(r, grid) for _, r in drawn}
    idle = {r.name: cumulative_g(r, grid, "idle_g") for _, r in drawn}
    baselines = {r.name: baseline_g(r, grid) for _, r in drawn}
    peak = max(float(c.max()) for c in [*actual.values(), *(b for b in baselines.values() if b is not None)])
    scale, unit = (1000.0, "kgCO2") if peak >= 1000.0 else (1.0, "gCO2")
    xs = to_dates(grid)
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    for i, run in drawn:
        ys = actual[run.name] / scale
        ax.plot(xs, ys, color=site_colour(i), linewidth=1.8, label=f"{run.label} ({ys[-1]:,.2f})")
        base = baselines[run.name]
        if base is not None:
            ax.plot(
                xs,
                base / scale,
                color=site_colour(i),
                linestyle="--",
                linewidth=1.2,
                label=f"{run.label} at once ({base[-1] / scale:,.2f})",
            )
    total = sum(actual.values()) / scale
    training = (sum(actual.values()) - sum(idle.values())) / scale
    bx.plot(xs, total, color="black", linewidth=1.8, label=f"swarm ({total[-1]:,.2f})")
    bx.plot(
        xs, training, color="tab:green", linewidth=1.4, label=f"swarm, training only ({training[-1]:,.2f})"
    )
    known = [b for b in baselines.values() if b is not None]
    if known:
        summed = sum(known) / scale
        partial = "" if len(known) == len(drawn) else f", {len(known)} of {len(drawn)} sites"
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
