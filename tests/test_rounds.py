"""A site's round, in-process: the federation's typed results and how the node acts on each of them.

No swarm here: a fake averager returns the outcome a test names, a fake digest board publishes the
digests a test names, and the ranks are a flat vector. Each branch of a round (apply, resync, fail,
solo, catch-up) is driven directly and checked against the global state it must leave behind.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.outer import GENESIS, OuterOptimizer, next_lineage
from greenswarm.averaging.round_report import RoundOutcome
from greenswarm.faults import FaultPlan
from greenswarm.node.federation import Applied, Failed, Federation, Resync
from greenswarm.node.global_state import GlobalState
from greenswarm.node.round_handling import RoundHandler
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.state_sync import StateSync

pytestmark = pytest.mark.rounds

ME, B, C = "peer-me", "peer-b", "peer-c"
N = 8  # values in the toy model


class FakeAverager:
    """Returns the outcomes it was given, one per round, and keeps what each round was asked."""

    def __init__(self, *outcomes: RoundOutcome):
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []
        self.measured_mbit = None

    def average(self, delta: torch.Tensor, **kwargs: Any) -> RoundOutcome:
        self.calls.append({"delta": delta.clone(), **kwargs})
        return self.outcomes.pop(0)


@dataclass
class FakeBoard:
    """Publishes what ``votes(my_digest, members)`` says each member published."""

    votes: Callable[[str, list[str]], dict[str, str]] = lambda mine, members: dict.fromkeys(members, mine)
    heard_refused: dict[str, str] = field(default_factory=dict)
    published: list[bool] = field(default_factory=list)

    def exchange(self, round_index, lineage, members, digest, timeout_s, publish=True, refused=None):
        self.published.append(publish)
        return self.votes(digest, list(members))


class FakeRanks:
    """A site's ranks as one flat vector of "local parameters"."""

    def __init__(self, local: torch.Tensor):
        self.local = local.clone()
        self.loads: list[torch.Tensor] = []
        self.shifts: list[torch.Tensor] = []
        self.weights: dict | None = None  # the averaging weights the last load took (schedule-free)

    def gather(self) -> torch.Tensor:
        return self.local.clone()

    def load(self, flat: torch.Tensor, weights: dict | None = None) -> None:
        self.local = flat.clone()
        self.loads.append(flat.clone())
        self.weights = weights

    def shift(self, flat: torch.Tensor) -> None:
        self.local += flat
        self.shifts.append(flat.clone())


def outcome(averaged: torch.Tensor, members: list[str] = (ME, B), slot: int = 7, **kw: Any) -> RoundOutcome:
    members = list(members)
    return RoundOutcome(
        True,
        members=members,
        gathered={p: {"site": f"site-{p}"} for p in members},
        averaged=averaged.clone(),
        slot=slot,
        wire="int8",
        seconds=0.5,
        allreduce_s=0.2,
        **kw,
    )


def global_state(values: float = 1.0) -> GlobalState:
    """FedAvg (lr 1, no momentum), so a step moves the global model by exactly the averaged vector."""
    return GlobalState(OuterOptimizer.from_config(torch.full((N,), values), "fedavg", 1.0, 0.0, False), "me")


def federation(
    averager: FakeAverager, board: FakeBoard | None = None, faults: str = "", **cfg: Any
) -> Federation:
    config = AveragingConfig(agreement_timeout_s=0.5, **cfg)
    return Federation(averager, board or FakeBoard(), config, "me", ME, FaultPlan.parse(faults))


def handler(
    fed: Federation,
    state: GlobalState,
    ranks: FakeRanks,
    download: Any = None,
    stats: SiteStats | None = None,
) -> RoundHandler:
    sync = StateSync(state, ranks, download or (lambda peers: None), threading.Event(), 0.3, retry_s=0.05)
    return RoundHandler(state, ranks, fed, sync, stats or SiteStats(tokens_since_sync=100), ME)


# ---------------------------------------------------------------------------------------- Federation


def test_no_partner_fails_without_averaging() -> None:
    averager = FakeAverager()
    result = federation(averager).run(torch.ones(N), global_state(), slot=3, partners=0, tokens=10)
    assert isinstance(result, Failed) and result.stage == "averaging"
    assert "no other site" in result.reason and averager.calls == []


def test_failed_averaging_is_failed_before_agreement() -> None:
    board = FakeBoard()
    fed = federation(FakeAverager(RoundOutcome(False, reason="no group formed", seconds=2.0)), board)
    result = fed.run(torch.ones(N), global_state(), slot=3, partners=1, tokens=10)
    assert isinstance(result, Failed) and result.stage == "averaging"
    assert (result.reason, result.slot, result.agreement_s, result.round_s) == (
        "no group formed",
        3,
        None,
        2.0,
    )
    assert board.published == [] and fed.round_seconds == []


