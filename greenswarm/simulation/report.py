"""``greenswarm simulate``: sites' policies against a trace, without training, and what they emit.

:func:`simulate` answers with a plain dict (what ``--json`` prints) plus the schedules behind it
(for the plot). Every run is put next to three yardsticks at *equal work*: each region's single
site training continuously (the anchor's baselines), the threshold ideal (training exactly inside
each site's windows, nothing outside), and perfect foresight (the cleanest site-hours of the trace).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from greenswarm.console import pyplot, save_figure, wide_console
from greenswarm.scheduler.config import ANCHOR_TRAIN_KW
from greenswarm.scheduler.energy import baseline_emissions_g
from greenswarm.scheduler.forecast import FileForecaster, Forecaster, NoisyForecaster, make_forecaster
from greenswarm.simulation.deadline import deadline_runs, foresight_runs
from greenswarm.simulation.engine import (
    SiteRun,
    SiteTotals,
    account,
    hold_idle,
    integrals,
    occupancy_hours,
    time_to_finish,
    truncate,
)
from greenswarm.simulation.intervals import coverage
from greenswarm.simulation.policies import POLICIES, PolicyConfig, simulate_policy
from greenswarm.timefmt import iso_utc, parse_instant
from greenswarm.traces.trace import Trace

#: Policies that choose their own hours against a deadline instead of following windows.
DEADLINE_POLICIES = ("deadline", "foresight")


@dataclass
class Simulation:
    """A finished simulation: the report and the schedules that produced it."""

    report: dict[str, Any]
    runs: list[SiteRun]
    yardsticks: dict[str, list[SiteRun]]
    trace: Trace
    start: float
    end: float


def _finish(runs: list[SiteRun], work_s: float | None, start: float, end: float) -> tuple[float, bool]:
    """Cut ``runs`` where ``work_s`` is done (or at ``end``); return the end and whether it was done."""
    finish = time_to_finish(runs, work_s, start) if work_s is not None else None
    done = finish is not None and finish <= end
    stop = finish if done else end
    truncate(runs, start, stop)
    return stop, done


def _sum(totals: list[SiteTotals], key: str) -> float:
    return float(sum(getattr(t, key) for t in totals))


def _kg(runs: list[SiteRun], trace: Trace, threshold: float) -> float:
    return _sum(account(runs, trace, threshold), "emissions_g") / 1000.0


def _runs_for(
    policy: str | PolicyConfig,
    trace: Trace,
    regions: list[str],
    start: float,
    deadline: float,
    work_s: float | None,
    train_kw: float,
    forecast: Forecaster,
    margin: float,
    threshold: float,
) -> list[SiteRun]:
    if isinstance(policy, PolicyConfig):
        return simulate_policy(trace, regions, policy, start)
    if work_s is None:
        raise ValueError(f"policy {policy} needs the work to do (--work SITE_HOURS)")
    if policy == "foresight":
        return foresight_runs(trace, regions, work_s, start, deadline, train_kw)
    return deadline_runs(trace, regions, work_s, start, deadline, forecast, train_kw, margin, cap=threshold)


def simulate(
    trace: Trace,
    regions: list[str],
    policy: str | PolicyConfig,
    *,
    work_h: float | None = None,
    start: float | None = None,
    deadline_h: float | None = None,
    forecast: str | Forecaster = "noisy",
    forecast_error: float = 0.3,
    forecast_seed: int = 0,
    margin: float = 0.0,
    threshold: float | None = None,
    train_kw: float | None = None,
    idle_kw: float | None = None,
    compare: tuple[PolicyConfig, ...] = (),
) -> Simulation:
    """Simulate ``regions`` (one site each) under ``policy`` until ``work_h`` site-hours are done.

    ``policy`` is a :class:`PolicyConfig` or ``deadline`` / ``foresight``. Without ``work_h`` the
    sites run to the end of the trace and the yardsticks are taken at the work they did. The
    ``deadline`` policy must finish by ``deadline_h`` hours after ``start`` (default: the trace's end)
    and plans with ``forecast``; perfect foresight, for every policy, picks the cleanest site-hours
    before that deadline. ``threshold``, ``train_kw`` and ``idle_kw`` override the policy's. The
    ``deadline`` and ``foresight`` policies count training alone by default, like the yardsticks
    (the choice of hours); with ``idle_kw`` their sites are powered from ``start`` until their work
    is done, idling at it between the hours they train, as a node that keeps its model on the GPUs
    (``energy.idle_kw``, 0.468 kW by default) does. Each policy
    in ``compare`` is simulated on the same terms and summarised under ``compare`` (and plotted).
    """
    for region in regions:
        trace.series(region)
    start = trace.start if start is None else float(start)
    if not trace.start <= start < trace.end:
        raise ValueError(
            f"start {iso_utc(start)} is outside the trace ({iso_utc(trace.start)} .. {iso_utc(trace.end)})"
        )
    deadline = trace.end if deadline_h is None else min(start + deadline_h * 3600.0, trace.end)
    if isinstance(policy, PolicyConfig):
        sched = replace(policy.scheduler, threshold=threshold) if threshold is not None else policy.scheduler
        energy = replace(policy.energy, train_kw=train_kw) if train_kw is not None else policy.energy
        energy = replace(energy, idle_kw=idle_kw) if idle_kw is not None else energy
        policy = replace(policy, scheduler=sched, energy=energy)
        sched.validate()
        energy.validate()
        threshold, train_kw = sched.threshold, energy.train_kw
    threshold = 100.0 if threshold is None else threshold
    train_kw = ANCHOR_TRAIN_KW if train_kw is None else train_kw
    work_s = None if work_h is None else work_h * 3600.0

    if not isinstance(forecast, str):
        forecaster = forecast
    elif forecast == "noisy":
        forecaster = NoisyForecaster(forecast_error, forecast_seed)
    else:
        forecaster = make_forecaster(forecast)
    runs = _runs_for(policy, trace, regions, start, deadline, work_s, train_kw, forecaster, margin, threshold)
    if isinstance(policy, str) and idle_kw:
        hold_idle(runs, start, deadline, idle_kw)
    end, done = _finish(runs, work_s, start, deadline if isinstance(policy, str) else trace.end)
    totals = account(runs, trace, threshold)
    work_done = _sum(totals, "work_s")
    energy_kwh = _sum(totals, "energy_kwh")
    emissions_kg = _sum(totals, "emissions_g") / 1000.0
    equal = work_done if work_s is None or not done else work_s

    ideal_cfg = replace(
        POLICIES["ideal"],
        scheduler=replace(POLICIES["ideal"].scheduler, threshold=threshold),
        energy=replace(POLICIES["ideal"].energy, train_kw=train_kw),
    )
    ideal = simulate_policy(trace, regions, ideal_cfg, start)
    _, ideal_done = _finish(ideal, equal, start, trace.end)
    capacity = len(regions) * (deadline - start)
    foresight = foresight_runs(trace, regions, min(equal, capacity), start, deadline, train_kw)
    ideal_kg = _kg(ideal, trace, threshold) if ideal_done else None
    foresight_kg = _kg(foresight, trace, threshold) if equal <= capacity else None

    baselines = {
        r: baseline_emissions_g(trace, r, start, start + equal, train_kw) / 1000.0 for r in trace.regions
    }
    name = policy.name if isinstance(policy, PolicyConfig) else policy
    describe = (
        policy.describe()
        if isinstance(policy, PolicyConfig)
        else (
            f"cleanest site-hours before {iso_utc(deadline)}"
            + (
                f", planned with the {_forecast_text(forecast, forecast_error)}"
                if policy == "deadline"
                else ", perfect foresight"
            )
        )
    )
    report: dict[str, Any] = {
        "policy": name,
        "description": describe,
        "trace": trace.source,
        "regions": list(regions),
        "threshold": threshold,
        "start": iso_utc(start),
        "end": iso_utc(end),
        "wall_hours": (end - start) / 3600.0,
        "work_site_hours": None if work_h is None else work_h,
        "site_hours": work_done / 3600.0,
        "finished": done if work_s is not None else True,
        "energy_kwh": energy_kwh,
        "emissions_kg": emissions_kg,
        "in_window_share": _sum(totals, "in_window_kwh") / energy_kwh if energy_kwh else 0.0,
        "restarts": sum(t.restarts for t in totals),
        "hours_by_sites": occupancy_hours(runs, start, end),
        "baselines": baselines,
        "baseline_ratios": {r: (emissions_kg / kg if kg else None) for r, kg in baselines.items()},
        "ideal_kg": ideal_kg,
        "vs_ideal": (emissions_kg / ideal_kg - 1.0) if ideal_kg else None,
        "foresight_kg": foresight_kg,
        "sites": [
            {
                "name": t.name,
                "region": t.region,
                "energy_kwh": t.energy_kwh,
                "emissions_kg": t.emissions_g / 1000.0,
                "train_hours": (t.train_s + t.federated_s) / 3600.0,
                "idle_hours": t.idle_s / 3600.0,
                "released_hours": t.released_s / 3600.0,
                "restart_hours": t.restart_s / 3600.0,
                "restarts": t.restarts,
                "work_site_hours": t.work_s / 3600.0,
                "in_window_share": t.in_window_kwh / t.energy_kwh if t.energy_kwh else 0.0,
            }
            for t in totals
        ],
    }
    if isinstance(policy, str) and policy == "deadline":
        report["forecast"] = forecast if isinstance(forecast, str) else forecast.name
        if forecast == "noisy":
            report["forecast_error"] = forecast_error
        report["deadline"] = iso_utc(deadline)
    yardsticks = {"ideal": ideal, "foresight": foresight}
    report["compare"] = {}
    for other in compare:
        sub = simulate(
            trace, regions, other, work_h=work_h, start=start, threshold=threshold, train_kw=train_kw
        )
        report["compare"][other.name] = {
            k: sub.report[k]
            for k in (
                "description",
                "emissions_kg",
                "energy_kwh",
                "in_window_share",
                "wall_hours",
                "finished",
            )
        }
        yardsticks[other.name] = sub.runs
    return Simulation(report, runs, yardsticks, trace, start, end)


def _forecast_text(forecast: str | Forecaster, error: float) -> str:
    if forecast == "noisy":
        return f"noisy forecast (truth x log-normal error, sigma {error:g} a day ahead)"
    if isinstance(forecast, FileForecaster):
        return f"forecasts issued in {forecast.forecasts.source} (each only from its issue time)"
    return f"{forecast if isinstance(forecast, str) else forecast.name} forecast"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_simulation(report: dict[str, Any]) -> None:
    """The report as a per-site table and the swarm's totals next to the yardsticks."""
    from rich.table import Table

    console = wide_console()
    table = Table(title=f"{report['policy']}: {report['description']}")
    releasing = any(s.get("restarts") or s.get("released_hours") for s in report["sites"])
    columns = ["site", "region", "train h", "idle h"]
    columns += ["released h", "restarts"] if releasing else []
    for col in columns + ["kWh", "kgCO2", "in window"]:
        table.add_column(col, justify="left" if col in ("site", "region") else "right")
    for s in report["sites"]:
        extra = [f"{s['released_hours']:.2f}", str(s["restarts"])] if releasing else []
        table.add_row(
            s["name"],
            s["region"],
            f"{s['train_hours']:.2f}",
            f"{s['idle_hours']:.2f}",
            *extra,
            f"{s['energy_kwh']:.2f}",
            f"{s['emissions_kg']:.3f}",
            f"{s['in_window_share']:.1%}",
        )
    console.print(table)
    occ = report["hours_by_sites"]
    status = "" if report["finished"] else "  (NOT finished: the trace ran out first)"
    console.print(
        f"{report['site_hours']:.2f} site-hours in {report['wall_hours']:.2f} h ({report['start']} .. "
        f"{report['end']}){status}\n"
        f"hours with 0/1/2/3+ sites training: "
        f"{occ['0']:.2f} / {occ['1']:.2f} / {occ['2']:.2f} / {occ['3+']:.2f}\n"
        f"energy {report['energy_kwh']:.2f} kWh, emissions {report['emissions_kg']:.3f} kgCO2, "
        f"{report['in_window_share']:.1%} of energy in window (< {report['threshold']:g} gCO2/kWh)"
        + (f", {report['restarts']} trainer restarts" if releasing else ""),
        highlight=False,
    )
    yard = Table(title="at equal work")
    yard.add_column("yardstick")
    yard.add_column("kgCO2", justify="right")
    yard.add_column("this run / it", justify="right")
    for r, kg in report["baselines"].items():
        ratio = report["baseline_ratios"][r]
        yard.add_row(f"one site in {r}, continuous", f"{kg:.2f}", _fmt(ratio, ".1%"))
    rows = [("threshold ideal", report["ideal_kg"]), ("perfect foresight", report["foresight_kg"])]
    rows += [(f"policy {name}", c["emissions_kg"]) for name, c in report.get("compare", {}).items()]
    for label, kg in rows:
        yard.add_row(label, _fmt(kg, ".3f"), _fmt(report["emissions_kg"] / kg if kg else None, ".1%"))
    console.print(yard)


def plot_simulation(sim: Simulation, path: str) -> str:
    """A PNG of cumulative emissions over the run, like the anchor's figure: this run, the ideal and
    perfect foresight (left), and each region's continuous single-site baseline at equal work (right,
    on a log scale so that kilograms and grams share one axis)."""
    from pathlib import Path

    plt = pyplot()

    rep = sim.report
    hours_equal = rep["site_hours"]
    span = max(sim.end - sim.start, hours_equal * 3600.0)
    grid = sim.start + np.linspace(0.0, span, 600)
    x = (grid - sim.start) / 3600.0
    curves = {f"{rep['policy']} ({rep['emissions_kg']:.2f} kg)": cumulative_kg(sim.runs, sim.trace, grid)}
    for key, runs in sim.yardsticks.items():
        kg = rep[f"{key}_kg"] if key in ("ideal", "foresight") else rep["compare"][key]["emissions_kg"]
        if kg is not None and key != rep["policy"]:
            curves[f"{key} ({kg:.2f} kg)"] = cumulative_kg(runs, sim.trace, grid)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    try:
        for label, ys in curves.items():
            # yardsticks dotted, so a policy that matches one (greenswarm and the ideal) shows both
            style = {"linestyle": ":", "linewidth": 2.2} if label.startswith(("ideal ", "foresight ")) else {}
            ax.plot(x, ys, label=label, **style)
            bx.plot(x, ys, label=label, **style)
        for region in rep["baselines"]:
            upto = np.minimum(grid, sim.start + hours_equal * 3600.0)
            ys = np.array([sim.trace.integral(region, sim.start, u) for u in upto]) * _train_kw(sim) / 3.6e6
            bx.plot(x, ys, linestyle="--", label=f"{region} continuous ({ys[-1]:.2f} kg)")
        for axis in (ax, bx):
            axis.set_xlabel("hours since start")
            axis.set_ylabel("cumulative emissions (kgCO2)")
            axis.legend(loc="upper left", fontsize=8)
            axis.set_xlim(0, x[-1])
        bx.set_yscale("log")
        bx.set_ylim(bottom=0.01)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{rep['site_hours']:.2f} site-hours over {', '.join(rep['regions'])}")
        bx.set_title("against single-site baselines at equal work")
        out = Path(path).expanduser()
        save_figure(fig, out)
    finally:
        plt.close(fig)
    return str(out)


def _train_kw(sim: Simulation) -> float:
    """The training draw of the run (the baselines use it), from its first training segment."""
    for run in sim.runs:
        for seg in run.segments:
            if seg.kind == "train" and seg.rate == 1.0:
                return seg.kw
    return ANCHOR_TRAIN_KW


def cumulative_kg(runs: list[SiteRun], trace: Trace, grid: np.ndarray) -> np.ndarray:
    """Swarm-wide kg emitted by each instant of ``grid``: per region, the summed power of its sites
    as a step function, integrated against the region's intensity."""
    out = np.zeros(len(grid))
    for region in dict.fromkeys(r.region for r in runs):
        sets = [s.intervals for r in runs if r.region == region for s in r.segments]
        kws = [s.kw for r in runs if r.region == region for s in r.segments]
        edges, power = coverage(sets, kws)
        if len(edges) < 2:
            continue
        pieces = np.column_stack([edges[:-1], edges[1:]])
        grams = power * integrals(trace, region, pieces) / 3600.0
        done = np.concatenate(([0.0], np.cumsum(grams)))
        out += np.interp(grid, edges, done) / 1000.0
    return out


def _regions(text: str) -> list[str]:
    from greenswarm.errors import ConfigError

    regions = [r.strip() for r in text.split(",") if r.strip()]
    if not regions:
        raise ConfigError(
            "name at least one region, e.g. --regions CAISO_NORTH,SPP_TX,NEM_SA", where="--regions"
        )
    return regions


def run_simulate(
    trace: str | Sequence[str],
    regions: str,
    *,
    policy: str = "greenswarm",
    overrides: list[str] | None = None,
    threshold: float | None = None,
    work: float | None = None,
    start: str | None = None,
    deadline: float | None = None,
    forecast: str = "noisy",
    forecast_error: float = 0.3,
    idle_kw: float | None = None,
    calibrate: str | None = None,
    compare: str | None = None,
    trace_options: dict[str, Any] | None = None,
    plot: str | None = None,
    as_json: bool = False,
) -> int:
    """``greenswarm simulate``: load the trace and the policy, simulate, print (table or one JSON
    object) and optionally plot. Every bad input becomes one line naming the flag at fault."""
    import json

    from greenswarm.errors import ConfigError, TraceError
    from greenswarm.scheduler.forecast import FILE_PREFIX, FORECASTERS, forecaster_from_spec
    from greenswarm.simulation.policies import load_policy
    from greenswarm.traces.readers import load_trace

    names = _regions(regions)
    for flag, value in (("--work", work), ("--deadline", deadline), ("--threshold", threshold)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"must be a number > 0, got {value:g}", where=flag)
    if not (math.isfinite(forecast_error) and forecast_error >= 0):
        raise ConfigError(f"must be a number >= 0, got {forecast_error:g}", where="--forecast-error")
    planner: str | Forecaster = forecast
    if forecast.startswith(FILE_PREFIX):
        options = trace_options or {}
        try:
            planner = forecaster_from_spec(
                forecast, tz=options.get("tz"), units=options.get("units", "g/kWh")
            )
        except TraceError as err:
            raise ConfigError(str(err), where="--forecast") from None
    elif forecast not in FORECASTERS:
        raise ConfigError(
            f"unknown forecast {forecast!r}; known: {', '.join(FORECASTERS)}, file:PATH", where="--forecast"
        )
    chosen: str | PolicyConfig = policy if policy in DEADLINE_POLICIES else load_policy(policy, overrides)
    if policy in DEADLINE_POLICIES and work is None:
        raise ConfigError(f"the {policy} policy plans for a fixed amount of work: give --work SITE_HOURS")
    others = tuple(load_policy(p.strip(), flag="--compare") for p in (compare or "").split(",") if p.strip())
    loaded = load_trace(trace, **(trace_options or {}))
    try:
        begin = None if start is None else parse_instant(start)
    except ConfigError as err:
        raise ConfigError(err.message, where="--start") from None
    if begin is not None and not loaded.start <= begin < loaded.end:
        raise ConfigError(
            f"{start} is outside the trace ({iso_utc(loaded.start)} .. {iso_utc(loaded.end)})",
            where="--start",
        )
    if idle_kw is not None and not (math.isfinite(idle_kw) and idle_kw >= 0):
        raise ConfigError(f"must be a number >= 0, got {idle_kw:g}", where="--idle-kw")
    measured = None
    train_kw = None
    if calibrate is not None:
        from greenswarm.simulation.calibrate import calibrate as read_calibration

        measured = read_calibration(calibrate)
        if isinstance(chosen, PolicyConfig):
            chosen = measured.apply(chosen)
        else:
            train_kw = measured.train_kw
            idle_kw = measured.idle_kw if idle_kw is None else idle_kw
    try:
        sim = simulate(
            loaded,
            names,
            chosen,
            work_h=work,
            start=begin,
            deadline_h=deadline,
            forecast=planner,
            forecast_error=forecast_error,
            threshold=threshold,
            train_kw=train_kw,
            idle_kw=idle_kw,
            compare=others,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if measured is not None:
        sim.report["calibrated"] = measured.describe()
    if plot:
        sim.report["plot"] = plot_simulation(sim, plot)
    if as_json:
        print(json.dumps(sim.report))
    else:
        print_simulation(sim.report)
        if plot:
            print(f"plot written to {sim.report['plot']}")
    return 0
