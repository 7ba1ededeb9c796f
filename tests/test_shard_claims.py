"""Claimed shards in-process: the reader's exact positions, the records' rules, and the claims of several
sites against one shared (fake) DHT, with a clock the test moves.

The real swarm (p2pd daemons, a killed site, a restarted bootstrap) is ``tests/test_shards.py``; these
pin each rule down on its own, fast.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from greenswarm.errors import ConfigError
from greenswarm.node.data import DataConfig, TokenBatches, iter_documents
from greenswarm.node.shard_claims import ShardClaims, claimable_shards, documents_between
from greenswarm.node.shard_reader import ClaimedBatches, ShardsRunOut, apply_plan
from greenswarm.node.shard_records import Lease, ShardRecord, choose, dataset_id, merge
from greenswarm.node.tokenizer import load_tokenizer

pytestmark = pytest.mark.shards

SHARDS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with path.open("w") as f:
        for i in range(240):
            f.write(json.dumps({"text": f"document {i} " + "abc " * (i % 9)}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")  # an empty document keeps its place, yields nothing
    return path


def data(corpus: Path, **kw: Any) -> DataConfig:
    return DataConfig(source=str(corpus), seq_len=16, num_shards=SHARDS, sharding="claim", **kw)


TOKENIZER = load_tokenizer("bytes")


def stream(reader: ClaimedBatches, batches: int) -> torch.Tensor:
    return torch.cat([next(reader).flatten() for _ in range(batches)])


# ------------------------------------------------------------------ the reader


def test_a_shard_continued_by_another_reader_gives_the_same_tokens(corpus: Path) -> None:
    one = ClaimedBatches(data(corpus), TOKENIZER, 3)
    one.assign(2, (0, 0, 0))
    whole = stream(one, 12)
    first = ClaimedBatches(data(corpus), TOKENIZER, 3)
    first.assign(2, (0, 0, 0))
    part = stream(first, 5)
    # another site, another micro-batch: it continues from the position the first one reached
    second = ClaimedBatches(data(corpus), TOKENIZER, 2)
    second.assign(2, first.positions[2])
    rest = stream(second, 10)
    joined = torch.cat([part, rest])
    n = min(len(joined), len(whole))
    assert torch.equal(joined[:n], whole[:n])


def test_a_reader_moves_on_at_the_end_of_an_epoch_and_counts_its_documents(corpus: Path) -> None:
    reader = ClaimedBatches(data(corpus), TOKENIZER, 4)
    reader.assign(1, (0, 0, 0))
    reader.assign(3, (0, 0, 0))
    documents = sum(
        1 for _ in iter_documents(DataConfig(source=str(corpus), shard_index=1, num_shards=SHARDS))
    )
    for _ in range(500):
        next(reader)
        if reader.queue == [3]:
            break
    assert reader.queue == [3]
    assert reader.positions[1] == (1, 0, 0) and reader.sizes[1] == documents
    assert reader.status() == {"queue": [3], "positions": {3: reader.positions[3]}}


def test_with_no_next_shard_a_reader_reads_its_shards_next_epoch_then_leaves_it(corpus: Path) -> None:
    reader = ClaimedBatches(data(corpus), TOKENIZER, 4)
    reader.assign(4, (0, 0, 0))
    while reader.positions[4][0] == 0:
        next(reader)
    next(reader)
    assert reader.queue == [4] and reader.positions[4][0] == 1 and reader.positions[4] > (1, 0, 0)
    wrapped = reader.positions[4]
    reader.assign(5, (0, 0, 0))  # given a next shard, it leaves the wrapped one where it is
    assert reader.queue == [5] and reader.positions[4] == wrapped
    next(reader)
    assert reader.positions[5] > (0, 0, 0)


def test_a_reader_with_nothing_assigned_refuses_to_make_up_data(corpus: Path) -> None:
    reader = ClaimedBatches(data(corpus), TOKENIZER, 2)
    with pytest.raises(ShardsRunOut):
        next(reader)
    reader.assign(0, (0, 3, 5))
    reader.withdraw(0)
    with pytest.raises(ShardsRunOut):
        next(reader)
    assert reader.positions[0] == (0, 3, 5)


def test_reader_state_round_trips_and_refuses_other_data(corpus: Path, caplog: Any) -> None:
    reader = ClaimedBatches(data(corpus), TOKENIZER, 2)
    reader.assign(0, (0, 0, 0))
    reader.assign(2, (1, 4, 0))
    stream(reader, 6)
    state = reader.state_dict()
    again = ClaimedBatches(data(corpus), TOKENIZER, 2)
    again.load_state_dict(state)
    assert again.status() == reader.status()
    assert torch.equal(stream(again, 3), stream(reader, 3))
    other = ClaimedBatches(data(corpus, seed=7), TOKENIZER, 2)
    with pytest.raises(ConfigError, match="cannot be resumed"):
        other.load_state_dict(state)
    # a position of a fixed shard, or of claimed ones, read by the other kind of reader: said, not fatal
    fixed = TokenBatches(DataConfig(source=str(corpus), num_shards=SHARDS), TOKENIZER, 2)
    with caplog.at_level(logging.WARNING):
        fixed.load_state_dict(state)
        again.load_state_dict(fixed.state_dict())
    assert "claimed through the swarm" in caplog.text and "fixed shard" in caplog.text


# ------------------------------------------------------------------ the records' rules


def lease(shard: int, at: float, until: float = 1e9, token: str = "") -> Lease:
    return Lease(shard, at, until, token or f"t{shard}-{at}")


def record(site: str, leases: list[Lease] = (), positions: dict | None = None, **kw: Any) -> ShardRecord:
    return ShardRecord(site, f"peer-{site}", "ds", SHARDS, list(leases), positions or {}, **kw)


def test_the_earliest_live_claim_holds_a_shard_and_positions_only_move_forward() -> None:
    records = [
        record("a", [lease(1, 10.0), lease(2, 30.0, until=50.0)], {1: (0, 5, 0), 3: (1, 2, 0)}),
        record("b", [lease(1, 12.0), lease(2, 20.0, until=40.0)], {1: (0, 9, 3), 3: (0, 8, 0)}),
        record("x", [lease(4, 1.0)], {4: (9, 9, 9)}, sizes={}),
    ]
    records[2] = ShardRecord("x", "peer-x", "other", SHARDS, [lease(4, 1.0)], {4: (9, 9, 9)})
    view = merge(records, "ds", now=45.0)
    assert view.holders[1].site == "a"  # claimed first
    assert [h.site for h in view.claims[1]] == ["a", "b"]
    assert view.holders[2].site == "a"  # b's earlier claim ran out at 40
    assert view.positions == {1: (0, 9, 3), 3: (1, 2, 0)}  # another dataset's record counts for nothing
    assert 4 not in view.holders


def test_free_shards_are_taken_lowest_epoch_first_and_never_a_held_one() -> None:
    records = [record("a", [lease(0, 1.0)], {1: (1, 0, 0), 2: (0, 40, 0), 3: (2, 0, 0)}, sizes={2: 40})]
    view = merge(records, "ds", now=5.0)
    assert view.next_epoch(2) == 1  # read to its last document: its first epoch is done
    picks = choose(view, range(SHARDS), tokens=set(), taken=set(), n=5, salt="peer-b")
    assert 0 not in picks
    assert [view.next_epoch(k) for k in picks] == sorted(view.next_epoch(k) for k in picks)
    assert set(picks[:2]) == {4, 5}  # never read: epoch 0
    # the holder's own claim is no obstacle to itself
    assert 0 in choose(view, range(SHARDS), tokens={records[0].leases[0].token}, taken=set(), n=6, salt="a")


def test_the_held_out_shard_is_never_claimable_and_names_the_dataset() -> None:
    from greenswarm.node.evaluation import EvalConfig

    claimable, excluded = claimable_shards(DataConfig(num_shards=8, sharding="claim"), EvalConfig())
    assert excluded == [7] and claimable == list(range(7))
    settings = {"source": "x", "seed": 0}
    assert dataset_id(settings, [7]) != dataset_id(settings, [6]) != dataset_id({**settings, "seed": 1}, [6])
    assert documents_between((0, 3, 5), (0, 10, 0), None) == 7
    assert documents_between((0, 3, 0), (2, 1, 0), 10) == 7 + 10 + 1
    assert documents_between((0, 3, 0), (1, 1, 0), None) is None


def test_a_shard_record_passes_the_swarms_schema() -> None:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from greenswarm.node.progress import record_validators

    schema, signer = record_validators("sw")[:2]
    assert isinstance(signer, RSASignatureValidator)
    subkey = signer.local_public_key

    def check(value: dict) -> bool:
        raw = DHTRecord(
            key=DHTID.generate(source="sw_shards").to_bytes(),
            subkey=DHTProtocol.serializer.dumps(subkey),
            value=DHTProtocol.serializer.dumps(value),
            expiration_time=1e10,
        )
        return schema.validate(raw)

    good = record("a", [lease(1, 10.0)], {1: (0, 5, 2)}, sizes={1: 40}, excluded=[5], wall_time=3.0)
    assert check(good.to_wire())
    assert ShardRecord.from_wire(good.to_wire()) == good
    assert not check({**good.to_wire(), "count": 1.5})
    assert not check({**good.to_wire(), "positions": [[1, 0, 5]]})
    assert not check({**good.to_wire(), "extra": 1})


# ------------------------------------------------------------------ claims against one fake DHT


class Board:
    """One DHT key's values for several sites, and the wall clock they all read. ``gets_left``: reads
    that answer before every further one times out; ``stores_fail``: writes are refused."""

    def __init__(self) -> None:
        self.values: dict[str, dict[bytes, tuple[Any, float]]] = {}
        self.t = 1000.0
        self.lock = threading.Lock()
        self.gets_left: int | None = None
        self.stores_fail = False
        self.after_get: list[Any] = []  # called, one per read, after a read answered

    def dht(self) -> Any:
        board = self

        class FakeDHT:
            def store(
                self, key: str, subkey: bytes, value: Any, expiration_time: float, return_future: bool
            ) -> Future:
                if board.stores_fail:
                    return _done(False)
                with board.lock:
                    old = board.values.setdefault(key, {}).get(subkey)
                    if old is None or old[1] < expiration_time:  # as hivemind keeps the later one
                        board.values[key][subkey] = (value, expiration_time)
                return _done(True)

            def get(self, key: str, latest: bool, return_future: bool) -> Future:
                if board.gets_left is not None:
                    if board.gets_left <= 0:
                        future: Future = Future()
                        future.set_exception(TimeoutError("no answer"))
                        return future
                    board.gets_left -= 1
                with board.lock:
                    items = {
                        k: SimpleNamespace(value=v, expiration_time=e)
                        for k, (v, e) in board.values.get(key, {}).items()
                        if e > board.t
                    }
                if board.after_get:
                    board.after_get.pop(0)()
                return _done(SimpleNamespace(value=items) if items else None)

        return FakeDHT()


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Site:
    """One site's claims with ``readers`` ranks, whose plans the test applies to plain readers."""

    def __init__(
        self, board: Board, name: str, corpus: Path, tmp: Path, readers: int = 1, peer: str = ""
    ) -> None:
        self.plans: list[dict] = []
        self.claims = ShardClaims(
            board.dht(), "sw", (peer or name).encode(), name, peer or f"peer-{name}", "ds", SHARDS,
            list(range(SHARDS - 1)), readers, lease_s=30.0, settle_s=0.01, apply=self.plans.append,
            run_dir=tmp / name, now=lambda: board.t,
        )  # fmt: skip
        self.readers = [ClaimedBatches(data(corpus), TOKENIZER, 2) for _ in range(readers)]

    def apply(self) -> None:
        for plan in self.plans:
            for rank, actions in plan.items():
                apply_plan(self.readers[rank], actions)
        self.plans.clear()

    def step(self) -> None:
        assert self.claims.prepare()
        self.apply()
        for reader in self.readers:
            next(reader)
        self.claims.after_step([r.status() for r in self.readers])

    def held(self) -> set[int]:
        return set(self.claims.held)