def test_agreeing_group_applies_in_the_groups_slot() -> None:
    averaged = torch.full((N,), 0.25)
    averager = FakeAverager(outcome(averaged, members=[ME, B, C], slot=9))
    fed = federation(averager)
    state = global_state()
    result = fed.run(torch.ones(N), state, slot=8, partners=2, tokens=64)
    assert isinstance(result, Applied)
    assert result.slot == 9 and result.members == [ME, B, C]
    assert torch.equal(result.averaged, averaged)
    assert result.agreement_s is not None and result.allreduce_s == 0.2
    call = averager.calls[0]
    assert (call["weight"], call["round_index"], call["lineage"], call["expected_size"]) == (
        64,
        8,
        GENESIS,
        3,
    )
    # (the claim: the weight; steps: the inner steps behind the update, fednova's tau)
    assert call["gather"] == {"site": "me", "outer_round": 0, "recent": 0.0, "steps": 0}
    assert fed.wire_rounds == {"int8": 1} and fed.round_seconds == [0.5]


def test_majority_with_another_digest_resyncs_to_its_step() -> None:
    def votes(mine: str, members: list[str]) -> dict[str, str]:
        return {ME: mine, B: "theirs", C: "theirs"}

    state = global_state()
    fed = federation(FakeAverager(outcome(torch.zeros(N), members=[ME, B, C], slot=4)), FakeBoard(votes))
    result = fed.run(torch.ones(N), state, slot=4, partners=2, tokens=1)
    assert isinstance(result, Resync)
    assert result.holders == [B, C]
    assert result.lineage == next_lineage(GENESIS, 4, [ME, B, C])


def test_no_majority_fails_in_agreement() -> None:
    def votes(mine: str, members: list[str]) -> dict[str, str]:
        return {ME: mine, B: "other"}  # C never answered: it counts against every digest

    fed = federation(FakeAverager(outcome(torch.zeros(N), members=[ME, B, C])), FakeBoard(votes))
    result = fed.run(torch.ones(N), global_state(), slot=7, partners=2, tokens=1)
    assert isinstance(result, Failed) and result.stage == "agreement"
    assert "no digest has a majority" in result.reason and result.agreement_s is not None


def test_error_feedback_carries_the_residual_of_applied_rounds_only() -> None:
    residual = torch.arange(N, dtype=torch.float32)
    averager = FakeAverager(
        outcome(torch.zeros(N), residual=residual.clone()),
        RoundOutcome(False, reason="no group formed"),
        outcome(torch.zeros(N), residual=torch.zeros(N)),
    )
    fed = federation(averager)
    delta = torch.ones(N)
    for _ in range(3):
        fed.run(delta, global_state(), slot=1, partners=1, tokens=1)
    sent = [call["delta"] for call in averager.calls]
    assert torch.equal(sent[0], delta)  # nothing carried yet
    assert torch.equal(sent[1], delta + residual)  # carried from the applied round
    assert torch.equal(sent[2], delta + residual)  # a failed round changed nothing


def test_refusals_heard_from_groupmates_join_the_result() -> None:
    board = FakeBoard(heard_refused={C: "norm 1e6 is far outside the group's", ME: "ignored: about me"})
    fed = federation(FakeAverager(outcome(torch.zeros(N), refused={B: "NaN"})), board)
    result = fed.run(torch.ones(N), global_state(), slot=1, partners=2, tokens=1)
    assert result.refused == {B: "NaN", C: "norm 1e6 is far outside the group's"}


def test_corrupt_result_fault_is_exposed_by_the_digests() -> None:
    """The fault changes this site's result after the all-reduce; the honest majority's digest (of the
    real average) differs from it, so the site must resync instead of applying a wrong step."""
    averaged = torch.full((N,), 0.5)
    honest = global_state().agreement_digest(averaged)

    def votes(mine: str, members: list[str]) -> dict[str, str]:
        return {ME: mine, B: honest, C: honest}

    fed = federation(
        FakeAverager(outcome(averaged, members=[ME, B, C])), FakeBoard(votes), "corrupt-result@1"
    )
    assert isinstance(fed.run(torch.ones(N), global_state(), slot=1, partners=2, tokens=1), Resync)


def test_withhold_digest_fault_reads_without_publishing() -> None:
    board = FakeBoard()
    fed = federation(FakeAverager(outcome(torch.zeros(N))), board, "withhold-digest@1")
    fed.run(torch.ones(N), global_state(), slot=1, partners=1, tokens=1)
    assert board.published == [False]


# ---------------------------------------------------------------------------------------- the node's side


def test_solo_round_takes_the_sites_own_step() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.75)), SiteStats(tokens_since_sync=5)
    end = handler(federation(FakeAverager()), state, ranks, stats=stats).end(False, 6, lambda: 0)
    assert (end.action, end.slot, end.moved, end.took_part) == ("solo", 6, True, False)
    assert torch.equal(state.params, torch.full((N,), 0.75))  # FedAvg alone: global = local
    assert (state.outer_round, state.round_index, state.lineage) == (1, 6, next_lineage(GENESIS, 6, [ME]))
    assert torch.equal(ranks.loads[-1], state.params)
    assert stats.counts["solo_rounds"] == 1 and stats.tokens_since_sync == 0
    assert stats.attempts == 0  # (no averaging attempt)


