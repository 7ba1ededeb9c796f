"""Policies that go past the threshold: pick the cleanest hours, not just the clean-enough ones.

Inside windows the intensity differs a lot between regions (on the anchor's trace NEM_SA sits near
0, SPP_TX near 14 and CAISO_NORTH near 78 gCO2/kWh), so a swarm with a deadline should train where
and when it is cleanest, and only as much as the work needs.

* :func:`foresight_runs`: perfect foresight. Sort every (site, sample) of the trace by intensity and
  take the cleanest until the work is covered. Unattainable; the lower bound.
* :func:`deadline_runs`: what a live swarm can do, decided by the same planner as a running node
  (:mod:`greenswarm.scheduler.deadline`). At each step it knows the trace up to now and a forecast
  of the rest (:mod:`greenswarm.scheduler.forecast`); it sets a price ``tau`` so that the forecast
  site-time at or below ``tau`` until the deadline covers the remaining work (plus a safety margin),
  and runs exactly the sites whose intensity *now* is below ``tau``, and a site *at* ``tau`` only
  for the part of the step the plan needs (with an oracle forecast this is :func:`foresight_runs`).
  If the remaining work no longer fits before the deadline, every site runs; with less than a day
  of history it follows the threshold.
"""

from __future__ import annotations

import numpy as np

from greenswarm.scheduler.deadline import DeadlinePlanner
from greenswarm.scheduler.forecast import DAY_S, Forecaster, values_at
from greenswarm.simulation.engine import Segments, SiteRun
from greenswarm.simulation.intervals import as_intervals
from greenswarm.traces.trace import Trace


def _cells(trace: Trace, start: float, stop: float) -> tuple[np.ndarray, np.ndarray]:
    """The trace's sample stretches clipped to ``[start, stop)``: ``(begins, ends)``."""
    bounds = np.append(trace.times, trace.end)
    begins = np.maximum(bounds[:-1], start)
    ends = np.minimum(bounds[1:], stop)
    keep = ends > begins
    return begins[keep], ends[keep]


def _runs(regions: list[str], chosen: list, train_kw: float) -> list[SiteRun]:
    runs = []
    for i, (region, pairs) in enumerate(zip(regions, chosen, strict=True)):
        run = SiteRun(f"site{i}-{region}", region)
        run.segments.append(Segments("train", as_intervals(pairs), train_kw, 1.0))
        runs.append(run)
    return runs


def foresight_runs(
    trace: Trace, regions: list[str], work_s: float, start: float, deadline: float, train_kw: float
) -> list[SiteRun]:
    """The cleanest ``work_s`` site-seconds in ``[start, deadline)``, chosen knowing the whole trace."""
    begins, ends = _cells(trace, start, deadline)
    values = np.concatenate([values_at(trace, r, begins) for r in regions])
    site = np.repeat(np.arange(len(regions)), len(begins))
    b = np.tile(begins, len(regions))
    e = np.tile(ends, len(regions))
    order = np.argsort(values, kind="stable")
    done = np.cumsum(e[order] - b[order])
    k = int(np.searchsorted(done, work_s - 1e-9))  # cells order[:k] whole, order[k] in part
    take = order[: k + 1]
    stop = e[take].copy()
    if k < len(order):
        stop[-1] = b[order[k]] + (work_s - (done[k - 1] if k else 0.0))
    by_site = np.argsort(site[take], kind="stable")
    bounds = np.searchsorted(site[take][by_site], np.arange(len(regions) + 1))
    pairs = np.column_stack([b[take], stop])[by_site]
    chosen = [pairs[bounds[i] : bounds[i + 1]] for i in range(len(regions))]
    return _runs(regions, chosen, train_kw)


def deadline_runs(
    trace: Trace,
    regions: list[str],
    work_s: float,
    start: float,
    deadline: float,
    forecaster: Forecaster,
    train_kw: float,
    margin: float = 0.0,
    cap: float | None = None,
    min_history_s: float = DAY_S,
) -> list[SiteRun]:
    """Decide, at each step of the trace, which sites train until the next one: the node's own
    :class:`~greenswarm.scheduler.deadline.DeadlinePlanner`, stepped through the trace (``cap``: the
    window threshold; see that module for ``margin`` and ``min_history_s``)."""
    planner = DeadlinePlanner(
        forecaster, regions, deadline, margin=margin, threshold=cap, min_history_s=min_history_s
    )
    chosen: list[list[tuple[float, float]]] = [[] for _ in regions]
    left, t = work_s, start
    while t < deadline and left > 1e-9:
        decision = planner.decide(trace, t, left)
        for s in np.argsort(decision.now, kind="stable"):
            take = min(float(decision.allow_s[s]), left)
            if take > 1e-9:
                chosen[s].append((t, t + take))
                left -= take
        t = decision.end
    return _runs(regions, chosen, train_kw)
