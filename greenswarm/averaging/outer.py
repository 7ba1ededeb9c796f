"""The outer step: each site's view of the global model and how an averaged pseudo-gradient moves it.

All outer math happens on one flat fp32 CPU vector per site (on rank 0 under torchrun), so the same
code serves a CPU toy and an FSDP-sharded model, and sites that start equal and apply the same
averaged pseudo-gradient stay equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from greenswarm.averaging.screening import all_finite


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate tensors into one flat fp32 CPU vector (into ``out`` when given)."""
    numel = sum(t.numel() for t in tensors)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return out


def unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes (no copy)."""
    views, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        views.append(flat[offset : offset + n].view(shape))
        offset += n
    return views


class OuterOptimizer:
    """Holds ``theta_global`` and the outer momentum; applies DiLoCo (Nesterov) or FedAvg steps.

    DiLoCo (Douillard et al., 2023): ``g = theta_global - theta_local`` averaged over sites, then SGD
    with Nesterov momentum on ``theta_global``. FedAvg is the special case lr=1, momentum=0.
    """

    def __init__(self, initial: torch.Tensor, lr: float, momentum: float, nesterov: bool):
        self.params = initial.detach().to(torch.float32).clone()
        self.momentum_buffer = torch.zeros_like(self.params)
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

    @classmethod
    def from_config(cls, initial: torch.Tensor, outer: str, lr: float, momentum: float, nesterov: bool):
        if outer == "fedavg":
            return cls(initial, lr=1.0, momentum=0.0, nesterov=False)
        return cls(initial, lr=lr, momentum=momentum, nesterov=nesterov)

    @property
    def numel(self) -> int:
        return self.params.numel()

    def pseudo_gradient(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``theta_global - theta_local`` as a flat vector."""
        return torch.sub(self.params, local, out=out)

    def step(self, averaged: torch.Tensor) -> None:
        """Apply one outer step with an averaged pseudo-gradient (same arithmetic on every site)."""
        if not all_finite(averaged):
            raise FloatingPointError("averaged pseudo-gradient has NaN/Inf; refusing to apply it")
        if self.momentum:
            self.momentum_buffer.mul_(self.momentum).add_(averaged)
            update = (
                averaged.add(self.momentum_buffer, alpha=self.momentum)
                if self.nesterov
                else self.momentum_buffer
            )
        else:
            update = averaged
        self.params.sub_(update, alpha=self.lr)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.params, self.momentum_buffer]

    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        params, momentum = tensors
        if params.numel() != self.numel or momentum.numel() != self.numel:
            raise ValueError(f"outer state has {params.numel()} values, expected {self.numel}")
        self.params.copy_(params.reshape(-1))
        self.momentum_buffer.copy_(momentum.reshape(-1))

    def digest(self) -> str:
        """A short digest of the global parameters (for logs and tests, not for consensus)."""
        return hashlib.sha256(self.params.numpy()).hexdigest()[:12]  # (hashed in place, not copied)


GENESIS = "genesis"


def next_lineage(lineage: str, round_index: int, members: Sequence[str]) -> str:
    """The lineage after an outer step taken in ``round_index`` by ``members`` (peer ids).

    Sites that share a lineage hold the same global parameters (within codec tolerance): they started
    from the same one and applied the same averaged step. Everyone in a group computes the same value
    from information they all have, without an extra message.
    """
    text = "|".join([lineage, str(round_index), *sorted(members)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def group_bits(lineage: str, nbits: int = 24) -> str:
    """Averaging-group key bits: only sites that hold the same global state (lineage) can match.

    The round slot is deliberately *not* in the key: a site whose last attempt overran a slot would
    otherwise look for its group one slot behind the others, and two sites could alternate slots
    forever without meeting. The group's slot is agreed afterwards (the latest of its members').
    """
    digest = hashlib.sha256(f"lineage:{lineage}".encode()).digest()
    value = int.from_bytes(digest[:4], "big") >> (32 - nbits)
    return format(value, f"0{nbits}b")
