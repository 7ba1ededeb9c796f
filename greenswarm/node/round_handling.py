"""How a site ends a round: take the step alone (SOLO), or federate and act on the group's result.

:class:`RoundHandler` is the node's side of a round. It gathers the site's parameters, turns them
into a pseudo-gradient against the global state, and then either applies it alone or hands it to
the :class:`~greenswarm.node.federation.Federation` and acts on the typed result: apply the agreed
step, resynchronize to the majority's state, or keep local progress after a failed round. It counts
what happened and returns a :class:`RoundEnd`; the node does what follows any new global model
(checkpoint, evaluation, record) and writes the round log.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from greenswarm.averaging.outer import next_lineage
from greenswarm.averaging.round_report import RoundOutcome
from greenswarm.node.federation import Applied, Failed, Federation, Resync, RoundResult, site_of
from greenswarm.node.global_state import GlobalState
from greenswarm.node.ranks import SiteRanks
from greenswarm.node.round_log import RoundEntry
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.state_sync import PendingRound, StateSync

#: how often a wait for a background round asks whether to give up on it (RoundHandler.finish)
GIVE_UP_POLL_S = 0.25


@dataclass
class RoundEnd:
    """How one round ended at this site."""

    action: str  # "apply" | "resync" | "fail" | "solo"
    slot: int  # the round's slot (the group's, when one formed)
    reason: str = ""  # why a round failed
    result: RoundResult | None = None  # the federated round's result (None: SOLO)
    moved: bool = False  # the global model changed: what follows a new global model is due
    steps_meanwhile: int = 0  # inner steps the site took while the round ran (kept on top of its result)

    @property
    def took_part(self) -> bool:
        """Whether this site took part in an averaged round (see the ``after-rounds`` fault)."""
        return self.moved and self.result is not None

    def entry(self, state: GlobalState, site: str, blocked_s: float) -> RoundEntry:
        """The round log's line for this round (``site``: this site's name)."""
        outcome = self.result.outcome if self.result is not None else None
        members = [site_of(outcome, p) for p in outcome.members] if outcome and outcome.ok else []
        return RoundEntry(
            slot=self.slot,
            action=self.action,
            outer_round=state.outer_round,
            lineage=state.lineage,
            digest=state.digest(),
            members=sorted(members) or [site],
            reason=self.reason,
            refused={site_of(outcome, p): why for p, why in self.result.refused.items()} if outcome else {},
            clipped={site_of(outcome, p): why for p, why in outcome.clipped.items()} if outcome else {},
            wire=outcome.wire if outcome else "",
            round_s=outcome.seconds if outcome else None,
            allreduce_s=outcome.allreduce_s if outcome else None,
            agreement_s=self.result.agreement_s if self.result is not None else None,
            blocked_s=blocked_s,
            steps_meanwhile=self.steps_meanwhile,
        )


@dataclass
class RoundInFlight:
    """A federated round between its snapshot and its result."""

    slot: int
    delta: torch.Tensor  # the pseudo-gradient snapshot it averages
    tokens: int  # the tokens behind it (moved out of the site's unsynced tokens)
    partners: int  # the other sites in a window when it began (the group it expects)
    background: bool  # run on a thread of its own while the loop trains on
    matchmaking_s: float | None = None  # how long it looks for its group (None: the configured time)
    search_s: float | None = None  # how long its group stays open to latecomers (None: 2x the above)
    future: Future[RoundResult] | None = None  # its result when in the background
    steps: int = 0  # inner steps taken since the snapshot
    # the group's step is on the global state already (applied on the round's thread as soon as the
    # group agreed); ``delta`` then holds the new global model minus the local snapshot: what the loop
    # adds to its parameters to keep the inner steps taken meanwhile
    applied: bool = False
    # the inner steps behind ``delta`` (moved out of the site's steps since its last outer step, like
    # ``tokens``; fednova's tau). Not ``steps``: those are taken after the snapshot
    trained_steps: int = 0
    # the loop stopped waiting for it (see RoundHandler.finish's ``give_up``): its thread must not move
    # the global state any more
    abandoned: bool = False
    # (outcome, group slot) once its all-reduce succeeded: from then on the others may apply a step
    # holding this site's update, so a round given up on must remember it (StateSync.maybe_applied)
    averaged: tuple[RoundOutcome, int] | None = None


def overlapped_matchmaking_s(
    configured_s: float, recent_steps_s: Sequence[float], sync_interval_s: float
) -> float:
    """How long an overlapped round looks for its group: ``configured_s`` (``averaging.matchmaking_s``),
    or the longest of this site's recent inner steps if longer, but at most a quarter of the sync
    interval (wall seconds; so a round that finds no group has failed well before the next boundary).

    Why: a site begins a round when the inner step in progress at the boundary ends, so groupmates
    whose steps take as long as this site's reach the round up to a step apart. With steps longer
    than the matchmaking time (a ~100 M model on a CPU: 12-20 s against the default 5 s) they miss
    each other and the round fails at both. A blocking round's wait would hold training; an
    overlapped round waits on its own thread, so waiting a step longer costs no training time."""
    longest = max(recent_steps_s, default=0.0)
    return max(configured_s, min(longest, sync_interval_s / 4))


def round_search_s(matchmaking_s: float, until_boundary_s: float) -> float:
    """How long a round's group stays open to latecomers: twice its matchmaking time, but ending one
    matchmaking time before the next boundary (``until_boundary_s`` wall seconds away), and never
    shorter than the matchmaking time itself.

    Why: a round that finds no group must fail early enough for the site to catch up between rounds
    and begin the next one at its boundary, when the others do. A search that ran past the boundary
    (twice 2 s in a 5-s replayed slot) made the site begin every next round late, after the others'
    group had formed: it failed that one too, for ever (docs/testing.md row 48)."""
    return min(2.0 * matchmaking_s, max(matchmaking_s, until_boundary_s - matchmaking_s))


def boundary_round_done(boundary_slot: int, finished_slot: int | None) -> bool:
    """Whether the overlapped round a site just finished (``finished_slot``: its group's slot, None if
    none finished) already was the group's round of the boundary it is at (``boundary_slot``).

    Why: a site that reached the last boundary late (its inner step, a failed round before) begins its
    round there, and its group can form with sites that began theirs at this boundary; the group's slot
    is its latest member's, this one. The site then holds this boundary's step already: another round
    for the same slot would find nobody (its groupmates train on to the next boundary), fail after its
    whole search, and write the slot twice in the round log (docs/testing.md row 63)."""
    return finished_slot is not None and finished_slot >= boundary_slot


def in_background(run: Callable[[], RoundResult]) -> Future[RoundResult]:
    """Run ``run`` on a daemon thread (a stop must never wait on a stuck round beyond its timeouts)."""
    future: Future[RoundResult] = Future()

    def target() -> None:
        try:
            future.set_result(run())
        except BaseException as e:  # (run never raises; this keeps a future from hanging if it does)
            future.set_exception(e)

    threading.Thread(target=target, name="round", daemon=True).start()
    return future


class RoundHandler:
    """Ends a site's rounds (see the module's docstring). ``peer_id`` names this site in a SOLO step."""

    def __init__(
        self,
        state: GlobalState,
        ranks: SiteRanks,
        federation: Federation,
        sync: StateSync,
        stats: SiteStats,
        peer_id: str,
        log: logging.Logger | None = None,
    ):
        self.state, self.ranks, self.federation, self.sync = state, ranks, federation, sync
        self.stats, self.counts, self.peer_id = stats, stats.counts, peer_id
        self.log = log or logging.getLogger(__name__)
        self.in_flight: RoundInFlight | None = None  # a federated round begun and not yet finished
        self._applying = threading.Lock()  # a round's thread applying vs. the loop giving up on it
        sync.on_settled = self._settled

    def catch_up_due(self, federated: bool) -> bool:
        """Whether the site must catch up with the swarm's head before ending this round: always
        before averaging (a group matches only sites on the same state), and before a SOLO step while
        a round this site did not apply may have been applied by the others (its own step would fork
        the lineage and carry its update in that round a second time)."""
        return federated or self.sync.pending_round is not None

    def end(
        self, federated: bool, slot: int, partners: Callable[[], int], search_s: float | None = None
    ) -> RoundEnd:
        """End round ``slot`` and wait for it: alone, or (``federated``) with the ``partners()`` other
        sites in a window, asked right before averaging (``search_s``: see :meth:`begin`)."""
        if not federated:
            delta = self.state.pseudo_gradient(self.ranks.gather())
            self._outer_step(delta, slot, [self.peer_id], solo=True)
            return RoundEnd("solo", slot, moved=True)
        self.begin(slot, partners, background=False, search_s=search_s)
        return self.finish()

    # ---- a federated round in two halves: begin (snapshot) and finish (act on the group's result)

    def begin(
        self,
        slot: int,
        partners: Callable[[], int],
        background: bool = True,
        matchmaking_s: float | None = None,
        search_s: float | None = None,
    ) -> None:
        """Snapshot this site's pseudo-gradient and tokens for round ``slot`` and start averaging them;
        in the ``background``, training goes on meanwhile (see :meth:`finish`). ``matchmaking_s``: how
        long the round looks for its group (the configured time if None; see
        :func:`overlapped_matchmaking_s`); ``search_s``: how long the group stays open to latecomers
        (twice that if None; see :func:`round_search_s`)."""
        assert self.in_flight is None, "a round is already in flight"
        delta = self.state.pseudo_gradient(self.ranks.gather())
        tokens, self.stats.tokens_since_sync = self.stats.tokens_since_sync, 0  # they go into this round
        trained, self.stats.steps_since_sync = self.stats.steps_since_sync, 0  # (and so do these)
        flight = RoundInFlight(
            slot, delta, tokens, partners(), background, matchmaking_s, search_s, trained_steps=trained
        )
        if background:
            flight.future = in_background(functools.partial(self._run, flight))
        self.in_flight = flight

    def step_taken(self) -> None:
        """An inner step was taken: a round in flight must keep it when its result is applied."""
        if self.in_flight is not None:
            self.in_flight.steps += 1

    def ready(self) -> bool:
        """Whether a round in flight has its result (finishing it will not wait)."""
        flight = self.in_flight
        return flight is not None and (flight.future is None or flight.future.done())

    def finish(self, give_up: Callable[[], str | None] | None = None) -> RoundEnd:
        """Act on the round in flight, waiting for its result if it has none yet: apply the group's step,
        resync to the majority's state, or keep local progress. Inner steps taken since the snapshot
        are kept on top of the new global model (the one-step-delayed outer step, docs/overlap.md).

        ``give_up``, asked while a background round's result is awaited: a reason the round can no
        longer finish (a stopping site whose p2p daemon is gone), after which it ends as a failed round
        (local progress kept; remembered as possibly applied by the others once its all-reduce had
        succeeded) instead of running out its timeouts, and its thread then moves no state."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None, "no round in flight"
        end = self._act(flight, give_up)
        end.steps_meanwhile = flight.steps
        return end

    def _awaited(self, flight: RoundInFlight, give_up: Callable[[], str | None] | None) -> RoundResult:
        """The background round's result, or a failure once ``give_up`` gives a reason."""
        assert flight.future is not None
        while give_up is not None:
            try:
                return flight.future.result(timeout=GIVE_UP_POLL_S)
            except FutureTimeout:
                pass
            reason = give_up()
            if reason is None:
                continue
            with self._applying:
                # (applied, or ended, meanwhile: its own result counts, and is at most a moment away)
                if not flight.future.done() and not flight.applied:
                    flight.abandoned = True
                    if flight.averaged is not None:  # past the all-reduce: failed in the agreement
                        outcome, slot = flight.averaged
                        return Failed(slot, reason, outcome, stage="agreement")
                    return Failed(flight.slot, reason, RoundOutcome(False))
        return flight.future.result()

    def _act(self, flight: RoundInFlight, give_up: Callable[[], str | None] | None = None) -> RoundEnd:
        result = self._awaited(flight, give_up) if flight.future is not None else self._run(flight)
        self.stats.add_attempt(result.outcome.seconds)  # (before its outcome's count: see SiteStats)
        self.counts["refused_updates"] += len(result.refused)
        if flight.applied:  # on the round's thread: only the local model is left to move
            assert isinstance(result, Applied)
            # now + (new global - snapshot) = new global + the local progress since the snapshot; with
            # no steps meanwhile the new global model itself, exactly
            shift = flight.delta if flight.steps else None
            self._outer_step(result.averaged, result.slot, result.members, applied=True, shift=shift)
            return RoundEnd("apply", result.slot, result=result, moved=True)
        delta, tokens = flight.delta, flight.tokens
        # local progress since the snapshot: (global - snapshot) - (global - now); none when blocking
        since = delta - self.state.pseudo_gradient(self.ranks.gather()) if flight.steps else None
        if isinstance(result, Applied):
            self._outer_step(result.averaged, result.slot, result.members, since)
            return RoundEnd("apply", result.slot, result=result, moved=True)
        if isinstance(result, Resync):
            if self.sync.resync(result, on_top=since):
                self.federation.keep_residual(result.outcome)
                self.counts["resyncs"] += 1  # this site's progress up to the snapshot is in their step
                return RoundEnd("resync", result.slot, result=result, moved=True)
            self.counts["failed_rounds"] += 1
            self.stats.tokens_since_sync += tokens
            self.stats.steps_since_sync += flight.trained_steps
            residual = result.outcome.residual  # the majority did apply it
            self.sync.maybe_applied(
                result.slot, result.lineage, delta, tokens, residual, flight.trained_steps
            )
            return RoundEnd("fail", result.slot, "could not get the majority's state", result)
        assert isinstance(result, Failed)
        self.counts["failed_rounds"] += 1
        self.stats.tokens_since_sync += tokens  # not in any step: they weigh in the next round
        self.stats.steps_since_sync += flight.trained_steps
        if self.peer_id in result.outcome.members:  # its update went in: the others may apply it
            after = next_lineage(self.state.lineage, result.slot, result.outcome.members)
            residual = result.outcome.residual
            self.sync.maybe_applied(result.slot, after, delta, tokens, residual, flight.trained_steps)
        self.log.warning(
            "round %d: %s (%s); keeping local progress, retrying next round",
            result.slot,
            "averaging failed" if result.stage == "averaging" else "the group did not agree on the result",
            result.reason,
        )
        return RoundEnd("fail", result.slot, result.reason, result)

    def _run(self, flight: RoundInFlight) -> RoundResult:
        """The federation's round (on the round's thread when overlapped): never raises. In the
        background, an agreed step moves the global state at once, here: a groupmate that must resync
        downloads it from this site, and would time out waiting for the loop's next look."""
        slot = flight.slot
        on_averaged = functools.partial(self._averaged, flight) if flight.background else None
        try:
            result = self.federation.run(
                flight.delta,
                self.state,
                slot,
                flight.partners,
                flight.tokens,
                flight.matchmaking_s,
                steps=flight.trained_steps,
                search_s=flight.search_s,
                on_averaged=on_averaged,
            )
        except Exception as e:  # a bug or a dead averager: the round fails, the site goes on
            self.log.exception("round %d raised", slot)
            return Failed(slot, f"the round raised {type(e).__name__}: {e}", RoundOutcome(False))
        if flight.background and isinstance(result, Applied):
            with self._applying:
                if flight.abandoned:  # the loop ended this round as failed, and holds its progress
                    return result
                # an agreed step that cannot be applied (NaN past the screening) ends the node, as in a
                # blocking round: finish re-raises it on the loop's thread
                self._apply_now(flight, result)
        return result

    def _averaged(self, flight: RoundInFlight, outcome: RoundOutcome, slot: int) -> None:
        """(the round's thread) The all-reduce succeeded: a give-up from now on fails in the agreement."""
        with self._applying:
            flight.averaged = (outcome, slot)

    def _apply_now(self, flight: RoundInFlight, result: Applied) -> None:
        """(the round's thread) Take the agreed step on the global state, and do here what would
        otherwise hold the loop: ``delta`` (``global_before - snapshot``) becomes ``global_after -
        snapshot``, the loop's whole rebase in one in-place add (no second model-sized copy), and the
        new state's digest, which the loop's next record and log line name, is hashed."""
        flight.delta.sub_(self.state.params)
        self.state.apply(result.averaged, result.slot, result.members)
        flight.delta.add_(self.state.params)
        self.state.hash_unlocked()
        flight.applied = True

    def _settled(self, held: PendingRound) -> None:
        """A round this site failed was applied by the others after all: the state this site adopted
        holds its update, its tokens (and steps) and the feedback it sent, so count them as synced."""
        self.federation.settle_residual(held.residual)
        self.stats.tokens_since_sync = max(0, self.stats.tokens_since_sync - held.tokens)
        self.stats.steps_since_sync = max(0, self.stats.steps_since_sync - held.steps)

    def _outer_step(
        self,
        averaged: torch.Tensor,
        slot: int,
        members: list[str],
        since: torch.Tensor | None = None,
        solo: bool = False,
        applied: bool = False,
        shift: torch.Tensor | None = None,
    ) -> None:
        """Apply an outer step (unless ``applied`` already, on the round's thread), load the new global
        parameters (plus the local progress ``since`` the round's snapshot) into every rank, or move
        every rank's parameters by ``shift`` (the same, computed on the round's thread), and say so."""
        if not applied:
            self.state.apply(averaged, slot, members)
        self.sync.moved()
        if shift is not None:
            self.ranks.shift(shift)
        else:
            self.ranks.load(self.state.params if since is None else self.state.params + since)
        if solo:  # (a federated round moved its tokens into the round at its snapshot)
            self.stats.tokens_since_sync = 0
            self.stats.steps_since_sync = 0
        self.counts["federated_rounds" if len(members) > 1 else "solo_rounds"] += 1
        self.log.info(
            "round %d: outer step %d %s, loss %.3f, global digest %s",
            slot,
            self.state.outer_round,
            f"averaged with {len(members) - 1} site(s)" if len(members) > 1 else "alone",
            self.stats.loss or float("nan"),
            self.state.digest(),
        )