def test_applied_round_moves_the_global_model_by_the_average() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=5)
    averaged = torch.full((N,), 0.25)  # the group's mean pseudo-gradient, not this site's 0.5
    fed = federation(FakeAverager(outcome(averaged, members=[ME, B], slot=11)))
    end = handler(fed, state, ranks, stats=stats).end(True, 10, lambda: 1)
    assert (end.action, end.slot, end.took_part) == ("apply", 11, True)
    assert torch.equal(state.params, torch.full((N,), 0.75))
    assert state.lineage == next_lineage(GENESIS, 11, [ME, B]) and state.round_index == 11
    assert stats.counts["federated_rounds"] == 1 and stats.tokens_since_sync == 0
    # its attempt is counted with its outcome, not when its line is written after the checkpoint: a scrape
    # in between saw a federated round and no attempt (the metrics' greenswarm_round_seconds)
    assert (stats.attempts, stats.attempt_s) == (1, 0.5)
    entry = end.entry(state, "me", blocked_s=1.0)
    assert entry.members == ["site-peer-b", "site-peer-me"] and entry.action == "apply"


def test_failed_round_keeps_local_progress() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=5)
    fed = federation(FakeAverager(RoundOutcome(False, reason="no group formed")))
    end = handler(fed, state, ranks, stats=stats).end(True, 10, lambda: 1)
    assert (end.action, end.reason, end.moved) == ("fail", "no group formed", False)
    assert torch.equal(state.params, torch.ones(N)) and state.outer_round == 0
    assert ranks.loads == [] and torch.equal(ranks.local, torch.full((N,), 0.5))
    assert stats.counts["failed_rounds"] == 1 and stats.tokens_since_sync == 5
    assert stats.attempts == 1  # a failed attempt is an attempt
    assert end.entry(state, "me", blocked_s=1.0).members == ["me"]


def _majority_elsewhere(mine: str, members: list[str]) -> dict[str, str]:
    return {ME: mine, B: "theirs", C: "theirs"}


def test_resync_takes_the_majoritys_state_and_drops_local_progress() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=5)
    expected = next_lineage(GENESIS, 7, [ME, B, C])
    theirs = torch.full((N,), 0.6)
    served = {"site": "b", "outer_round": 1, "lineage": expected, "round_index": 7}
    downloads: list[list[str]] = []

    def download(peers: list[str]) -> tuple[dict, list[torch.Tensor]]:
        downloads.append(list(peers))
        return served, [theirs.clone(), torch.zeros(N)]

    residual = torch.full((N,), 0.01)
    fed = federation(FakeAverager(outcome(torch.zeros(N), members=[ME, B, C], residual=residual)))
    fed.digests = FakeBoard(_majority_elsewhere)
    end = handler(fed, state, ranks, download, stats).end(True, 7, lambda: 2)
    assert (end.action, end.moved, end.took_part) == ("resync", True, True)
    assert downloads == [[B, C]]
    assert torch.equal(state.params, theirs) and state.lineage == expected
    assert torch.equal(ranks.local, theirs)  # this site's pending progress is already in their step
    assert stats.counts["resyncs"] == 1 and stats.tokens_since_sync == 0
    assert torch.equal(fed.feedback, residual)


def test_resync_that_gets_no_state_fails_and_keeps_progress() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=5)
    stale = {"site": "b", "outer_round": 0, "lineage": GENESIS, "round_index": -1}  # not yet stepped
    fed = federation(FakeAverager(outcome(torch.zeros(N), members=[ME, B, C])))
    fed.digests = FakeBoard(_majority_elsewhere)
    end = handler(fed, state, ranks, lambda peers: (stale, [torch.zeros(N), torch.zeros(N)]), stats).end(
        True, 7, lambda: 2
    )
    assert (end.action, end.reason, end.moved) == ("fail", "could not get the majority's state", False)
    assert torch.equal(state.params, torch.ones(N)) and ranks.loads == []
    assert stats.counts["failed_rounds"] == 1 and stats.tokens_since_sync == 5


# ---------------------------------------------------------------------------------------- state sync


@dataclass
class Head:
    site: str
    outer_round: int
    lineage: str
    peer_id: str = B


class FakeView:
    def __init__(self, head: Head | None, holders: tuple[str, ...] = (B,)):
        self._head, self.holders = head, list(holders)

    def head(self, in_window_only: bool = False) -> Head | None:
        return self._head

    def holders_of(self, outer_round: int, lineage: str) -> list[str]:
        return self.holders


def test_catch_up_keeps_local_progress_on_top_of_the_adopted_state() -> None:
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.75))  # pending progress: -0.25
    served = {"site": "b", "outer_round": 3, "lineage": "abc", "round_index": 9}
    sync = StateSync(
        state, ranks, lambda peers: (served, [torch.full((N,), 2.0), torch.zeros(N)]), threading.Event(), 1
    )
    assert sync.catch_up(FakeView(Head("b", 3, "abc")), in_window_only=False)
    assert (state.outer_round, state.lineage, state.round_index) == (3, "abc", 9)
    assert torch.equal(ranks.local, torch.full((N,), 1.75))


