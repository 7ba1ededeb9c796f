"""How much each member's update counts (``averaging.weighting``), in-process: tokens, fednova, equal.

A fake group stands in for the averager: it holds the other members' sent vectors, weights and
gathered metadata, and combines this member's with them as every reducer does -- the weights counted
from the gathered claims (:func:`bounded_weights`), the coded vectors' weighted mean in sorted peer
order -- so each member of a group gets the same average, and the :class:`Federation` of each
member turns it into its step as the node does.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from greenswarm.averaging.aggregation import bounded_weights
from greenswarm.averaging.averager import RulesMismatch, check_rules
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.outer import OuterOptimizer
from greenswarm.averaging.round_report import RoundOutcome
from greenswarm.averaging.weighting import group_scale, local_steps, outgoing, scaled, to_update_units
from greenswarm.errors import ConfigError
from greenswarm.faults import FaultPlan
from greenswarm.node.config import load_site_config
from greenswarm.node.federation import Applied, Federation
from greenswarm.node.global_state import GlobalState
from greenswarm.node.round_handling import RoundHandler
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.state_sync import PendingRound, StateSync
from tests.test_rounds import FakeAverager, FakeBoard, FakeRanks, outcome

pytestmark = pytest.mark.rounds

ME, B, C = "peer-me", "peer-b", "peer-c"
N = 64
INTERVAL_S = 60.0


def bf16(vector: torch.Tensor) -> torch.Tensor:
    """A lossy wire format: what a member's coding hands on."""
    return vector.to(torch.bfloat16).to(torch.float32)


class GroupAverager:
    """One member's all-reduce with a group whose other members' sends are fixed (see the docstring).
    ``others``: peer -> (sent vector, claimed weight, gathered metadata)."""

    def __init__(
        self,
        me: str,
        others: dict[str, tuple[torch.Tensor, float, dict]],
        cfg: AveragingConfig,
        code: Callable[[torch.Tensor], torch.Tensor] = bf16,
    ):
        self.me, self.others, self.cfg, self.code = me, others, cfg, code
        self.measured_mbit = None
        self.calls: list[dict[str, Any]] = []

    def average(self, delta: torch.Tensor, weight: float, round_index: int, **kw: Any) -> RoundOutcome:
        self.calls.append({"delta": delta.clone(), "weight": weight, **kw})
        rules = {**self.cfg.rules(), "interval_s": kw["interval_s"]}
        sends = {**self.others, self.me: (delta, weight, kw["gather"])}
        gathered = {
            peer: {**gather, "tokens": max(float(w), 1e-6), "rules": rules}
            for peer, (_, w, gather) in sends.items()
        }
        weights, clipped = bounded_weights(gathered, rules, kw["interval_s"])
        peers = sorted(sends)
        averaged = torch.zeros_like(delta)
        for peer in peers:  # (as hivemind's reducer: a running sum of weight x part, over the weights)
            averaged.add_(self.code(sends[peer][0]), alpha=weights[peer])
        averaged.div_(sum(weights[p] for p in peers))
        return RoundOutcome(
            True,
            members=peers,
            gathered=gathered,
            averaged=averaged,
            slot=round_index,
            wire="bf16",
            seconds=0.1,
            allreduce_s=0.05,
            residual=delta - self.code(delta),
            clipped=clipped,
            weights=weights,
        )


def global_state() -> GlobalState:
    return GlobalState(OuterOptimizer.from_config(torch.zeros(N), "fedavg", 1.0, 0.0, False), "me")


