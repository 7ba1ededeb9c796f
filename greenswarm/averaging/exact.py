"""An all-reduce after which every member of the group holds the same bits, or the round fails.

hivemind's :class:`~hivemind.averaging.allreduce.AllReduceRunner` returns *differences*: the reducer
of a part sends ``average - sender's part`` through the wire codec, and each sender adds that to its
own values. Two things follow, and both make sites drift apart silently:

* the result is ``own + codec(average - own)``, which differs from site to site in the last bits
  (fp16 rounding of the correction, and float addition not undoing subtraction exactly);
* when a reducer fails, hivemind registers a zero difference for its parts and finishes normally, so
  every survivor keeps *its own* values in that slice and reports success.

:class:`ExactAllReduceRunner` changes the protocol on both ends, inside the same hivemind messages:

* a reducer sends back the average itself, encoded with this averager's wire codec, and keeps for
  its own part the same encode-decode round trip of it, so every member decodes identical bytes;
* a part whose reducer failed is a failed round: the runner raises after the parts are in, instead of
  handing back a vector that mixes averaged and local slices;
* a reducer that refuses any part of a sender's update (:mod:`greenswarm.averaging.screening`)
  voids its whole slice: every sender gets, in place of its next averaged part, a message naming the
  refused sender, and every member's round fails. A refusal can only drop a sender from then on, in
  the refusing reducer's slice; the sender's earlier parts there, and its parts in other reducers'
  slices, would otherwise stay in an average that the honest members apply;
* a reducer that loses a sender midway (its stream broke, or it fell silent, before all its parts
  were in) voids its slice the same way, with a message naming the lost sender, instead of finishing
  the slice without it: the others would otherwise apply an average holding part of that sender's
  update, and the sender (whose own round failed) could not tell which part;
* a reducer weighs each sender's parts by the weight every member counted for it from the gathered
  claims (:func:`~greenswarm.averaging.aggregation.bounded_weights`), not by what a part's message
  says; a message that says more than the sender claimed is refused like a poisoned part. With
  ``averaging.aggregate: trimmed-mean`` the reducer is a
  :class:`~greenswarm.averaging.aggregation.TrimmedMeanReducer`;
* the sender closes each reducer's stream once it holds the parts it expects, and the reducer keeps
  the stream open until then. hivemind's reducer closes its end right after its last reply, and the
  p2p daemon then now and then resets the stream before that reply is delivered (roughly one stream
  in a few thousand, on a busy machine: ``benchmarks/stream_tail.py``): the sender saw a short
  stream, its reducer "failed", and a round every member had reduced correctly failed on one of them.

Every peer of a swarm must run this runner (they do: it is what :class:`SwarmAverager` uses); a peer
running plain hivemind would add the average to its values as if it were a difference, so the group
digest check (:mod:`greenswarm.averaging.agreement`) would expose it as disagreeing.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import AsyncIterator, Callable

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished

from greenswarm.averaging.aggregation import TrimmedMeanReducer, weight_lie
from greenswarm.averaging.screening import screen_part
from greenswarm.faults import FaultPlan

log = logging.getLogger(__name__)

LINGER_LIMIT_S = 10.0
"""How long a reducer holds a stream open for a sender that has all its parts but has not closed
(used when the runner has no reducer timeout): a sender that died never closes."""
#: codes that, with a sender's id, void a slice: that sender was refused, or lost midway
VOID_CODES = (averaging_pb2.PROTOCOL_VIOLATION, averaging_pb2.INTERNAL_ERROR)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose output is the group's average, bit-identical on every member."""

    def __init__(
        self,
        *,
        compression: CompressionBase,
        faults: FaultPlan | None = None,
        claims: dict | None = None,
        weights: dict | None = None,
        claimed: dict | None = None,
        aggregate: str = "mean",
        trim: float = 0.0,
        on_refused: Callable[[str, str], None] | None = None,
        **kwargs,
    ):
        super().__init__(compression=compression, **kwargs)
        if aggregate == "trimmed-mean":
            reducer = self.tensor_part_reducer
            self.tensor_part_reducer = TrimmedMeanReducer(reducer.part_shapes, reducer.num_senders, trim)
        # each sender's weight as every member counted it (bounded), and as it claimed it (None: the
        # messages' own weights, unchecked, as hivemind does)
        self._weights = weights
        self._claimed = claimed or {}
        self._codec = compression
        self._faults = faults or FaultPlan()
        # each sender's claimed update norm (see greenswarm.averaging.screening); parts are checked
        # against it before they are accumulated, and a refusal is reported through on_refused
        self._claims = claims or {}
        self._on_refused = on_refused or (lambda peer, why: None)
        self._own_refusal: str | None = None  # this site's own part failed its claim: its round fails
        # (refused sender, refusing reducer) once any reducer refused a part: the round is void everywhere
        self._void: tuple[PeerID, PeerID] | None = None
        # (lost sender, reducer that lost it) once any reducer lost a sender midway: void everywhere too
        self._lost: tuple[PeerID, PeerID] | None = None
        # a member that answered it is not in this group (it never joined: see SwarmAverager's
        # rpc_aggregate_part): none of its parts will come, and the round is void
        self._absent: PeerID | None = None
        self._encoded: dict[int, asyncio.Future] = {}  # part index -> its average, encoded once for all
        # outputs are averages, so a failed reducer's slice would be filled with local values (not
        # zero differences); run() turns any such slice into a failure of the whole round
        self.tensor_part_container.return_deltas = False

    def _encoded_average(self, part_index: int, averaged: torch.Tensor) -> asyncio.Future:
        """The wire form of part ``part_index``'s average: coded once, sent to every sender and decoded
        for this reducer's own part (all of them get the same bytes)."""
        if part_index not in self._encoded:
            info = CompressionInfo.from_tensor(averaged)
            self._encoded[part_index] = asyncio.get_event_loop().run_in_executor(
                None, lambda: self._codec.compress(averaged, info, allow_inplace=False)
            )
        return self._encoded[part_index]

    async def run(self) -> AsyncIterator[torch.Tensor]:
        """Yield the averaged tensors; raise if any part of them is not the group's average."""
        outputs = []
        expected = len(self.tensor_part_container.local_tensors)
        async for tensor in super().run():
            outputs.append(tensor)
            if len(outputs) == expected:
                # hivemind finalizes this site's reducer as soon as its own outputs are in; a member
                # whose own parts failed (refused, or a reducer died) gets there early, so it would
                # cut off the slice it reduces for the others: finish serving them first
                await self.tensor_part_reducer.finished.wait()
        if self._own_refusal is not None:
            raise AllreduceException(f"this site's own update was refused: {self._own_refusal}")
        if self._void is not None:
            sender, reducer = self._void
            who = "this site" if reducer == self.peer_id else str(reducer)
            raise AllreduceException(
                f"{who} refused a part of {sender}'s update: the round is void for every member"
            )
        if self._absent is not None:
            raise AllreduceException(
                f"{self._absent} answered that it is not in this group (it never joined it, or its step had "
                "ended): the round is void for every member"
            )
        if self._lost is not None:
            sender, reducer = self._lost
            who = "this site" if reducer == self.peer_id else str(reducer)
            raise AllreduceException(
                f"{who} lost {sender}'s update midway (its parts stopped): the round is void for every member"
            )
        failed = self.tensor_part_container.failed_size
        if failed:
            total = self.tensor_part_container.total_size
            raise AllreduceException(f"{failed} of {total} values were not averaged (a reducer failed)")
        for tensor in outputs:
            yield tensor

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> None:
        """hivemind's finalize, after which a failed runner's error counts as read. hivemind keeps it in
        the runner's future, which only the runner's own request checks look at (done or cancelled, not
        what it holds): nobody reads it, and asyncio would print it, with a traceback, into the site's
        log as "Future exception was never retrieved" (docs/testing.md row 62). The round's failure is
        reported where it ends, by the averager."""
        super().finalize(cancel=cancel, exception=exception)
        if self._future.done() and not self._future.cancelled():
            self._future.exception()

    async def _communicate_with_peer(self, peer_id) -> None:
        if peer_id != self.peer_id:
            return await self._exchange_with_reducer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, part in enumerate(self.parts_for_local_averaging):
            weight = (
                self._weights.get(self.peer_id, self.weight) if self._weights is not None else self.weight
            )
            refusal = screen_part(part, self._claims.get(self.peer_id))
            if refusal is not None:  # this site reduces the others' parts, but adds nothing of its own
                self._own_refusal = refusal
                self._on_refused(str(self.peer_id), f"(this site's own part) {refusal}")
                self._voided(self.peer_id)
                part, weight = torch.zeros_like(part), 0.0
            reducer = self.tensor_part_reducer
            averaged = await reducer.accumulate_part(sender_index, part_index, part, weight=weight)
            # keep what the other members will decode, not the unrounded average
            encoded = await self._encoded_average(part_index, averaged)
            same_as_peers = await loop.run_in_executor(None, deserialize_torch_tensor, encoded)
            self.tensor_part_container.register_processed_part(peer_index, part_index, same_as_peers)

    async def _exchange_with_reducer(self, peer_id) -> None:
        """Send this site's parts to ``peer_id`` and register exactly the parts it sends back.

        What the reducer sends is the encoded average, so it is registered as decoded. The sender
        stops reading after the parts it expects and closes the stream: that close is what tells the
        reducer its replies arrived (see :meth:`_linger`)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        loop = asyncio.get_event_loop()
        stream = None
        try:
            done_sending = asyncio.Event()
            parts = self._generate_input_for_peer(peer_index)
            if expected and self._faults.fires("drop-part"):  # as if the stream broke before any part
                log.warning("fault injected: drop-part (none of this site's parts reach %s)", peer_id)
                parts = _no_parts()
            inputs = attach_event_on_finished(parts, done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            received = 0
            async for message in aiter_with_timeout(stream, self.reducer_timeout):
                if message.code == averaging_pb2.PROTOCOL_VIOLATION and message.peer_id:  # a voided slice
                    sender = PeerID(message.peer_id)
                    self._void = self._void or (sender, peer_id)
                    self._on_refused(str(sender), f"{peer_id}'s reducer refused a part of its update")
                    raise AllreduceException(f"{peer_id} refused a part of {sender}'s update")
                if message.code == averaging_pb2.INTERNAL_ERROR and message.peer_id:  # a sender lost there
                    self._lost = self._lost or (PeerID(message.peer_id), peer_id)
                    raise AllreduceException(f"{peer_id} lost {PeerID(message.peer_id)}'s update midway")
                if message.code == averaging_pb2.BAD_GROUP_ID:  # not in this group: its parts never come
                    self._absent = self._absent or peer_id
                    if peer_id in self.sender_peer_ids:  # (this site's reducer must not wait for them)
                        await self._ban_sender(peer_id)
                    raise AllreduceException(f"{peer_id} is not in this group")
                if message.code != averaging_pb2.AVERAGED_PART:
                    code = averaging_pb2.MessageCode.Name(message.code)
                    raise AllreduceException(f"{peer_id} sent {code}")
                part = await loop.run_in_executor(None, deserialize_torch_tensor, message.tensor_part)
                self.tensor_part_container.register_processed_part(peer_index, received, part)
                received += 1
                if received == expected:  # stop here: the reducer holds the stream open until we close
                    break
            if received != expected:
                raise AllreduceException(f"{peer_id} sent {received} parts, but we expected {expected}")
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            if stream is not None:
                await stream.aclose()

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's reducer handler, then :meth:`_linger` once every part has been answered.

        The linger sits here, in the handler itself, because the sender's close cancels the handler:
        for a client-mode sender hivemind accumulates in a task of its own that the close never
        reaches, so a linger there would wait out its whole limit. (``typing.AsyncIterator``, not
        ``collections.abc``'s: hivemind reads these hints to register the handler as streaming.)"""
        replies, voided = 0, False
        async for message in super().rpc_aggregate_part(stream, context):
            yield message
            replies += message.code == averaging_pb2.AVERAGED_PART
            voided = voided or (message.code in VOID_CODES and bool(message.peer_id))
        if voided or (replies and replies == self.tensor_part_reducer.num_parts):
            await self._linger()  # (a void slice's message must reach the sender as surely as a part)

    async def _linger(self) -> None:
        """Hold a reducer's stream open after its last reply, until the sender closes it (which cancels
        this handler) or the limit passes: closing first can lose that reply on the wire."""
        await asyncio.sleep(self.reducer_timeout or LINGER_LIMIT_S)

    def _voided(self, sender: PeerID) -> None:
        """This reducer refused a part of ``sender``'s update: its slice is void (see the module)."""
        if self._void is None:
            self._void = (sender, self.peer_id)

    def _void_message(self) -> averaging_pb2.AveragingData:
        """What a sender gets in place of an averaged part of a void slice: the refused sender's id (a
        protocol violation), or the lost sender's (an internal error)."""
        code = averaging_pb2.PROTOCOL_VIOLATION if self._void is not None else averaging_pb2.INTERNAL_ERROR
        sender, _reducer = self._void or self._lost
        return averaging_pb2.AveragingData(code=code, peer_id=sender.to_bytes())

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            sender = self.sender_peer_ids[sender_index]
            async for message in stream:
                part = await loop.run_in_executor(None, deserialize_torch_tensor, message.tensor_part)
                refusal = screen_part(part, self._claims.get(sender))
                weight = message.weight
                if refusal is None and self._weights is not None:
                    refusal = weight_lie(message.weight, self._claimed.get(sender, 0.0))
                    weight = self._weights.get(sender, 0.0)
                if refusal is not None:  # never accumulated; and nobody gets this slice any more
                    self._on_refused(str(sender), refusal)
                    self._voided(sender)
                    yield self._void_message()
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:  # the sender was banned meanwhile: it no longer gets results
                    break
                if self._void is not None or self._lost is not None:  # another sender's part was refused,
                    yield self._void_message()  # or another sender was lost: the slice is void
                    break
                if part_index == 0:
                    self._faults.hit("allreduce")  # mid all-reduce: a groupmate's part is in this reducer
                encoded = await self._encoded_average(part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _ban_sender(self, peer_id: PeerID) -> None:
        """hivemind's ban of a sender whose stream broke or fell silent -- which, before all of its parts
        were in, voids this reducer's slice (see the module). Marked before the ban: the ban completes
        the part the other senders wait on, and each of them then gets the void message instead."""
        received = self.tensor_part_reducer.num_parts_received[self.sender_peer_ids.index(peer_id)]
        if received < self.tensor_part_reducer.num_parts and self._void is None and self._lost is None:
            self._lost = (peer_id, self.peer_id)
        await super()._ban_sender(peer_id)
        # hivemind's watch for senders that never start waits for all of them to start, however many
        # are banned, and the runner's end waits for that watch: a sender banned before it began (a
        # member that never joined the group) held every round that counted it for the whole timeout
        if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders:
            self.all_senders_started.set()


async def _no_parts() -> AsyncIterator[averaging_pb2.AveragingData]:
    """An empty stream of parts (the ``drop-part`` fault)."""
    return
    yield  # (an async generator that yields nothing)