def test_catch_up_ignores_a_head_that_is_not_ahead() -> None:
    state, ranks = global_state(1.0), FakeRanks(torch.ones(N))
    sync = StateSync(state, ranks, lambda peers: pytest.fail("downloaded"), threading.Event(), 1)
    assert not sync.catch_up(FakeView(Head("b", 0, GENESIS)), in_window_only=True)
    assert not sync.catch_up(FakeView(None), in_window_only=True)


def test_between_rounds_a_state_that_ranks_above_is_taken_once_and_retried_later() -> None:
    """Two groups formed at one boundary step on two lineages; the faster group's catch-up at the next
    boundary comes before the slower one has published, so between rounds a site looks again: once
    per state it sees, and again after HEAL_RETRY_S while it is still behind (a download that failed:
    a peer's daemon refuses for a while to dial an address that just failed)."""
    from greenswarm.node.state_sync import HEAL_RETRY_S

    state, ranks = global_state(1.0), FakeRanks(torch.ones(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 1)
    assert not sync.heal_due(FakeView(None), now=100.0)
    assert not sync.heal_due(FakeView(Head("b", 0, GENESIS)), now=100.0)  # its own state: nothing to take
    other = FakeView(Head("b", 0, "~" + GENESIS))  # the same outer step, a lineage that ranks above
    assert sync.heal_due(other, now=100.0)
    assert not sync.heal_due(other, now=100.0)  # tried: not again until the head moves...
    assert not sync.heal_due(other, now=100.0 + HEAL_RETRY_S - 0.1)
    t = 100.0 + HEAL_RETRY_S + 0.1
    assert sync.heal_due(other, now=t)  # ...or a while has passed, twice as long each time
    assert not sync.heal_due(other, now=t + 2 * HEAL_RETRY_S - 0.1)
    assert sync.heal_due(other, now=t + 2 * HEAL_RETRY_S + 0.1)
    assert sync.heal_due(FakeView(Head("b", 1, GENESIS)), now=t + 2 * HEAL_RETRY_S + 0.2)


def test_a_new_holder_of_the_state_is_tried_at_once() -> None:
    """A released site's presence comes up seconds after its trainer ended, whose last record (its
    address gone) lives out its ttl beside the presence's: a site whose catch-up failed on that record
    alone must not wait out the backoff once the presence serves the same state (it trained on alone
    and stepped past it: docs/testing.md row 79); a holder that leaves is no new chance."""
    state, ranks = global_state(1.0), FakeRanks(torch.ones(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 1)
    ended = FakeView(Head("a", 5, "x", peer_id="ended"), holders=("ended",))
    assert sync.heal_due(ended, now=100.0)  # (its download failed)
    assert not sync.heal_due(ended, now=101.0)
    ended.holders = ["presence", "ended"]
    assert sync.heal_due(ended, now=101.5)  # a new holder: at once
    assert not sync.heal_due(ended, now=102.0)
    ended.holders = ["presence"]  # the ended trainer's record expired: nothing new to try
    assert not sync.heal_due(ended, now=102.5)


def test_the_freshest_holder_is_tried_first() -> None:
    """A download tries the holders in turn: the one whose record was written last comes first (an
    ended trainer's last record is older than its presence's, refreshed every few seconds)."""
    from types import SimpleNamespace

    from greenswarm.node.progress import ProgressRecord
    from greenswarm.node.swarm_view import SwarmView

    def record(peer: str, outer_round: int, lineage: str, wall_time: float) -> SimpleNamespace:
        fields = dict(
            site="a", region="A", state="RELEASED", peer_id=peer, outer_round=outer_round, lineage=lineage,
            round_index=0, local_steps=0, tokens=0, loss=None, window_end=None, energy_kwh=0.0,
            emissions_g=0.0, clock_time=0.0, wall_time=wall_time,
        )  # fmt: skip
        return SimpleNamespace(value=ProgressRecord(**fields).to_wire())

    # (records come back sorted by site, then peer id: "ended" before "presence")
    stored = [record("ended", 5, "x", 10.0), record("presence", 5, "x", 30.0), record("other", 4, "y", 40.0)]
    dht = SimpleNamespace(get=lambda key, latest=False: SimpleNamespace(value=dict(enumerate(stored))))
    view = SwarmView(dht, "s", ME, poll_s=3600.0)
    try:
        view.poll_now()
        assert view.holders_of(5, "x") == ["presence", "ended"]
    finally:
        view.close()


def test_a_view_read_at_every_decision_reads_at_most_once_per_age() -> None:
    """A shared deadline plan reads the others' records before each decision (row 95); under a fast
    replay those come milliseconds apart, and a read is a DHT round trip: ``poll_if_older`` skips a
    read while the records held are younger than asked, and reads once they are older."""
    from types import SimpleNamespace

    from greenswarm.node.swarm_view import SwarmView

    reads: list[str] = []
    dht = SimpleNamespace(get=lambda key, latest=False: reads.append(key) or None)
    view = SwarmView(dht, "s", ME, poll_s=3600.0)  # the background's own read, at its start
    try:
        deadline = time.monotonic() + 5.0
        while not math.isfinite(view.read_at) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(reads) == 1
        for _ in range(20):
            view.poll_if_older(3600.0)
        assert len(reads) == 1
        view.poll_if_older(0.0)
        assert len(reads) == 2
    finally:
        view.close()


def test_adopt_refuses_a_state_of_the_wrong_shape(caplog: pytest.LogCaptureFixture) -> None:
    state, ranks = global_state(1.0), FakeRanks(torch.ones(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 1)
    meta = {"site": "b", "outer_round": 3, "lineage": "abc", "round_index": 9}
    with caplog.at_level(logging.WARNING):
        assert not sync.adopt(meta, [torch.zeros(N + 1), torch.zeros(N + 1)], keep_pending=True)
    assert state.outer_round == 0 and "wrong shape" in caplog.text


def test_served_state_is_a_copy_with_its_position() -> None:
    state = global_state(1.0)
    meta, tensors = state.served()
    assert meta == {"site": "me", "outer_round": 0, "lineage": GENESIS, "round_index": -1, "ancestors": []}
    tensors[0].fill_(9.0)
    assert torch.equal(state.params, torch.ones(N))


# ---------------------------------------------------------------------------------------- a retried attempt


def test_a_failed_attempt_leaves_the_update_and_a_retry_codes_it_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hivemind may run the all-reduce hook again in one step. The update buffer must still hold the
    update then: if the failed attempt had left the coded vector there, the retry would code it again
    and carry a residual of coded - coded = 0 into the next round (error feedback silently lost).

    The averager's hook runs here in-process, with hivemind's runner replaced by one that fails its
    first attempt and averages in its second (the group: this site and one other, int8 on the wire)."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer

    import greenswarm.averaging.averager as averager_module
    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.codecs import wire_format
    from greenswarm.averaging.round_report import RoundReport
    from greenswarm.averaging.wire import wire_offer

    attempts: list[torch.Tensor] = []

    class Runner:  # hivemind's AllReduceRunner, as far as the hook uses it
        def __init__(self, tensors: list[torch.Tensor], **kwargs: Any):
            self.tensors, self.modes = tensors, kwargs["modes"]
            attempts.append(tensors[0].clone())  # what this attempt sends

        async def _average(self):
            if len(attempts) == 1:
                raise RuntimeError("a reducer failed")
            yield torch.full_like(self.tensors[0], 0.5)

        def __aiter__(self):
            return self._average()

    monkeypatch.setattr(averager_module, "ExactAllReduceRunner", Runner)
    me, other = PeerID(b"\x00\x24\x08\x01" + bytes(32)), PeerID(b"\x00\x24\x08\x01" + bytes([1] * 32))
    avg = object.__new__(SwarmAverager)  # the hook's state only: no process, no DHT
    avg._parent_pid = -1  # (hivemind's __del__ stops a process it started: there is none)
    avg._cfg, avg._admission, avg._faults = AveragingConfig(wire="int8"), None, FaultPlan()
    avg._rates = {}  # (no certificate bounds a weight here)
    avg._residual, avg._reports, avg.prefix, avg._p2p = torch.zeros(N * 64), {}, "test", None
    avg.dht, avg._state_updated = SimpleNamespace(peer_id=me), threading.Event()
    offer = wire_offer("int8", None, 10.0)
    gathered = [
        MSGPackSerializer.dumps((1.0, 0, MSGPackSerializer.dumps({"wire_offer": offer, "norm": 1.0})))
        for _ in (me, other)
    ]
    group = SimpleNamespace(group_id=b"group", peer_ids=[me, other], gathered=gathered)
    update = torch.randn(N * 64, generator=torch.Generator().manual_seed(3))
    flat = update.clone()
    coded = wire_format("int8").roundtrip(update)
    assert not torch.equal(coded, update)  # int8 leaves a residual to carry

    async def attempt() -> None:
        avg._reports[group.group_id] = RoundReport()
        avg._running_groups = {group.group_id: asyncio.get_running_loop().create_future()}
        await avg._run_allreduce_inplace_([flat], group, peer_fractions=(0.5, 0.5))

    with pytest.raises(RuntimeError, match="a reducer failed"):
        asyncio.run(attempt())
    assert torch.equal(flat, update)  # the failed attempt left the update as it was
    asyncio.run(attempt())
    assert torch.equal(attempts[1], coded)  # the retry sent the update's code, not the code's code
    assert torch.equal(avg._residual, update - coded)  # and carries the update's residual
    assert torch.equal(flat, torch.full_like(flat, 0.5))  # then the buffer holds the group's average


# ---------------------------------------------------------------------------------------- split decisions


def _no_majority_seen(mine: str, members: list[str]) -> dict[str, str]:
    return {ME: mine}  # this site's agreement timed out before the others' digests reached it


def _split_round(stats: SiteStats) -> tuple[GlobalState, FakeRanks, RoundHandler, torch.Tensor, str]:
    """A three-site round that everyone averaged, B and C applied, and this site saw no majority of:
    it keeps its local progress. Returns what the others hold afterwards (their state's parameters
    and lineage) with this site's parts."""
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.5))  # this site's update: 0.5
    averaged = torch.full((N,), 0.3)  # the group's mean update, this site's 0.5 in it
    fed = federation(
        FakeAverager(outcome(averaged, members=[ME, B, C], slot=7)), FakeBoard(_no_majority_seen)
    )
    theirs = torch.full((N,), 0.7)  # what B and C hold after applying it (FedAvg: 1.0 - 0.3)
    handler_ = handler(fed, state, ranks, stats=stats)
    return state, ranks, handler_, theirs, next_lineage(GENESIS, 7, [ME, B, C])


def _served_after(lineage: str, params: torch.Tensor) -> Any:
    """A download that serves the others' state one step past the round of ``lineage``."""
    later = next_lineage(lineage, 8, [B, C])
    meta = {
        "site": "b",
        "outer_round": 2,
        "lineage": later,
        "round_index": 8,
        "ancestors": [GENESIS, lineage],
    }
    return (lambda peers: (meta, [params.clone(), torch.zeros(N)])), Head("b", 2, later)


def test_a_site_that_missed_the_majority_keeps_its_update_out_of_the_step_it_later_adopts() -> None:
    """Its pseudo-gradient is already in the others' step: adopting that step (or one after it) with
    its whole local progress on top would count it twice. Only the progress made since the round is
    kept."""
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, theirs, lineage = _split_round(stats)
    end = handler_.end(True, 7, lambda: 2)
    assert (end.action, end.moved) == ("fail", False) and end.result.stage == "agreement"
    assert torch.equal(ranks.local, torch.full((N,), 0.5))  # local progress kept, for now
    ranks.local -= 0.1  # it trains on: progress since the round
    # B and C took another step after that one (without this site): the state it catches up to
    # descends from the round's step
    sync = handler_.sync
    sync.download, head = _served_after(lineage, theirs - 0.2)
    assert sync.catch_up(FakeView(head), in_window_only=True)
    # the adopted parameters, minus only the 0.1 trained since the round (not 0.5 + 0.1)
    torch.testing.assert_close(ranks.local, theirs - 0.2 - 0.1)


def test_a_state_that_does_not_contain_the_round_gets_the_whole_local_progress() -> None:
    """The others failed that round too and averaged a later one without this site: nothing of its
    update is in their state, so all of its local progress is kept."""
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, theirs, lineage = _split_round(stats)
    handler_.end(True, 7, lambda: 2)
    other = next_lineage(GENESIS, 8, [B, C])
    served = {"site": "b", "outer_round": 1, "lineage": other, "round_index": 8, "ancestors": [GENESIS]}
    handler_.sync.download = lambda peers: (served, [torch.full((N,), 0.9), torch.zeros(N)])
    assert handler_.sync.catch_up(FakeView(Head("b", 1, other)), in_window_only=True)
    torch.testing.assert_close(ranks.local, torch.full((N,), 0.9) - 0.5)  # all 0.5 of its progress


def test_served_state_names_its_ancestors() -> None:
    state = global_state(1.0)
    state.apply(torch.zeros(N), 3, [ME, B])
    first = state.lineage
    state.apply(torch.zeros(N), 4, [ME, B])
    meta, _ = state.served()
    assert meta["ancestors"] == [GENESIS, first] and state.descends_from(first)


def _failed_after_sending(residual: torch.Tensor | None = None) -> RoundOutcome:
    """This site's all-reduce failed after the group formed (and, likely, after it sent its parts)."""
    members = [ME, B, C]
    return RoundOutcome(
        False,
        reason="the all-reduce timed out after 30 s",
        members=members,
        gathered={p: {"site": f"site-{p}"} for p in members},
        slot=7,
        residual=residual,
    )


def test_a_site_whose_all_reduce_failed_after_sending_is_settled_when_it_adopts_the_step() -> None:
    """Not only a failed agreement: a site whose own all-reduce failed once its group formed may also
    have its update in a step the others applied. When it adopts a state holding that step, its
    update, its tokens and the feedback it sent are the swarm's: only what came after is its own, and
    the round's coding residual is the feedback it carries on."""
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.5))
    stats = SiteStats(tokens_since_sync=40)
    residual = torch.full((N,), 0.01)
    fed = federation(FakeAverager(_failed_after_sending(residual)))
    fed.feedback = torch.full((N,), 0.02)  # carried into (and sent with) the failed round
    handler_ = handler(fed, state, ranks, stats=stats)
    end = handler_.end(True, 7, lambda: 2)
    assert (end.action, end.result.stage, end.slot) == ("fail", "averaging", 7)
    assert handler_.sync.pending_round is not None and handler_.sync.pending_round.tokens == 40
    ranks.local -= 0.1  # it trains on: 10 more tokens
    stats.tokens_since_sync += 10
    lineage = next_lineage(GENESIS, 7, [ME, B, C])
    handler_.sync.download, head = _served_after(lineage, torch.full((N,), 0.6))
    assert handler_.sync.catch_up(FakeView(head), in_window_only=True)
    torch.testing.assert_close(ranks.local, torch.full((N,), 0.5))  # 0.6 - only the 0.1 since
    assert stats.tokens_since_sync == 10  # the round's 40 tokens are in the swarm's step
    assert torch.equal(fed.feedback, residual)  # not the 0.02 it already sent
    assert handler_.sync.pending_round is None


