"""Reading sites' run directories for the run report.

A site's ``node.run_dir`` holds ``summary.json`` (written when the node stops), ``history.jsonl``
(:mod:`greenswarm.node.history`: the way there, a point per log interval and per event) and
``rounds.jsonl`` (:mod:`greenswarm.node.round_log`). A run killed early, an older greenswarm or a site
that never trained leaves some of them out; the report is made from what is there, and each gap is
a note in the report and one log line, never a traceback. A path that is no run directory at all (and
holds none) is a one-line :class:`~greenswarm.errors.GreenswarmError` naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from greenswarm.errors import GreenswarmError
from greenswarm.node.history import FILE as HISTORY
from greenswarm.node.history import TRAINING, read_history
from greenswarm.node.round_log import FILE as ROUNDS
from greenswarm.node.round_log import read_rounds
from greenswarm.scheduler.config import ANCHOR_TRAIN_KW
from greenswarm.scheduler.energy import baseline_emissions_g
from greenswarm.traces.trace import Trace

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
#: what makes a directory a site's run directory (any one of them)
RUN_FILES = (SUMMARY, HISTORY, ROUNDS)


class ReportError(GreenswarmError):
    """A path given to ``greenswarm report`` is not a run directory, or the report cannot be written."""


@dataclass
class SiteRun:
    """What one site's run directory says (``None`` / empty: the file was not there)."""

    path: Path
    name: str  # the site's name, as its round log's members name it
    region: str
    summary: dict[str, Any] | None = None
    start: dict[str, Any] | None = None  # the history's first ``start`` line
    points: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trace: Trace | None = None  # the intensity the site followed, when it can be read here
    label: str = ""  # how the report names it (its name, and its directory when two share one)

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    @property
    def sync_interval_s(self) -> float | None:
        for source in (self.summary, self.start):
            if source and source.get("sync_interval_s"):
                return float(source["sync_interval_s"])
        return None

    @property
    def t0(self) -> float | None:
        """Clock time at which the run began (its first history line)."""
        if self.start is not None:
            return float(self.start["clock"])
        return float(self.points[0]["clock"]) if self.points else None

    @property
    def t1(self) -> float | None:
        """Clock time of the run's last history point."""
        return float(self.points[-1]["clock"]) if self.points else None

    def total(self, key: str) -> float | None:
        """A final figure: from the summary, else the history's last point (a run that did not stop)."""
        if self.summary is not None and self.summary.get(key) is not None:
            return self.summary[key]
        alias = {"local_steps": "steps"}.get(key, key)
        if self.points and self.points[-1].get(alias) is not None:
            return self.points[-1][alias]
        return None

    def seconds_by_state(self) -> dict[str, float]:
        return dict((self.summary or {}).get("seconds_by_state") or {})

    def trained_s(self) -> float:
        """Clock seconds spent training (SOLO or FEDERATED): the work an equal-work baseline repeats."""
        by_state = self.seconds_by_state()
        if by_state:
            return sum(float(by_state.get(s, 0.0)) for s in TRAINING)
        return float(self.points[-1].get("trained_s", 0.0)) if self.points else 0.0

    def emissions_split(self) -> tuple[float | None, float | None]:
        """(grams while training, grams while not: IDLE, RELEASED, RESTARTING), from the summary or
        the last history point."""
        by_state = (self.summary or {}).get("emissions_g_by_state")
        if by_state:
            trained = sum(float(by_state.get(s, 0.0)) for s in TRAINING)
            return trained, sum(float(v) for s, v in by_state.items() if s not in TRAINING)
        if self.points:
            last = self.points[-1]
            return last["emissions_g"] - last.get("idle_g", 0.0), last.get("idle_g", 0.0)
        return None, None

    def train_kw(self) -> float:
        """The training draw: measured by the run (its kWh over its hours training), else configured."""
        kwh, hours = (self.summary or {}).get("kwh_by_state") or {}, self.trained_s() / 3600.0
        trained_kwh = sum(float(kwh.get(s, 0.0)) for s in TRAINING)
        if not kwh and self.points:
            last = self.points[-1]
            trained_kwh = last["energy_kwh"] - last.get("idle_kwh", 0.0)
        if hours > 0 and trained_kwh > 0:
            return trained_kwh / hours
        if self.start and self.start.get("train_kw"):
            return float(self.start["train_kw"])
        return ANCHOR_TRAIN_KW

    def equal_work_g(self, until: float | None = None) -> float | None:
        """Grams the same training would have emitted run at once from the run's start, at the run's
        training draw, for as long as it trained (equal work: the demo's and simulate's baseline), up
        to clock time ``until``; None without the trace or a start."""
        if self.trace is None or self.t0 is None:
            return None
        end = self.t0 + self.trained_s()
        if until is not None:
            end = min(end, until)
        if end <= self.t0:
            return 0.0
        return baseline_emissions_g(self.trace, self.region, self.t0, end, self.train_kw())


def is_run_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in RUN_FILES)


