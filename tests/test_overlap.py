"""Rounds that run beside training (``averaging.overlap``), in-process: the round's result arrives
while the site trains on, and the site must act on it exactly once, keeping the inner steps it took
meanwhile -- or, when the round fails, keep everything.

The fakes are test_rounds.py's; the averager here waits for the test to release it, so the test
takes "inner steps" (moves the local vector) while the round is in flight.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from greenswarm.averaging.outer import GENESIS, next_lineage
from greenswarm.averaging.round_report import RoundOutcome
from greenswarm.node.config import TrainConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig
from greenswarm.node.ranks import SiteRanks
from greenswarm.node.round_handling import (
    RoundHandler,
    boundary_round_done,
    overlapped_matchmaking_s,
    round_search_s,
)
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.trainer import InnerTrainer
from tests.test_rounds import (
    ME,
    B,
    C,
    FakeAverager,
    FakeBoard,
    FakeRanks,
    N,
    federation,
    global_state,
    handler,
    outcome,
)

pytestmark = pytest.mark.overlap


class HeldAverager(FakeAverager):
    """Holds each round until the test releases it: the site trains on meanwhile."""

    def __init__(self, *outcomes: RoundOutcome):
        super().__init__(*outcomes)
        self.release = threading.Event()
        self.entered = threading.Event()

    def average(self, delta: torch.Tensor, **kwargs: Any) -> RoundOutcome:
        self.entered.set()
        assert self.release.wait(10), "the test never released the round"
        return super().average(delta, **kwargs)


def _train_meanwhile(handler_: RoundHandler, ranks: FakeRanks, stats: SiteStats, steps: int = 2) -> None:
    """Inner steps taken while the round is in flight: each moves the local vector by -0.05."""
    for _ in range(steps):
        ranks.local -= 0.05
        stats.tokens_since_sync += 10
        handler_.step_taken()


def _wait_ready(handler_: RoundHandler) -> None:
    deadline = time.monotonic() + 10
    while not handler_.ready():
        assert time.monotonic() < deadline, "the round's result never arrived"
        time.sleep(0.01)


def test_a_result_that_arrives_while_training_is_applied_once_keeping_the_steps_meanwhile() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    averager = HeldAverager(outcome(torch.full((N,), 0.25), members=[ME, B], slot=7))
    handler_ = handler(federation(averager), state, ranks, stats=stats)
    handler_.begin(7, lambda: 1)
    assert averager.entered.wait(10) and not handler_.ready()
    _train_meanwhile(handler_, ranks, stats)  # the loop trains on: -0.1 since the snapshot
    assert state.outer_round == 0 and stats.tokens_since_sync == 20  # the round holds its 40 tokens
    averager.release.set()
    _wait_ready(handler_)
    # agreed: the global state moved at once, on the round's thread, so a groupmate that must resync
    # downloads the new state from this site; the loop's local model has not been touched yet
    meta, (served, _momentum) = state.served()
    assert meta["outer_round"] == 1 and torch.allclose(served, torch.full((N,), 0.75))
    assert not ranks.loads and not ranks.shifts and torch.allclose(ranks.local, torch.full((N,), 0.4))
    assert state._digest == state.outer.digest()  # hashed there too, not by the loop's next record
    end = handler_.finish()
    assert (end.action, end.slot, end.moved) == ("apply", 7, True)
    assert averager.calls[0]["weight"] == 40 and torch.equal(
        averager.calls[0]["delta"], torch.full((N,), 0.5)
    )
    assert state.outer_round == 1 and state.lineage == next_lineage(GENESIS, 7, [ME, B])
    torch.testing.assert_close(state.params, torch.full((N,), 0.75))  # FedAvg: 1.0 - the group's 0.25
    torch.testing.assert_close(ranks.local, torch.full((N,), 0.65))  # the new global, minus the 0.1 since
    assert stats.tokens_since_sync == 20 and stats.counts["federated_rounds"] == 1
    # exactly once: nothing is in flight any more, and a later round begins from the new global model
    assert handler_.in_flight is None and not handler_.ready()
    with pytest.raises(AssertionError, match="no round in flight"):
        handler_.finish()
    # one in-place rebase: the loop's parameters move by (new global - snapshot), no gather and no load
    assert (
        len(averager.calls) == 1 and not ranks.loads and len(ranks.shifts) == 1 and end.steps_meanwhile == 2
    )


def test_a_result_with_no_steps_meanwhile_loads_the_new_global_model_exactly() -> None:
    """No inner step since the snapshot: the local model is the new global one bit for bit (the rebase
    by addition would round differently)."""
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.3))
    averager = HeldAverager(outcome(torch.full((N,), 0.1), members=[ME, B], slot=7))
    handler_ = handler(federation(averager), state, ranks)
    handler_.begin(7, lambda: 1)
    averager.release.set()
    _wait_ready(handler_)
    assert handler_.finish().steps_meanwhile == 0
    assert not ranks.shifts and len(ranks.loads) == 1 and torch.equal(ranks.local, state.params)


def test_a_failed_background_round_leaves_the_sites_progress_intact() -> None:
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    averager = HeldAverager(RoundOutcome(False, reason="no group formed before the deadline"))
    handler_ = handler(federation(averager), state, ranks, stats=stats)
    handler_.begin(7, lambda: 1)
    _train_meanwhile(handler_, ranks, stats)
    averager.release.set()
    _wait_ready(handler_)
    end = handler_.finish()
    assert (end.action, end.moved) == ("fail", False)
    assert state.outer_round == 0 and torch.equal(state.params, torch.ones(N))
    assert ranks.loads == [] and torch.allclose(ranks.local, torch.full((N,), 0.4))  # every step kept
    assert stats.tokens_since_sync == 60  # the round's 40 tokens weigh in the next round again
    assert stats.counts["failed_rounds"] == 1 and handler_.sync.pending_round is None


def test_a_round_that_can_no_longer_finish_is_given_up_and_its_late_result_moves_nothing() -> None:
    """A stop that reached the p2p daemon too (Ctrl-C, SIGTERM to the group): the round in flight can
    no longer finish, and the node's stop gives it up (``give_up``) instead of running out its timeouts.
    It ends as a failed round: local progress and tokens kept, the global state as it was, even when
    the group's agreed step arrives on the round's thread afterwards (docs/testing.md row 70)."""
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    averager = HeldAverager(outcome(torch.full((N,), 0.25), members=[ME, B], slot=7))
    handler_ = handler(federation(averager), state, ranks, stats=stats)
    handler_.begin(7, lambda: 1)
    assert averager.entered.wait(10)
    _train_meanwhile(handler_, ranks, stats)
    asked: list[float] = []

    def give_up() -> str | None:  # the daemon "goes" at the second look
        asked.append(time.monotonic())
        return "its p2p daemon is gone" if len(asked) >= 2 else None

    flight = handler_.in_flight
    end = handler_.finish(give_up)
    assert (end.action, end.moved, end.reason) == ("fail", False, "its p2p daemon is gone")
    assert len(asked) == 2 and flight.abandoned
    assert state.outer_round == 0 and torch.equal(state.params, torch.ones(N))
    assert torch.allclose(ranks.local, torch.full((N,), 0.4)) and stats.tokens_since_sync == 60
    averager.release.set()  # the group agreed after all: this site's thread must not apply it now
    flight.future.result(timeout=10)
    assert state.outer_round == 0 and torch.equal(state.params, torch.ones(N)) and not flight.applied

    # without a reason to give up, the wait is the round's own, and its result counts
    averager.outcomes.append(outcome(torch.full((N,), 0.25), members=[ME, B], slot=8))
    handler_.begin(8, lambda: 1)
    assert handler_.finish(lambda: None).action == "apply" and state.outer_round == 1


class HeldBoard(FakeBoard):
    """Holds the digest exchange (the agreement, after a successful all-reduce) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.entered = threading.Event(), threading.Event()

    def exchange(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        self.entered.set()
        assert self.release.wait(10), "the test never released the agreement"
        return super().exchange(*args, **kwargs)


def test_a_round_given_up_after_its_all_reduce_is_remembered_as_possibly_applied() -> None:
    """Given up in the agreement: the all-reduce had succeeded, so the others may still apply a step
    that holds this site's update. The site remembers it (its pending round), so a later catch-up
    that finds it applied does not count this update and its tokens a second time."""
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    board = HeldBoard()
    fed = federation(FakeAverager(outcome(torch.full((N,), 0.25), members=[ME, B], slot=7)), board)
    handler_ = handler(fed, state, ranks, stats=stats)
    handler_.begin(7, lambda: 1)
    assert board.entered.wait(10)
    end = handler_.finish(lambda: "its p2p daemon is gone")
    assert (end.action, end.moved) == ("fail", False) and end.result.stage == "agreement"
    pending = handler_.sync.pending_round
    assert pending is not None and pending.slot == 7 and pending.tokens == 40
    assert state.outer_round == 0 and stats.tokens_since_sync == 40  # the tokens wait in the pending round
    board.release.set()


def test_a_round_applied_before_the_give_up_counts_as_applied() -> None:
    """The round's thread had applied the agreed step when the stop looked: it is an applied round."""
    state, ranks = global_state(1.0), FakeRanks(torch.full((N,), 0.5))
    handler_ = handler(
        federation(FakeAverager(outcome(torch.full((N,), 0.25), members=[ME, B]))), state, ranks
    )
    handler_.begin(7, lambda: 1)
    _wait_ready(handler_)
    end = handler_.finish(lambda: "its p2p daemon is gone")
    assert (end.action, end.moved) == ("apply", True) and state.outer_round == 1


def test_a_resync_after_a_background_round_keeps_the_steps_since_the_snapshot() -> None:
    """The majority's state holds this site's snapshot (in their step), not what it trained since."""
    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    expected = next_lineage(GENESIS, 7, [ME, B, C])
    theirs = torch.full((N,), 0.6)
    served = {"site": "b", "outer_round": 1, "lineage": expected, "round_index": 7}
    averager = HeldAverager(outcome(torch.zeros(N), members=[ME, B, C], slot=7))
    fed = federation(averager, FakeBoard(lambda mine, members: {ME: mine, B: "theirs", C: "theirs"}))
    download = lambda peers: (served, [theirs.clone(), torch.zeros(N)])  # noqa: E731
    handler_ = handler(fed, state, ranks, download, stats)
    handler_.begin(7, lambda: 2)
    _train_meanwhile(handler_, ranks, stats)
    averager.release.set()
    _wait_ready(handler_)
    end = handler_.finish()
    assert (end.action, end.moved) == ("resync", True)
    assert state.lineage == expected and torch.equal(state.params, theirs)
    torch.testing.assert_close(ranks.local, theirs - 0.1)
    assert stats.tokens_since_sync == 20 and stats.counts["resyncs"] == 1


def test_a_round_that_raises_in_the_background_fails_instead_of_hanging() -> None:
    """No silent failure and no stuck loop: an exception in the round thread is a failed round."""

    class Broken(FakeAverager):
        def average(self, delta: torch.Tensor, **kwargs: Any) -> RoundOutcome:
            raise RuntimeError("the averager process is gone")

    state, ranks, stats = global_state(1.0), FakeRanks(torch.full((N,), 0.5)), SiteStats(tokens_since_sync=40)
    handler_ = handler(federation(Broken()), state, ranks, stats=stats)
    handler_.begin(7, lambda: 1)
    _wait_ready(handler_)
    end = handler_.finish()
    assert end.action == "fail" and "the averager process is gone" in end.reason
    assert stats.tokens_since_sync == 40 and torch.equal(ranks.local, torch.full((N,), 0.5))


def test_a_rank_shift_adds_in_place_what_a_gather_and_load_would_set() -> None:
    """The rebase's one in-place add (``SiteRanks.shift``) leaves the model's parameters where gathering
    them, adding and loading the sum would, and moves nothing else."""
    data = DataConfig(seq_len=16, shard_index=0, num_shards=1)
    trainer = InnerTrainer(
        ModelConfig(), data, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World()
    )
    ranks = SiteRanks(World(), trainer)
    before = ranks.gather()
    shift = torch.linspace(-1.0, 1.0, before.numel())
    ranks.shift(shift)
    torch.testing.assert_close(ranks.gather(), before + shift, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------- a real swarm


# (Sites averaging in overlapped rounds hold the same global models bit for bit, and train while their
# rounds run: tests/test_fsdp.py, with sites of one, two and three ranks.)


@pytest.mark.swarm
@pytest.mark.faults
def test_kills_during_a_background_round_and_a_background_write_resume_exactly(
    swarm: Any, tmp_path: Any
) -> None:
    """Three real sites with overlapped rounds (and so checkpoints written beside training): one killed
    in the middle of an all-reduce that runs beside its training, one killed while its writer thread
    was between a checkpoint's two renames. Each restart resumes exactly what its checkpoint held,
    which verifies and holds no NaN, and averages again; no two sites ever hold different global
    models for the same outer step."""
    from tests.campaign import Fault, assert_survived, run_campaign

    faults = [Fault("site-2", "kill", "allreduce", 2), Fault("site-0", "kill", "checkpoint", 2)]
    assert_survived(run_campaign(swarm, tmp_path, faults, averaging={"overlap": True}), faults)


def test_an_overlapped_round_looks_for_its_group_at_least_one_inner_step_long() -> None:
    """Groupmates reach a boundary when their step in progress ends, up to a step apart: an overlapped
    round (which waits on its own thread) looks for its group at least that long, within a quarter of
    the sync interval; short steps leave the configured time as it is."""
    assert overlapped_matchmaking_s(5.0, [], 60.0) == 5.0  # no step yet
    assert overlapped_matchmaking_s(5.0, [0.01, 0.02], 60.0) == 5.0  # steps shorter than configured
    assert overlapped_matchmaking_s(5.0, [12.0, 19.5, 14.0], 120.0) == 19.5  # the longest recent step
    assert overlapped_matchmaking_s(5.0, [40.0], 60.0) == 15.0  # capped: it must fail before the next round
    assert overlapped_matchmaking_s(30.0, [40.0], 60.0) == 30.0  # never below what is configured
    # the round hands it to the averager (None: the configured time, as a blocking round uses)
    averager = HeldAverager(outcome(torch.full((N,), 0.1), members=[ME, B], slot=3))
    handler_ = handler(federation(averager), global_state(1.0), FakeRanks(torch.full((N,), 0.5)))
    handler_.begin(3, lambda: 1, matchmaking_s=19.5)
    averager.release.set()
    _wait_ready(handler_)
    handler_.finish()
    assert averager.calls[0]["matchmaking_s"] == 19.5


def test_a_round_that_finds_no_group_gives_up_in_time_to_catch_up_before_the_next_boundary() -> None:
    """A round's group stays open to latecomers for twice its matchmaking time, but closes one
    matchmaking time before the next boundary (never sooner than the matchmaking time itself): a site
    whose round found no group catches up between rounds and begins the next one when the others do.
    The lock-in it prevents (docs/testing.md row 48): a 5-s replayed slot, a 2-s matchmaking time, a
    site that began late after a void round searched 4 s, past the next boundary, so it began every
    next round after the others' group had formed, and failed them all."""
    assert round_search_s(5.0, 600.0) == 10.0  # a real slot: twice the matchmaking time
    assert round_search_s(2.0, 4.5) == 2.5  # a replayed slot: ends 2 s before the next boundary
    assert round_search_s(2.0, 3.1) == 2.0  # began late: never less than the matchmaking time
    assert round_search_s(2.0, 0.0) == 2.0
    # the round hands it to the averager, blocking or in the background
    for background in (True, False):
        averager = HeldAverager(outcome(torch.full((N,), 0.1), members=[ME, B], slot=3))
        handler_ = handler(federation(averager), global_state(1.0), FakeRanks(torch.full((N,), 0.5)))
        averager.release.set()
        handler_.begin(3, lambda: 1, background=background, matchmaking_s=2.0, search_s=2.6)
        _wait_ready(handler_)
        handler_.finish()
        assert (averager.calls[0]["matchmaking_s"], averager.calls[0]["search_s"]) == (2.0, 2.6)


class _BoundarySite:
    """What ``SiteNode._end_round`` reads of a site, at boundary 97 of an overlapped swarm whose round in
    flight finishes with its group's slot ``finished_slot`` (the site began it at boundary 96)."""

    def __init__(self, finished_slot: int):
        from types import SimpleNamespace

        from greenswarm.node.site import SiteNode

        self.site = site = object.__new__(SiteNode)
        self.begun: list[int] = []
        site.cfg = SimpleNamespace(averaging=SimpleNamespace(sync_interval_s=600.0, overlap=True))
        site.clock = SimpleNamespace(now=lambda: 97 * 600.0 + 1.0)
        site._slot = 96

        def finish(stopped: float | None = None) -> bool:  # as _after_round leaves it
            site._slot = max(site._slot, finished_slot)
            return True

        site._finish_round = finish
        site._matchmaking_s = lambda: 1.0
        site._search_s = lambda seconds: 2.0
        site.round_handler = SimpleNamespace(
            catch_up_due=lambda federated: False,
            begin=lambda slot, partners, matchmaking_s, search_s: self.begun.append(slot),
        )


def test_a_late_sites_round_that_formed_with_the_next_boundarys_group_is_that_boundarys_round() -> None:
    """A two-rank site reached boundary 96 late and began its round there; its group formed with a site
    that began at boundary 97 (the group's slot: 97). At boundary 97 it finishes that round and must not
    begin another for 97 (its groupmate trains on to 98: the round would fail, and the log would hold
    slot 97 twice, docs/testing.md row 63), nor, alone at 97, take a SOLO step for it. A round that was
    96's leaves 97's to begin."""
    from greenswarm.scheduler.state import SiteState

    for state in (SiteState.FEDERATED, SiteState.SOLO):  # (SOLO: the others left their windows meanwhile)
        late = _BoundarySite(finished_slot=97)
        late.site._end_round(state)
        assert late.begun == [] and late.site._slot == 97, state
    on_time = _BoundarySite(finished_slot=96)
    on_time.site._end_round(SiteState.FEDERATED)
    assert on_time.begun == [97] and on_time.site._slot == 97
    assert boundary_round_done(97, 97) and not boundary_round_done(97, 96)
    assert not boundary_round_done(97, None)
