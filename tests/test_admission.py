"""Admission with real processes: members of a certified swarm average, an outsider gets nothing in,
and a poisoned update is refused before it is averaged (issue #7, parts 2-4).

Every peer here is a real hivemind DHT and averager (their own processes, p2pd daemons on
127.0.0.1). Results are compared bit for bit with a round of the same members and the same updates
without the outsider or the poisoner: two senders sum the same way in any order, and ``fp32`` on the
wire codes each value alone, so equal means the intruder changed nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from hivemind.dht.validation import DHTRecord

from greenswarm.averaging.averager import RoundOutcome, SwarmAverager
from greenswarm.averaging.config import LOOPBACK_TIMEOUTS, AveragingConfig
from greenswarm.bootstrap.identity import identity_seed, load_or_create_identity
from greenswarm.faults import FaultPlan
from greenswarm.network import start_dht
from greenswarm.node.progress import (
    ProgressPublisher,
    ProgressRecord,
    fetch_records,
    live_members,
    record_validators,
)
from greenswarm.security.admission import Admission
from greenswarm.security.certificates import create_authority, issue
from greenswarm.security.records import MemberRecordValidator

pytestmark = [pytest.mark.security, pytest.mark.swarm]

SWARM = "sec"
# six of hivemind's 512 KiB parts (and a few values): in a group of three every member reduces two.
# With 100,003 values the whole vector was one part, so one member reduced everything; when that was
# the member meant to drop its parts on the way to a reducer, it had no reducer to drop them on
NUMEL = 6 * 2**17 + 3


@dataclass
class Peer:
    name: str
    peer_id: str
    dht: object
    averager: SwarmAverager
    validators: list


def _certify(tmp_path: Path, name: str) -> tuple[Path, Admission]:
    identity = tmp_path / f"{name}.key"
    peer_id = load_or_create_identity(identity)
    cert = tmp_path / f"{name}.cert"
    issue(
        tmp_path / "authority.key",
        swarm=SWARM,
        site=name,
        region="R",
        peer_id=peer_id,
        valid_s=3600,
        out=cert,
    )
    return identity, Admission.from_files(SWARM, tmp_path / "authority.key.pub", cert)


class _Snoop(MemberRecordValidator):
    """An outsider's validator: it reads (strips) every member's record without checking any, and
    signs its own records with whatever certificate it holds."""

    def validate(self, record: DHTRecord) -> bool:
        return True


def _peer(tmp_path: Path, name: str, entry: list[str], certified: bool, faults: str = "") -> Peer:
    if certified:
        identity, admission = _certify(tmp_path, name)
        validators = record_validators(SWARM, admission, identity_seed(identity))
    else:  # an outsider with its own identity and a copy of member a's certificate (a valid one!)
        identity = tmp_path / f"{name}.key"
        load_or_create_identity(identity)
        admission = Admission.from_files(SWARM, tmp_path / "authority.key.pub", tmp_path / "a.cert")
        validators = [*record_validators(SWARM), _Snoop(admission, identity_seed(identity))]
    dht = start_dht(
        entry, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(identity), record_validators=validators
    )
    averager = SwarmAverager(
        dht,
        f"{SWARM}-avg",
        NUMEL,
        AveragingConfig(wire="fp32", **LOOPBACK_TIMEOUTS),
        lambda: ({"site": name}, [torch.ones(3), torch.zeros(3)]),
        faults=FaultPlan.parse(faults),
        admission=admission,  # the outsider shows a's certificate when it asks to join
        members=functools.partial(live_members, dht, SWARM),
    )
    return Peer(name, dht.peer_id.to_base58(), dht, averager, validators)


@pytest.fixture
def swarm(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Peer]]:
    """A certified swarm: a bootstrap DHT that checks records, members ``a`` and ``b``, a member
    ``p`` with the fault plan ``request.param`` (if any), and an outsider ``x`` that knows the bootstrap
    address, reads every record, and shows a copy of ``a``'s certificate. Every peer process logs
    greenswarm's warnings to ``tmp_path/peers.log`` (the handler is in place before they fork)."""
    handler = logging.FileHandler(tmp_path / "peers.log")
    handler.setLevel(logging.WARNING)
    logging.getLogger("greenswarm").addHandler(handler)
    create_authority(tmp_path / "authority.key")
    reader = Admission.from_files(SWARM, tmp_path / "authority.key.pub")
    boot = start_dht(
        [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators(SWARM, reader)
    )
    entry = [str(a) for a in boot.get_visible_maddrs()]
    peers: dict[str, Peer] = {}
    try:
        peers["a"] = _peer(tmp_path, "a", entry, certified=True)
        peers["b"] = _peer(tmp_path, "b", entry, certified=True)
        peers["p"] = _peer(tmp_path, "p", entry, certified=True, faults=getattr(request, "param", ""))
        peers["x"] = _peer(tmp_path, "x", entry, certified=False)
        yield peers
    finally:
        for peer in peers.values():
            peer.averager.shutdown()
            peer.dht.shutdown()
        boot.shutdown()
        logging.getLogger("greenswarm").removeHandler(handler)
        handler.close()


def _round(
    peers: list[Peer], deltas: list[torch.Tensor], lineage: str, intruder: Peer | None = None
) -> list[RoundOutcome]:
    """One round of ``peers``; an ``intruder`` asks to join their group (again and again) while the
    members wait for one more site, as nodes do when they count it among the sites in a window."""
    outcomes: list[RoundOutcome | None] = [None] * len(peers)
    size = len(peers) + (intruder is not None)
    done = threading.Event()

    def one(i: int) -> None:
        outcomes[i] = peers[i].averager.average(
            deltas[i], 1.0 + i, 0, lineage, expected_size=size, gather={"site": peers[i].name}
        )

    def intrude() -> None:
        time.sleep(0.5)  # the members have declared themselves: it asks them (hivemind's order)
        while not done.is_set():
            tried = intruder.averager.average(deltas[0], 1.0, 0, lineage, expected_size=size, gather={})
            assert not tried.ok, "the intruder averaged with someone"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(peers))]
    if intruder is not None:
        threads.append(threading.Thread(target=intrude))
    for t in threads[: len(peers)]:
        t.start()
    for t in threads[len(peers) :]:
        t.start()
    for t in threads[: len(peers)]:
        t.join(timeout=90)
    done.set()
    for t in threads[len(peers) :]:
        t.join(timeout=60)
    return outcomes  # type: ignore[return-value]