def test_a_round_that_failed_before_a_group_formed_is_not_remembered() -> None:
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.5))
    handler_ = handler(federation(FakeAverager(RoundOutcome(False, reason="no group formed"))), state, ranks)
    handler_.end(True, 7, lambda: 2)
    assert handler_.sync.pending_round is None and not handler_.catch_up_due(False)


def test_a_site_that_remembers_a_round_catches_up_before_a_solo_step() -> None:
    """Alone in a window after a split round, the site must not step on its own old state: that step
    would fork the swarm's lineage and carry its update in the round a second time. It catches up
    first, and its SOLO step then descends from the others' step."""
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, theirs, lineage = _split_round(stats)
    handler_.end(True, 7, lambda: 2)
    assert handler_.catch_up_due(federated=False)  # the rule the node follows before every round
    ranks.local -= 0.1
    handler_.sync.download, head = _served_after(lineage, theirs - 0.2)
    assert handler_.sync.catch_up(FakeView(head), in_window_only=False)
    end = handler_.end(False, 9, lambda: 0)
    assert end.action == "solo" and not handler_.catch_up_due(federated=False)
    assert state.descends_from(lineage) and state.outer_round == 3
    torch.testing.assert_close(state.params, theirs - 0.2 - 0.1)  # FedAvg alone: global = local


