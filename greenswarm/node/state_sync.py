"""Taking another site's global state: catch-up, resync, and the adoption both end in.

* **catch-up** -- a site entering a window (or starting a federated round) sees a live site with a
  more advanced global state; it downloads that state and keeps its own local progress on top (its
  progress since its last outer step is in nobody's state yet);
* **resync** -- the group's digests showed that this site's round result differs from the
  majority's; it downloads the majority's state *after* their step, which already contains this
  site's pseudo-gradient, so its local progress is dropped.

A split decision: a group formed and averaged, but this site did not apply the step -- it saw no
majority of digests before its agreement timeout, its own all-reduce failed after sending its
parts, or it could not download the majority's state -- while the others applied it, with this
site's pseudo-gradient in it. Its local progress then holds that pseudo-gradient *and* the swarm's
state does. So the site remembers such a round (:meth:`StateSync.maybe_applied`): when it later
adopts a state that descends from the round's step (its lineage, or one of the ancestors the state
carries), it keeps only the progress made after the round on top of it, and settles the round as
applied (:attr:`StateSync.on_settled`: its tokens are in the swarm's step, its coding residual is
the error feedback to carry). A state that does not descend from it (the others failed the round
too, or averaged later rounds without this site) gets the whole local progress. A site must not
take a SOLO step while it remembers such a round without first catching up (see
:meth:`~greenswarm.node.round_handling.RoundHandler.catch_up_due`): its step would fork the swarm's
lineage and carry the update a second time. The remembered rounds (the last :data:`MAX_PENDING`) are
checkpointed with the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from greenswarm.node.federation import Resync
from greenswarm.node.global_state import GlobalState
from greenswarm.node.ranks import SiteRanks
from greenswarm.node.swarm_view import SwarmView, state_key

#: (metadata, tensors) from the first of the given peers that served its state, or None
Download = Callable[[Sequence[str]], tuple[dict[str, Any], list[torch.Tensor]] | None]
#: why a state served by a peer (its metadata, tensors, the peer's id) is not to be adopted, or None
Verify = Callable[[dict[str, Any], list[torch.Tensor], str], str | None]


def attested(digest: str, server: str, records: Sequence[Any]) -> str | None:
    """Why a downloaded state whose digest is ``digest``, served by peer ``server``, is not the state its
    lineage's holders signed, or None to adopt it. ``records`` are the live signed progress records
    that claim the served (outer step, lineage) -- the server's own among them, if it published one.

    The state is adopted when its digest is the one the most of those records attest (every other
    digest has fewer: a tie is no verdict, and the site tries again later), and a holder other than
    the server attests it too -- or the server is the only holder of that lineage (a step it took
    alone: nobody else can vouch for it). So one member serving a forged state under a lineage others
    hold is refused whether or not its own record lies."""
    votes = Counter(r.state_digest for r in records if getattr(r, "state_digest", None))
    if not votes:
        return "no live member's record attests a state at that outer step and lineage (yet)"
    tally = ", ".join(f"{d[:12]}x{n}" for d, n in votes.most_common())
    if votes[digest] == 0:
        return f"its digest {digest[:12]} is not the one its lineage's holders signed ({tally})"
    if any(votes[digest] <= n for other, n in votes.items() if other != digest):
        return f"its digest {digest[:12]} has no more signatures than another ({tally})"
    holders = {r.peer_id for r in records}
    vouched = [r for r in records if r.peer_id != server and r.state_digest == digest]
    if not vouched and holders - {server}:
        return (
            f"only the server signed its digest {digest[:12]}; the other holders of that lineage did not "
            f"({tally})"
        )
    return None


#: how many remembered rounds a site keeps (each is a model-sized update: rounds are minutes apart, and
#: a site that keeps failing rounds catches up long before this many pile up)
MAX_PENDING = 4
#: wall seconds before :meth:`StateSync.heal_due` answers again for a head this site failed to adopt,
#: doubling with each try for the same head up to :data:`HEAL_RETRY_MAX_S` (a download that fails may
#: hold the loop for its timeout)
HEAL_RETRY_S = 10.0
HEAL_RETRY_MAX_S = 300.0


@dataclass
class PendingRound:
    """A round this site averaged in but did not apply: the others may have."""

    slot: int
    lineage: str  # the lineage of the state after that round's step
    delta: torch.Tensor  # the pseudo-gradient this site sent (relative to its state then)
    tokens: int = 0  # the tokens behind it (its weight in the round)
    residual: torch.Tensor | None = None  # what coding left out of what it sent (None: not known)
    steps: int = 0  # the inner steps behind it (absent from checkpoints written before it was kept)

    def state_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "lineage": self.lineage,
            "delta": self.delta,
            "tokens": self.tokens,
            "residual": self.residual,
            "steps": self.steps,
        }


class StateSync:
    """Downloads and adopts other sites' global states for one site."""

    def __init__(
        self,
        state: GlobalState,
        ranks: SiteRanks,
        download: Download,
        stop: threading.Event,
        timeout_s: float,
        log: logging.Logger | None = None,
        retry_s: float = 0.5,
        verify: Verify | None = None,
    ):
        self.state, self.ranks, self.download = state, ranks, download
        self.verify = verify  # None: a served state is taken as it is (an open swarm's choice)
        self.refused: dict[str, str] = {}  # peer -> why the last state it served was refused
        # the head's state heal_due last answered for, its holders then, when, and how many times in a row
        self._healing: tuple[tuple[int, str], frozenset[str], float, int] | None = None
        self.stop, self.timeout_s, self.retry_s = stop, timeout_s, retry_s
        self.log = log or logging.getLogger(__name__)
        # rounds this site averaged in but did not apply, oldest first (a lineage is a chain, so an
        # adopted state can hold at most one of them: each forked from this site's state then)
        self.pending_rounds: list[PendingRound] = []
        #: called with a remembered round found applied in an adopted state (see the module's docstring)
        self.on_settled: Callable[[PendingRound], None] | None = None
        #: called with the peer and the reason when a state it served was refused (the site counts them)
        self.on_refused: Callable[[str, str], None] | None = None

    def maybe_applied(
        self,
        slot: int,
        lineage: str,
        delta: torch.Tensor,
        tokens: int = 0,
        residual: torch.Tensor | None = None,
        steps: int = 0,
    ) -> None:
        """Remember a round whose step others may have applied with this site's ``delta`` (over
        ``tokens`` tokens and ``steps`` inner steps, coded with ``residual`` left out, in the units of
        ``delta``) in it; ``lineage``: the state's lineage after that step."""
        kept = residual.clone() if residual is not None else None
        self.pending_rounds.append(PendingRound(slot, lineage, delta.clone(), tokens, kept, steps))
        del self.pending_rounds[:-MAX_PENDING]

    @property
    def pending_round(self) -> PendingRound | None:
        """The last remembered round (None: none is)."""
        return self.pending_rounds[-1] if self.pending_rounds else None

    def state_dict(self) -> dict[str, Any]:
        """The remembered rounds, for a checkpoint (a restart must not forget them)."""
        return {"pending_rounds": [held.state_dict() for held in self.pending_rounds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending_rounds = [PendingRound(**held) for held in state.get("pending_rounds", [])]

    def moved(self) -> None:
        """This site's global state moved by a step of its own: a remembered round is moot (adopting a
        state that descends from it replaces that step, and the progress in it, altogether)."""
        self.pending_rounds.clear()

    def catch_up(self, view: SwarmView, in_window_only: bool) -> bool:
        """If a live site holds a more advanced global state, adopt it and keep local progress on top."""
        head = view.head(in_window_only=in_window_only)
        if head is None or state_key(head.outer_round, head.lineage) <= self.state.key():
            return False
        started = time.monotonic()
        got = self.download_checked(view.holders_of(head.outer_round, head.lineage))
        if got is None:
            self.log.warning(
                "could not download the state of round %d from %s; training on", head.outer_round, head.site
            )
            return False
        if not self.adopt(*got, keep_pending=True):
            return False
        self.log.info(
            "caught up with %s: global state of outer step %d in %.2f s; local progress kept",
            got[0].get("site", head.site),
            self.state.outer_round,
            time.monotonic() - started,
        )
        return True

    def heal_due(self, view: SwarmView, in_window_only: bool = True, now: float | None = None) -> bool:
        """Whether a site in a window now (any serving site: ``in_window_only`` False, for a site
        training alone) holds a state that ranks above this site's, and this site has not tried to
        adopt that very state in the last :data:`HEAL_RETRY_S`: checked between rounds, from the
        view's last poll (no DHT call). Two groups that formed at one boundary step two lineages on;
        the catch-up at each boundary comes right after this site's own round, before a slower group
        has published its step, so without a look between rounds the faster group would never see
        the other ahead and the swarm would stay split (seen: 2 + 3 sites, for every round after). A
        site alone in its window looks too: a released site's presence may hold a state ahead of its
        own, which its catch-up on entering could not download (a peer's daemon refuses to dial an
        address that just failed for a while). A failed download is tried again after
        :data:`HEAL_RETRY_S`, then twice as long each time, or at once when a peer that holds the
        state appears (a released site's presence comes up seconds after its trainer ended, and the
        ended trainer's last record, whose address no longer answers, lives out its ttl beside it; a
        site that waited out the backoff there trained on alone and stepped past the presence's state:
        docs/testing.md row 79). ``now``: the monotonic clock's reading, for a test."""
        head = view.head(in_window_only=in_window_only)
        if head is None or state_key(head.outer_round, head.lineage) <= self.state.key():
            return False
        seen = (head.outer_round, head.lineage)  # (a state, not this site's self.state)
        holders = frozenset(view.holders_of(*seen))
        now = time.monotonic() if now is None else now
        tries = 0
        if self._healing is not None and self._healing[0] == seen and holders <= self._healing[1]:
            _, _, last, tries = self._healing
            if now < last + min(HEAL_RETRY_S * 2 ** (tries - 1), HEAL_RETRY_MAX_S):
                return False
        self._healing = (seen, holders, now, tries + 1)
        return True

    def resync(self, result: Resync, on_top: torch.Tensor | None = None) -> bool:
        """Take the majority's state after the step of ``result``'s round (this site's pseudo-gradient
        is already in it, so local progress up to the round's snapshot is not kept; ``on_top``: the
        progress made since, when the round ran beside training); False if none came in time."""
        self.log.warning("round %d: %s; resynchronizing from %s", result.slot, result.reason, result.holders)
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set():
            got = self.download_checked(result.holders)
            if (
                got is not None
                and got[0].get("lineage") == result.lineage
                and self.adopt(*got, keep_pending=False, on_top=on_top)
            ):
                self.log.info(
                    "round %d: resynchronized to outer step %d, global digest %s",
                    result.slot,
                    self.state.outer_round,
                    self.state.digest(),
                )
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(self.retry_s)  # the majority may not have applied its step yet
        self.log.warning(
            "round %d: could not get the majority's state; keeping local progress, catching up later",
            result.slot,
        )
        return False

    def download_checked(self, peers: Sequence[str]) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The state of the first of ``peers`` that serves one its lineage's holders signed
        (:attr:`verify`); each one refused is said once per reason, remembered in :attr:`refused`,
        and the next peer is tried."""
        if self.verify is None:
            return self.download(peers)
        for peer in peers:
            got = self.download([peer])
            if got is None:
                continue
            why = self.verify(got[0], got[1], peer)
            if why is None:
                return got
            site = got[0].get("site", "a peer")
            if self.refused.get(peer) != why:
                self.log.warning(
                    "refused the state served by %s (%s) for outer step %s: %s; trying the next holder",
                    site, peer, got[0].get("outer_round"), why,
                )  # fmt: skip
            self.refused[peer] = why
            if self.on_refused is not None:
                self.on_refused(peer, why)
        return None

    def adopt(
        self,
        meta: dict[str, Any],
        tensors: list[torch.Tensor],
        keep_pending: bool,
        on_top: torch.Tensor | None = None,
    ) -> bool:
        """Make a downloaded global state this site's; keep the local progress made since this site's
        last outer step on top of it only when ``keep_pending`` (it is not yet in that state), or else
        the given ``on_top`` progress (made since a round's snapshot, which that state holds)."""
        if not self.state.fits(tensors):
            self.log.warning("%s served a state of the wrong shape; ignoring it", meta.get("site", "a peer"))
            return False
        pending = self.state.pseudo_gradient(self.ranks.gather()) if keep_pending else None
        if on_top is not None and pending is None:
            pending = -on_top
        self.state.adopt(meta, tensors)
        held = next((r for r in reversed(self.pending_rounds) if self.state.descends_from(r.lineage)), None)
        self.pending_rounds.clear()  # the others are not in this state, nor in any that descends from it
        if keep_pending and held is not None:
            pending -= held.delta  # already in the adopted state: keep only what came after the round
            if self.on_settled is not None:
                self.on_settled(held)
            self.log.info(
                "the state of outer step %d contains round %d, whose result this site did not apply: its "
                "update in that round is not counted twice",
                self.state.outer_round,
                held.slot,
            )
        weights = meta.get("averaging")  # (schedule-free: the history its x averages)
        self.ranks.load(self.state.params if pending is None else self.state.params - pending, weights)
        return True
