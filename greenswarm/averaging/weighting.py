"""How much each member's pseudo-gradient counts in a round (``averaging.weighting``).

Sites differ in GPUs, batch size and how much of a round they were in a window, so the members of a
group bring pseudo-gradients over very different amounts of training. The weighting decides what
each member sends and with what weight; the node (:class:`~greenswarm.node.federation.Federation`)
and ``benchmarks/weighting.py`` both combine through this module, so the benchmark measures exactly
what the node does.

* ``tokens`` (the default) -- a member sends its update ``delta`` with weight = the tokens it trained
  since its last outer step: the group's step is the token-weighted mean of the updates.
* ``equal`` -- a member sends ``delta`` with weight 1, and every member counts as 1 whatever it claims
  (:func:`~greenswarm.averaging.aggregation.bounded_weights`): the plain mean of the updates.
* ``fednova`` -- normalized averaging (Wang et al., "Tackling the Objective Inconsistency Problem in
  Heterogeneous Federated Optimization", NeurIPS 2020, arXiv 2007.07481). A member that took ``tau_i``
  inner steps since its last outer step sends ``delta_i / tau_i`` (its mean progress per step) with
  weight ``p_i`` = its tokens (its data share), and every member multiplies the group's weighted mean
  by ``tau_eff = sum_i p_i tau_i / sum_i p_i``::

      step = tau_eff * sum_i p_i (delta_i / tau_i) / sum_i p_i

  This is the paper's FedNova with the vanilla-SGD normalizer ``||a_i||_1 = tau_i`` and its default
  ``tau_eff = sum_i p_i ||a_i||_1`` (the inner optimizer here is AdamW, for which the paper gives no
  closed-form ``a_i``; counting steps is the variant its experiments with plain local steps use). A
  member that trained more steps no longer pulls the step towards its own local optimum in proportion
  to its steps on top of its data share; with the same ``tau`` at every member it is ``tokens`` (up to
  float rounding).

Every member must apply the same bits (they publish digests of what they apply and must agree), so
``tau_eff`` is computed from the group's gathered metadata (each member gathers its ``steps``), in
sorted peer order, with the weights the reducers counted (the claims after ``max_tokens_per_s``
clipping; :func:`~greenswarm.averaging.aggregation.bounded_weights`); under ``aggregate:
trimmed-mean``, which ignores weights, it is the trimmed mean of the members' steps with the same
``trim`` (equal weights for the steps that are kept), so one member's claim cannot blow the step up.
The scale is rounded to fp32 once and multiplied in fp32: one correctly rounded product per value.

What coding leaves out of a sent vector (error feedback) is in sent units; :func:`to_update_units`
turns it back into units of ``delta`` (times ``tau``), so error feedback and a remembered round
(:mod:`greenswarm.node.state_sync`) stay in the units of the update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from greenswarm.averaging.aggregation import trimmed_mean


def local_steps(steps: Any) -> int:
    """``tau``: a member's inner steps since its last outer step, at least 1 (a member that took none
    sends only its error feedback, which counts as one step's worth)."""
    if isinstance(steps, bool) or not isinstance(steps, int | float) or not math.isfinite(steps):
        return 1
    return max(int(steps), 1)


def outgoing(weighting: str, update: torch.Tensor, tokens: float, steps: int) -> tuple[torch.Tensor, float]:
    """``(vector to send, weight to claim)`` for this member's ``update`` (delta units, error feedback
    included) over ``tokens`` tokens and ``steps`` inner steps. ``tokens`` goes out as it came (the
    default's weight, bit for bit)."""
    if weighting == "fednova":
        return update / local_steps(steps), tokens
    if weighting == "equal":
        return update, 1.0
    return update, tokens


def to_update_units(weighting: str, sent: torch.Tensor | None, steps: int) -> torch.Tensor | None:
    """A vector in the units this member sent (a coding residual) in units of its update: times ``tau``
    under ``fednova``, as it is otherwise (the same tensor)."""
    if sent is None or weighting != "fednova":
        return sent
    return sent * local_steps(steps)


def claimed_steps(user: Any) -> int:
    """The steps a member gathered (:func:`local_steps` of its ``steps``; missing or garbled: 1)."""
    return local_steps(user.get("steps") if isinstance(user, Mapping) else None)


def group_scale(
    weighting: str,
    members: Iterable[str],
    gathered: Mapping[str, Any],
    weights: Mapping[str, float],
    aggregate: str = "mean",
    trim: float = 0.25,
) -> float:
    """What every member multiplies the group's combined vector by: ``tau_eff`` under ``fednova`` (see
    the module's docstring), 1 otherwise. ``members``: the admitted members (their updates were
    combined); ``gathered``: peer -> its gathered metadata (``steps``); ``weights``: peer -> the weight
    the reducers counted for it. The same on every member: sorted peers, plain float arithmetic."""
    if weighting != "fednova":
        return 1.0
    peers = sorted(members)
    if not peers:
        return 1.0
    taus = [float(claimed_steps(gathered.get(peer))) for peer in peers]
    if aggregate == "trimmed-mean":
        column = torch.tensor(taus, dtype=torch.float64).reshape(-1, 1)
        return float(trimmed_mean(column, trim)[0])
    counted = [float(weights.get(peer, 0.0)) for peer in peers]
    total = math.fsum(counted)  # (each counted weight is at least 1e-6: never 0)
    if not total > 0:
        return 1.0
    return math.fsum(w * t for w, t in zip(counted, taus, strict=True)) / total


def scaled(vector: torch.Tensor, scale: float) -> torch.Tensor:
    """``vector`` times ``scale`` (rounded to the vector's dtype once); ``vector`` itself when 1."""
    if scale == 1.0:
        return vector
    return vector * torch.tensor(scale, dtype=vector.dtype)