def test_a_refusal_of_this_sites_own_update_is_not_counted_as_a_groupmates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = {ME: "part 3 far outside the claimed norm", C: "NaN"}
    failed = RoundOutcome(False, reason="this site's update was refused", refused=refused, members=[B])
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=5)
    with caplog.at_level(logging.WARNING):
        handler_ = handler(federation(FakeAverager(failed)), state, ranks, stats=stats)
        end = handler_.end(True, 7, lambda: 2)
    assert end.result.refused == {C: "NaN"} and stats.counts["refused_updates"] == 1
    # its update is in no step the others may take: there is nothing to remember
    assert handler_.sync.pending_round is None
    assert "refused the update of peer-me" not in caplog.text
    assert "this site's update was refused: part 3" in caplog.text
    assert end.entry(state, "me", blocked_s=1.0).refused == {"peer-c": "NaN"}


class _Ledger:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"kwh": 1.5}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


class _SavingRanks(FakeRanks):
    def save(self, own: bool = False) -> dict[str, Any]:
        return {"local": self.local.clone()}

    def restore(self, payload: dict[str, Any]) -> None:
        self.local = payload["local"].clone()


def test_a_restarted_site_remembers_the_round_and_the_ancestors(tmp_path) -> None:
    """A restart between a split round and the catch-up must not forget either half of the rule: the
    remembered round (from the checkpoint) and the ancestors the state names (what a later site
    downloading it checks against)."""
    from greenswarm.node.config import load_site_config
    from greenswarm.node.site_checkpoints import SiteCheckpoints

    cfg = load_site_config(None, ["name=me", "region=CAISO_NORTH", f"node.run_dir={tmp_path}"])
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, theirs, lineage = _split_round(stats)
    state.apply(torch.zeros(N), 3, [ME, B])  # a step before: an ancestor to keep
    first = state.lineage
    ranks = _SavingRanks(ranks.local)
    handler_.sync.ranks = handler_.ranks = ranks
    handler_.end(True, 7, lambda: 2)
    held = handler_.sync.pending_round
    SiteCheckpoints(cfg, FaultPlan(), ranks, state, handler_.sync, stats, _Ledger()).save()

    state2, ranks2, stats2 = global_state(0.0), _SavingRanks(torch.zeros(N)), SiteStats()
    sync2 = StateSync(state2, ranks2, lambda peers: None, threading.Event(), 0.3)
    assert SiteCheckpoints(cfg, FaultPlan(), ranks2, state2, sync2, stats2, _Ledger()).resume()
    assert state2.ancestors == state.ancestors and state2.descends_from(GENESIS) and state2.lineage == first
    pending = sync2.pending_round
    assert (pending.slot, pending.lineage, pending.tokens) == (held.slot, held.lineage, held.tokens)
    assert torch.equal(pending.delta, held.delta) and stats2.tokens_since_sync == 5


