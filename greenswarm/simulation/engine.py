"""Run sites' schedules against a trace, stop when the swarm has done its work, and account for it.

A simulated site is a few interval sets, each with a power draw and a work rate (site-seconds of
training per second): training alone, training in a federated round, powered but idle (provisioning,
waiting). Everything is interval arithmetic and prefix sums over the trace, with no time stepping, so
1000 sites x a year of hourly data takes well under a second.

Accounting conventions are the ledger's (:mod:`greenswarm.scheduler.energy`): grams = kW x the
exact integral of the trace's step function / 3600. Which step function -- the raw samples held, or
the samples interpolated linearly onto a 60 s grid as the curtail-llm anchor did -- is the trace's
business (:meth:`greenswarm.traces.trace.Trace.resampled`); the engine integrates whatever it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from greenswarm.simulation.intervals import (
    EMPTY,
    as_intervals,
    clip,
    coverage,
    intersect,
    subtract,
    total,
    where_count,
)
from greenswarm.traces.trace import Trace


@dataclass
class Segments:
    """One way a site spends its time: where, at how many kW, doing how much work per second."""

    kind: str  # "train", "federated", "idle", and for a releasing site "checkpoint", "released", "restart"
    intervals: np.ndarray
    kw: float
    rate: float


@dataclass
class SiteRun:
    """A site's simulated schedule: its name, region and how it spends its time."""

    name: str
    region: str
    segments: list[Segments] = field(default_factory=list)

    def training(self) -> np.ndarray:
        """All stretches in which the site makes progress."""
        parts = [s.intervals for s in self.segments if s.rate > 0]
        return np.concatenate(parts) if parts else EMPTY.copy()


def split_federated(runs: list[SiteRun], round_s: float, overhead_s: float, pause_kw: float) -> None:
    """Charge the cost of synchronous rounds where two or more sites train at once.

    A round of ``round_s`` seconds of training is followed by ``overhead_s`` seconds in which the
    site is powered but not training (aggregation, evaluation, waiting for stragglers -- 130 s per
    600 s round in the anchor's logs), drawing ``pause_kw``. Modelled as a duty cycle: inside
    federated stretches a site trains ``round_s / (round_s + overhead_s)`` of the time and pauses the
    rest.
    """
    if overhead_s <= 0:
        return
    edges, counts = coverage([r.training() for r in runs])
    federated = where_count(edges, counts, lambda c: c >= 2)
    duty = round_s / (round_s + overhead_s)
    for run in runs:
        out: list[Segments] = []
        for seg in run.segments:
            if seg.kind != "train":
                out.append(seg)
                continue
            fed = intersect(seg.intervals, federated)
            out.append(Segments("train", subtract(seg.intervals, federated), seg.kw, seg.rate))
            out.append(Segments("federated", fed, duty * seg.kw + (1 - duty) * pause_kw, duty * seg.rate))
        run.segments = out


def hold_idle(runs: list[SiteRun], start: float, end: float, idle_kw: float) -> None:
    """Power every site from ``start`` to ``end`` at ``idle_kw`` whenever it does not train: a node
    keeps its process and model while it waits (the run is cut where its work is done)."""
    if idle_kw <= 0:
        return
    whole = np.array([[start, end]]) if end > start else EMPTY.copy()
    for run in runs:
        run.segments.append(Segments("idle", subtract(whole, as_intervals(run.training())), idle_kw, 0.0))


def time_to_finish(runs: list[SiteRun], work_s: float, start: float) -> float | None:
    """The instant at which the swarm's summed work since ``start`` reaches ``work_s`` site-seconds,
    or None if it never does."""
    sets = [clip(s.intervals, start, np.inf) for r in runs for s in r.segments if s.rate > 0]
    rates = [s.rate for r in runs for s in r.segments if s.rate > 0]
    edges, rate = coverage(sets, rates)
    if len(edges) < 2:
        return None
    done = np.concatenate(([0.0], np.cumsum(rate * np.diff(edges))))
    i = int(np.searchsorted(done, work_s - 1e-9))
    if i >= len(done):
        return None
    if i == 0:
        return float(edges[0])
    return float(edges[i - 1] + (work_s - done[i - 1]) / rate[i - 1])


