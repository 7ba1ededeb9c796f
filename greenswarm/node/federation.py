"""One federated round, from a site's pseudo-gradient to what the site must do with the group's result.

:class:`Federation` owns what a round needs beyond the global state: the averager (matchmaking and
the all-reduce), the digest board (the group's proof that every member applies the same step),
error feedback (what coding left out of this site's last averaged update) and the round timings the
summary reports. :meth:`Federation.run` returns one of three typed results, and the node acts on it:

* :class:`Applied` -- the group averaged and a majority holds this site's result: apply it;
* :class:`Resync` -- a majority holds another result: download theirs (:mod:`~greenswarm.node.state_sync`);
* :class:`Failed` -- no group, a failed all-reduce, or no majority: keep local progress, retry next round.

It never touches the model or the global state: the node applies an :class:`Applied` result, so a
unit test can drive every branch with a fake averager and a fake digest board.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from greenswarm.averaging.aggregation import bounded_weights
from greenswarm.averaging.agreement import Verdict, decide
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.outer import next_lineage
from greenswarm.averaging.round_report import RoundOutcome
from greenswarm.averaging.weighting import group_scale, outgoing, scaled, to_update_units
from greenswarm.faults import FaultPlan
from greenswarm.node.global_state import GlobalState


class Averager(Protocol):
    """What a round needs of :class:`~greenswarm.averaging.averager.SwarmAverager`."""

    measured_mbit: float | None

    def average(
        self,
        delta: torch.Tensor,
        weight: float,
        round_index: int,
        lineage: str,
        expected_size: int,
        gather: dict[str, Any],
        matchmaking_s: float | None = None,
        interval_s: float | None = None,
        search_s: float | None = None,
    ) -> RoundOutcome: ...


class Board(Protocol):
    """What a round needs of :class:`~greenswarm.averaging.agreement.DigestBoard`."""

    heard_refused: dict[str, str]

    def exchange(
        self,
        round_index: int,
        lineage: str,
        members: list[str],
        digest: str,
        timeout_s: float,
        publish: bool = True,
        refused: dict[str, str] | None = None,
    ) -> dict[str, str]: ...


@dataclass
class RoundResult:
    """What every round result says: the round's slot, why it ended as it did, and its timings."""

    slot: int
    reason: str
    outcome: RoundOutcome  # the averaging attempt as the averager reported it
    agreement_s: float | None = None  # the digest exchange (None: the round failed before it)
    refused: dict[str, str] = field(default_factory=dict)  # groupmates' updates refused, and why

    @property
    def round_s(self) -> float:
        """Matchmaking and the all-reduce."""
        return self.outcome.seconds

    @property
    def allreduce_s(self) -> float | None:
        """The all-reduce alone (None: no group formed)."""
        return self.outcome.allreduce_s


@dataclass
class Applied(RoundResult):
    """The group agrees on this site's result: take the step ``averaged`` with ``members``."""

    averaged: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    members: list[str] = field(default_factory=list)  # peer ids, this site included


@dataclass
class Resync(RoundResult):
    """A majority applied a result other than this site's: take their state after their step."""

    holders: list[str] = field(default_factory=list)  # members that hold the majority's result
    lineage: str = ""  # the lineage the majority's state must have


@dataclass
class Failed(RoundResult):
    """Nobody in the group can trust the round (or none formed): keep local progress."""

    stage: str = "averaging"  # "averaging" (no group, a failed all-reduce) or "agreement"