def test_joining_that_fails_halfway_stops_what_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part that fails to start (here the swarm view) must not leave the DHT and its daemon, or the
    averager process, running behind the error."""
    import greenswarm.node.joining as joining
    from greenswarm.node.config import load_site_config

    stopped: list[str] = []

    class Part:
        def __init__(self, name: str):
            self.name = name
            self.peer_id = type("P", (), {"to_base58": lambda self: "peer-x"})()

        def shutdown(self) -> None:
            stopped.append(self.name)

    def no_view(*args: Any, **kwargs: Any) -> None:
        raise OSError("the view could not start")

    monkeypatch.setattr(joining, "resolve_reachability", lambda swarm: ("direct", "test"))
    monkeypatch.setattr(joining, "start_dht", lambda *a, **k: Part("dht"))
    monkeypatch.setattr(joining, "SwarmAverager", lambda *a, **k: Part("averager"))
    monkeypatch.setattr(joining, "SwarmView", no_view)
    cfg = load_site_config(None, ["name=me", "region=CAISO_NORTH"])
    with pytest.raises(OSError, match="the view could not start"):
        joining.join_swarm(cfg, N, lambda: ({}, []), FaultPlan(), logging.getLogger("test"))
    assert stopped == ["averager", "dht"]


def test_an_all_reduce_that_runs_out_of_time_says_so() -> None:
    """The round log's reason for a timed-out all-reduce names the timeout (not a bare 'TimeoutError')."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.averaging import DecentralizedAverager

    from greenswarm.averaging import averager as averager_module
    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.round_report import RoundFailed

    async def forever(self: Any, group_info: Any, min_vector_size: int, **kwargs: Any) -> None:
        await asyncio.sleep(60)

    avg = object.__new__(SwarmAverager)
    avg._parent_pid = -1
    avg._cfg, avg._reports = AveragingConfig(allreduce_timeout_s=0.05), {}
    original = DecentralizedAverager._aggregate_with_group
    DecentralizedAverager._aggregate_with_group = forever
    try:
        with pytest.raises(RoundFailed, match="the all-reduce timed out after 0.05 s"):
            asyncio.run(avg._aggregate_with_group(SimpleNamespace(group_id=b"g"), 0))
    finally:
        DecentralizedAverager._aggregate_with_group = original
    assert averager_module._describe(TimeoutError()) == "timed out"


