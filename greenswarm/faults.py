"""Fault injection: named points where a test (or an operator rehearsing a failure) makes a site fail.

Production code calls :meth:`FaultPlan.fires` (behavioural faults) or :meth:`FaultPlan.hit` (process
faults) at each point; a plan is empty unless the environment variable ``GREENSWARM_FAULTS`` names
faults, so a check costs one dictionary lookup. A plan is a comma-separated list of entries, each
firing on the n-th visit of its point (counting from 1, per process) or on every visit (``@*``).

Behavioural faults, ``POINT@N``:

* ``corrupt-result`` -- after a successful all-reduce, overwrite the first tenth of this site's
  averaged vector with its own pseudo-gradient: what a lost part did under hivemind's protocol. The
  group's digest check must expose it and the site must resynchronize.
* ``withhold-digest`` -- after a round, publish no digest (a member that died right after the
  all-reduce): the others must decide by majority without it.
* ``poison-nan`` / ``poison-scale`` -- send NaN, or 1000x this site's pseudo-gradient, in place of
  it, while claiming the clean one's norm: a broken or malicious member. The group's reducers must
  refuse it before it is averaged (docs/security.md).
* ``poison-part`` -- send 1000x the second half of this site's pseudo-gradient (the first half
  clean) while claiming the clean norm: the reducers of the clean half accept their parts, the others
  refuse theirs. No member may apply that round (the refusing reducers void it for everyone).
* ``drop-part`` -- send none of this site's parts to the first groupmate that reduces some, as
  when that stream breaks: that reducer has lost the site midway, and no member may apply the round
  (the reducer voids it for everyone, instead of averaging its slice without the site).
* ``poison-flip`` -- send -10x this site's pseudo-gradient and claim *its* norm (an honest-looking
  claim that screening lets through): what robust aggregation (``averaging.aggregate: trimmed-mean``)
  is for.
* ``claim-tokens`` -- claim a billion tokens for this round (in the gathered metadata and every part's
  weight): ``averaging.max_tokens_per_s`` must bound the claim.
* ``serve-forged`` -- serve a newcomer a forged global state (the parameters moved) under this site's
  own lineage and outer step: the newcomer must refuse it against the lineage's signed records and
  take the state from another holder.

Process faults, ``ACTION:POINT@N`` with ACTION ``kill`` (SIGKILL) or ``stop`` (SIGSTOP), applied to
the *whole site* at once -- the node, its hivemind processes and their p2pd daemons -- as when a
machine dies or freezes. Nothing gets a chance to clean up; a stopped site stays frozen until
someone sends it SIGCONT (or SIGKILL). Points:

* ``step`` -- mid inner step: after the backward pass, before the optimizer step;
* ``matchmaking`` -- while the averager looks for this round's group;
* ``allreduce`` -- mid all-reduce: this site, as a reducer, has received a groupmate's first part;
* ``checkpoint`` -- while writing a checkpoint, between retiring the old file and renaming the new
  one into place (the moment with no ``checkpoint.pt`` on disk);
* ``serve-state`` -- while serving the global state to a newcomer that downloads it.

For example ``GREENSWARM_FAULTS=kill:allreduce@2`` kills the site in its second all-reduce.

``after-rounds@N`` holds every other entry back until this process has taken part in N averaged
rounds (visits before that are not counted): a restarted site proves it is back before it falls again.

``min-group@K`` counts visits to ``corrupt-result`` and ``withhold-digest`` only in rounds whose group
has at least K members: a majority of two cannot outvote a corrupted member, so a test of the
majority rule wants its fault in a group of three, whichever round that turns out to be.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psutil

from greenswarm.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "GREENSWARM_FAULTS"
BEHAVIOURS = (
    "corrupt-result",
    "withhold-digest",
    "poison-nan",
    "poison-scale",
    "poison-part",
    "drop-part",
    "poison-flip",
    "claim-tokens",
    "serve-forged",
)
PROCESS_POINTS = ("step", "matchmaking", "allreduce", "checkpoint", "serve-state")
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass
class FaultPlan:
    """Which injection points fire, on which visits, and (for process faults) with which signal."""

    at: dict[str, set[int] | None] = field(default_factory=dict)  # None: every visit
    actions: dict[str, str] = field(default_factory=dict)  # process point -> kill | stop
    site_pid: int = field(default_factory=os.getpid)  # the node's process: the root of the site
    after_rounds: int = 0  # count nothing until this process has taken part in this many rounds
    min_group: int = 0  # count group-sized points only in groups of at least this many members
    record: str | None = None  # a JSON-lines file that gets one line per process fault, before it fires
    _visits: Counter = field(default_factory=Counter)
    # averaged rounds so far, shared with the forked averager process (whose points count too)
    _rounds: Any = field(default_factory=lambda: multiprocessing.Value("i", 0, lock=False))

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        plan = cls()
        for entry in filter(None, (e.strip() for e in text.split(","))):
            spec, _, when = entry.partition("@")
            if spec in ("after-rounds", "min-group"):
                if not when.isdigit():
                    raise ConfigError(f"{entry!r}: expected {spec}@N (N >= 0)", field=ENV)
                setattr(plan, spec.replace("-", "_"), int(when))
                continue
            action, _, point = spec.rpartition(":")
            if action:
                if action not in ACTIONS:
                    raise ConfigError(
                        f"{entry!r}: unknown action {action!r}; known: {', '.join(ACTIONS)}", field=ENV
                    )
                if point not in PROCESS_POINTS:
                    raise ConfigError(
                        f"{entry!r}: unknown point {point!r}; known: {', '.join(PROCESS_POINTS)}", field=ENV
                    )
                if plan.actions.get(point, action) != action:
                    raise ConfigError(f"{entry!r}: point {point!r} has two actions", field=ENV)
                plan.actions[point] = action
            elif point not in BEHAVIOURS:
                known = ", ".join(BEHAVIOURS + tuple(f"kill:{p}" for p in PROCESS_POINTS))
                raise ConfigError(f"unknown fault point {point!r}; known: {known} (or stop:POINT)", field=ENV)
            if when in ("", "*"):
                plan.at[point] = None
                continue
            if not when.isdigit() or int(when) < 1:
                raise ConfigError(f"{entry!r}: expected point@N (N >= 1) or point@*", field=ENV)
            visits = plan.at.setdefault(point, set())
            if visits is not None:
                visits.add(int(when))
        return plan

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls.parse(os.environ.get(ENV, ""))

    def __bool__(self) -> bool:
        return bool(self.at)

    def round_done(self) -> None:
        """The node took part in an averaged round (see ``after-rounds``)."""
        self._rounds.value += 1

    def fires(self, point: str, group: int | None = None) -> bool:
        """Count a visit to ``point`` (in a round of a ``group`` of that many members, where it has
        one); True when the plan says this visit fails."""
        if point not in self.at or self._rounds.value < self.after_rounds:
            return False
        if group is not None and group < self.min_group:
            return False
        self._visits[point] += 1
        visits = self.at[point]
        return visits is None or self._visits[point] in visits

    def armed(self, point: str) -> bool:
        """Whether ``point`` has a process fault (callers may prepare the moment it needs)."""
        return point in self.actions

    def hit(self, point: str) -> None:
        """Count a visit to process point ``point``; kill or stop the whole site when it fires."""
        if point not in self.actions or not self.fires(point):
            return
        action = self.actions[point]
        log.warning("fault injected: %s at %s (visit %d)", action, point, self._visits[point])
        if self.record:
            self._write_record(action, point)
        for handler in logging.getLogger().handlers:  # the line must reach the log before the signal
            handler.flush()
        signal_site(self.site_pid, ACTIONS[action])

    def _write_record(self, action: str, point: str) -> None:
        line = {"action": action, "point": point, "visit": self._visits[point], "wall_time": time.time()}
        try:
            os.makedirs(os.path.dirname(self.record) or ".", exist_ok=True)
            with open(self.record, "a", encoding="utf-8") as f:
                f.write(json.dumps({**line, "pid": self.site_pid}) + "\n")
        except OSError as e:  # the fault fires all the same
            log.warning("cannot record the fault in %s: %s", self.record, e)


def signal_site(site_pid: int, sig: int) -> None:
    """Send ``sig`` to the site rooted at ``site_pid`` and all its descendants, the caller last (it
    may be one of them: a stopped or killed caller could not go on signalling)."""
    try:
        root = psutil.Process(site_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    me = os.getpid()
    for proc in procs:
        if proc.pid != me:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    if any(proc.pid == me for proc in procs):
        os.kill(me, sig)
