"""Fault injection: named points where a test (or an operator rehearsing a failure) makes a process fail.

Production code calls :meth:`FaultPlan.fires` at each point; a plan is empty unless the environment
variable ``GREENSWARM_FAULTS`` names faults, so the check costs one dictionary lookup. A plan is a
comma-separated list of ``point@n`` (fire the n-th time the point is reached, counting from 1) or
``point@*`` (every time), for example ``GREENSWARM_FAULTS=corrupt-result@2``.

Points:

* ``corrupt-result`` -- after a successful all-reduce, overwrite the first tenth of this site's
  averaged vector with its own pseudo-gradient: what a lost part did under hivemind's protocol. The
  group's digest check must expose it and the site must resynchronize.
* ``withhold-digest`` -- after a round, publish no digest (a member that died right after the
  all-reduce): the others must decide by majority without it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from greenswarm.errors import ConfigError

ENV = "GREENSWARM_FAULTS"
POINTS = ("corrupt-result", "withhold-digest")


@dataclass
class FaultPlan:
    """Which injection points fire, and on which visits."""

    at: dict[str, set[int] | None] = field(default_factory=dict)  # None: every visit
    _visits: Counter = field(default_factory=Counter)

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        plan = cls()
        for entry in filter(None, (e.strip() for e in text.split(","))):
            point, _, when = entry.partition("@")
            if point not in POINTS:
                raise ConfigError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}", field=ENV)
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

    def fires(self, point: str) -> bool:
        """Count a visit to ``point``; True when the plan says this visit fails."""
        if point not in self.at:
            return False
        self._visits[point] += 1
        visits = self.at[point]
        return visits is None or self._visits[point] in visits
