"""The deadline plan: which sites train in the step that begins now, so that the work is done by the
deadline in the cleanest site-hours a forecast can see.

One decision, used both by a running node (:class:`~greenswarm.scheduler.deadline_schedule.DeadlineSchedule`)
and by ``greenswarm simulate --policy deadline`` (:func:`~greenswarm.simulation.deadline.deadline_runs`),
so that the simulator models what the node does. At every step of the signal's grid (receding
horizon: the plan is made again at each step, with the latest samples and the work still left):

* the forecaster is handed the trace *cut at now* (a forecaster that needs the future -- the oracle,
  the noisy oracle -- says so with ``past_only = False`` and is the only one that gets more);
* every (site, step) until the deadline gets a value: the present one for the step that begins now,
  the forecast for the rest;
* the plan takes the cleanest of them until they cover ``(1 + margin)`` x the work left: its last
  value is the *price*. A site trains now if its present value is below the price (and, when it is
  the marginal one, for the part of the step the plan needs);
* ``threshold`` caps the plan: while the steps forecast below it cover the work, none above it is
  chosen, so a poor forecast degrades towards the threshold policy rather than towards dirty hours;
* with less than ``min_history_s`` of samples behind now (a past-only forecast has nothing to go
  on: the anchor's 18 h trace) the plan *is* the threshold policy: a site trains while its value is below
  ``threshold``;
* whenever the work left no longer fits before the deadline, every site trains: the deadline is
  never missed for want of trying.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from greenswarm.scheduler.forecast import DAY_S, Forecaster, values_at
from greenswarm.traces.trace import Trace

#: how much of a live signal a site under a deadline plan keeps: the profile forecaster looks back four weeks
PLAN_RETENTION_S = 35 * DAY_S

#: how many equal parts of its work a site's published supply has (a progress record stays small)
QUANTILES = 24

#: why a site trains or waits in a step, as the node logs it and the simulator counts it
PLAN, FORCED, FALLBACK, DONE, LATE = "plan", "forced", "threshold-fallback", "done", "late"
#: seconds of work left that count as none (clock arithmetic at ~1.7e9 s rounds to ~1e-7 s)
DONE_S = 1e-6


@dataclass(frozen=True)
class Decision:
    """What the plan says for the step ``[begin, end)``."""

    begin: float
    end: float
    allow_s: np.ndarray  # per site: seconds of this step to train (0 .. end - begin)
    now: np.ndarray  # per site: the value in force now (gCO2/kWh)
    price: float  # the plan's marginal value: a site trains now below it (inf when forced)
    reason: str  # PLAN, FORCED, FALLBACK, DONE or LATE (or the schedule's own)
    next_start: list[float | None]  # per site: the first later step the plan chooses (None: none)
    left_s: float  # seconds of this site's training the work left amounts to, when decided
    supply: Supply | None = None  # the first site's own supply, as it publishes it (a plan only)

    def trains(self, site: int = 0) -> bool:
        return bool(self.allow_s[site] > 1e-9)


def known_until(trace: Trace, now: float) -> Trace:
    """``trace`` with only the samples at or before ``now``: all that a decision at ``now`` may read."""
    k = max(int(np.searchsorted(trace.times, now, side="right")), 1)
    if k == len(trace.times):
        return trace
    values = {r: v[:k] for r, v in trace.values.items()}
    return Trace(trace.times[:k], values, trace.resolution_s, trace.source)


class DeadlinePlanner:
    """Plans ``regions`` (one site each) to finish their work by ``deadline`` (see module doc)."""

    def __init__(
        self,
        forecaster: Forecaster,
        regions: list[str],
        deadline: float,
        *,
        margin: float = 0.0,
        threshold: float | None = None,
        min_history_s: float = DAY_S,
    ):
        self.forecaster, self.regions, self.deadline = forecaster, list(regions), float(deadline)
        self.margin, self.threshold, self.min_history_s = float(margin), threshold, float(min_history_s)

    def step(self, trace: Trace, now: float) -> tuple[float, float]:
        """The step of the signal's grid that holds ``now``: ``[now, next sample)``, clipped to the
        deadline (past the trace's last sample the grid goes on at its resolution)."""
        res = trace.resolution_s
        i = int(np.searchsorted(trace.times, now, side="right")) - 1
        base = float(trace.times[i]) if i >= 0 else float(trace.times[0])
        end = base + res * (math.floor((now - base) / res) + 1)
        return now, min(end, self.deadline) if now < self.deadline else end

    def decide(
        self,
        trace: Trace,
        now: float,
        left: float,
        *,
        rate: float = 1.0,
        others: Sequence[Supply] = (),
    ) -> Decision:
        """The decision for the step that begins at ``now`` with ``left`` work left.

        Work is counted in site-seconds (``rate`` 1) or in tokens (``rate``: this site's tokens per
        second). ``others``: what the other sites sharing the work can do before the deadline, each as
        the values of its forecast steps and the work each would give (:class:`Supply`); the price is
        then the swarm's, and this site trains now if it is among the cleanest site-hours of all.
        """
        begin, end = self.step(trace, now)
        n = len(self.regions)
        past_only = getattr(self.forecaster, "past_only", True)
        known = known_until(trace, now) if past_only else trace
        present = np.array([values_at(known, r, np.array([now]))[0] for r in self.regions])
        left_s = max(left, 0.0) / rate
        if left_s <= DONE_S:
            return Decision(begin, end, np.zeros(n), present, math.inf, DONE, [None] * n, left_s)
        step = end - begin
        if now >= self.deadline:  # past it with work left: train until done
            return Decision(begin, end, np.full(n, step), present, math.inf, LATE, [None] * n, left_s)
        future_b = np.arange(end, self.deadline, trace.resolution_s, dtype=np.float64)
        future_e = np.minimum(future_b + trace.resolution_s, self.deadline)
        own = np.concatenate([np.full(n, step), np.tile(future_e - future_b, n)]) * rate
        extra_values = [np.asarray(o.values, dtype=np.float64) for o in others]
        extra_work = [np.asarray(o.work, dtype=np.float64) for o in others]
        capacity = float(own.sum() + sum(w.sum() for w in extra_work))
        if left >= capacity * (1 - 1e-12) - 1e-9:  # no slack left: everyone trains
            return Decision(begin, end, np.full(n, step), present, math.inf, FORCED, [None] * n, left_s)
        if past_only and now - known.start < self.min_history_s and self.threshold is not None:
            allow = np.where(present < self.threshold, step, 0.0)
            return Decision(begin, end, allow, present, self.threshold, FALLBACK, [None] * n, left_s)
        forecast = [self.forecaster.predict(known, r, now, future_b) for r in self.regions]
        values = np.concatenate([present, *forecast, *extra_values])
        amounts = np.concatenate([own, *extra_work])
        need = left * (1.0 + self.margin)
        if self.threshold is not None:
            clean = values < self.threshold
            if amounts[clean].sum() >= need:
                values = np.where(clean, values, np.inf)
        order = np.argsort(values, kind="stable")
        covered = np.cumsum(amounts[order])
        m = min(int(np.searchsorted(covered, need - 1e-9)), len(order) - 1)
        plan = np.zeros(len(values))
        plan[order[:m]] = amounts[order[:m]]
        plan[order[m]] = min(amounts[order[m]], need - (covered[m - 1] if m else 0.0))
        chosen = plan[n : len(own)].reshape(n, -1) > 1e-9
        nxt = [float(future_b[np.argmax(c)]) if c.any() else None for c in chosen]
        price = float(values[order[m]])
        supply = Supply.of(
            np.concatenate([present[:1], forecast[0]]), np.append(step, future_e - future_b) * rate
        )
        return Decision(begin, end, plan[:n] / rate, present, price, PLAN, nxt, left_s, supply)


@dataclass(frozen=True)
class Supply:
    """What one site can still train before the deadline, by how clean: ``values`` (gCO2/kWh) and the
    ``work`` each would give (tokens). A site publishes its own, summarised to :data:`QUANTILES`
    equal parts, so that sites sharing one target price the swarm's work together."""

    values: tuple[float, ...]
    work: tuple[float, ...]

    @classmethod
    def of(cls, values: np.ndarray, work: np.ndarray, parts: int | None = None) -> Supply:
        """``values``/``work`` summarised as ``parts`` equal shares of the work, at their quantiles."""
        parts = QUANTILES if parts is None else parts
        total = float(work.sum())
        if total <= 0 or not len(values):
            return cls((), ())
        order = np.argsort(values, kind="stable")
        cum = np.cumsum(work[order])
        marks = (np.arange(parts) + 0.5) / parts * total
        picked = values[order][np.minimum(np.searchsorted(cum, marks), len(order) - 1)]
        return cls(tuple(float(v) for v in picked), tuple([total / parts] * parts))
