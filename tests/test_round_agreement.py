"""Real averagers on loopback: after a round every member holds the group's average, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from greenswarm.averaging.agreement import DigestBoard, Verdict, decide, state_digest
from greenswarm.averaging.averager import RoundOutcome, SwarmAverager
from greenswarm.averaging.codecs import wire_format
from greenswarm.averaging.config import LOOPBACK_TIMEOUTS, AveragingConfig
from greenswarm.network import start_dht

pytestmark = pytest.mark.swarm

NUMEL = 300_007  # not a multiple of anything: parts of uneven size


@pytest.fixture
def averagers(request: pytest.FixtureRequest) -> Iterator[list[SwarmAverager]]:
    """Three averagers on loopback; ``request.param`` is one wire format, or one per averager."""
    wires = request.param if isinstance(request.param, tuple) else (request.param,) * 3
    first = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [start_dht(peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    made = [
        SwarmAverager(d, "exact-avg", NUMEL, AveragingConfig(wire=w, **LOOPBACK_TIMEOUTS), lambda: ({}, []))
        for d, w in zip(dhts, wires, strict=True)
    ]
    try:
        yield made
    finally:
        for part in [*made, *dhts]:
            part.shutdown()


def _round(averagers: list[SwarmAverager], deltas: list[torch.Tensor], weights: list[float], index: int):
    outcomes: list[RoundOutcome | None] = [None] * len(averagers)

    def one(i: int) -> None:
        outcomes[i] = averagers[i].average(
            # each round from its own global state, as a node's lineage changes with every applied round
            # (groups are keyed by lineage: two rounds on one lineage could mix a straggler of the first)
            deltas[i], weights[i], round_index=index, lineage=f"l{index}", expected_size=len(averagers),
            gather={},
        )  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcomes


WIRES = ["fp32", "fp16", "scaled-fp16", "bf16", "int8", "int8-zstd", "int7-zstd", "auto"]


@pytest.mark.compression
@pytest.mark.parametrize("averagers", WIRES, indirect=True)
def test_every_member_holds_the_same_bits(averagers: list[SwarmAverager]) -> None:
    """A real 3-process round per wire format: identical results, close to the true weighted mean,
    and a residual that is exactly what the format's coding left out of what each member sent."""
    gen = torch.Generator().manual_seed(0)
    weights = [1.0, 2.0, 5.0]
    for index in range(2):
        deltas = [torch.randn(NUMEL, generator=gen) * (i + 1) for i in range(3)]
        outcomes = _round(averagers, deltas, weights, index)
        assert all(o is not None and o.ok for o in outcomes), [o and o.reason for o in outcomes]
        results = [o.averaged for o in outcomes]
        assert len({state_digest([r]) for r in results}) == 1, "members hold different averages"
        fmt = wire_format(outcomes[0].wire)
        assert {o.wire for o in outcomes} == {fmt.name}
        if averagers[0]._cfg.wire != "auto":
            assert fmt.name == averagers[0]._cfg.wire
        expected = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        scale = max(d.abs().max().item() for d in deltas)
        # int formats: at most half a step of the sender's block, then half a step of the average's
        steps = {"int8": 127, "int8-zstd": 127, "int7-zstd": 63}
        bound = (
            2 * scale / steps[fmt.name]
            if fmt.name in steps
            else (1e-6 if fmt.name == "fp32" else 1e-2 * scale)
        )
        assert (results[0] - expected).abs().max().item() <= bound
        for outcome, delta in zip(outcomes, deltas, strict=True):
            assert torch.allclose(outcome.residual + fmt.roundtrip(delta), delta, atol=1e-6)
        assert len(outcomes[0].members) == 3


@pytest.mark.compression
@pytest.mark.parametrize("averagers", [("int8", "fp16", "int8")], indirect=True)
def test_members_with_different_wire_formats_refuse_the_round(averagers: list[SwarmAverager]) -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
    outcomes = _round(averagers, deltas, [1.0, 1.0, 1.0], 0)
    assert not any(o.ok for o in outcomes), [o.reason for o in outcomes]
    assert all("refused a group: members use different wire formats" in o.reason for o in outcomes), [
        o.reason for o in outcomes
    ]


@pytest.fixture
def dhts() -> Iterator[list]:
    first = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    made = [first] + [start_dht(peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    try:
        yield made
    finally:
        for d in made:
            d.shutdown()


def _exchange(dhts: list, digests: list[str], publish: list[bool], timeout_s: float) -> list[Verdict]:
    members = [d.peer_id.to_base58() for d in dhts]
    boards = [DigestBoard(d, "agree-test", m) for d, m in zip(dhts, members, strict=True)]
    verdicts: list[Verdict | None] = [None] * len(dhts)

    def one(i: int) -> None:
        seen = boards[i].exchange(7, "lineage", members, digests[i], timeout_s, publish=publish[i])
        verdicts[i] = decide(members[i], digests[i], seen, members)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(dhts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 30)
    return verdicts


def test_digests_exchanged_on_the_dht_decide_the_round(dhts: list) -> None:
    verdicts = _exchange(dhts, ["a" * 32, "a" * 32, "b" * 32], [True, True, True], timeout_s=10)
    assert [v.action for v in verdicts] == ["apply", "apply", "resync"]
    members = [d.peer_id.to_base58() for d in dhts]
    assert verdicts[2].holders == sorted(members[:2])


def test_a_lost_digest_still_leaves_a_majority(dhts: list) -> None:
    verdicts = _exchange(dhts, ["a" * 32] * 3, [True, True, False], timeout_s=3)
    assert [v.action for v in verdicts] == ["apply"] * 3
    assert "2/3 members reported" in verdicts[0].reason


def test_under_the_trimmed_mean_a_pair_forms_no_group_and_three_do() -> None:
    """Two sites under ``aggregate: trimmed-mean`` find no group (a pair would leave nothing out, and
    an attacker paired with one honest site would set half its step: docs/testing.md row 76): each
    says so, with no members and no all-reduce. Three form one and hold its median."""
    first = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first] + [
        start_dht([str(a) for a in first.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for _ in range(2)
    ]
    cfg = AveragingConfig(wire="fp32", aggregate="trimmed-mean", **LOOPBACK_TIMEOUTS)
    made = [SwarmAverager(d, "trim-avg", NUMEL, cfg, lambda: ({}, [])) for d in dhts]
    try:
        deltas = [torch.full((NUMEL,), float(i + 1)) for i in range(3)]
        pair = _round(made[:2], deltas[:2], [1.0, 1.0], index=0)
        assert all(o is not None and not o.ok for o in pair), [o and o.reason for o in pair]
        assert all("could not find a group" in o.reason for o in pair), [o.reason for o in pair]
        assert all(o.members == [] and o.allreduce_s is None for o in pair), pair
        three = _round(made, deltas, [1.0, 1.0, 1.0], index=1)
        assert all(o is not None and o.ok for o in three), [o and o.reason for o in three]
        assert all(torch.equal(o.averaged, torch.full((NUMEL,), 2.0)) for o in three)  # the median
    finally:
        for part in [*made, *reversed(dhts)]:
            part.shutdown()
