"""A failed round leaves no error that nobody reads (docs/testing.md row 62).

asyncio prints a task's or future's error that was never read, with a traceback, when the object is
collected: in a site's log, beside the round's own one-line "averaging failed ... retrying next
round", as if something had crashed. hivemind leaves three such errors behind a round that fails: its
step task re-raises what it already gave the step's future, its all-reduce runner keeps its error in a
future nobody awaits, and an aggregation cancelled by two timeouts at once ends a task whose error
nobody reads. Each test drives greenswarm's override of the hook in-process, with hivemind's own
behaviour around it stood in by a few lines, and collects what asyncio would have printed.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import NoCompression
from hivemind.p2p import PeerID

from greenswarm.averaging.averager import SwarmAverager
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.exact import ExactAllReduceRunner
from greenswarm.averaging.round_report import RoundFailed

pytestmark = pytest.mark.rounds


def _unread(body: Callable[[], Awaitable[Any]]) -> tuple[Any, list[str]]:
    """Run ``body`` in a fresh loop; its result (or the error it raised), and every message asyncio
    would have printed about an error never read."""
    said: list[str] = []

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: said.append(context["message"]))
        try:
            outcome = await body()
        except Exception as e:
            outcome = e
        for _ in range(3):  # what is unreferenced now is collected, and asyncio reports it here
            gc.collect()
            await asyncio.sleep(0)
        return outcome

    return asyncio.run(main()), said


def _averager(allreduce_timeout_s: float) -> SwarmAverager:
    """A SwarmAverager with only what its round hooks read (no process, no DHT)."""
    avg = object.__new__(SwarmAverager)
    avg._parent_pid = -1
    avg._cfg, avg._reports = AveragingConfig(allreduce_timeout_s=allreduce_timeout_s), {}
    avg._steps = avg._steps_ended = 0
    return avg


@pytest.mark.parametrize("unwinding_s", [0.0, 0.01], ids=["unwinds-at-once", "unwinds-over-loop-steps"])
def test_an_averager_stopped_past_both_timeouts_fails_its_round_and_leaves_no_unread_error(
    monkeypatch: pytest.MonkeyPatch, unwinding_s: float
) -> None:
    """The averager process stops (SIGSTOP, or starved on a busy machine) mid all-reduce until both
    greenswarm's all-reduce timeout and hivemind's backstop around it have passed: the round fails,
    saying it timed out, and nothing is left for asyncio to print. hivemind's runner may take loop
    steps to unwind (its pending parts, its streams), so the backstop cancels it a second time there:
    the report is lost then (the step fails with a bare timeout), and still nothing is left unread."""

    async def like_hivemind(self: Any, group_info: Any, min_vector_size: int, **kwargs: Any) -> None:
        try:  # an all-reduce whose groupmate never answers; hivemind turns any end of it into this
            await asyncio.sleep(60)
        except BaseException as e:
            if unwinding_s:
                await asyncio.sleep(unwinding_s)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from None

    monkeypatch.setattr(DecentralizedAverager, "_aggregate_with_group", like_hivemind)
    avg = _averager(allreduce_timeout_s=0.05)

    async def hivemind_step() -> Any:  # hivemind's step bounds the aggregation by its own timeout
        asyncio.get_running_loop().call_later(0.01, time.sleep, 0.3)  # the process stops past both
        return await asyncio.wait_for(avg._aggregate_with_group(SimpleNamespace(group_id=b"g"), 0), 0.1)

    outcome, said = _unread(hivemind_step)
    if unwinding_s:
        assert isinstance(outcome, TimeoutError), repr(outcome)  # (what hivemind's step then holds)
    else:
        assert isinstance(outcome, RoundFailed), repr(outcome)
        assert outcome.reason == "the all-reduce timed out after 0.05 s"
    assert said == []


def test_an_all_reduce_that_failed_first_says_why_though_the_timeout_passed_while_it_unwound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A groupmate's error ends the all-reduce, and the timeout passes while hivemind's runner is still
    unwinding (its cleanup keeps the cancellation from it): the round names the error, not a timeout."""

    async def like_hivemind(self: Any, group_info: Any, min_vector_size: int, **kwargs: Any) -> None:
        try:
            raise RuntimeError("a groupmate left")
        except BaseException as e:
            try:  # the cleanup takes longer than the bound, and swallows its cancellation
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                pass
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from None

    monkeypatch.setattr(DecentralizedAverager, "_aggregate_with_group", like_hivemind)
    avg = _averager(allreduce_timeout_s=0.05)
    outcome, said = _unread(lambda: avg._aggregate_with_group(SimpleNamespace(group_id=b"g"), 0))
    assert isinstance(outcome, RoundFailed), repr(outcome)
    assert outcome.reason == "MatchmakingException: Unable to run All-Reduce: a groupmate left"
    assert said == []


def test_a_step_whose_error_the_step_holds_leaves_no_unread_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind's step hands its error to the step's future and raises it again from its task, which
    nobody awaits: greenswarm's step reads it; an error the step does not hold still goes on."""

    class Step:
        error: BaseException | None = None

        def done(self) -> bool:
            return self.error is not None

        def cancelled(self) -> bool:
            return False

    async def like_hivemind(self: Any, *, step: Step, future_for_init: Any) -> None:
        error = TimeoutError()
        if handed:
            step.error = error
        raise error

    monkeypatch.setattr(DecentralizedAverager, "_step", like_hivemind)
    avg = _averager(allreduce_timeout_s=1.0)

    async def in_a_task_nobody_awaits() -> None:
        task = asyncio.get_running_loop().create_task(avg._step(step=Step(), future_for_init=None))
        await asyncio.wait([task])

    handed = True
    assert _unread(in_a_task_nobody_awaits)[1] == []
    handed = False  # (an error that reached nobody: asyncio still says so)
    assert _unread(in_a_task_nobody_awaits)[1] == ["Task exception was never retrieved"]


@pytest.mark.parametrize("error", [asyncio.CancelledError(), MatchmakingException("a groupmate left")])
def test_a_failed_runner_leaves_no_unread_error(error: BaseException) -> None:
    """An all-reduce that failed or was cancelled part way: hivemind keeps the error in the runner's
    future, which nobody awaits; the exact runner reads it."""
    me, other = PeerID(b"me" * 17), PeerID(b"it" * 17)

    async def fail_a_runner() -> None:
        runner = ExactAllReduceRunner(
            p2p=SimpleNamespace(peer_id=me),
            servicer_type=SwarmAverager,
            prefix="test",
            group_id=b"g",
            tensors=[torch.zeros(8)],
            ordered_peer_ids=[me, other],
            peer_fractions=(0.5, 0.5),
            compression=NoCompression(),
        )
        runner.finalize(exception=error)

    assert _unread(fail_a_runner)[1] == []
