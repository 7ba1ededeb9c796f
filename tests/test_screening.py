"""The group's verdict on poisoned updates (issue #7, part 4), from the gathered claims alone."""

from __future__ import annotations

import pytest
import torch

from greenswarm.averaging.screening import screen_claims, screen_part, within_claims

pytestmark = pytest.mark.security


def _claims(**norms: float | tuple[float, float]) -> dict[str, dict]:
    out = {}
    for peer, value in norms.items():
        norm, recent = value if isinstance(value, tuple) else (value, 0.0)
        out[peer] = {"norm": norm, "recent": recent}
    return out


def test_nan_missing_and_outsized_updates_are_refused() -> None:
    claims = {**_claims(a=1.0, b=1.2, c=float("nan"), d=1000.0), "e": {"site": "e"}}
    refused = screen_claims(claims, max_norm_ratio=10)
    assert set(refused) == {"c", "d", "e"}
    assert "NaN/Inf" in refused["c"] and "limit 10x" in refused["d"] and "did not say" in refused["e"]


def test_a_site_that_trained_longer_is_judged_by_the_groups_recent_updates() -> None:
    """One site entered its window just before the boundary: its update is tiny. The other's is 26x
    larger, as large as the updates the group applied lately: not an outlier."""
    claims = _claims(big=(1.32, 0.0), small=(0.05, 1.1))
    assert screen_claims(claims, max_norm_ratio=10) == {}
    # without that history, the same claims look like an outlier
    assert set(screen_claims(_claims(big=1.32, small=0.05), max_norm_ratio=10)) == {"big"}
    # 1000x of a normal update stays out, history or not
    assert set(screen_claims(_claims(big=(1100.0, 0.0), small=(0.05, 1.1)), max_norm_ratio=10)) == {"big"}


def test_a_member_cannot_widen_its_own_limit() -> None:
    """Its own inflated 'recent' or a zero-norm groupmate does not move the scale it is judged by."""
    claims = _claims(liar=(1000.0, 1e6), a=(1.0, 1.0), b=(0.0, 0.0))
    assert set(screen_claims(claims, max_norm_ratio=10)) == {"liar"}


def test_the_norm_check_can_be_turned_off_but_nan_cannot() -> None:
    refused = screen_claims(_claims(a=1.0, b=1e6, c=float("inf")), max_norm_ratio=0)
    assert set(refused) == {"c"}


def test_parts_are_held_to_their_senders_claim() -> None:
    part = torch.ones(100)  # norm 10
    assert screen_part(part, claimed_norm=10.0) is None
    assert "more than the" in screen_part(part * 2, claimed_norm=10.0)
    assert "NaN/Inf" in screen_part(torch.tensor([1.0, float("nan")]), claimed_norm=None)
    assert within_claims(torch.ones(4), [2.0, 1.0]) is None  # norm 2: an average of these can be
    assert "a reducer returned a poisoned part" in within_claims(torch.ones(4) * 3, [2.0, 1.0])


def test_under_the_trimmed_mean_a_group_left_with_two_updates_is_refused_by_every_member() -> None:
    """hivemind's minimum group is a leader's rule: a leader that assembles a pair, or a group of three
    whose screening refuses one, would leave the trimmed mean two values, a plain mean. Every member
    computes the same admitted set from the same claims, so each refuses the round alike; under the
    mean the two are averaged as before."""
    from types import SimpleNamespace

    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.config import AveragingConfig
    from greenswarm.averaging.round_report import RoundReport

    claims = _claims(a=1.0, b=1.2, p=1000.0)  # p's update is refused by the norm screen
    users = list(claims.items())
    group = SimpleNamespace(peer_ids=[])  # (the return value's peers: not reached, or not read here)
    for aggregate, fails in (("trimmed-mean", True), ("mean", False)):
        me = SimpleNamespace(
            _cfg=AveragingConfig(aggregate=aggregate, max_norm_ratio=10), peer_id="a", _rates={}
        )
        report = RoundReport()
        if fails:
            with pytest.raises(ValueError, match="2 of the group's updates would count"):
                SwarmAverager._screened(me, group, users, [1 / 3] * 3, report)  # type: ignore[arg-type]
            assert "trimmed-mean needs 3" in report.refusal
        else:
            SwarmAverager._screened(me, group, users, [1 / 3] * 3, report)  # type: ignore[arg-type]
            assert report.refusal == ""