def _round_of_all(
    peers: list[Peer], deltas: list[torch.Tensor], lineage: str, tries: int = 3
) -> list[RoundOutcome]:
    """A round whose group is all of ``peers``: on a loaded machine matchmaking can split them (two
    form a group while the third is still declaring itself, and ends alone), and then the round tests
    nothing about a full group. A round holding fewer is run again, on a new lineage."""
    want = sorted(peer.peer_id for peer in peers)
    for attempt in range(tries):
        got = _round(peers, deltas, f"{lineage}-{attempt}")
        if all(sorted(o.members) == want for o in got):
            return got
    raise AssertionError(f"no round of all {len(peers)} in {tries} tries: {[o.members for o in got]}")


def _deltas(seed: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) for _ in range(n)]


def _reference(swarm: dict[str, Peer], deltas: list[torch.Tensor], lineage: str) -> torch.Tensor:
    """The round of ``a`` and ``b`` alone: what any intruder or poisoner must leave unchanged."""
    a, b = _round([swarm["a"], swarm["b"]], deltas, lineage)
    assert a.ok and b.ok, (a.reason, b.reason)
    assert torch.equal(a.averaged, b.averaged)
    return a.averaged


def test_an_outsider_cannot_join_download_or_publish(swarm: dict[str, Peer], tmp_path: Path) -> None:
    a, b, x = swarm["a"], swarm["b"], swarm["x"]
    deltas = _deltas(0, 3)
    expected = _reference(swarm, deltas[:2], "l0")

    # the outsider tries the same group (same lineage) at the same moment
    got = _round([a, b], deltas[:2], "l1", intruder=x)
    assert got[0].ok and got[1].ok, (got[0].reason, got[1].reason)
    assert got[0].members == got[1].members == sorted([a.peer_id, b.peer_id])
    assert torch.equal(got[0].averaged, expected) and torch.equal(got[1].averaged, expected)

    # it cannot download the model state from a member
    assert x.averager.download_state([a.peer_id, b.peer_id]) is None

    # members publish progress; the outsider's record reaches no certified reader
    for peer in (a, b, x):  # (ttl: the outsider's record would still be live when the reader looks)
        publisher = ProgressPublisher(peer.dht, SWARM, peer.validators, refresh_s=60, ttl_s=60)
        publisher.maybe_publish(lambda peer=peer: _record(peer), force=True)
        publisher.flush(timeout=30)  # every write has ended, taken or refused, before anyone reads
    seen = _poll_sites(a.dht, {"a", "b"})
    assert seen == {"a", "b"}, seen

    # a member that never averaged with a (so a has not seen its certificate) downloads once its
    # record is out: a finds it among the records the DHT took from members only
    p = swarm["p"]
    ProgressPublisher(p.dht, SWARM, p.validators, refresh_s=60, ttl_s=60).maybe_publish(
        lambda: _record(p), force=True
    )
    state = p.averager.download_state([a.peer_id])
    assert state is not None and state[0] == {"site": "a"}, state

    err = (tmp_path / "peers.log").read_text()
    # the transport stays encrypted and authenticated: no p2pd of the swarm turns Noise or TLS off
    daemons = [p for p in psutil.Process().children(recursive=True) if p.name() == "p2pd"]
    assert len(daemons) >= 5, daemons
    for daemon in daemons:
        flags = daemon.cmdline()
        assert not {"-noise=false", "-tls=false", "-tls=0", "-noise=0"} & set(flags), flags

    refusal = f"certificate of peer {x.peer_id}: issued to peer {a.peer_id}, but this peer is {x.peer_id}"
    assert f"refused a join request from {x.peer_id}: {refusal}" in err
    assert f"refused to serve the model state to {x.peer_id}" in err
    assert (
        f"refused a DHT record from {x.peer_id}: certificate of peer {x.peer_id}: issued to peer {a.peer_id}"
        in err
    )


