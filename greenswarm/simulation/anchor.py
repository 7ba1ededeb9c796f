"""Read the curtail-llm anchor's own logs into site schedules, so greenswarm's ledger can account
for *their* run on *their* trace and be checked against their published numbers.

The anchor (arXiv 2602.22760) logged two things per experiment:

* an event log (``exp1_events.csv``: ``wall_time, elapsed_s, event_type, round, client, details``)
  with ``PROVISION_START`` / ``DEPROVISION`` per client -- when a client's machine was powered;
* a loss log per client (``exp1_client_<i>.csv``: ``time, step, loss, perplexity``, ``time`` in
  seconds since the experiment started) -- when it was actually taking optimizer steps.

A client trains while its loss log advances (stretches split where no step was logged for more
than ``gap_s``: the aggregation and evaluation pauses between rounds) and is powered but idle for
the rest of its provisioned time. A client still provisioned at the end of the log is
deprovisioned at the last event. Elapsed seconds map onto the trace as ``trace start + offset_s``.
The client's region is read from its ``PROVISION_DECISION`` (``mci=<value>``): the region whose
trace holds that value at that time; ``regions`` overrides it.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greenswarm.errors import TraceError
from greenswarm.scheduler.config import ANCHOR_IDLE_KW, ANCHOR_TRAIN_KW
from greenswarm.scheduler.forecast import values_at
from greenswarm.simulation.engine import Segments, SiteRun
from greenswarm.simulation.intervals import as_intervals, subtract
from greenswarm.traces.trace import Trace

EVENT_COLUMNS = ("elapsed_s", "event_type", "client", "details")
LOSS_COLUMNS = ("time", "step")
#: A pause in a loss log longer than this is not training (the anchor logs a step every ~3 s).
DEFAULT_GAP_S = 60.0

#: What the anchor published for its 3-site run (DESIGN.md, from the paper).
PUBLISHED = {
    "wall_hours": 14.78,
    "site_hours": 17.78,
    "energy_kwh": 37.7,
    "emissions_kg": 1.38,
    "in_window_share": 0.97,
    "baselines_kg": {"CAISO_NORTH": 11.41, "SPP_TX": 14.55, "NEM_SA": 12.33, "DE": 27.07},
}


@dataclass
class Event:
    elapsed_s: float
    kind: str
    client: str
    details: str
    line: int


def read_events(path: Path) -> list[Event]:
    """The event log's rows, with one clear error (file:line) for anything malformed."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as err:
        raise TraceError(f"{path}: cannot read the event log: {err.strerror or err}") from None
    with handle:
        rows = csv.DictReader(handle)
        missing = [c for c in EVENT_COLUMNS if c not in (rows.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: an anchor event log needs columns {', '.join(missing)}")
        events = []
        for line, row in enumerate(rows, start=2):
            try:
                elapsed = float(row["elapsed_s"])
            except (TypeError, ValueError):
                elapsed = math.nan
            if not math.isfinite(elapsed):
                raise TraceError(f"{path}:{line}: elapsed_s {row['elapsed_s']!r} is not a number")
            events.append(
                Event(elapsed, row["event_type"] or "", row["client"] or "", row["details"] or "", line)
            )
    if not events:
        raise TraceError(f"{path}: the event log has no events")
    return events


def read_training(path: Path, gap_s: float) -> np.ndarray:
    """Stretches ``[first step, last step]`` of a loss log, split at pauses longer than ``gap_s``."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as err:
        raise TraceError(f"{path}: cannot read the loss log: {err.strerror or err}") from None
    with handle:
        rows = csv.DictReader(handle)
        if "time" not in (rows.fieldnames or []):
            raise TraceError(f"{path}:1: a loss log needs a 'time' column (seconds since the start)")
        times = []
        for line, row in enumerate(rows, start=2):
            try:
                times.append(float(row["time"]))
            except (TypeError, ValueError):
                times.append(math.nan)
            if not math.isfinite(times[-1]):
                raise TraceError(f"{path}:{line}: time {row['time']!r} is not a number")
            if len(times) > 1 and times[-1] < times[-2]:
                raise TraceError(f"{path}:{line}: time goes backwards ({times[-2]:g} -> {times[-1]:g})")
    if len(times) < 2:
        return np.zeros((0, 2))
    t = np.asarray(times)
    breaks = np.flatnonzero(np.diff(t) > gap_s)
    starts = np.concatenate(([t[0]], t[breaks + 1]))
    ends = np.concatenate((t[breaks], [t[-1]]))
    return as_intervals(np.column_stack([starts, ends]))


def provisioned(events: list[Event], client: str, end: float) -> np.ndarray:
    """When ``client``'s machine was powered: ``PROVISION_START`` to ``DEPROVISION`` (or ``end``)."""
    spans, since = [], None
    for ev in events:
        if ev.client != client:
            continue
        if ev.kind == "PROVISION_START" and since is None:
            since = ev.elapsed_s
        elif ev.kind == "DEPROVISION" and since is not None:
            spans.append((since, ev.elapsed_s))
            since = None
    if since is not None:
        spans.append((since, end))
    return as_intervals(spans)


def infer_region(events: list[Event], client: str, trace: Trace, offset_s: float) -> str | None:
    """The region whose trace showed the ``mci=`` value logged at ``client``'s provision decisions."""
    votes: dict[str, int] = {}
    for ev in events:
        match = re.search(r"mci=([0-9.eE+-]+)", ev.details)
        if ev.client != client or ev.kind != "PROVISION_DECISION" or not match:
            continue
        seen = float(match.group(1))
        t = trace.start + offset_s + ev.elapsed_s
        probe = np.array([t - 60.0, t, t + 60.0])  # the controller's clock and the log's differ by seconds
        for region in trace.regions:
            if np.any(np.isclose(values_at(trace, region, probe), seen, rtol=1e-6, atol=1e-6)):
                votes[region] = votes.get(region, 0) + 1
    return max(votes, key=votes.__getitem__) if votes else None


def anchor_runs(
    events_path: Path,
    trace: Trace,
    *,
    loss_logs: dict[str, Path] | None = None,
    regions: dict[str, str] | None = None,
    offset_s: float = 0.0,
    gap_s: float = DEFAULT_GAP_S,
    train_kw: float = ANCHOR_TRAIN_KW,
    idle_kw: float = ANCHOR_IDLE_KW,
) -> tuple[list[SiteRun], float, float]:
    """The anchor's clients as :class:`SiteRun` s in trace time, with the run's start and end."""
    events = read_events(events_path)
    end = max(ev.elapsed_s for ev in events)
    clients = sorted({ev.client for ev in events if ev.client})
    if not clients:
        raise TraceError(f"{events_path}: no client appears in the event log")
    origin = trace.start + offset_s
    runs = []
    for client in clients:
        log = (loss_logs or {}).get(client) or events_path.with_name(
            f"{events_path.stem.split('_')[0]}_{client}.csv"
        )
        region = (regions or {}).get(client) or infer_region(events, client, trace, offset_s)
        if region is None:
            raise TraceError(
                f"{events_path}: cannot tell {client}'s region from its mci= values; name it with --regions"
            )
        trace.series(region)
        powered = provisioned(events, client, end)
        training = as_intervals(np.concatenate([read_training(log, gap_s), np.zeros((0, 2))]))
        # training outside a provisioned stretch would be a broken log; keep what the event log allows
        training = subtract(training, subtract(training, powered))
        run = SiteRun(client, region)
        run.segments.append(Segments("train", training + origin, train_kw, 1.0))
        run.segments.append(Segments("idle", subtract(powered, training) + origin, idle_kw, 0.0))
        runs.append(run)
    return runs, origin, origin + end