@pytest.fixture
def board() -> Any:
    return Board()


@pytest.fixture
def a(board: Board, corpus: Path, tmp_path: Path) -> Iterator[Site]:
    """Site a, started, one step taken: it holds the shard its reader reads."""
    site = Site(board, "a", corpus, tmp_path)
    try:
        site.claims.start([{}], background=False)
        site.step()
        yield site
    finally:
        site.claims.close()


def test_sites_claiming_together_never_hold_one_shard(board: Board, corpus: Path, tmp_path: Path) -> None:
    sites = [Site(board, name, corpus, tmp_path, readers=2 if name == "b" else 1) for name in "abc"]
    for site in sites:
        site.claims.start([{} for _ in site.readers], background=False)
    try:
        for site in sites:
            site.step()
        for site in sites:
            site.claims._top_up()  # (what the background thread does when a rank lacks its next shard)
            site.claims.before_step()
            site.apply()
        held = [site.held() for site in sites]
        assert sum(map(len, held)) == len(set().union(*held)) == 5  # 4 ranks, 5 claimable shards
        assert all(site.readers[0].queue for site in sites)
    finally:
        for site in sites:
            site.claims.close()


def test_a_crossed_claim_is_withdrawn_before_it_is_read(board: Board, corpus: Path, tmp_path: Path) -> None:
    a, b = Site(board, "a", corpus, tmp_path), Site(board, "b", corpus, tmp_path)
    try:
        a.claims.start([{}], background=False)
        assert a.claims.prepare()
        (shard,) = a.held()
        # b's claim on the same shard crossed a's in the DHT: both wrote, b read before a's showed
        b.claims.held[shard] = Lease(shard, board.t + 0.5, board.t + 30, "b-token")
        b.claims._renew()
        assert shard not in b.held() and b.claims._plan == {0: [("withdraw", shard, None, None)]}
        a.claims._renew()
        assert a.held() == {shard}
    finally:
        a.claims.close()
        b.claims.close()