class Federation:
    """Runs federated rounds for one site (see the module's docstring)."""

    def __init__(
        self,
        averager: Averager,
        digests: Board,
        cfg: AveragingConfig,
        site: str,
        peer_id: str,
        faults: FaultPlan | None = None,
        started: float | None = None,
        log: logging.Logger | None = None,
        interval_s: float | None = None,
    ):
        self.averager, self.digests, self.cfg = averager, digests, cfg
        # the round interval in wall seconds (a replay runs faster): claimed tokens are bounded over it
        self.interval_s = cfg.sync_interval_s if interval_s is None else interval_s
        self.site, self.peer_id = site, peer_id
        self.faults = faults or FaultPlan()
        self.started = time.monotonic() if started is None else started
        self.log = log or logging.getLogger(__name__)
        self.feedback: torch.Tensor | None = None  # error feedback; allocated with the first round
        self.round_seconds: list[float] = []  # matchmaking + all-reduce, per averaged round
        self.agreement_seconds: list[float] = []  # digest exchange and decision, per averaged round
        self.wire = ""  # the wire format of the last averaged round
        self.wire_rounds: dict[str, int] = {}  # averaged rounds by wire format
        self.wire_bytes: dict[str, float] = {}  # bytes those sent (as many came back), nominally
        self.first_round_s: float | None = None  # seconds from the node's start to its first averaged round

    def run(
        self,
        delta: torch.Tensor,
        state: GlobalState,
        slot: int,
        partners: int,
        tokens: int,
        matchmaking_s: float | None = None,
        steps: int = 0,
        search_s: float | None = None,
        on_averaged: Callable[[RoundOutcome, int], None] | None = None,
    ) -> RoundResult:
        """Average ``delta`` (this site's pseudo-gradient over ``tokens`` tokens and ``steps`` inner steps,
        taken in round ``slot``) with a group of up to ``partners`` other sites, and agree on the result.
        ``matchmaking_s``: how long to look for the group (``averaging.matchmaking_s`` if None);
        ``search_s``: how long the group stays open to latecomers (twice that if None);
        ``on_averaged(outcome, slot)``: called once the all-reduce succeeded, before the agreement (from
        then on the others may apply a step that holds this site's update).

        The weighting (``averaging.weighting``, :mod:`greenswarm.averaging.weighting`) happens here and
        only here: what goes to the averager is in its units (``fednova``: per inner step), and what
        comes back -- the group's step, this site's coding residual -- is turned back into the units of
        ``delta``, so everything downstream (the outer step, error feedback, a remembered round) is
        the same whatever the weighting."""
        if not partners:
            return Failed(slot, "no other site is in a window any more", RoundOutcome(False))
        weighting = self.cfg.weighting
        sent, weight = outgoing(weighting, self._with_feedback(delta), tokens, steps)
        if self.faults.fires("claim-tokens"):
            self.log.warning(
                "fault injected: claim-tokens (this site claims a billion tokens, not %s)", weight
            )
            weight = 10**9
        outcome = self.averager.average(
            sent,
            weight=weight,
            round_index=slot,
            lineage=state.lineage,
            expected_size=1 + partners,
            gather={
                "site": self.site,
                "outer_round": state.outer_round,
                "recent": state.recent_update_norm,  # the scale the group screens updates against
                "steps": steps,  # inner steps behind the update (fednova's tau)
            },
            matchmaking_s=matchmaking_s,
            interval_s=self.interval_s,
            search_s=search_s,
        )
        outcome.residual = to_update_units(weighting, outcome.residual, steps)
        if outcome.members:
            slot = outcome.slot  # the group's slot: names the round the same for every member
        for peer, why in outcome.refused.items():
            self._note_refusal(outcome, slot, peer, why)
        for peer, why in outcome.clipped.items():
            self.log.warning("round %d: bounded the weight of %s: %s", slot, site_of(outcome, peer), why)
        if not outcome.ok:  # (a round a reducer voided still names whose update it refused)
            return Failed(slot, outcome.reason, outcome, refused=self._refused(outcome))
        self._count(outcome)
        self._scale(outcome, slot)
        if on_averaged is not None:
            on_averaged(outcome, slot)
        verdict, agreement_s = self._agree(outcome, delta, state, slot)
        refused = self._refused(outcome)
        if verdict.action == "resync":
            lineage = next_lineage(state.lineage, slot, outcome.members)
            return Resync(slot, verdict.reason, outcome, agreement_s, refused, verdict.holders, lineage)
        if verdict.action != "apply":
            return Failed(slot, verdict.reason, outcome, agreement_s, refused, stage="agreement")
        self.keep_residual(outcome)
        return Applied(slot, verdict.reason, outcome, agreement_s, refused, outcome.averaged, outcome.members)

    def keep_residual(self, outcome: RoundOutcome) -> None:
        """The round's result is this site's now: carry what coding left out of it into the next."""
        if self.feedback is not None and outcome.residual is not None:
            self.feedback.copy_(outcome.residual)

    def settle_residual(self, residual: torch.Tensor | None) -> None:
        """A round this site failed turned out applied by the others (see
        :class:`~greenswarm.node.state_sync.PendingRound`): what it sent then -- its update and the
        feedback carried in it -- is in the swarm's state, so only that round's residual carries on
        (none when the round failed before coding: nothing left out is known, so nothing is carried)."""
        if self.feedback is None:
            return
        if residual is None:
            self.feedback.zero_()
        else:
            self.feedback.copy_(residual)

    def _scale(self, outcome: RoundOutcome, slot: int) -> None:
        """Turn the group's combined vector into the group's step (``fednova``: times ``tau_eff``, from
        the gathered steps and the weights the reducers counted; the same bits at every member)."""
        if self.cfg.weighting != "fednova" or outcome.averaged is None:
            return
        weights = outcome.weights
        if not weights:  # (an averager that did not say: count them as its reducers do)
            claims = {peer: outcome.gathered.get(peer) for peer in outcome.members}
            rules = {**self.cfg.rules(), "interval_s": float(self.interval_s)}
            weights, _ = bounded_weights(claims, rules, float(self.interval_s))
        scale = group_scale(
            "fednova", outcome.members, outcome.gathered, weights, self.cfg.aggregate, self.cfg.trim
        )
        outcome.averaged = scaled(outcome.averaged, scale)
        self.log.debug("round %d: fednova scales the group's average by tau_eff %.4g", slot, scale)

    def _refused(self, outcome: RoundOutcome) -> dict[str, str]:
        """Groupmates whose updates the round refused (this site's own refusal is the round's reason)."""
        return {peer: why for peer, why in outcome.refused.items() if peer != self.peer_id}

    def _with_feedback(self, delta: torch.Tensor) -> torch.Tensor:
        if not self.cfg.error_feedback:
            return delta
        if self.feedback is None:
            self.feedback = torch.zeros_like(delta)
        return delta + self.feedback

    def _count(self, outcome: RoundOutcome) -> None:
        self.round_seconds.append(outcome.seconds)
        self.wire = outcome.wire
        self.wire_rounds[outcome.wire] = self.wire_rounds.get(outcome.wire, 0) + 1
        sent = outcome.report.wire_bytes if outcome.report is not None else 0.0
        self.wire_bytes[outcome.wire] = self.wire_bytes.get(outcome.wire, 0.0) + sent
        if self.first_round_s is None:
            self.first_round_s = time.monotonic() - self.started
            self.log.info("first averaging round completed %.1f s after start", self.first_round_s)

    def _note_refusal(self, outcome: RoundOutcome, slot: int, peer: str, why: str) -> None:
        """A groupmate's update was refused before it was averaged (or this site's was): say so."""
        if peer == self.peer_id:
            self.log.warning("round %d: this site's update was refused: %s", slot, why)
        else:
            self.log.warning("round %d: refused the update of %s: %s", slot, site_of(outcome, peer), why)

    def _agree(
        self, outcome: RoundOutcome, delta: torch.Tensor, state: GlobalState, slot: int
    ) -> tuple[Verdict, float]:
        """Prove with the group that every member is about to apply the same step (see
        :mod:`greenswarm.averaging.agreement`); the verdict and the seconds it took."""
        averaged = outcome.averaged
        assert averaged is not None  # an ok outcome carries its average
        group = len(outcome.members)
        if self.faults.fires("corrupt-result", group):
            n = max(1, averaged.numel() // 10)
            averaged[:n] = delta[:n]  # as if the part reduced elsewhere had been lost
            self.log.warning("fault injected: corrupt-result (first %d values not averaged)", n)
        started = time.monotonic()
        digest = state.agreement_digest(averaged)
        publish = not self.faults.fires("withhold-digest", group)
        if not publish:
            self.log.warning("fault injected: withhold-digest (this site's digest is not published)")
        published = self.digests.exchange(
            slot,
            state.lineage,
            outcome.members,
            digest,
            timeout_s=self.cfg.agreement_timeout_s,
            publish=publish,
            refused=outcome.refused,
        )
        for peer, why in self.digests.heard_refused.items():  # refused by a groupmate's reducer
            if peer not in outcome.refused and peer != self.peer_id:
                outcome.refused[peer] = why
                self._note_refusal(outcome, slot, peer, why)
        verdict = decide(self.peer_id, digest, published, outcome.members)
        seconds = time.monotonic() - started
        self.agreement_seconds.append(seconds)
        self.log.debug(
            "round %d: %s after %.2f s of digest exchange (%s)", slot, verdict.action, seconds, verdict.reason
        )
        return verdict, seconds


def site_of(outcome: RoundOutcome, peer: str) -> str:
    """A groupmate's site name from what it gathered (its peer id when it named none)."""
    gathered = outcome.gathered.get(peer)
    return str(gathered.get("site", peer)) if isinstance(gathered, dict) else peer
