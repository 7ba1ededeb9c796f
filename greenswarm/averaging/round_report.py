"""What one averaging round reports: from the averager process to the node, and from the averager to
the round's caller.

The averager runs in its own process (hivemind's design). What that process saw of a round -- the
group's gathered metadata, the wire format it chose, how long coding and the all-reduce took, how
many bytes went out, whose parts its reducer refused and why a group was refused -- comes back as
one :class:`RoundReport`, through the same future that carries the step's result (or, for a round
that failed after its group formed, inside the :class:`RoundFailed` exception that future raises).
The caller then gets a :class:`RoundOutcome`: the report's facts plus the averaged vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException


@dataclass
class RoundReport:
    """One round as the averager process saw it, from the moment its group formed."""

    began: float = field(default_factory=time.monotonic)  # CLOCK_MONOTONIC: comparable across processes
    gathered: dict[str, Any] = field(default_factory=dict)  # peer -> the metadata it gathered
    wire: str = ""  # the wire format the group chose ("" when it never got that far)
    seconds: float = 0.0  # coding and the all-reduce (0: the all-reduce did not complete)
    wire_bytes: float = 0.0  # what this site sent and received, nominally
    refused: dict[str, str] = field(default_factory=dict)  # groupmates whose parts this reducer refused
    clipped: dict[str, str] = field(default_factory=dict)  # members whose claimed tokens counted less
    weights: dict[str, float] = field(default_factory=dict)  # peer -> the weight its parts counted with
    refusal: str = ""  # why this site refused the group, or why the group refused this site's update
    coded: bool = False  # this site's update was coded for the wire (its residual is this round's)

    def allreduce_s(self) -> float:
        """Seconds from the group forming to now."""
        return time.monotonic() - self.began

    def mbit(self) -> float | None:
        """The link rate this round showed (None: no completed all-reduce to tell)."""
        return 8 * self.wire_bytes / self.seconds / 1e6 if self.seconds > 0 and self.wire_bytes > 0 else None


class RoundFailed(AllreduceException):
    """A round that failed after its group formed, with what the averager process saw of it.

    A subclass of hivemind's ``AllreduceException`` so that hivemind's step loop handles it as it
    handles its own; its arguments are (reason, report), so it crosses the process boundary whole."""

    def __init__(self, reason: str, report: RoundReport):
        super().__init__(reason, report)
        self.reason, self.report = reason, report

    def __str__(self) -> str:
        return self.reason


@dataclass
class RoundOutcome:
    """The result of one averaging attempt. ``averaged`` is set only when ``ok``."""

    ok: bool
    reason: str = ""
    members: list[str] = field(default_factory=list)
    gathered: dict[str, Any] = field(default_factory=dict)
    averaged: torch.Tensor | None = None
    seconds: float = 0.0
    wire: str = ""  # the wire format the group chose
    residual: torch.Tensor | None = None  # what this site's coding left out of what it sent
    allreduce_s: float | None = None  # time in the all-reduce itself (None: no group formed)
    slot: int = -1  # the group's round slot: the latest of its members' (all of them compute the same)
    refused: dict[str, str] = field(default_factory=dict)  # peer -> why its update was not averaged in
    clipped: dict[str, str] = field(default_factory=dict)  # peer -> how its claimed weight was bounded
    weights: dict[str, float] = field(default_factory=dict)  # peer -> the weight the reducers counted
    report: RoundReport | None = None  # what the averager process saw (None: no group formed)
