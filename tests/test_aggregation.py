"""Bounded weights and the trimmed mean, in-process: what every reducer computes from the gathered claims."""

from __future__ import annotations

import asyncio

import pytest
import torch

from greenswarm.averaging.aggregation import (
    TrimmedMeanReducer,
    bounded_weights,
    claimed_weight,
    member_rate,
    trimmed_mean,
    weight_lie,
)
from greenswarm.averaging.averager import RulesMismatch, check_rules
from greenswarm.averaging.config import AveragingConfig
from greenswarm.averaging.screening import within_claims
from greenswarm.errors import ConfigError

pytestmark = pytest.mark.hardening


def test_trimmed_mean_leaves_out_the_extremes_of_each_coordinate() -> None:
    rows = torch.tensor([[1.0, 10.0], [2.0, -50.0], [3.0, 20.0], [1000.0, 30.0]])
    # trim 0.25 of 4: one largest and one smallest per column, the middle two averaged
    assert trimmed_mean(rows, 0.25).tolist() == [2.5, 15.0]
    assert trimmed_mean(rows, 0.0).tolist() == pytest.approx(rows.mean(dim=0).tolist())
    # two rows cannot lose one each side: the mean of both (never an empty set)
    assert trimmed_mean(rows[:2], 0.4).tolist() == [1.5, -20.0]
    # three rows with trim 0.25 (of three: none) still lose one each side: the median, so one
    # attacker of a group of three is left out too
    assert trimmed_mean(rows[1:], 0.25).tolist() == [3.0, 20.0]


@pytest.mark.parametrize("attack", [-100.0, 1e6])  # a sign-flipped and scaled update, a huge one
def test_one_attacker_of_four_stays_inside_the_honest_range(attack: float) -> None:
    """Whatever one member of four sends, each coordinate of the trimmed mean lies between the honest
    members' values there; the mean follows the attacker."""
    honest = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([honest, attack * honest[:1]])
    robust = trimmed_mean(rows, 0.25)
    assert bool((robust >= honest.min(dim=0).values - 1e-6).all())
    assert bool((robust <= honest.max(dim=0).values + 1e-6).all())
    assert float((rows.mean(dim=0) - honest.mean(dim=0)).norm()) > 10 * float(
        (robust - honest.mean(dim=0)).norm()
    )


def test_the_reducer_returns_each_parts_trimmed_mean_and_leaves_out_weightless_parts() -> None:
    """hivemind's part reducer with the trimmed mean: four senders, two parts; a sender with weight 0
    (a member whose own update was refused sends zeros) is no value."""

    async def reduce() -> list[list[float]]:
        reducer = TrimmedMeanReducer([torch.Size([2]), torch.Size([2])], num_senders=4, trim=0.25)
        values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [-100.0, 100.0]]

        async def sender(i: int) -> list[list[float]]:
            out = []
            for part in range(2):
                weight = 0.0 if i == 3 and part == 1 else 1.0
                got = await reducer.accumulate_part(
                    i, part, torch.tensor(values[i]) * (part + 1), weight=weight
                )
                out.append(got.tolist())
            return out

        results = await asyncio.gather(*(sender(i) for i in range(4)))
        assert all(r == results[0] for r in results)  # every sender gets the same average
        return results[0]

    first, second = asyncio.run(reduce())
    assert first == [2.0, 5.0]  # [-100, 1, 3, 5] -> (1 + 3) / 2; [2, 4, 6, 100] -> (4 + 6) / 2
    assert second == [6.0, 8.0]  # three values, trim 0.25 of 3 is none: the mean of 2, 6, 10 and 4, 8, 12


def test_claims_above_the_rate_count_as_the_rate_times_the_interval() -> None:
    claims = {
        "a": {"tokens": 1000},
        "b": {"tokens": 10**9},  # claims a billion
        "c": {"tokens": 0},
        "d": {"tokens": float("nan")},
    }
    weights, clipped = bounded_weights(claims, {"max_tokens_per_s": 100.0}, interval_s=60.0)
    assert weights == {"a": 1000.0, "b": 6000.0, "c": 1e-6, "d": 1e-6}
    assert set(clipped) == {"b"} and "counted as 6,000" in clipped["b"]
    # a certificate's own rate bounds its holder lower; no rate at all bounds nothing
    weights, clipped = bounded_weights(claims, {"max_tokens_per_s": 100.0}, 60.0, {"a": 10.0})
    assert weights["a"] == 600.0 and set(clipped) == {"a", "b"}
    assert bounded_weights(claims, {}, 60.0)[0]["b"] == 1e9
    assert member_rate({"max_tokens_per_s": None}, 5.0) == 5.0 and member_rate({}, None) is None
    assert claimed_weight({"tokens": True}) == 1e-6  # (a bool is no count)


def test_a_part_that_says_more_weight_than_its_sender_claimed_is_a_lie() -> None:
    assert weight_lie(1000.0, 1000.0) is None
    assert "more than the 10 tokens it claimed" in weight_lie(1e9, 10.0)


def test_a_group_whose_members_combine_by_other_rules_is_refused() -> None:
    rules = {**AveragingConfig().rules(), "interval_s": 5.0}
    users = [("me", {"site": "a", "rules": rules}), ("them", {"site": "b", "rules": rules})]
    check_rules(users, "me")
    other = [("me", {"site": "a", "rules": rules}), ("them", {"site": "b", "rules": {**rules, "trim": 0.1}})]
    with pytest.raises(RulesMismatch, match="b .* combines updates by"):
        check_rules(other, "me")
    older = [("me", {"site": "a", "rules": rules}), ("them", {"site": "b"})]  # an older greenswarm
    with pytest.raises(RulesMismatch):
        check_rules(older, "me")


def test_a_coordinatewise_aggregate_may_pass_every_members_norm_but_not_their_sum() -> None:
    """The coordinate-wise median of (1,1,0), (1,0,1), (0,1,1) is (1,1,1): longer than each of them."""
    rows = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    median = trimmed_mean(rows, 0.34)
    claims = [float(r.norm()) for r in rows]
    assert within_claims(median, claims) is not None  # the mean's bound would call it poisoned
    assert within_claims(median, claims, coordinatewise=True) is None
    assert within_claims(10 * median, claims, coordinatewise=True) is not None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"aggregate": "median"}, "aggregate"),
        ({"trim": 0.5}, "trim"),
        ({"max_tokens_per_s": 0}, "max_tokens_per_s"),
        ({"aggregate": "trimmed-mean", "max_group_size": 2}, "max_group_size"),  # (it needs three)
    ],
)
def test_aggregation_fields_are_checked_at_load(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        AveragingConfig(**overrides).validate()
    assert err.value.field == field