def test_a_crashed_sites_shard_is_continued_from_what_it_committed(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    a, b = Site(board, "a", corpus, tmp_path), Site(board, "b", corpus, tmp_path)
    try:
        a.claims.start([{}], background=False)
        for _ in range(4):
            a.step()
        (shard,) = a.held()
        a.claims.commit([a.readers[0].state_dict()])  # a checkpoint holding this is on disk
        committed = a.readers[0].positions[shard]
        for _ in range(3):
            a.step()  # read, never checkpointed: lost with a
        a.claims._stop.set()  # a dies: no more renewals
        board.t += 31.0  # its lease runs out
        b.claims.start([{}], background=False)
        b.claims.known.clear()
        won = b.claims._claim(wanted={shard: 0})
        b.claims.before_step()
        b.apply()
        assert won == [shard] and b.readers[0].positions[shard] == committed
        journal = [json.loads(line) for line in (tmp_path / "a" / "shards.jsonl").read_text().splitlines()]
        assert journal[-1]["to"] == list(committed) and journal[-1]["site"] == "a"
    finally:
        a.claims.close()
        b.claims.close()


def test_a_shard_read_to_its_end_is_released_at_the_next_commit(board: Board, a: Site) -> None:
    a.claims._top_up()
    a.claims.before_step()
    a.apply()
    first, second = a.readers[0].queue
    while a.readers[0].queue[0] == first:
        a.step()
    assert first in a.held()  # read to its end, but not yet in a checkpoint
    a.claims.commit([a.readers[0].state_dict()])
    assert first not in a.held() and second in a.held()
    assert merge([ShardRecord.from_wire(_stored(board))], "ds", board.t).position(first) == (1, 0, 0)
    a.claims.release_all("its window closed")
    assert not a.held() and a.readers[0].queue == [second]  # (the withdrawal is the ranks' plan)
    a.apply()
    assert a.readers[0].queue == [] and _stored(board)["leases"] == []


def _stored(board: Board, subkey: bytes | None = None) -> dict:
    if subkey is not None:
        return board.values["sw_shards"][subkey][0]
    ((value, _),) = board.values["sw_shards"].values()
    return value


def test_a_restart_takes_back_its_own_shards_and_leaves_one_taken_over(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    a = Site(board, "a", corpus, tmp_path, readers=2)
    try:
        a.claims.start([{}, {}], background=False)
        a.step()
        saved = a.claims.state_dict()
        statuses = [r.status() for r in a.readers]
        own, other = a.readers[0].queue[0], a.readers[1].queue[0]
    finally:
        a.claims._stop.set()
    # a restarts (a new peer id: no fixed identity) while its leases still run; meanwhile c took over
    # rank 1's shard
    board.values["sw_shards"][b"c"] = (
        record("c", [Lease(other, board.t - 100.0, board.t + 30.0, "c-token")]).to_wire(),
        board.t + 1e4,
    )
    again = Site(board, "a", corpus, tmp_path, readers=2, peer="peer-a-restarted")
    try:
        again.claims.start(statuses, saved, background=False)
        assert own in again.held() and other not in again.held()
        assert again.claims.held[own].token == saved["tokens"][own][0]
        assert again.claims._plan[1] == [("withdraw", other, None, None)]
    finally:
        again.claims.close()


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [],
            "site.yaml:8: eval.num_shards: with data.sharding 'claim' the held-out shard is one of",
        ),
        (["data.sharding=claimed"], "data.sharding: must be one of fixed, claim"),
        (["data.num_shards=1"], "data.num_shards: with sharding 'claim' the swarm's corpus needs at least 2"),
        (["data.claim_settle_s=30"], "data.claim_settle_s: must be at most a third of lease_s"),
        (["data.lease_s=0"], "data.lease_s: must be a number of seconds > 0"),
        (["eval.shard_index=9"], "eval.shard_index: the held-out shard must be one of data.num_shards (8)"),
        (["data.shard_index=2"], "data.shard_index: with data.sharding 'claim' the site reads the shards"),
    ],
)
def test_claim_settings_are_checked_at_load_naming_the_field(
    tmp_path: Path, overrides: list, message: str
) -> None:
    from greenswarm.node.config import load_site_config

    path = tmp_path / "site.yaml"
    lines = ["name: a", "region: R", "data:", "  sharding: claim", "  num_shards: 8", "eval:", "  batches: 2"]
    path.write_text("\n".join([*lines, "  num_shards: 4", ""]))
    fixed = ["eval.num_shards=0"] if overrides else []  # (the file's own mistake: its line is named)
    with pytest.raises(ConfigError) as err:
        load_site_config(path, fixed + overrides)
    assert message in str(err.value)
    assert load_site_config(path, ["eval.num_shards=8"]).data.claimed


