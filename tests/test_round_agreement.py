"""Real averagers on loopback: after a round every member holds the group's average, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from greenswarm.averaging.agreement import DigestBoard, Verdict, decide, state_digest
from greenswarm.averaging.averager import RoundOutcome, SwarmAverager
from greenswarm.averaging.config import LOOPBACK_TIMEOUTS, AveragingConfig
from greenswarm.network import start_dht

pytestmark = pytest.mark.swarm

NUMEL = 300_007  # not a multiple of anything: parts of uneven size


@pytest.fixture
def averagers(request: pytest.FixtureRequest) -> Iterator[list[SwarmAverager]]:
    wire = request.param
    cfg = AveragingConfig(wire=wire, **LOOPBACK_TIMEOUTS)
    first = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [start_dht(peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    made = [SwarmAverager(d, "exact-avg", NUMEL, cfg, lambda: ({}, [])) for d in dhts]
    try:
        yield made
    finally:
        for part in [*made, *dhts]:
            part.shutdown()


def _round(averagers: list[SwarmAverager], deltas: list[torch.Tensor], weights: list[float], index: int):
    outcomes: list[RoundOutcome | None] = [None] * len(averagers)

    def one(i: int) -> None:
        outcomes[i] = averagers[i].average(
            deltas[i], weights[i], round_index=index, lineage="l", expected_size=len(averagers), gather={}
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcomes


@pytest.mark.parametrize("averagers", ["fp32", "fp16", "scaled-fp16"], indirect=True)
def test_every_member_holds_the_same_bits(averagers: list[SwarmAverager]) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [1.0, 2.0, 5.0]
    for index in range(2):
        deltas = [torch.randn(NUMEL, generator=gen) * (i + 1) for i in range(3)]
        outcomes = _round(averagers, deltas, weights, index)
        assert all(o is not None and o.ok for o in outcomes), [o and o.reason for o in outcomes]
        results = [o.averaged for o in outcomes]
        assert len({state_digest([r]) for r in results}) == 1, "members hold different averages"
        expected = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        tolerance = 0 if averagers[0]._cfg.wire == "fp32" else 2e-3 * expected.abs().max().item()
        assert (results[0] - expected).abs().max().item() <= tolerance + 1e-6
        assert len(outcomes[0].members) == 3


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
