"""The swarm averager: hivemind's ``DecentralizedAverager`` with greenswarm's round and state rules.

What it adds to hivemind, and why:

* a round matches only sites in the same lineage (the group key is derived from it), so a group
  never mixes pseudo-gradients taken against different global parameters; the round's slot is the
  latest of the members' slots, which every member reads from the gathered metadata;
* the expected group size is set per round from who is in a window now, so a full group starts at
  once instead of waiting out the matchmaking time;
* the state it serves to newcomers is the site's global view (parameters + outer momentum + lineage),
  provided by the node under its lock, and a newcomer downloads it from a *chosen* peer (the swarm's
  head), not from whichever peer hivemind's priority list names first;
* the all-reduce is :class:`~greenswarm.averaging.exact.ExactAllReduceRunner`: every member ends with
  the same bits (so a digest can prove agreement), and a part that was not averaged fails the round
  instead of leaving local values in a slice of the result;
* every timeout is set (hivemind's all-reduce defaults wait forever), and every failure comes back as
  a :class:`RoundOutcome` with a reason instead of an exception or a silent partial result;
* in a certified swarm (``admission``) only members take part: a join request, a group and a state
  download from a peer without a valid membership certificate are refused (docs/security.md);
* poisoned updates (NaN/Inf, or a norm far outside the group's) are refused before they are
  averaged (:mod:`greenswarm.averaging.screening`); claimed weights are bounded, and the group may
  combine updates by a trimmed mean instead of the mean (:mod:`greenswarm.averaging.aggregation`):
  every member must configure both alike, or the group is refused (and the weighting too:
  :mod:`greenswarm.averaging.weighting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.compression import NoCompression
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import achain, as_aiter

from greenswarm import hivemind_internals as seam
from greenswarm.averaging.aggregation import bounded_weights, claimed_weight
from greenswarm.averaging.codecs import wire_format
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.exact import ExactAllReduceRunner
from greenswarm.averaging.outer import group_bits
from greenswarm.averaging.poisoning import poison
from greenswarm.averaging.round_report import RoundFailed, RoundOutcome, RoundReport
from greenswarm.averaging.screening import all_finite, screen_claims, update_norm, within_claims
from greenswarm.averaging.wire import WireMismatch, choose_wire, offers_of, wire_offer
from greenswarm.faults import FaultPlan
from greenswarm.network import end_helper
from greenswarm.procs import exit_with_parent
from greenswarm.security.admission import Admission, RefusalLog
from greenswarm.security.certificates import CertificateError

log = logging.getLogger(__name__)

#: seconds hivemind's own all-reduce timeout waits beyond greenswarm's (which ends a round with its report)
ALLREDUCE_BACKSTOP_S = 5.0

#: how often a groupmate's part request for a group this site does not know looks again (see
#: :meth:`SwarmAverager.rpc_aggregate_part`)
JOIN_POLL_S = 0.05

#: what a site serves to newcomers: (metadata, tensors)
StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class SwarmAverager(DecentralizedAverager):
    """Averages one flat pseudo-gradient vector per round with the sites that share this site's state."""

    def __init__(
        self,
        dht: Any,
        prefix: str,
        numel: int,
        cfg: AveragingConfig,
        state_provider: StateProvider,
        client_mode: bool = False,
        faults: FaultPlan | None = None,
        admission: Admission | None = None,
        members: Callable[[], Any] | None = None,
    ):
        self._cfg = cfg
        self._admission = admission  # None: an open swarm, anyone may average
        # (async, in the averager process) the peer ids of members that published a record: who may
        # download the state without having shown a certificate in a group yet
        self._members = members
        self._certified: dict[str, float] = {}  # peer -> certificate expiry, from checked certificates
        self._rates: dict[str, float | None] = {}  # peer -> its certificate's max tokens/s (a round's group)
        self._refusals = RefusalLog(log)  # an outsider's flood of requests must not flood the log
        self._state_provider = state_provider
        self._faults = faults or FaultPlan()  # copied into the averager process by the fork
        # what coding left out of this site's update: written by the averager process during a round and
        # read here after it (a model-sized vector: shared memory, like the averaged buffer itself)
        self._residual = torch.zeros(numel, dtype=torch.float32).share_memory_()
        self._reports: dict[bytes, RoundReport] = {}  # (averager process) group id -> its round's report
        self._steps = 0  # (averager process) averaging steps under way
        self._steps_ended = 0  # (averager process) and how many have ended
        self.measured_mbit: float | None = None  # this site's link rate seen in its last all-reduce
        previous_sigint = signal.getsignal(signal.SIGINT)
        super().__init__(
            [torch.zeros(numel, dtype=torch.float32)],
            dht,
            start=True,
            prefix=prefix,
            target_group_size=cfg.max_group_size,
            min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_s,
            request_timeout=cfg.request_timeout_s,
            # a backstop: greenswarm's own timeout (_aggregate_with_group) ends a round first, with a report.
            # (Both cancel the same task; the node's own bound on the step, _round_bound_s, is the last)
            allreduce_timeout=cfg.allreduce_timeout_s + ALLREDUCE_BACKSTOP_S,
            next_chunk_timeout=cfg.chunk_timeout_s,
            compression=wire_format("int8" if cfg.wire == "auto" else cfg.wire).compression,  # per round
            state_compression=NoCompression(),  # state must arrive bit-exact
            allow_state_sharing=not client_mode,
            client_mode=client_mode,
            shutdown_timeout=5,
        )
        # hivemind's run_in_background sets SIGINT to "ignore" in *our* process; give Ctrl-C back
        signal.signal(signal.SIGINT, previous_sigint)
        seam.lock_outer_pipe(self)

    def run(self) -> None:
        """The averager process (forked): hivemind's loop, ended when the node dies without a word."""
        exit_with_parent()
        super().run()

    def shutdown(self) -> None:
        """hivemind's shutdown, bounded -- or none when the DHT's p2p daemon, which this averager talks
        through, is gone already (see :func:`greenswarm.network.end_helper`)."""
        dht_pid = getattr(self.dht, "pid", None)
        if dht_pid is None or not self.is_alive():
            super().shutdown()
        else:
            end_helper(self, dht_pid, super().shutdown)

    # ---- serving state (runs in this process, on hivemind's background thread) ----

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        self._faults.hit("serve-state")  # a newcomer is downloading this site's state right now
        metadata, tensors = self._state_provider()
        if self._faults.fires("serve-forged"):
            log.warning("fault injected: serve-forged (this site serves a forged global state)")
            tensors = [tensors[0] + 0.01, *tensors[1:]]
        return metadata, tensors, None

    # ---- one round ----

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
    ) -> RoundOutcome:
        """All-reduce ``delta`` (weighted) with a group of sites on ``lineage``; ``round_index`` is this
        site's round slot (the group's slot is the latest of its members', see :class:`RoundOutcome`).
        ``matchmaking_s``: how long this round looks for its group (``averaging.matchmaking_s`` if None);
        it stays open to latecomers for up to ``search_s`` (twice ``matchmaking_s`` if None; see
        :func:`greenswarm.node.round_handling.round_search_s`). ``interval_s``: the round interval in
        wall seconds, over which claimed tokens are bounded (``averaging.sync_interval_s`` if None)."""
        interval_s = self._cfg.sync_interval_s if interval_s is None else interval_s
        matchmaking_s = self._cfg.matchmaking_s if matchmaking_s is None else matchmaking_s
        search_s = 2 * matchmaking_s if search_s is None else max(search_s, matchmaking_s)
        started = time.monotonic()
        control = None
        try:
            self._call(
                "_configure_round",
                wait_s=10.0,
                bits=group_bits(lineage),
                # (a pair that reached its target would form below min_group_size: hivemind assembles a
                # group at its target without asking the minimum)
                target=max(self._cfg.min_group_size, min(expected_size, self._cfg.max_group_size)),
            )
            if self._faults.fires("poison-flip"):
                log.warning(
                    "fault injected: poison-flip (this site sends -10x its update, claiming its norm)"
                )
                delta = -10.0 * delta
            norm = update_norm(delta)  # the claim every reducer holds this site's parts to
            with self.get_tensors() as (buffer,):
                buffer.copy_(delta)
            offer = wire_offer(self._cfg.wire, self.measured_mbit, self._cfg.round_budget_s)
            shown = {"certificate": self._admission.certificate} if self._admission is not None else {}
            rules = {**self._cfg.rules(), "interval_s": float(interval_s)}
            weight = max(float(weight), 1e-6)
            control = self.step(
                gather={
                    **gather,
                    **shown,
                    # the claim every reducer weighs and bounds this site's parts by: the weight itself,
                    # so a caller cannot send parts weighing more than the members counted
                    "tokens": weight,
                    "slot": round_index,
                    "wire_offer": offer,
                    "norm": norm,
                    "rules": rules,
                },
                weight=weight,
                scheduled_time=get_dht_time() + matchmaking_s,
                timeout=search_s,
                # one attempt a round: a retried all-reduce would report only its own failure, hiding
                # the one that ended the round; the next round is the retry
                allow_retries=False,
                wait=False,
            )
            self._matchmaking_fault(control, search_s)
            report = control.result(timeout=self._round_bound_s(search_s))
        except RoundFailed as e:  # the group formed, then the round failed: the report says how far it got
            return self._failed(e.reason, started, e.report, round_index)
        except Exception as e:  # hivemind reports failures as several exception types
            if control is not None and not control.done():  # our wait ran out: the process is gone or stuck
                control.cancel()
                silent = f"the averager process did not answer in {self._round_bound_s(search_s):.0f} s"
                return self._failed(silent, started)
            return self._failed(_describe(e), started)
        if not isinstance(report, RoundReport) or not report.gathered:
            return self._failed("no group formed before the deadline", started)
        with self.get_tensors() as (buffer,):
            averaged = buffer.clone()
        if not all_finite(averaged):
            return self._failed("averaged vector has NaN/Inf", started, report, round_index)
        gathered = report.gathered
        slot, admitted, refused = self._group_of(gathered, round_index)
        claims = [float(gathered[peer]["norm"]) for peer in admitted]
        poisoned = within_claims(averaged, claims, coordinatewise=self._cfg.aggregate == "trimmed-mean")
        if poisoned is not None:
            return self._failed(poisoned, started, report, round_index)
        refused.update(report.refused)
        self.measured_mbit = report.mbit() or self.measured_mbit
        return RoundOutcome(
            True,
            slot=slot,
            members=admitted,
            refused=refused,
            gathered=gathered,
            averaged=averaged,
            seconds=time.monotonic() - started,
            wire=report.wire,  # as the averager process chose it for the group
            residual=self._residual.clone(),
            allreduce_s=report.allreduce_s(),
            clipped=dict(report.clipped),
            weights=dict(report.weights),
            report=report,
        )

    def _round_bound_s(self, search_s: float) -> float:
        """The longest a round can take when the averager process works: the search for its group, the
        all-reduce, slack."""
        return search_s + self._cfg.allreduce_timeout_s + 10.0

    def _group_of(self, gathered: dict[str, Any], round_index: int) -> tuple[int, list[str], dict[str, str]]:
        """The group's slot (the latest of its members'), its admitted members and the updates every
        member refused by their claims -- computed alike by every member from the gathered metadata."""
        refused = screen_claims(gathered, self._cfg.max_norm_ratio)
        admitted = sorted(peer for peer in gathered if peer not in refused)
        slots = [g.get("slot") for g in gathered.values() if isinstance(g, dict)]
        return max((s for s in slots if isinstance(s, int)), default=round_index), admitted, refused

    def _failed(
        self, reason: str, started: float, report: RoundReport | None = None, round_index: int = -1
    ) -> RoundOutcome:
        """A failed round. One whose group formed names its slot and members as an applied one would:
        this site failed, but the others may have applied the step (see
        :meth:`greenswarm.node.state_sync.StateSync.maybe_applied`)."""
        failed = RoundOutcome(
            False,
            reason=reason,
            seconds=time.monotonic() - started,
            allreduce_s=report.allreduce_s() if report is not None else None,  # None: no group formed
            report=report,
        )
        if report is None or not report.gathered:
            return failed
        failed.slot, failed.members, _ = self._group_of(report.gathered, round_index)
        failed.gathered = dict(report.gathered)
        failed.refused = dict(report.refused)  # whose update a reducer refused (a void round)
        failed.clipped = dict(report.clipped)
        failed.weights = dict(report.weights)
        if report.coded:  # what went on the wire, had the others applied it
            failed.residual = self._residual.clone()
        return failed

    def _matchmaking_fault(self, control: Any, search_s: float) -> None:
        """The ``matchmaking`` fault point: fire once the averager is looking for this round's group."""
        if not self._faults.armed("matchmaking"):
            return
        deadline = time.monotonic() + search_s
        while control.stage.value < AveragingStage.LOOKING_FOR_GROUP.value and time.monotonic() < deadline:
            time.sleep(0.005)
        self._faults.hit("matchmaking")

    async def _configure_round(self, bits: str, target: int, future: MPFuture) -> None:
        """Runs in the averager process: set this round's group key and expected group size."""
        try:
            seam.set_group(self, bits, target)
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    async def _step(self, *, step: Any, future_for_init: MPFuture) -> None:
        """Runs in the averager process: hivemind's step. hivemind hands every error that ends a step to
        the step's own future (through which the node reads and reports it) and then raises it again
        from this task, which nobody awaits: asyncio would print it, with a traceback, into the site's
        log as "Task exception was never retrieved". An error the step's future holds is read here."""
        self._steps += 1
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        except Exception as e:
            if not step.done():
                raise
            if step.cancelled():  # the node stopped waiting (and said so): what ended the step, in a line
                log.warning("an averaging step the node had given up on ended: %s", _describe(e))
            else:
                log.debug("averaging step ended: %s (the node reads it from the step)", _describe(e))
        finally:
            self._steps -= 1
            self._steps_ended += 1

    async def _aggregate_with_group(
        self, group_info: Any, min_vector_size: int, **kwargs: Any
    ) -> RoundReport:
        """Runs in the averager process once a group has formed: hivemind's aggregation, bounded by the
        all-reduce timeout, answered with the round's :class:`RoundReport` (a failure raises
        :class:`RoundFailed` carrying it). Both reach the node through the step's own future."""
        report = self._reports[group_info.group_id] = RoundReport()
        # a timeout around the call, not wait_for: wait_for would run hivemind's aggregation as a task of
        # its own, and when hivemind's backstop cancelled this one while that task was being cancelled
        # (both timeouts pass together in a process that was stopped or starved past them), the task's
        # error went unread and asyncio printed its traceback into the site's log (docs/testing.md row 62)
        bound = asyncio.timeout(self._cfg.allreduce_timeout_s)
        try:
            async with bound:
                gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        except Exception as e:  # (hivemind turns any cancellation of its aggregation into an Exception)
            # a timeout when the bound cancelled the aggregation and that cancellation ended it (hivemind
            # raises its MatchmakingException while handling it): not an error that came first
            cancelled = isinstance(e, TimeoutError) or isinstance(e.__context__, asyncio.CancelledError)
            reason = _describe(e)
            if bound.expired() and cancelled:
                reason = f"the all-reduce timed out after {self._cfg.allreduce_timeout_s:g} s"
            raise RoundFailed(report.refusal or reason, report) from None
        finally:
            self._reports.pop(group_info.group_id, None)
        report.gathered = {str(peer): data for peer, data in gathered.items()}
        return report

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        """Runs in the averager process: hivemind's hook for one all-reduce, with the exact runner. The
        tensors are *replaced* by the group's average (hivemind adds a difference to them), and only
        when the all-reduce succeeded: a failed attempt leaves this site's update as it was."""
        report = self._reports[group_info.group_id]
        group_id = group_info.group_id if group_id is None else group_id
        users = self._gathered_users(group_info)
        report.gathered = {peer: user for peer, user in users if user is not None}
        try:
            self._check_members(users)
            check_rules(users, str(self.peer_id))
            fmt = choose_wire(offers_of(users), sum(t.numel() for t in tensors))
        except (WireMismatch, CertificateError, RulesMismatch) as e:
            log.error("refusing to average with this group: %s", e)
            report.refusal = f"refused a group: {e}"
            raise
        kwargs.update(self._screened(group_info, users, kwargs["peer_fractions"], report))
        # error feedback needs the residual of exactly what goes on the wire: code the whole vector
        # once here (hivemind's parts start on block boundaries, so coding them again changes nothing).
        # The update itself stays as it was, so the residual of any attempt is its own
        started = time.monotonic()  # coding is part of the round's cost
        (flat,) = tensors
        coded = await asyncio.get_event_loop().run_in_executor(None, fmt.roundtrip, flat)
        torch.sub(flat, coded, out=self._residual)
        report.coded = True
        kwargs["compression"] = poison(coded, fmt.compression, self._faults)
        runner = ExactAllReduceRunner(
            aggregate=self._cfg.aggregate,
            trim=self._cfg.trim,
            p2p=seam.averager_p2p(self),
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=[coded],
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            faults=self._faults,
            on_refused=functools.partial(self._refuse_part, report),
            **kwargs,
        )
        seam.expose_runner(self, group_id, runner)  # lets groupmates' part requests reach it
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("an auxiliary peer must not receive averaged tensors")
            return
        try:
            averaged = [tensor async for tensor in runner]  # all or nothing: run() raises on a failed part
        except Exception as e:  # hivemind reports only a step's last attempt: say what ended this one
            log.warning("all-reduce with %s failed: %s", ", ".join(_name(p, u) for p, u in users), e)
            raise
        n = len(group_info.peer_ids)
        report.seconds = time.monotonic() - started
        report.wire_bytes = 2 * flat.numel() * fmt.nominal_bytes * (n - 1) / n
        report.wire = fmt.name
        for tensor, average in zip(tensors, averaged, strict=True):
            tensor.copy_(average)
        seam.mark_averaged(self)

    def _gathered_users(self, group_info: Any) -> list[tuple[str, Any]]:
        """Each member's own gathered metadata (None for a member that gathered something else)."""
        users = []
        for peer, blob in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                users.append((str(peer), seam.gathered_metadata(self, blob)))
            except Exception:  # a member that gathered something else: the checks name it
                users.append((str(peer), None))
        return users

    def _check_members(self, users: list[tuple[str, Any]]) -> None:
        """In a certified swarm, raise unless every member showed a valid certificate for its own id
        (the transport authenticated the ids; a leader could still have let an outsider in)."""
        if self._admission is None:
            return
        for peer, user in users:
            certificate = user.get("certificate") if isinstance(user, dict) else None
            membership = self._admission.check(certificate, peer)
            self._certified[peer] = membership.expires
            self._rates[peer] = membership.max_tokens_per_s

    def _screened(
        self, group_info: Any, users: list[tuple[str, Any]], fractions: Sequence[float], report: RoundReport
    ) -> dict:
        """The all-reduce's modes, part fractions and claims after refusing poisoned updates: a refused
        member sends nothing and reduces nothing (see :mod:`greenswarm.averaging.screening`)."""
        claims = dict(users)
        refused = screen_claims(claims, self._cfg.max_norm_ratio)
        me = str(self.peer_id)
        if me in refused:
            report.refusal = f"the group refused this site's update: {refused[me]}"
            raise ValueError(report.refusal)
        for peer, why in refused.items():
            log.warning("refusing the update of %s: %s", _name(peer, claims.get(peer)), why)
        # hivemind's own rule (a member with no share of the vector is a client), except that a
        # refused member is an auxiliary: it has no share and sends nothing
        peers = [peer for peer, _ in users]
        modes = [
            AveragingMode.AUX if peer in refused else AveragingMode.CLIENT if f == 0 else AveragingMode.NODE
            for peer, f in zip(peers, fractions, strict=True)
        ]
        kept = [0.0 if peer in refused else float(f) for peer, f in zip(peers, fractions, strict=True)]
        if not sum(kept):
            raise ValueError("no member is left to reduce the group's parts")
        admitted = {peer: claims[peer] for peer in peers if peer not in refused}
        trimmed = self._cfg.aggregate == "trimmed-mean"
        if trimmed and len(admitted) < self._cfg.min_group_size:  # (hivemind's minimum: a leader's only)
            report.refusal = (
                f"{len(admitted)} of the group's updates would count, and {self._cfg.aggregate} needs "
                f"{self._cfg.min_group_size}: a pair leaves nothing out (every member fails it alike)"
            )
            raise ValueError(report.refusal)
        rules = claims.get(me, {}).get("rules") if isinstance(claims.get(me), dict) else None
        rules = rules if isinstance(rules, dict) else {}  # (alike in every member: see check_rules)
        weights, clipped = bounded_weights(admitted, rules, float(rules.get("interval_s", 0.0)), self._rates)
        for peer, why in clipped.items():
            log.warning("bounding the weight of %s: %s", _name(peer, claims.get(peer)), why)
        report.clipped = clipped
        report.weights = dict(weights)  # what the group's step is weighted by (fednova's tau_eff too)
        return {
            "modes": tuple(modes),
            "peer_fractions": tuple(f / sum(kept) for f in kept),
            "claims": {
                pid: float(claims[str(pid)]["norm"]) for pid in group_info.peer_ids if str(pid) not in refused
            },
            "weights": {pid: weights[str(pid)] for pid in group_info.peer_ids if str(pid) in weights},
            "claimed": {
                pid: claimed_weight(admitted[str(pid)]) for pid in group_info.peer_ids if str(pid) in weights
            },
        }

    def _refuse_part(self, report: RoundReport, peer: str, why: str) -> None:
        """This site's reducer refused a groupmate's part (averager process): log it, report it."""
        log.warning("refused a part of %s's update: %s", peer, why)
        if peer == str(self.peer_id):  # the round's failure, in words (not the runner's exception)
            report.refusal = f"this site's update was refused: {why}"
        report.refused[peer] = why

    # ---- a groupmate's parts (averager process) ----

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:  # hivemind reads typing's alias
        """hivemind's handler for a groupmate's parts, except that a group this site is not in is
        answered (``BAD_GROUP_ID``) as soon as the site can tell, not whenever it next forms a group.

        Why: a leader can count a site in a group that the site never joined. On a busy machine the
        site's join request can time out (``request_timeout_s``) as the leader accepts it, and the site
        looks on elsewhere until its step ends with no group. hivemind's handler waits for the next
        group the site registers, so the leader waited out its chunk timeout for this site's parts,
        and its next rounds found nobody meanwhile: three failed rounds in a row for both sites of a
        3-s slot (docs/testing.md row 51). Now the answer comes once this site's step is over without
        that group (at once when no step is under way), and the leader's round fails then, saying so
        (:class:`~greenswarm.averaging.exact.ExactAllReduceRunner`)."""
        request = await anext(stream)
        if not await self._joined(request.group_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            # held open until the sender closes it: closing first can lose the answer on the wire (see
            # greenswarm.averaging.exact), and the sender would wait again. Its parts are read and
            # dropped meanwhile: hivemind's server notices a close only while it is not blocked handing
            # on a part, and it holds 5 at most
            with contextlib.suppress(Exception):  # (the limit passed, or the stream broke)
                async with asyncio.timeout(self._cfg.chunk_timeout_s):
                    async for _ in stream:
                        pass
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _joined(self, group_id: bytes) -> bool:
        """Whether this site is in group ``group_id``. A groupmate's parts can come before this site has
        registered the group (its leader's word is still on the way), so while a step of this site is
        still searching it is asked again, up to the chunk timeout (the sender's reducer stops waiting
        for this site's own parts then). Not once a step ended (the next one cannot be in a group that
        formed before it), nor once the step registered another group: hivemind answers that at once."""
        deadline = time.monotonic() + self._cfg.chunk_timeout_s
        ended = self._steps_ended
        while not seam.has_group(self, group_id):
            over = not self._steps or self._steps_ended != ended or seam.registered_another_group(self)
            if over or time.monotonic() > deadline:
                return False
            await asyncio.sleep(JOIN_POLL_S)
        return True

    # ---- admission (averager process) ----

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads typing's alias
        """hivemind's join handler, behind a membership check: an outsider never enters a group."""
        if self._admission is not None:
            try:
                user = seam.gathered_metadata(self, request.gather)
                certificate = user.get("certificate") if isinstance(user, dict) else None
                membership = self._admission.check(certificate, str(context.remote_id))
            except Exception as e:
                self._refusals.warn(f"refused a join request from {context.remote_id}: {_reason(e)}")
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            self._certified[str(context.remote_id)] = membership.expires
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's state server, behind a membership check: only members download the model."""
        if self._admission is not None and not await self._is_member(str(context.remote_id)):
            self._refusals.warn(
                f"refused to serve the model state to {context.remote_id}: it holds no valid membership "
                "certificate"
            )
            return  # hivemind's way to deny: the requester tries its next source
        async for message in super().rpc_download_state(request, context):
            yield message

    def apply_revocations(self, blob: bytes) -> None:
        """Apply a newer revocation list in the averager process too (joins, groups, state serving)."""
        if self._admission is not None:
            self._call("_apply_revocations", blob=blob)

    async def _apply_revocations(self, blob: bytes, future: MPFuture) -> None:
        """Runs in the averager process: the list in force here; a revoked peer's past checks forgotten."""
        try:
            self._admission.revoke(blob)
            for peer in [p for p in self._certified if self._admission.revoked(p) is not None]:
                del self._certified[peer]
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    async def _is_member(self, peer: str) -> bool:
        """Whether ``peer`` showed a valid certificate in a group or join request, or published a
        record (which the DHT accepts from certified members only). A newcomer's first record may
        still be on its way, so the records are read again for a few seconds. A revoked peer is none."""
        if self._admission.revoked(peer) is not None:
            return False
        for attempt in range(4):
            if self._certified.get(peer, 0.0) > time.time():
                return True
            if self._members is None:
                return False
            try:
                found = await self._members()
            except Exception as e:  # the DHT is busy or shutting down: deny, the requester retries
                log.debug("cannot read the swarm's members: %r", e)
                found = {}
            self._certified.update(found)
            if self._certified.get(peer, 0.0) > time.time() or attempt == 3:
                break
            await asyncio.sleep(1.0)
        return self._certified.get(peer, 0.0) > time.time()

    # ---- downloading state from a chosen peer ----

    def download_state(self, peers: Sequence[str]) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Download the served state from the first of ``peers`` that answers; None if none does."""
        if not peers:
            return None
        return self._call(
            "_download_state_from", peers=list(peers), wait_s=self._cfg.state_timeout_s * len(peers) + 5
        )

    async def _download_state_from(self, peers: list[str], future: MPFuture) -> None:
        try:
            for peer in peers:
                try:
                    state = await seam.download_served_state(self, peer, self._cfg.chunk_timeout_s)
                except Exception as e:
                    log.warning("state download from %s failed: %r", peer, e)
                    continue
                if state is not None:
                    future.set_result(state)
                    return
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    # ---- plumbing ----

    def _call(self, method: str, wait_s: float = 30.0, **kwargs: Any) -> Any:
        """Run ``method`` in the averager process and wait for its result."""
        return seam.call_averager(self, method, wait_s, **kwargs)


class RulesMismatch(ValueError):
    """A groupmate combines updates by other rules (``averaging.aggregate``, ``trim``,
    ``max_tokens_per_s``, ``weighting``, the round interval): averaged together, each reducer would
    weigh its slice by its own rules."""


def check_rules(users: list[tuple[str, Any]], me: str) -> None:
    """Raise :class:`RulesMismatch` unless every member gathered the rules member ``me`` gathered (the
    round interval included: claimed tokens are bounded over it)."""
    gathered = {peer: user.get("rules") if isinstance(user, dict) else None for peer, user in users}
    mine = gathered.get(me)
    for peer, user in users:
        if gathered[peer] != mine:
            raise RulesMismatch(
                f"{_name(peer, user)} combines updates by {gathered[peer]!r}, this site by {mine!r}: every "
                "member of a swarm must set averaging.aggregate, trim, max_tokens_per_s and weighting alike "
                "(and the same round interval)"
            )


def _name(peer: str, user: Any) -> str:
    """A groupmate as people know it: its site name, and its peer id."""
    site = user.get("site") if isinstance(user, dict) else None
    return f"{site} ({peer})" if site else peer


def _describe(error: BaseException) -> str:
    """A failure as the round log shows it: the exception's type and message (a bare timeout says so)."""
    if isinstance(error, TimeoutError) and not str(error):
        return "timed out"
    return f"{type(error).__name__}: {error}".strip(": ")


def _reason(error: Exception) -> str:
    return str(error) if isinstance(error, CertificateError) else f"unreadable join request ({error!r})"
