"""Refusing poisoned updates before they are averaged.

A member of a group may send a pseudo-gradient with NaN/Inf (a diverged or broken site) or one far
larger than everyone else's (a bug, or an attack): averaged in, either ruins every member's model
in one round. Two checks keep them out, and both act *before* a value is accumulated (a third,
:func:`within_claims`, checks the result):

1. **Claims, checked by the whole group.** Each member gathers the norm of the update it is about to
   send, and the norm of the last update it applied to the global model (``recent``). Every member
   reads the same gathered claims and computes the same verdict (:func:`screen_claims`): a claim
   that is missing, NaN/Inf, or more than ``max_norm_ratio`` times the group's *scale* is refused.
   A member's scale comes from the *other* members only: the larger of the lower median of their
   claims and the lower median of their recent updates. The second keeps an honest site that trained
   much longer this round than its groupmates (one entered its window just before the boundary)
   from being refused as an outlier round after round; judging each member by the others' figures
   keeps its own inflated claims from widening its limit. A refused member takes no part in the
   all-reduce (it sends nothing and reduces nothing), so the others end with exactly the average
   they would have computed had it sent nothing.
2. **Parts, checked by each reducer.** A member may lie in its claim. Each reducer checks every
   part it receives (:func:`screen_part`): finite, and no larger than the sender's claimed norm for
   the whole vector. A part that fails is not accumulated and the sender is dropped by that reducer.
   A liar therefore gets in only parts within its claim, which the first check bounded.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: a part may exceed its sender's claim by this much (coding for the wire moves a norm a little)
CLAIM_TOLERANCE = 0.05


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite, from its smallest and largest value (one reduction, no
    mask as large as ``x``): NaN makes both NaN, +Inf the largest, -Inf the smallest. ``isfinite(x).all()``
    says the same, ~20x slower at ~100 M values, and a round checks model-sized vectors several times."""
    if not x.is_floating_point() or not x.numel():
        return True
    low, high = torch.aminmax(x.detach())
    return math.isfinite(float(low)) and math.isfinite(float(high))


def screen_claims(claims: dict[str, Any], max_norm_ratio: float) -> dict[str, str]:
    """``peer -> why its update is refused`` for one group, from the members' gathered metadata
    (each a dict with ``norm``); the same on every member because the gathered data is."""
    norms: dict[str, float] = {}
    refused: dict[str, str] = {}
    for peer, user in claims.items():
        norm = user.get("norm") if isinstance(user, dict) else None
        if isinstance(norm, bool) or not isinstance(norm, int | float):
            refused[peer] = "it did not say how large its update is"
        elif not math.isfinite(norm) or norm < 0:
            refused[peer] = "its update has NaN/Inf values"
        else:
            norms[peer] = float(norm)
    if max_norm_ratio > 0:
        recents = {p: _positive(u.get("recent")) for p, u in claims.items() if isinstance(u, dict)}
        for peer, norm in norms.items():
            # a member is judged by the others' figures only, so its own claims cannot widen its
            # limit; zero updates and newcomers (no recent update) say nothing about the scale
            now = _lower_median([n for p, n in norms.items() if p != peer])
            recent = _lower_median([r for p, r in recents.items() if p != peer])
            reference = max(now, recent)
            if reference <= 0:
                continue
            if norm > max_norm_ratio * reference:
                refused[peer] = (
                    f"its update norm {norm:.3g} is {norm / reference:.0f}x the group's scale "
                    f"{reference:.3g} (limit {max_norm_ratio:g}x)"
                )
    return refused


def _positive(value: Any) -> float:
    """A gathered number if it is a finite positive float, else 0 (missing, garbled or a newcomer's)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(0.0, float(value))


def _lower_median(values: list[float]) -> float:
    """The lower median of the positive values (0 if none): one inflated value cannot raise it."""
    positive = sorted(v for v in values if v > 0)
    return positive[(len(positive) - 1) // 2] if positive else 0.0


def screen_part(part: torch.Tensor, claimed_norm: float | None) -> str | None:
    """Why a received part of a sender's update is refused, or None to accumulate it."""
    if not all_finite(part):
        return "a part of its update has NaN/Inf values"
    if claimed_norm is not None:
        norm = float(torch.linalg.vector_norm(part.float()))
        if norm > claimed_norm * (1 + CLAIM_TOLERANCE) + 1e-12:
            return (
                f"a part of its update has norm {norm:.3g}, "
                f"more than the {claimed_norm:.3g} it claimed for all of it"
            )
    return None


def update_norm(update: torch.Tensor) -> float:
    """The norm a member claims for its update (NaN or Inf when the update is not finite)."""
    return float(torch.linalg.vector_norm(update.float()))


def within_claims(averaged: torch.Tensor, claims: list[float], coordinatewise: bool = False) -> str | None:
    """Why a group's averaged update cannot be an average of the admitted claims, or None.

    An average is a convex combination, so its norm is at most the largest member's: a reducer that
    returned a poisoned part (a member may reduce a slice for the whole group) shows up here. A
    ``coordinatewise`` aggregate (the trimmed mean) combines each coordinate with weights of its own,
    so its norm can pass the largest member's; each of its values lies between the members' values
    there, so it is at most the root of the members' squared norms summed.
    """
    if not claims:
        return None
    norm = update_norm(averaged)
    bound = math.sqrt(sum(c * c for c in claims)) if coordinatewise else max(claims)
    limit = bound * (1 + CLAIM_TOLERANCE) + 1e-12
    if not norm <= limit:
        which = "the members' together" if coordinatewise else "any admitted member's"
        return (
            f"the averaged update has norm {norm:.3g}, more than {which} ({bound:.3g}): "
            "a reducer returned a poisoned part"
        )
    return None
