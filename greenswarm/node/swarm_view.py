"""What a site knows about the others: the live progress records, refreshed in the background.

The node asks this view two questions: how many other sites are in a window now (SOLO or
FEDERATED), and which live site holds the most advanced global state (the *head*), so that a site
entering a window behind the swarm downloads that state first.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from greenswarm.node.model import ModelIdentity
from greenswarm.node.progress import ProgressRecord, fetch_records

log = logging.getLogger(__name__)


def state_key(outer_round: int, lineage: str) -> tuple[int, str]:
    """Total order of global states: more outer rounds first, then lineage (a deterministic tiebreak)."""
    return (outer_round, lineage)


class SwarmView:
    """Polls the swarm's progress records every ``poll_s`` wall seconds on a daemon thread."""

    def __init__(
        self,
        dht: Any,
        swarm: str,
        my_peer_id: str,
        poll_s: float,
        model: str | None = None,
        revoked: Callable[[str], bool] | None = None,
    ):
        self.dht, self.swarm, self.me, self.poll_s = dht, swarm, my_peer_id, poll_s
        # whether the swarm's authority revoked a peer: its records (stored before the revocation, and
        # readable until they expire) count for nothing
        self.revoked = revoked or (lambda peer: False)
        self.model = model  # this site's ModelIdentity.to_wire(): sites training another model are not peers
        self._identity = ModelIdentity.from_wire(model) if model else None
        self._records: list[ProgressRecord] = []
        self._unlike: list[ProgressRecord] = []  # live sites that train another model
        self._said_unlike: set[str] = set()
        self._lock = threading.Lock()
        self.read_at = -math.inf  # time.monotonic() when the records now held began to be read
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-view", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_now()
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def poll_now(self, timeout_s: float | None = None) -> None:
        """Read the records now, in the caller's thread (before decisions that must not use stale
        views). ``timeout_s``: give up after this long and keep the view the background's last poll
        read (a poll period old, or as old as that poll is slow): a peer that does not answer -- frozen,
        its machine gone -- holds a DHT read for the DHT's own timeout (seconds), and a node reading at
        every round's boundary would lose that much training, and begin its round late, every round.
        (The DHT's process finishes the read given up; only the caller stops waiting.)"""
        began = time.monotonic()
        try:
            records = fetch_records(self.dht, self.swarm, timeout_s)
        except TimeoutError:
            log.debug("progress poll took over %.1f s: the view stays the last poll's", timeout_s)
            return
        except Exception as e:  # the DHT may be shutting down or briefly unreachable
            log.debug("progress poll failed: %r", e)
            return
        # (a record without a model is an older greenswarm's: it averages under another key; another
        # version of transformers with the same model and start is the same model)
        unlike = [
            r
            for r in records
            if self._identity is not None
            and r.peer_id != self.me
            and not self._identity.same_model(ModelIdentity.from_wire(r.model or ""))
        ]
        for record in unlike:
            if record.peer_id not in self._said_unlike:
                self._said_unlike.add(record.peer_id)
                log.warning(
                    "ignoring site %s (%s): it trains %s, this site %s",
                    record.site, record.peer_id, describe_model(record.model), describe_model(self.model),
                )  # fmt: skip
        with self._lock:
            self._records = [r for r in records if r not in unlike and not self.revoked(r.peer_id)]
            self._unlike = unlike
            self.read_at = max(self.read_at, began)

    def poll_if_older(self, age_s: float, timeout_s: float | None = None) -> None:
        """:meth:`poll_now`, unless the records held were read under ``age_s`` wall seconds ago: a
        caller that asks at every decision of a fast replay (its steps a few wall milliseconds apart)
        reads at most once per ``age_s``, not at every step."""
        if time.monotonic() - self.read_at >= age_s:
            self.poll_now(timeout_s)

    def refresh(self) -> None:
        """Ask for a poll now (e.g. right after a round, when others' records change)."""
        self._wake.set()

    def others(self) -> list[ProgressRecord]:
        with self._lock:
            return [r for r in self._records if r.peer_id != self.me]

    def unlike(self) -> list[ProgressRecord]:
        """Live sites that train another model (architecture, parameter count or tokenizer): never
        counted as partners, never a source of state."""
        with self._lock:
            return list(self._unlike)

    def others_in_window(self) -> list[ProgressRecord]:
        return [r for r in self.others() if r.in_window]

    def head(self, in_window_only: bool = False) -> ProgressRecord | None:
        """The other live site with the most advanced global state (None if there is none)."""
        candidates = self.others_in_window() if in_window_only else self.others()
        return max(candidates, key=lambda r: state_key(r.outer_round, r.lineage), default=None)

    def holders_of(self, outer_round: int, lineage: str) -> list[str]:
        """Peer ids of other live sites holding exactly this global state (download sources), the
        freshest record first: the likeliest to answer (a released site's ended trainer leaves its last
        record to live out its ttl beside its presence's, and a download tries the holders in turn)."""
        holders = [r for r in self.others() if (r.outer_round, r.lineage) == (outer_round, lineage)]
        return [r.peer_id for r in sorted(holders, key=lambda r: r.wall_time, reverse=True)]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)


def describe_model(wire: str | None) -> str:
    """A record's model identity as a person reads it (the raw text when it is not one)."""
    if not wire:
        return "a model it does not name (an older greenswarm: upgrade every site)"
    identity = ModelIdentity.from_wire(wire)
    return str(identity) if identity else repr(wire)