def updates(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {peer: torch.randn(N, generator=g) for peer in (ME, B, C)}


def round_of(
    me: str,
    work: dict[str, tuple[int, int]],
    deltas: dict[str, torch.Tensor],
    cfg: AveragingConfig,
    order: list[str] | None = None,
    code: Callable[[torch.Tensor], torch.Tensor] = bf16,
) -> tuple[Applied, GroupAverager]:
    """Member ``me``'s round in a group whose members trained ``work`` (peer -> (tokens, steps)) and
    took the pseudo-gradients ``deltas``; the others' gathered metadata in ``order`` (each member's
    dicts are built in its own order)."""
    others = {}
    for peer in order or sorted(work):
        if peer != me:
            tokens, steps = work[peer]
            sent, weight = outgoing(cfg.weighting, deltas[peer], tokens, steps)
            others[peer] = (sent, weight, {"site": peer, "steps": steps})
    averager = GroupAverager(me, others, cfg, code)
    fed = Federation(averager, FakeBoard(), cfg, me, me, FaultPlan(), interval_s=INTERVAL_S)
    tokens, steps = work[me]
    result = fed.run(deltas[me], global_state(), slot=3, partners=2, tokens=tokens, steps=steps)
    assert isinstance(result, Applied), result.reason
    return result, averager


# ---------------------------------------------------------------------------------------- configuration


def test_weighting_is_checked_at_load() -> None:
    with pytest.raises(ConfigError) as err:
        AveragingConfig(weighting="fedprox").validate()
    assert err.value.field == "weighting"
    with pytest.raises(ConfigError) as err:
        load_site_config(None, ["name=x", "region=R", "averaging.weighting=fedprox"])
    message = str(err.value)
    assert "averaging.weighting" in message and "tokens, fednova, equal" in message
    cfg = load_site_config(None, ["name=x", "region=R", "averaging.weighting=fednova"])
    assert cfg.averaging.weighting == "fednova"
    assert AveragingConfig().weighting == "tokens" and AveragingConfig().rules()["weighting"] == "tokens"


def test_a_group_whose_members_weigh_updates_differently_is_refused() -> None:
    mine = {**AveragingConfig().rules(), "interval_s": 5.0}
    theirs = {**AveragingConfig(weighting="fednova").rules(), "interval_s": 5.0}
    check_rules([("me", {"rules": mine}), ("them", {"rules": dict(mine)})], "me")
    with pytest.raises(RulesMismatch, match="weighting"):
        check_rules([("me", {"site": "a", "rules": mine}), ("them", {"site": "b", "rules": theirs})], "me")


# ---------------------------------------------------------------------------------------- tokens (default)


def test_tokens_weighting_sends_the_update_as_before() -> None:
    """The default is today's round, bit for bit: the update (with its feedback) goes out as it is,
    weighted by the tokens themselves, and the group's average comes back as the step unchanged."""
    averaged = torch.full((N,), 0.25)
    residual = torch.arange(N, dtype=torch.float32)
    averager = FakeAverager(outcome(averaged, residual=residual))
    fed = Federation(averager, FakeBoard(), AveragingConfig(), "me", ME)
    delta = torch.randn(N)
    result = fed.run(delta, global_state(), slot=1, partners=1, tokens=640, steps=7)
    call = averager.calls[0]
    assert torch.equal(call["delta"], delta) and call["weight"] == 640 and isinstance(call["weight"], int)
    assert call["gather"]["steps"] == 7
    assert isinstance(result, Applied) and torch.equal(result.averaged, averaged)
    assert torch.equal(fed.feedback, residual)  # the residual is carried as it came
    assert outgoing("tokens", delta, 640, 7)[0] is delta and to_update_units("tokens", delta, 7) is delta


# ---------------------------------------------------------------------------------------- fednova


def test_fednova_with_equal_steps_is_token_weighting() -> None:
    deltas = updates(1)
    work = {ME: (1000, 8), B: (3000, 8), C: (500, 8)}
    by_tokens, _ = round_of(ME, work, deltas, AveragingConfig(weighting="tokens"))
    by_fednova, _ = round_of(ME, work, deltas, AveragingConfig(weighting="fednova"))
    # (the sent vectors differ by 1/8, so bf16 coding rounds them alike: only float rounding differs)
    assert torch.allclose(by_fednova.averaged, by_tokens.averaged, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(by_tokens.averaged, (deltas[ME] + deltas[B] + deltas[C]) / 3, atol=1e-3)


def test_fednova_normalizes_by_steps_and_scales_by_the_token_weighted_steps() -> None:
    deltas = updates(2)
    work = {ME: (1000, 2), B: (2000, 8), C: (4000, 32)}
    result, averager = round_of(ME, work, deltas, AveragingConfig(weighting="fednova"))
    sent = averager.calls[0]
    assert torch.equal(sent["delta"], deltas[ME] / 2) and sent["weight"] == 1000
    p = {peer: tokens for peer, (tokens, _) in work.items()}
    tau_eff = sum(p[q] * work[q][1] for q in p) / sum(p.values())  # (2000 + 16000 + 128000) / 7000
    expected = tau_eff * sum(p[q] * bf16(deltas[q] / work[q][1]) for q in p) / sum(p.values())
    assert torch.allclose(result.averaged, expected, rtol=1e-5, atol=1e-6)


def test_fednova_scale_is_computed_alike_by_every_member() -> None:
    """Each member builds its gathered metadata in its own order and counts the weights after clipping
    (C claims more than ``max_tokens_per_s`` allows); every member applies the same bits."""
    deltas = updates(3)
    work = {ME: (1000, 3), B: (2000, 7), C: (10**9, 40)}
    cfg = AveragingConfig(weighting="fednova", max_tokens_per_s=100.0)  # 6,000 tokens a 60 s round
    steps = {}
    for me, order in ((ME, [C, B]), (B, [ME, C]), (C, [B, ME])):
        mine = {ME: deltas[ME], B: deltas[B], C: deltas[C]}
        steps[me] = round_of(me, work, mine, cfg, order)[0].averaged
    assert torch.equal(steps[ME], steps[B]) and torch.equal(steps[B], steps[C])
    counted = {ME: 1000.0, B: 2000.0, C: 6000.0}  # C's claim clipped, in tau_eff as in the mean
    gathered = {peer: {"steps": s} for peer, (_, s) in work.items()}
    scale = group_scale("fednova", [C, ME, B], gathered, counted)
    assert scale == pytest.approx((1000 * 3 + 2000 * 7 + 6000 * 40) / 9000)
    assert scale == group_scale("fednova", [B, C, ME], dict(reversed(gathered.items())), counted)
    assert global_state().agreement_digest(steps[ME]) == global_state().agreement_digest(steps[C])


def test_fednova_under_the_trimmed_mean_takes_the_trimmed_mean_of_the_steps() -> None:
    gathered = {ME: {"steps": 4}, B: {"steps": 6}, C: {"steps": 10**6}}  # C claims a million steps
    weights = {ME: 1.0, B: 1.0, C: 1.0}
    assert group_scale("fednova", gathered, gathered, weights, "trimmed-mean", 0.25) == 6.0  # the median
    assert group_scale("fednova", [ME, B], gathered, weights, "trimmed-mean", 0.25) == 5.0  # two: the mean
    assert group_scale("tokens", gathered, gathered, weights) == 1.0
    assert group_scale("equal", gathered, gathered, weights) == 1.0
    # a missing or garbled claim counts as one step; a member with no steps sends its feedback as one
    assert [local_steps(s) for s in (None, "3", float("nan"), True, 0, 5)] == [1, 1, 1, 1, 1, 5]


def test_scaled_multiplies_once_in_the_vectors_precision() -> None:
    v = torch.randn(N)
    assert scaled(v, 1.0) is v
    assert torch.equal(scaled(v, 1 / 3), v * torch.tensor(1 / 3, dtype=torch.float32))


def test_fednova_error_feedback_stays_in_update_units() -> None:
    """What coding left out of the sent vector (delta / tau) is carried as tau times that: the next
    round sends (delta' + residual) / tau'."""
    deltas = updates(4)
    cfg = AveragingConfig(weighting="fednova")
    others = {B: (deltas[B] / 5, 100.0, {"steps": 5})}
    averager = GroupAverager(ME, others, cfg)
    fed = Federation(averager, FakeBoard(), cfg, "me", ME, interval_s=INTERVAL_S)
    assert isinstance(fed.run(deltas[ME], global_state(), 1, 1, tokens=100, steps=4), Applied)
    sent = deltas[ME] / 4
    carried = (sent - bf16(sent)) * 4
    assert torch.equal(fed.feedback, carried)
    fed.run(deltas[C], global_state(), 2, 1, tokens=100, steps=8)
    assert torch.equal(averager.calls[1]["delta"], (deltas[C] + carried) / 8)


def test_fednova_failed_round_remembers_its_steps_and_residual_in_update_units() -> None:
    """A round this site failed after coding (the others may have applied it) is remembered with its
    tokens, steps and residual (times tau); settling it takes them off what the next round weighs."""
    residual = torch.full((N,), 0.125)
    failed = outcome(torch.zeros(N), members=[ME, B])
    failed.ok, failed.reason, failed.averaged, failed.residual = (
        False,
        "the all-reduce timed out",
        None,
        residual,
    )
    cfg = AveragingConfig(weighting="fednova", agreement_timeout_s=0.5)
    fed = Federation(FakeAverager(failed), FakeBoard(), cfg, "me", ME)
    state, ranks = global_state(), FakeRanks(torch.full((N,), -0.5))
    stats = SiteStats(tokens_since_sync=40, steps_since_sync=4)
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 0.3, retry_s=0.05)
    handler = RoundHandler(state, ranks, fed, sync, stats, ME)
    end = handler.end(True, 5, lambda: 1)
    assert end.action == "fail" and (stats.tokens_since_sync, stats.steps_since_sync) == (40, 4)
    held = sync.pending_round
    assert (held.tokens, held.steps) == (40, 4) and torch.equal(held.residual, residual * 4)
    assert fed.averager.calls[0]["gather"]["steps"] == 4
    assert torch.equal(fed.averager.calls[0]["delta"], (state.params - ranks.local) / 4)
    stats.tokens_since_sync, stats.steps_since_sync = 50, 5  # one more step trained since
    handler._settled(held)
    assert (stats.tokens_since_sync, stats.steps_since_sync) == (10, 1)
    assert torch.equal(fed.feedback, residual * 4)


# ---------------------------------------------------------------------------------------- equal


def test_equal_weighting_ignores_tokens() -> None:
    deltas = updates(5)
    work = {ME: (10, 1), B: (10_000, 4), C: (10**9, 40)}  # C claims a billion: it counts as one too
    result, averager = round_of(ME, work, deltas, AveragingConfig(weighting="equal"))
    assert averager.calls[0]["weight"] == 1.0 and torch.equal(averager.calls[0]["delta"], deltas[ME])
    mean = sum(bf16(deltas[q]) for q in (B, C, ME)) / 3
    assert torch.allclose(result.averaged, mean, rtol=1e-6, atol=1e-7)
    claims = {ME: {"tokens": 1.0}, B: {"tokens": 1e9}}
    rules = {**AveragingConfig(weighting="equal", max_tokens_per_s=1.0).rules(), "interval_s": 60.0}
    assert bounded_weights(claims, rules, 60.0) == ({ME: 1.0, B: 1.0}, {})


# ---------------------------------------------------------------------------------------- the site's counters


def test_steps_since_the_last_outer_step_move_into_the_round() -> None:
    state, ranks = global_state(), FakeRanks(torch.full((N,), 0.5))
    stats = SiteStats(tokens_since_sync=30, steps_since_sync=3)
    cfg = AveragingConfig(weighting="fednova", agreement_timeout_s=0.5)
    averager = FakeAverager(outcome(torch.zeros(N)), RoundOutcome(False, reason="no group formed"))
    fed = Federation(averager, FakeBoard(), cfg, "me", ME)
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 0.3, retry_s=0.05)
    handler = RoundHandler(state, ranks, fed, sync, stats, ME)
    assert handler.end(True, 1, lambda: 1).action == "apply"
    assert (stats.tokens_since_sync, stats.steps_since_sync) == (0, 0) and averager.calls[0]["weight"] == 30
    stats.tokens_since_sync, stats.steps_since_sync = 20, 2  # two steps trained since
    assert handler.end(True, 2, lambda: 1).action == "fail"
    assert (stats.tokens_since_sync, stats.steps_since_sync) == (20, 2)  # back: they weigh in the next
    assert averager.calls[1]["gather"]["steps"] == 2
    # a SOLO step has no weighting, and banks the steps with the tokens
    end = handler.end(False, 3, lambda: 0)
    assert end.action == "solo" and (stats.tokens_since_sync, stats.steps_since_sync) == (0, 0)
    assert len(averager.calls) == 2