def test_of_two_remembered_rounds_the_one_in_the_adopted_state_is_settled() -> None:
    """Two rounds in a row that this site did not apply (the second with a group that formed on its
    old state): a state holding the first must not get the first's update a second time because the
    second was remembered after it."""
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, theirs, lineage = _split_round(stats)
    handler_.end(True, 7, lambda: 2)  # round 7: the others applied it; this site did not
    ranks.local -= 0.1
    second = _failed_after_sending()
    second.slot = 8
    handler_.federation.averager.outcomes.append(second)
    handler_.end(True, 8, lambda: 2)  # round 8, on its old state: failed after sending, too
    assert [r.slot for r in handler_.sync.pending_rounds] == [7, 8]
    ranks.local -= 0.1
    handler_.sync.download, head = _served_after(lineage, theirs - 0.2)
    assert handler_.sync.catch_up(FakeView(head), in_window_only=True)
    # only round 7's 0.5 was in their step: the 0.2 trained since stays on top of it
    torch.testing.assert_close(ranks.local, theirs - 0.2 - 0.2)
    assert handler_.sync.pending_rounds == []


@pytest.mark.schedulefree
def test_a_site_restarted_with_another_inner_optimizer_refuses_its_checkpoint_in_one_line(tmp_path) -> None:
    """A checkpoint whose global state another optimizer wrote (AdamW's parameters against
    schedule-free x, the same size) is refused before any rank loads it, naming the settings."""
    from greenswarm.errors import GreenswarmError
    from greenswarm.node.config import load_site_config
    from greenswarm.node.site_checkpoints import SiteCheckpoints

    base = ["name=me", "region=CAISO_NORTH", f"node.run_dir={tmp_path}"]
    cfg = load_site_config(None, base)
    stats = SiteStats(tokens_since_sync=5)
    state, ranks, handler_, _, _ = _split_round(stats)
    ranks = _SavingRanks(ranks.local)
    SiteCheckpoints(cfg, FaultPlan(), ranks, state, handler_.sync, stats, _Ledger()).save()

    other = load_site_config(None, [*base, "train.optimizer=adamw-schedulefree", "train.sf_z=shift"])
    state2, ranks2 = global_state(0.0), _SavingRanks(torch.zeros(N))
    sync2 = StateSync(state2, ranks2, lambda peers: None, threading.Event(), 0.3)
    with pytest.raises(GreenswarmError, match=r"\(params\).*\(x/shift\).*train\.optimizer, train\.sf_z"):
        SiteCheckpoints(other, FaultPlan(), ranks2, state2, sync2, SiteStats(), _Ledger()).resume()
    assert ranks2.local.abs().sum() == 0  # nothing was loaded


@pytest.mark.schedulefree
def test_a_served_state_carries_its_averaging_weights_to_the_site_that_adopts_it() -> None:
    """Schedule-free: the state a site serves names how much history its x averages, and a site that
    adopts the state loads it with those weights (so its next step continues the average)."""
    server = global_state(1.0)
    server.averaging = lambda: {"weight_sum": 2.5e-5, "lr_max": 1e-3}
    meta, tensors = server.served()
    assert meta["averaging"] == {"weight_sum": 2.5e-5, "lr_max": 1e-3}
    state, ranks = global_state(0.0), FakeRanks(torch.zeros(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 0.3)
    assert sync.adopt(meta, tensors, keep_pending=False)
    assert ranks.weights == meta["averaging"] and torch.equal(ranks.local, tensors[0])
    server.averaging = lambda: None  # an AdamW site serves none
    assert "averaging" not in server.served()[0]