def run_dirs(paths: list[str | Path]) -> list[Path]:
    """Each path as a site's run directory, or the run directories right under it (a demo's work
    directory); a path that is neither is a :class:`ReportError` naming it."""
    found: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if not path.is_dir():
            raise ReportError(f"{given}: no such directory")
        if is_run_dir(path):
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))
        if not inside:
            raise ReportError(
                f"{given}: not a run directory (no {', '.join(RUN_FILES)} in it or in a folder under it)"
            )
        found.extend(inside)
    unique = list(dict.fromkeys(p.resolve() for p in found))
    return unique


def _read_summary(path: Path, notes: list[str]) -> dict[str, Any] | None:
    file = path / SUMMARY
    if not file.is_file():
        notes.append(f"no {SUMMARY}: the node did not stop cleanly (yet); totals come from its history")
        return None
    try:
        summary = json.loads(file.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        notes.append(
            f"{SUMMARY} is not valid JSON ({err.msg}, line {err.lineno}); totals come from its history"
        )
        return None
    if not isinstance(summary, dict):
        notes.append(f"{SUMMARY} is not a JSON object; totals come from its history")
        return None
    return summary


def read_run(path: Path) -> SiteRun:
    """One site's run directory; what is missing becomes a note (and one warning for the directory)."""
    notes: list[str] = []
    summary = _read_summary(path, notes)
    lines = read_history(path / HISTORY)
    if not (path / HISTORY).is_file():
        notes.append(
            f"no {HISTORY}: loss, states and cumulative emissions cannot be drawn for this site "
            "(an older greenswarm wrote this run, or the node never started)"
        )
    elif not [x for x in lines if x.get("kind") == "point"]:
        notes.append(f"{HISTORY} holds no complete point yet")
    rounds = read_rounds(path / ROUNDS)
    if not (path / ROUNDS).is_file():
        notes.append(f"no {ROUNDS}: the site ended no round")
    starts = [x for x in lines if x.get("kind") == "start"]
    points = [x for x in lines if x.get("kind") == "point" and _point_ok(x)]
    points.sort(key=lambda x: (x["clock"], x["wall"]))
    start = starts[0] if starts else None
    name = (summary or {}).get("site") or (start or {}).get("site") or path.name
    region = (summary or {}).get("region") or (start or {}).get("region") or "?"
    run = SiteRun(path, str(name), str(region), summary, start, points, rounds, notes)
    if notes:
        log.warning("%s (%s): %s", run.name, path, "; ".join(notes))
    return run


def _point_ok(point: dict[str, Any]) -> bool:
    """A point with the fields every figure reads (a line from a future version may have more)."""
    try:
        float(point["clock"]), float(point["wall"]), float(point["tokens"]), float(point["emissions_g"])
        return isinstance(point["state"], str)
    except (KeyError, TypeError, ValueError):
        return False


def load_traces(runs: list[SiteRun]) -> None:
    """Read each site's trace as its history names it, once per distinct trace; one that cannot be
    read here (moved, or a live signal) leaves the site with its own samples and a note."""
    from greenswarm.traces.readers import load_trace

    cache: dict[str, Trace | str] = {}
    for run in runs:
        if run.start is None:
            continue
        spec, options = run.start.get("trace"), run.start.get("trace_options") or {}
        if run.start.get("signal"):
            run.notes.append(
                f"intensity from a live signal ({run.start['signal']}): drawn from the site's own samples"
            )
            continue
        if not spec:
            continue
        key = json.dumps([spec, options], sort_keys=True, default=str)
        if key not in cache:
            try:
                cache[key] = load_trace(spec, **options)
            except (GreenswarmError, OSError, TypeError, ValueError) as err:
                cache[key] = str(err).splitlines()[0] if str(err) else type(err).__name__
        loaded = cache[key]
        if isinstance(loaded, Trace) and run.region in loaded.regions:
            run.trace = loaded
        else:
            why = loaded if isinstance(loaded, str) else f"it has no region {run.region}"
            run.notes.append(
                f"trace {spec} cannot be read here ({why}): intensity from the site's own samples"
            )
            log.warning("%s: trace %s cannot be read here (%s)", run.name, spec, why)


def read_runs(paths: list[str | Path]) -> list[SiteRun]:
    """Every site under ``paths`` (see :func:`run_dirs`), with its trace where it can be read; two
    sites of the same name (two runs of one site) are told apart by their directories."""
    runs = [read_run(p) for p in run_dirs(paths)]
    label_apart(runs)
    load_traces(runs)
    return runs


def label_apart(runs: list[SiteRun]) -> None:
    """Label runs that share a site name with the shortest tail of their paths (two parts at least,
    ``parent/dir``) that differs between them: ``exp1/runs/a`` and ``exp2/runs/a`` would both read
    ``runs/a`` with a fixed two, and the legends and tables would show one site twice."""
    by_name: dict[str, list[SiteRun]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    for name, same in by_name.items():
        if len(same) < 2:
            continue
        parts = [run.path.parts for run in same]
        tails = [run.path.as_posix() for run in same]  # (distinct: run_dirs resolved and deduplicated them)
        for k in range(2, max(len(p) for p in parts)):
            tried = [Path(*p[-k:]).as_posix() for p in parts]
            if len(set(tried)) == len(tried):
                tails = tried
                break
        for run, tail in zip(same, tails, strict=True):
            run.label = f"{name} ({tail})"