def test_counters_and_remembered_rounds_from_before_steps_were_kept_still_load() -> None:
    stats = SiteStats()
    stats.load_state_dict(
        {"local_steps": 9, "tokens": 90, "loss": 2.0, "tokens_since_sync": 30, "counts": {}}
    )
    assert (stats.tokens_since_sync, stats.steps_since_sync) == (30, 0)
    stats.steps_since_sync = 3
    again = SiteStats()
    again.load_state_dict(stats.state_dict())
    assert again.steps_since_sync == 3
    old = {"slot": 1, "lineage": "x", "delta": torch.zeros(2), "tokens": 5, "residual": None}
    assert PendingRound(**old).steps == 0
    assert PendingRound(**{**old, "steps": 4}).state_dict()["steps"] == 4


# ---------------------------------------------------------------------------------------- the benchmark

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "weighting.py"


@pytest.mark.parametrize("weighting", ["tokens", "fednova", "equal"])
def test_the_benchmark_combines_as_the_node_does(weighting: str) -> None:
    """``benchmarks/weighting.py`` measures the node's rule: its step is the one a member's Federation
    applies for the same group (no wire coding, as in the benchmark)."""
    spec = importlib.util.spec_from_file_location("weighting_benchmark", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    deltas = updates(6)
    work = {ME: (1000, 6), B: (2000, 12), C: (4000, 24)}
    step, scale = benchmark.combine(weighting, {p: (deltas[p], *work[p]) for p in work})
    result, _ = round_of(ME, work, deltas, AveragingConfig(weighting=weighting), code=lambda v: v)
    assert torch.equal(step, result.averaged)
    assert scale == {"tokens": 1.0, "equal": 1.0, "fednova": (6000 + 24000 + 96000) / 7000}[weighting]


def test_the_benchmark_runs_and_fednova_matches_tokens_with_bigger_batches() -> None:
    """A tiny run of the benchmark's ``batch`` scenario (every site takes the same steps): fednova and
    tokens train the same model, and every run the same tokens."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--seeds",
            "0",
            "--rounds",
            "2",
            "--inner",
            "1",
            "--micro-batch",
            "1",
        ]
        + ["--eval-batches", "1", "--scenarios", "batch", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    runs = {r["weighting"]: r for r in report["runs"]}
    assert set(runs) == {"tokens", "fednova", "equal"} and len({r["tokens"] for r in runs.values()}) == 1
    assert runs["fednova"]["eval_loss"] == pytest.approx(runs["tokens"]["eval_loss"], rel=1e-4)
    row = {r["weighting"]: r for r in report["table"]}["fednova"]
    assert row["median_vs_tokens"] == pytest.approx(1.0, rel=1e-4) and row["median_mid_loss"] is not None
