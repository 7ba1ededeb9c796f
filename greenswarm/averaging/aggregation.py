"""How a group's pseudo-gradients become one: bounded weights, and a robust alternative to the mean.

**Bounded weights.** A member's weight in the mean is the number of tokens it says it trained since
its last round. Said, not shown: one member could claim a billion and make the average its own
update, within the norm bound that screening (:mod:`greenswarm.averaging.screening`) enforces. With
``averaging.max_tokens_per_s`` (and, per member, its certificate's ``max_tokens_per_s``) a claim is
counted at most at that rate over the round's interval (:func:`bounded_weights`). Every member
computes the same counted weights from the gathered metadata, and each reducer weights a sender's
parts by them, not by what the part's message says (a message that says more than the gathered
claim is a lie, and refused: :func:`weight_lie`), so every slice of the vector is averaged with
the same weights.

**Trimmed mean** (``averaging.aggregate: trimmed-mean``). Coordinate by coordinate, the ``trim``
share of the largest values and of the smallest are left out and the rest averaged with equal
weights (Yin et al., "Byzantine-robust distributed learning", ICML 2018). One attacker of four, with
``trim`` 0.25, never moves a coordinate outside the range of the three honest values, whatever it
sends in whatever direction; the mean moves as far as the attacker's weight and norm bound let it.
The price: tokens no longer weight the sites (a site that trained little counts as much as one that
trained a lot), the honest extremes are dropped too, and each reducer sorts every coordinate of its
slice across the group (:class:`TrimmedMeanReducer`). The reducer keeps every sender's part of the
slice it is reducing, one part at a time, where the mean keeps a running sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from hivemind.averaging.partition import TensorPartReducer

#: a part's message may say a weight this much above the gathered claim (float round trips)
WEIGHT_TOLERANCE = 1e-6


def trimmed_mean(stacked: torch.Tensor, trim: float) -> torch.Tensor:
    """The coordinate-wise trimmed mean of ``stacked``'s rows: ``floor(trim * n)`` of the largest and of
    the smallest values of each column left out, at least one with any ``trim`` (so a group of three
    takes the median: 0.25 of three rounds down to none, and one attacker would go straight in) and
    fewer if that would leave none (a group of two is averaged), the rest averaged."""
    n = stacked.shape[0]
    cut = min(max(math.floor(trim * n + 1e-9), 1 if trim > 0 else 0), (n - 1) // 2)
    if cut == 0:
        return stacked.mean(dim=0)
    ordered, _ = torch.sort(stacked, dim=0)
    return ordered[cut : n - cut].mean(dim=0)


class _PartsOfOneSlice:
    """Stands in for hivemind's running sum of one part: it keeps each sender's part (``add_``) and,
    once all are in, hands back their trimmed mean (``div_``). A part with no weight (a member whose
    own update was refused sends zeros, weighted 0) is not a value, and is left out."""

    def __init__(self, shape: torch.Size, trim: float):
        self.shape, self.trim = shape, trim
        self.parts: list[torch.Tensor] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> _PartsOfOneSlice:
        if alpha:
            self.parts.append(part.detach().reshape(-1).to(torch.float32))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        if not self.parts:
            return torch.zeros(self.shape)
        return trimmed_mean(torch.stack(self.parts), self.trim).reshape(self.shape)


class TrimmedMeanReducer(TensorPartReducer):
    """hivemind's part reducer with the trimmed mean in place of the weighted mean: the same waits,
    failures and bans, and an accumulator that keeps the parts (see :class:`_PartsOfOneSlice`)."""

    def __init__(self, part_shapes: Any, num_senders: int, trim: float):
        self.trim = trim  # (set first: the base class makes the first accumulator in its __init__)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartsOfOneSlice(self.part_shapes[self.current_part_index], self.trim)


def member_rate(rules: Mapping[str, Any], certificate_rate: float | None) -> float | None:
    """The most tokens a second a member may claim: the swarm's and its certificate's, the lower."""
    rates = [r for r in (rules.get("max_tokens_per_s"), certificate_rate) if r is not None]
    return min(float(r) for r in rates) if rates else None


def claimed_weight(user: Any) -> float:
    """The weight a member claims in its gathered metadata: its ``tokens``, at least 1e-6 (what the
    averager's step weighs a zero claim at); a missing or garbled claim counts as that least."""
    tokens = user.get("tokens") if isinstance(user, Mapping) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int | float) or not math.isfinite(tokens):
        tokens = 0.0
    return max(float(tokens), 1e-6)


def bounded_weights(
    claims: Mapping[str, Any],
    rules: Mapping[str, Any],
    interval_s: float,
    certificate_rates: Mapping[str, float | None] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """``(peer -> the weight its parts count with, peer -> why it was clipped)`` for one group, from the
    members' gathered metadata (each a dict with ``tokens``): a claim above the member's rate
    (:func:`member_rate`) times ``interval_s`` counts as that much. Under ``averaging.weighting:
    equal`` every member counts as 1, whatever it claims. The same on every member."""
    weights: dict[str, float] = {}
    clipped: dict[str, str] = {}
    if rules.get("weighting") == "equal":
        return dict.fromkeys(claims, 1.0), clipped
    rates = certificate_rates or {}
    for peer, user in claims.items():
        claimed = claimed_weight(user)
        rate = member_rate(rules, rates.get(peer))
        weights[peer] = claimed
        if rate is not None and claimed > rate * interval_s:
            weights[peer] = max(rate * interval_s, 1e-6)
            clipped[peer] = (
                f"it claimed {claimed:,.0f} tokens in a {interval_s:g} s round, more than {rate:g} tokens/s "
                f"allows: counted as {weights[peer]:,.0f}"
            )
    return weights, clipped


def weight_lie(message_weight: float, claimed: float) -> str | None:
    """Why a part whose message says ``message_weight`` is refused, given its sender's gathered claim."""
    if message_weight > claimed * (1 + WEIGHT_TOLERANCE) + 1e-9:
        return f"its parts say weight {message_weight:g}, more than the {claimed:g} tokens it claimed"
    return None
