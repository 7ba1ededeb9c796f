"""What a site knows about the others: the live progress records, refreshed in the background.

The node asks this view two questions: how many other sites are in a window now (SOLO or
FEDERATED), and which live site holds the most advanced global state (the *head*), so that a site
entering a window behind the swarm downloads that state first.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from greenswarm.node.progress import ProgressRecord, fetch_records

log = logging.getLogger(__name__)


def state_key(outer_round: int, lineage: str) -> tuple[int, str]:
    """Total order of global states: more outer rounds first, then lineage (a deterministic tiebreak)."""
    return (outer_round, lineage)


class SwarmView:
    """Polls the swarm's progress records every ``poll_s`` wall seconds on a daemon thread."""

    def __init__(self, dht: Any, swarm: str, my_peer_id: str, poll_s: float):
        self.dht, self.swarm, self.me, self.poll_s = dht, swarm, my_peer_id, poll_s
        self._records: list[ProgressRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-view", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_now()
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def poll_now(self) -> None:
        """Read the records now, in the caller's thread (before decisions that must not use stale views)."""
        try:
            records = fetch_records(self.dht, self.swarm)
        except Exception as e:  # the DHT may be shutting down or briefly unreachable
            log.debug("progress poll failed: %r", e)
            return
        with self._lock:
            self._records = records

    def refresh(self) -> None:
        """Ask for a poll now (e.g. right after a round, when others' records change)."""
        self._wake.set()

    def others(self) -> list[ProgressRecord]:
        with self._lock:
            return [r for r in self._records if r.peer_id != self.me]

    def others_in_window(self) -> list[ProgressRecord]:
        return [r for r in self.others() if r.in_window]

    def head(self, in_window_only: bool = False) -> ProgressRecord | None:
        """The other live site with the most advanced global state (None if there is none)."""
        candidates = self.others_in_window() if in_window_only else self.others()
        return max(candidates, key=lambda r: state_key(r.outer_round, r.lineage), default=None)

    def holders_of(self, outer_round: int, lineage: str) -> list[str]:
        """Peer ids of other live sites holding exactly this global state (download sources)."""
        return [r.peer_id for r in self.others() if (r.outer_round, r.lineage) == (outer_round, lineage)]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
