"""A member that a leader counted in a group it never joined says so, and the leader's round fails
then, not after its chunk timeout (docs/testing.md row 51).

On a busy machine a site's join request can time out as its leader accepts it: the site looks on
elsewhere until its step ends with no group, while the leader starts an all-reduce that counts it.
hivemind's part handler made the leader's requests wait for the next group the site would register,
so the leader waited out its whole chunk timeout, and its next rounds found nobody meanwhile (CI saw
three failed rounds in a row, both sites, in a 3-s slot). The site now answers ``BAD_GROUP_ID`` once
its step is over without that group, and the leader's runner stops waiting for its parts.

The member's handler is :class:`SwarmAverager`'s own, on a real p2p daemon, with only what it reads
set (no averager process, no DHT); the leader is a real :class:`ExactAllReduceRunner`.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.compression import NoCompression
from hivemind.p2p import P2P

from greenswarm.averaging.averager import SwarmAverager
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.exact import ExactAllReduceRunner

pytestmark = pytest.mark.swarm

#: long enough that a leader waiting out its timeouts would fail the test's own bound
SENDER_TIMEOUT_S = 60.0


def _member(steps: int, groups: dict | None = None) -> SwarmAverager:
    """A SwarmAverager with only what its part handler reads: ``steps`` averaging steps under way."""
    avg = object.__new__(SwarmAverager)
    avg._parent_pid = -1
    avg._cfg = AveragingConfig(chunk_timeout_s=SENDER_TIMEOUT_S)
    avg._steps, avg._steps_ended = steps, 0
    avg._running_groups = {} if groups is None else groups
    avg._pending_groups_registered = asyncio.Event()  # (cleared: its search has registered nothing)
    return avg


async def _leader_round(step_ends_after_s: float | None) -> tuple[str, float, float | None]:
    """A leader's two-member all-reduce with a member that never joined; the member's step ends after
    ``step_ends_after_s`` (None: it has none under way). The leader's error, when it came, and when the
    member's step ended (seconds from the start)."""
    leader = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    entry = [str(a) for a in await leader.get_visible_maddrs()]
    member = await P2P.create(initial_peers=entry, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    prefix = "absent-member"
    avg = _member(steps=0 if step_ends_after_s is None else 1)
    await avg.add_p2p_handlers(member, namespace=prefix)
    runner = ExactAllReduceRunner(
        p2p=leader,
        servicer_type=SwarmAverager,  # (the averager's handlers are where groupmates' parts go)
        prefix=prefix,
        group_id=b"a group the member never joined",
        tensors=[torch.randn(100_000)],
        # parts for both members to reduce, the member's more than hivemind's server holds (5): the
        # member must read them while it holds the stream for its answer
        part_size_bytes=4_096,
        ordered_peer_ids=[leader.peer_id, member.peer_id],
        peer_fractions=(0.5, 0.5),
        compression=NoCompression(),
        sender_timeout=SENDER_TIMEOUT_S,
        reducer_timeout=2 * SENDER_TIMEOUT_S,
    )
    started = time.monotonic()
    ended: list[float] = []

    async def end_the_step() -> None:
        await asyncio.sleep(step_ends_after_s or 0.0)
        ended.append(time.monotonic() - started)
        avg._steps, avg._steps_ended = 0, 1

    ender = asyncio.create_task(end_the_step()) if step_ends_after_s is not None else None
    try:
        with pytest.raises(AllreduceException) as failed:
            await asyncio.wait_for(_run(runner), SENDER_TIMEOUT_S / 2)  # (a leader that waits: TimeoutError)
        return str(failed.value), time.monotonic() - started, ended[0] if ended else None
    finally:
        if ender is not None:
            await ender
        await member.shutdown()
        await leader.shutdown()


async def _run(runner: ExactAllReduceRunner) -> list[torch.Tensor]:
    return [tensor async for tensor in runner]


@pytest.mark.parametrize("step_ends_after_s", [None, 1.0], ids=["no-step-under-way", "step-ends-without-it"])
def test_the_leader_fails_once_the_member_says_it_never_joined(step_ends_after_s: float | None) -> None:
    error, failed_at, step_ended_at = asyncio.run(_leader_round(step_ends_after_s))
    assert "answered that it is not in this group" in error, error
    if step_ended_at is not None:  # it answered when its step was over, not before: it might have joined
        assert failed_at >= step_ended_at


def test_a_member_whose_group_registers_meanwhile_takes_the_parts() -> None:
    """The leader's word can reach a member after a groupmate's first parts: while its step is under
    way the member waits for the group, and takes the parts once it has registered it."""

    async def main() -> bool:
        groups: dict = {}
        avg = _member(steps=1, groups=groups)
        asyncio.get_running_loop().call_later(0.2, groups.__setitem__, b"g", object())
        return await avg._joined(b"g")

    assert asyncio.run(main())


def test_a_member_that_registered_another_group_answers_at_once() -> None:
    """A member whose search ended in another group is not in this one, however long its step runs."""

    async def main() -> bool:
        avg = _member(steps=1, groups={b"its own": object()})
        avg._pending_groups_registered.set()
        return await asyncio.wait_for(avg._joined(b"g"), SENDER_TIMEOUT_S / 2)

    assert not asyncio.run(main())