def test_a_shard_left_for_another_is_released_even_unread_since(board: Board, a: Site) -> None:
    (first,) = a.held()
    while a.readers[0].positions[first][0] == 0:  # no next shard: it reads the next epoch of its own
        a.step()
    a.claims.commit([a.readers[0].state_dict()])  # everything read so far is committed
    assert a.held() == {first}
    a.claims._top_up()  # a next shard comes: the reader leaves the wrapped one where it is
    a.claims.before_step()
    a.apply()
    assert first not in a.readers[0].queue
    a.claims.commit([a.readers[0].state_dict()])
    assert first not in a.held() and len(a.held()) == 1


def test_a_checkpoint_from_before_a_shard_was_claimed_again_does_not_release_it(
    board: Board, a: Site
) -> None:
    (shard,) = a.held()
    old = a.readers[0].state_dict()
    old["left"] = {shard: "an-earlier-claim"}  # a snapshot from when it had left the shard under another
    a.claims.commit([old])
    assert a.held() == {shard}


def test_a_claim_the_dht_fails_midway_leaves_no_lease_and_no_crash(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    a = Site(board, "a", corpus, tmp_path)
    try:
        a.claims.start([{}], background=False)
        board.gets_left = 1  # the claim's first read answers, the one after its settle times out
        assert not a.claims.prepare()  # said, not raised: the loop waits and tries again
        assert not a.held() and _stored(board)["leases"] == [] and not a.claims._plan
        board.gets_left, board.stores_fail = None, True  # now its lease cannot be written
        a.claims._retry_at = 0.0
        assert not a.claims.prepare() and not a.held()
        board.stores_fail = False
        a.claims._retry_at = 0.0
        assert a.claims.prepare() and len(a.held()) == 1
    finally:
        a.claims.close()


def test_a_site_that_cannot_serve_every_rank_keeps_nothing(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    others = Site(board, "o", corpus, tmp_path, readers=2)
    d = Site(board, "d", corpus, tmp_path, readers=2)
    try:
        others.claims.start([{}, {}], background=False)
        others.step()
        others.claims._top_up()  # four of the five claimable shards held
        assert len(others.held()) == 4
        d.claims.start([{}, {}], background=False)
        assert not d.claims.prepare()  # one free shard for two ranks: it cannot train
        assert not d.held() and not d.claims._plan
        d.claims._top_up()  # and takes no next shards either
        assert not d.held()
    finally:
        others.claims.close()
        d.claims.close()


def test_a_lease_not_renewed_in_time_is_left(board: Board, a: Site, caplog: Any) -> None:
    (shard,) = a.held()
    board.t += 31.0  # the DHT took none of its renewals for longer than a lease
    with caplog.at_level(logging.WARNING):
        a.claims._renew()
    assert not a.held() and a.claims._plan == {0: [("withdraw", shard, None, None)]}
    assert "could not renew the lease on shard" in caplog.text
    expires = board.values["sw_shards"][b"a"][1]
    a.claims._publish(wait=True)
    assert board.values["sw_shards"][b"a"][1] > expires  # every write expires after the last


def test_a_renewal_the_dht_did_not_take_is_tried_again_at_once_and_keeps_the_lease(
    board: Board, a: Site
) -> None:
    (shard,) = a.held()
    third = a.claims.lease_s / 3
    # a renewal the DHT took: the next is due a third of the lease after this one began, however
    # long it took
    assert a.claims._renew() is True
    assert a.claims._next_renewal(100.0, stored=True) == 100.0 + third
    until = a.claims.held[shard].until
    board.t += 2 * third  # then one store fails, two thirds of a lease on
    board.stores_fail = True
    assert a.claims._renew() is False and a.held() == {shard}
    assert a.claims.held[shard].until == until  # not counted as renewed
    retry = a.claims._next_renewal(time.monotonic(), stored=False)
    assert retry - time.monotonic() <= min(a.claims.lease_s / 12, 1.0)  # a moment later, not a third
    # the retry writes without reading first (it read a moment ago), and the lease holds on
    board.stores_fail, board.gets_left = False, 0  # (a read would now time out and be said)
    board.t += 1.0
    assert a.claims._renew(read=False) is True
    assert a.held() == {shard} and a.claims.held[shard].until == board.t + a.claims.lease_s
    assert "fetch" not in a.claims._said


def test_a_restart_outside_its_window_releases_everything_it_took_back(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    a = Site(board, "a", corpus, tmp_path, readers=2)
    a.claims.start([{}, {}], background=False)
    a.step()
    saved, statuses = a.claims.state_dict(), [r.status() for r in a.readers]
    states = [r.state_dict() for r in a.readers]
    taken = a.readers[1].queue[0]
    a.claims.close()
    board.values["sw_shards"][b"c"] = (
        record("c", [Lease(taken, board.t - 100.0, board.t + 30.0, "c-token")]).to_wire(),
        board.t + 1e4,
    )
    again = Site(board, "a", corpus, tmp_path, readers=2, peer="peer-a-restarted")
    for reader, state in zip(again.readers, states, strict=True):
        reader.load_state_dict(state)
    try:
        again.claims.start(statuses, saved, background=False)
        again.claims.release_all("outside its window")  # what the node does when it is IDLE
        again.apply()
        assert [r.queue for r in again.readers] == [[], []] and not again.held()
    finally:
        again.claims.close()


def test_claims_that_cross_in_the_dht_settle_on_the_earlier_one(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    b = Site(board, "b", corpus, tmp_path)
    rival: dict[str, Any] = {}

    def a_claims_the_same_shards_a_moment_earlier() -> None:  # a's store lands during b's settle
        leases = [Lease(k, board.t - 0.2, board.t + 30.0, f"a-{k}") for k in range(SHARDS - 1)]
        rival["record"] = record("a", leases)
        board.values.setdefault("sw_shards", {})[b"a"] = (rival["record"].to_wire(), board.t + 1e4)

    board.after_get.append(a_claims_the_same_shards_a_moment_earlier)
    try:
        b.claims.start([{}], background=False)
        assert not b.claims.prepare()  # b wrote its lease, saw a's earlier one after settling, withdrew
        assert not b.held() and _stored(board, b"b")["leases"] == []
        assert merge([rival["record"]], "ds", board.t).holders[0].site == "a"
    finally:
        b.claims.close()


def test_a_renewal_during_a_claims_settle_does_not_orphan_it(
    board: Board, corpus: Path, tmp_path: Path
) -> None:
    a = Site(board, "a", corpus, tmp_path)
    board.after_get.append(lambda: None)  # the claim's first read
    board.after_get.append(lambda: a.claims._publish(wait=True, renew=True))  # renewed as it settles
    try:
        a.claims.start([{}], background=False)
        assert a.claims.prepare()
        a.apply()
        assert a.held() == set(a.readers[0].queue) and len(a.held()) == 1
    finally:
        a.claims.close()