@pytest.mark.parametrize(
    ("swarm", "poison"),
    [("poison-nan@1", "nan"), ("poison-scale@1", "scale"), ("poison-part@1", "part"), ("", "honest-nan")],
    ids=["nan-claiming-clean", "1000x-claiming-clean", "half-1000x-claiming-clean", "nan-claimed"],
    indirect=["swarm"],
)
def test_a_poisoned_update_is_averaged_in_nowhere(
    swarm: dict[str, Peer], poison: str, tmp_path: Path
) -> None:
    """A member that says its update is NaN is left out by every member from its claim: the others end
    with exactly the average of their own updates. A member that lies about its update has parts
    refused by the reducers that see the poison, and a refused part voids the round for every member:
    its earlier parts, and its clean parts in other reducers' slices, would otherwise be in the
    average the others apply. The half-poisoned update is the case that shows it: the reducers of
    its clean half see nothing wrong."""
    a, b, p = swarm["a"], swarm["b"], swarm["p"]
    deltas = _deltas(1, 3)
    expected = _reference(swarm, deltas[:2], "l0")
    if poison == "honest-nan":  # a diverged member: its update is NaN and it says so
        deltas[2] = torch.full((NUMEL,), float("nan"))

    if poison == "honest-nan":  # refused from its claim: p is in no group, so no full group to wait for
        got = _round([a, b, p], deltas, "l1")
    else:
        got = _round_of_all([a, b, p], deltas, "l1")
    assert not got[2].ok
    if poison == "honest-nan":  # refused from its claim by every member: not a member of the round
        assert got[0].ok and got[1].ok, (got[0].reason, got[1].reason)
        for outcome in got[:2]:
            assert torch.equal(outcome.averaged, expected), "the poisoned update changed the others' result"
        assert all(p.peer_id in o.refused for o in got[:2]), [o.refused for o in got[:2]]
        assert got[0].members == got[1].members == sorted([a.peer_id, b.peer_id])
        assert "the group refused this site's update: its update has NaN/Inf values" in got[2].reason
        return
    # refused part by part, by the members that reduced a poisoned slice: nobody applies the round
    assert not got[0].ok and not got[1].ok, (got[0].reason, got[1].reason)
    for outcome in got[:2]:
        assert outcome.averaged is None
        assert f"refused a part of {p.peer_id}'s update" in outcome.reason, outcome.reason
        assert p.peer_id in outcome.refused, outcome.refused  # every member counts the refusal
    assert f"refused a part of {p.peer_id}'s update" in (tmp_path / "peers.log").read_text()

    # the next round (p clean again) averages all three as usual
    again = _round_of_all([a, b, p], _deltas(2, 3), "l2")  # (a split group tests nothing of p)
    assert all(o.ok for o in again), [o.reason for o in again]
    assert (
        again[0].members == again[1].members == again[2].members == sorted([a.peer_id, b.peer_id, p.peer_id])
    )


def _record(peer: Peer) -> ProgressRecord:
    return ProgressRecord(
        site=peer.name, region="R", state="FEDERATED", peer_id=peer.peer_id, outer_round=0, lineage="l",
        round_index=0, local_steps=0, tokens=0, loss=None, window_end=None, energy_kwh=0.0,
        emissions_g=0.0, clock_time=0.0, wall_time=0.0,
    )  # fmt: skip


def _poll_sites(dht: object, want: set[str], timeout: float = 15.0) -> set[str]:
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        seen = {r.site for r in fetch_records(dht, SWARM)}
        if want <= seen:
            return seen
        time.sleep(0.3)
    return seen


@pytest.mark.faults
@pytest.mark.parametrize("swarm", ["drop-part@1"], indirect=True)
def test_a_member_lost_midway_is_averaged_in_nowhere(swarm: dict[str, Peer], tmp_path: Path) -> None:
    """A reducer that loses a sender before all its parts are in (here: none of them arrive, as when
    the stream broke) must not finish its slice without it: the others would apply an average holding
    the sender's update in every other slice, and the sender -- whose own round failed -- could not
    tell which part of its update went in. The reducer voids the round for every member instead."""
    a, b, p = swarm["a"], swarm["b"], swarm["p"]
    got = _round_of_all([a, b, p], _deltas(3, 3), "l1")
    log = (tmp_path / "peers.log").read_text()
    assert not any(o.ok for o in got), ([(o.ok, o.reason, o.members) for o in got], [p.peer_id], log[-3000:])
    lost = [o.reason for o in got[:2] if f"lost {p.peer_id}'s update midway" in o.reason]
    assert lost, [o.reason for o in got]  # the honest members say why, naming the lost member
    assert "fault injected: drop-part" in log

    # the next round (nothing dropped) averages all three as usual
    again = _round([a, b, p], _deltas(4, 3), "l2")
    assert all(o.ok for o in again), [o.reason for o in again]
