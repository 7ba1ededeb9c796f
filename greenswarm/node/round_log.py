"""The round log: one JSON line per round this site ended, appended to ``run_dir/rounds.jsonl``.

Progress records on the DHT say where a site *is*; the round log says what happened to every round
it took part in -- who was in the group, how long matchmaking, the all-reduce and the digest
exchange took, what the site decided (apply, resync, fail, solo) and why, and the global digest it
ended with. Scripts (the fault benchmark, an operator's dashboard) read it; a line is flushed as
soon as the round ends, so a site killed a moment later has still recorded it. A restarted site
appends to the same file, and each line carries the process id and seconds since that process
started, so restarts are visible in it. A torn last line (a kill mid-write) is skipped by
:func:`read_rounds`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from greenswarm.jsonlines import read_json_lines

log = logging.getLogger(__name__)

FILE = "rounds.jsonl"


@dataclass
class RoundEntry:
    """What one round did at one site."""

    slot: int  # the clock-aligned round slot
    action: str  # apply | resync | fail | solo
    outer_round: int  # this site's outer step after the round
    lineage: str
    digest: str  # the global parameters' digest after the round
    members: list[str] = field(default_factory=list)  # site names of the group (this site included)
    reason: str = ""  # why a round failed
    refused: dict[str, str] = field(default_factory=dict)  # groupmates whose updates were refused, and why
    clipped: dict[str, str] = field(default_factory=dict)  # members whose claimed tokens counted less, how
    wire: str = ""
    round_s: float | None = None  # the averaging attempt: matchmaking + all-reduce
    allreduce_s: float | None = None  # the all-reduce alone (None: no group formed)
    agreement_s: float | None = None  # the digest exchange
    blocked_s: float = 0.0  # how long training waited for this round, all of it included
    steps_meanwhile: int = 0  # inner steps taken while the round ran (averaging.overlap)
    since_start_s: float = 0.0  # seconds since this process started
    wall_time: float = 0.0
    pid: int = 0


@dataclass
class RoundTotals:
    """How long this process's rounds held training up, summed as their lines are written: the node's
    metrics (``greenswarm_round_blocked_seconds``) read them at scrape time instead of reading the file
    back. (The averaging attempts' seconds are counted with the rounds' outcomes, in SiteStats: a line
    is written only after the round's checkpoint, seconds later on a loaded machine.)"""

    rounds: int = 0
    blocked_s: float = 0.0  # training held up, all rounds

    def add(self, entry: RoundEntry) -> None:
        self.rounds += 1
        self.blocked_s += entry.blocked_s


class RoundLog:
    """Appends :class:`RoundEntry` lines to ``directory/rounds.jsonl``."""

    def __init__(self, directory: str | Path, started: float):
        self.path = Path(directory) / FILE
        self.started = started  # time.monotonic() at process start
        self.totals = RoundTotals()

    def write(self, entry: RoundEntry) -> None:
        self.totals.add(entry)
        entry.since_start_s = round(time.monotonic() - self.started, 3)
        entry.wall_time = time.time()
        entry.pid = os.getpid()
        line = json.dumps(asdict(entry), separators=(",", ":")) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:  # a diagnostic must never stop training
            log.warning("cannot append to %s: %s", self.path, e)


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a round log (a torn or garbled line is skipped)."""
    return read_json_lines(path)
