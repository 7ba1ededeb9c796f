"""Policies that go past the threshold: pick the cleanest hours, not just the clean-enough ones.

Inside windows the intensity differs a lot between regions (on the anchor's trace NEM_SA sits near
0, SPP_TX near 14 and CAISO_NORTH near 78 gCO2/kWh), so a swarm with a deadline should train where
and when it is cleanest, and only as much as the work needs.

* :func:`foresight_runs`: perfect foresight. Sort every (site, sample) of the trace by intensity and
  take the cleanest until the work is covered. Unattainable; the lower bound.
* :func:`deadline_runs`: what a live swarm can do. At each decision step it knows the trace up to
  now and a forecast of the rest (:mod:`greenswarm.scheduler.forecast`); it sets a price
  ``tau`` so that the forecast site-time at or below ``tau`` until the deadline covers the remaining
  work (plus a safety margin), and runs exactly the sites whose intensity *now* is below ``tau``,
  and a site *at* ``tau`` only for the part of the step the plan needs (with an oracle forecast
  this is :func:`foresight_runs`). If the remaining work no longer fits before the deadline, every
  site runs.
"""

from __future__ import annotations

import numpy as np

from greenswarm.scheduler.forecast import Forecaster, values_at
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
    margin: float = 0.1,
    cap: float | None = None,
) -> list[SiteRun]:
    """Decide, at each sample of the trace, which sites train until the next one (see module doc).

    ``margin`` asks the forecast for ``(1 + margin)`` x the remaining work, so that a forecast that
    is too optimistic about later hours does not leave the swarm short at the deadline. ``cap``
    (the window threshold) keeps the plan to hours forecast below it while those cover the work:
    a poor forecast then degrades towards the threshold policy rather than towards dirty hours.
    """
    begins, ends = _cells(trace, start, deadline)
    chosen: list[list[tuple[float, float]]] = [[] for _ in regions]
    left = work_s
    for k, (t, t_end) in enumerate(zip(begins, ends, strict=True)):
        if left <= 1e-9:
            break
        now = np.array([values_at(trace, r, np.array([t]))[0] for r in regions])
        future_b, future_e = begins[k + 1 :], ends[k + 1 :]
        forecast = [forecaster.predict(trace, r, t, future_b) for r in regions]
        values = np.concatenate([now, *forecast])
        durations = np.concatenate(
            [np.full(len(regions), t_end - t), np.tile(future_e - future_b, len(regions))]
        )
        if cap is not None:
            clean = values < cap
            if durations[clean].sum() >= left * (1.0 + margin):
                values = np.where(clean, values, np.inf)
        order = np.argsort(values, kind="stable")
        covered = np.cumsum(durations[order])
        step = t_end - t
        if left >= covered[-1] - 1e-9:  # no slack left: everyone runs
            allow = np.full(len(regions), step)
        else:
            # the plan: the cells order[:m] whole and the marginal cell order[m] (intensity tau) only
            # in part; a site whose present cell is the marginal one trains just that part now
            need = left * (1.0 + margin)
            m = int(np.searchsorted(covered, need - 1e-9))
            plan = np.zeros(len(values))
            plan[order[:m]] = durations[order[:m]]
            plan[order[m]] = need - (covered[m - 1] if m else 0.0)
            allow = plan[: len(regions)]
        for s in np.argsort(now, kind="stable"):
            take = min(allow[s], left)
            if take <= 1e-9:
                continue
            chosen[s].append((t, t + take))
            left -= take
    return _runs(regions, chosen, train_kw)
