"""The site's history: one JSON line per log interval and per event, appended to ``run_dir/history.jsonl``.

The summary says where a run ended and the round log what each round did, but a run report also
needs the way there: loss against tokens, the state the site was in at each moment of clock time,
the grid's intensity and the threshold it was held against, and emissions as they accumulated. The
periodic log line says most of that for people (minute-resolution clock, rounded figures, and only
where the operator kept the log); this file says it for programs, in the run directory itself.

The file starts with a ``start`` line (what the run follows: the trace, the window rule, the round
interval, the replay's speed-up, the configured power), written again by a restarted process, then
``point`` lines. A point is written when the site's state changes, when the node reports an event
(an outer step, a catch-up, the start and the stop: ``force``), and otherwise every
``node.log_every_s`` wall seconds, beside the log line. A point that records entering or leaving a
window also says how late after the window's edge the node noticed (``late_s``, clock seconds). A
write that fails is said once and never stops training; a torn last line (a kill mid-write) is
skipped by :func:`read_history`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from greenswarm.jsonlines import read_json_lines
from greenswarm.scheduler.policy import HysteresisPolicy, PercentilePolicy, ThresholdPolicy
from greenswarm.scheduler.state import SiteState

log = logging.getLogger(__name__)

FILE = "history.jsonl"
TRAINING = (SiteState.SOLO.value, SiteState.FEDERATED.value)


def threshold_at(policy: Any, trace: Any, region: str, t: float) -> float | None:
    """The intensity (gCO2/kWh) below which ``policy`` opens a window at clock time ``t``; None for a
    rule without one (a deadline plan) or a percentile with no samples yet."""
    if isinstance(policy, ThresholdPolicy):
        return policy.threshold
    if isinstance(policy, HysteresisPolicy):
        return policy.enter_below
    if not isinstance(policy, PercentilePolicy) or trace is None:
        return None
    times, series = trace.times, trace.series(region)
    if policy.period_s is None:
        upto = series  # over the whole trace (a live signal's: as observed so far)
    else:  # rolling: the samples in (t - period, t], as the policy computes it at each sample
        lo = int(np.searchsorted(times, t - policy.period_s, side="right"))
        hi = int(np.searchsorted(times, t, side="right"))
        upto = series[lo:hi]
    return float(np.percentile(upto, policy.percentile)) if len(upto) else None


def _trace_spec(spec: str | None) -> str | None:
    """The trace as the config names it, a file or directory made absolute (a report may run elsewhere)."""
    if spec and Path(spec).expanduser().exists():
        return str(Path(spec).expanduser().resolve())
    return spec


class History:
    """Appends the site's ``start`` and ``point`` lines to ``run_dir/history.jsonl`` (see module doc)."""

    def __init__(self, run_dir: str | Path, every_s: float):
        self.path = Path(run_dir) / FILE
        self.every_s = float(every_s)
        self.last = -float("inf")  # time.monotonic() of the last point
        self.last_state: str | None = None
        self.started = False
        self.failed = False
        # (the trace's identity and length, its whole-trace threshold): computed once per trace
        self._static: tuple[tuple[int, int], float | None] | None = None

    def maybe_write(self, node: Any, force: bool = False, late_s: float | None = None) -> None:
        """A point for ``node`` (a :class:`~greenswarm.node.site.SiteNode`) if its state changed, an
        event is ``force``\\ d, or ``every_s`` wall seconds passed since the last one. ``late_s``: the
        change of state this point records came that many clock seconds after its window's edge
        (:func:`~greenswarm.scheduler.policy.noticed_late_s`), kept as the point's ``late_s``."""
        state = node.state.value
        if not force and state == self.last_state and time.monotonic() - self.last < self.every_s:
            return
        self.last, self.last_state = time.monotonic(), state
        lines = [] if self.started else [self._start_line(node)]
        self.started = True
        point = self._point(node)
        if late_s is not None:
            point["late_s"] = late_s
        lines.append(point)
        self._append(lines)

    def _start_line(self, node: Any) -> dict[str, Any]:
        cfg = node.cfg
        sched = cfg.scheduler
        return {
            "kind": "start",
            "site": cfg.name,
            "region": cfg.region,
            "wall": time.time(),
            "clock": node.clock.now(),
            "pid": os.getpid(),
            "trace": _trace_spec(sched.trace),
            "trace_options": sched.trace_options(),
            "signal": sched.signal.kind if sched.signal is not None else None,  # (never its credentials)
            "policy": sched.policy,
            "threshold": sched.threshold,
            "percentile": sched.percentile,
            "sync_interval_s": cfg.averaging.sync_interval_s,
            "speedup": float(getattr(node.clock, "speedup", 1.0)),
            "train_kw": cfg.energy.train_kw,
            "idle_kw": cfg.energy.idle_kw,
        }

    def _point(self, node: Any) -> dict[str, Any]:
        now, stats, ledger, region = node.clock.now(), node.stats, node.ledger, node.cfg.region
        trace = ledger.trace
        global_state = getattr(node, "global_state", None)  # (set once the node has started)
        return {
            "kind": "point",
            "wall": time.time(),
            "clock": now,
            "state": node.state.value,
            "outer_round": global_state.outer_round if global_state is not None else 0,
            "steps": stats.local_steps,
            "tokens": stats.tokens,
            "loss": stats.loss if stats.loss is None or np.isfinite(stats.loss) else None,
            "eval_loss": stats.eval_loss,
            "intensity": trace.intensity(region, now) if trace is not None else None,
            "threshold": self._threshold(node, trace, now),
            "energy_kwh": ledger.energy_kwh,
            "emissions_g": ledger.emissions_g,
            # not training: waiting (IDLE), released, restarting
            "idle_kwh": sum(v for k, v in ledger.kwh.items() if k not in TRAINING),
            "idle_g": sum(v for k, v in ledger.grams.items() if k not in TRAINING),
            "trained_s": sum(ledger.seconds[s] for s in TRAINING),
        }

    def _threshold(self, node: Any, trace: Any, now: float) -> float | None:
        policy = getattr(node.schedule, "policy", None)
        static = isinstance(policy, PercentilePolicy) and policy.period_s is None and trace is not None
        if not static:
            return threshold_at(policy, trace, node.cfg.region, now)
        key = (id(trace), len(trace.times))  # a live signal's trace grows: computed again as it does
        if self._static is None or self._static[0] != key:
            self._static = (key, threshold_at(policy, trace, node.cfg.region, now))
        return self._static[1]

    def _append(self, lines: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(line, separators=(",", ":"), default=str) + "\n" for line in lines)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:  # a diagnostic must never stop training
            if not self.failed:
                self.failed = True
                log.warning(
                    "cannot append to %s: %s (the run report will lack this site's history)", self.path, e
                )


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a history file, oldest first (a torn or garbled line is skipped)."""
    return read_json_lines(path)