def truncate(runs: list[SiteRun], t0: float, t1: float) -> None:
    """Keep only what happens in ``[t0, t1)``: the experiment stops when its work is done."""
    for run in runs:
        for seg in run.segments:
            seg.intervals = clip(seg.intervals, t0, t1)


def integrals(trace: Trace, region: str, intervals: np.ndarray) -> np.ndarray:
    """Exact integral of the trace over each interval (gCO2/kWh x s), vectorised."""
    if not len(intervals):
        return np.zeros(0)
    series = trace.series(region)
    times = trace.times
    cum = np.concatenate(([0.0], np.cumsum(series[:-1] * np.diff(times))))

    def anti(t: np.ndarray) -> np.ndarray:
        i = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 1)
        return cum[i] + series[i] * (t - times[i])

    return anti(intervals[:, 1]) - anti(intervals[:, 0])


def in_window_trace(trace: Trace, threshold: float) -> Trace:
    """A 0/1 trace that is 1 where a region's intensity is below ``threshold``: integrating it over a
    site's intervals gives the seconds it spent in window, with the same conventions as emissions."""
    flags = {r: (trace.series(r) < threshold).astype(np.float64) for r in trace.regions}
    return Trace(times=trace.times, values=flags, resolution_s=trace.resolution_s, source=trace.source)


@dataclass
class SiteTotals:
    """One site's accounting."""

    name: str
    region: str
    energy_kwh: float
    emissions_g: float
    in_window_kwh: float
    train_s: float
    federated_s: float
    idle_s: float
    work_s: float
    released_s: float = 0.0
    restart_s: float = 0.0  # restarts and the checkpoints of releases, at training power
    restarts: int = 0  # trainer starts after a release (or after a launch outside a window)


def account(runs: list[SiteRun], trace: Trace, threshold: float) -> list[SiteTotals]:
    """Energy, emissions and in-window energy of each site."""
    flags = in_window_trace(trace, threshold)
    out = []
    for run in runs:
        energy = grams = in_kwh = work = 0.0
        seconds = dict.fromkeys(("train", "federated", "idle", "released", "restart", "checkpoint"), 0.0)
        restarts = 0
        for seg in run.segments:
            secs = total(seg.intervals)
            seconds[seg.kind] += secs
            restarts += len(seg.intervals) if seg.kind == "restart" else 0
            work += seg.rate * secs
            energy += seg.kw * secs / 3600.0
            grams += seg.kw / 3600.0 * float(np.sum(integrals(trace, run.region, seg.intervals)))
            in_kwh += seg.kw / 3600.0 * float(np.sum(integrals(flags, run.region, seg.intervals)))
        out.append(
            SiteTotals(
                run.name,
                run.region,
                energy,
                grams,
                in_kwh,
                seconds["train"],
                seconds["federated"],
                seconds["idle"],
                work,
                seconds["released"],
                seconds["restart"] + seconds["checkpoint"],
                restarts,
            )
        )
    return out


def occupancy_hours(runs: list[SiteRun], t0: float, t1: float) -> dict[str, float]:
    """Hours of ``[t0, t1)`` with 0, 1, 2 and 3+ sites training."""
    edges, counts = coverage([clip(r.training(), t0, t1) for r in runs])
    hours = {"0": 0.0, "1": 0.0, "2": 0.0, "3+": 0.0}
    covered = 0.0
    for c, d in zip(counts, np.diff(edges), strict=True):
        key = "3+" if c >= 3 else str(int(c))
        hours[key] += d / 3600.0
        covered += d / 3600.0 if c > 0 else 0.0
    hours["0"] = (t1 - t0) / 3600.0 - covered
    return hours


def cumulative_emissions(runs: list[SiteRun], trace: Trace, grid: np.ndarray) -> np.ndarray:
    """Swarm-wide grams emitted by each instant of ``grid`` (for the cumulative-emissions plot)."""
    out = np.zeros(len(grid))
    for run in runs:
        for seg in run.segments:
            if not len(seg.intervals):
                continue
            a, b = seg.intervals[:, 0], seg.intervals[:, 1]
            upto = np.clip(grid[:, None], a[None, :], b[None, :])
            flat = np.column_stack([np.broadcast_to(a, upto.shape).ravel(), upto.ravel()])
            out += seg.kw / 3600.0 * integrals(trace, run.region, flat).reshape(upto.shape).sum(axis=1)
    return out
