"""Refusing poisoned updates before they are averaged.

A member of a group may send a pseudo-gradient with NaN/Inf (a diverged or broken site) or one far
larger than everyone else's (a bug, or an attack): averaged in, either ruins every member's model
in one round. Two checks keep them out, and both act *before* a value is accumulated:

1. **Claims, checked by the whole group.** Each member gathers the norm of the update it is about to
   send. Every member reads the same gathered claims and computes the same verdict
   (:func:`screen_claims`): a claim that is missing, NaN/Inf, or more than ``max_norm_ratio`` times
   the lower median of the other members' claims is refused. A refused member takes no part in the
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
        for peer, norm in norms.items():
            # zero updates (a member that trained nothing) say nothing about the scale
            others = sorted(n for p, n in norms.items() if p != peer and n > 0)
            if not others:
                continue
            reference = others[(len(others) - 1) // 2]  # the lower median: robust to one huge claim
            if norm > max_norm_ratio * reference:
                refused[peer] = (
                    f"its update norm {norm:.3g} is {norm / reference:.0f}x the group's median "
                    f"{reference:.3g} (limit {max_norm_ratio:g}x)"
                )
    return refused


def screen_part(part: torch.Tensor, claimed_norm: float | None) -> str | None:
    """Why a received part of a sender's update is refused, or None to accumulate it."""
    if not bool(torch.isfinite(part).all()):
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


def within_claims(averaged: torch.Tensor, claims: list[float]) -> str | None:
    """Why a group's averaged update cannot be an average of the admitted claims, or None.

    An average is a convex combination, so its norm is at most the largest member's: a reducer that
    returned a poisoned part (a member may reduce a slice for the whole group) shows up here.
    """
    if not claims:
        return None
    norm = update_norm(averaged)
    limit = max(claims) * (1 + CLAIM_TOLERANCE) + 1e-12
    if not norm <= limit:
        return (
            f"the averaged update has norm {norm:.3g}, more than any admitted member's ({max(claims):.3g}): "
            "a reducer returned a poisoned part"
        )
    return None
