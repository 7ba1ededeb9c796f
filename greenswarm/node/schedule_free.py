"""Schedule-Free AdamW (Defazio et al., 2024, "The Road Less Scheduled"), with the three sequences
kept apart so that a swarm can move them exactly.

A curtailed run never knows how many steps it will get, so a schedule that needs the total length
(cosine, the decay of WSD) decays too early or never. Schedule-Free replaces the schedule by an
average: a base sequence ``z`` takes AdamW steps, the average ``x`` follows it with weights
``c_t = w_t / sum(w)``, and gradients are taken at ``y = (1 - beta) z + beta x``. ``x`` is the model
to evaluate and export at any moment.

Why not ``schedulefree.AdamWScheduleFree`` (the reference implementation, which the tests compare
this one with): it stores only ``y`` and ``z`` and switches the parameters between ``y`` and ``x``
by ``lerp`` in ``train()``/``eval()``, so every switch rounds the weights, and a site that
evaluates, or a swarm that loads ``x``, would not continue bit for bit. Here the state holds ``x`` and
``z`` exactly, and the parameters always hold ``y = lerp(z, x, beta)`` computed from them by
:meth:`ScheduleFreeAdamW.sync_y`, so ``y`` is a function of the state: a checkpoint stores ``x`` (as
the model) and ``z``, and a restart recomputes the same ``y``. The cost is one model-sized buffer
more than the reference (x, z, the second moment and y: four, against AdamW's three).

ScheduleFree+ (Defazio, 2026, arXiv 2605.19095) is implemented in part, where it is stated precisely
enough: inner momentum (``momentum`` > 0: a bias-corrected first moment of the gradient feeds the
``z`` step, separate from the interpolation ``beta``). Its Polyak step size, beta annealing and
AdamC-style weight decay are not (docs/schedule_free.md says why).

Every operation is elementwise on a parameter's own tensor, so an FSDP2-sharded parameter (a
DTensor) and its state tensors, which share its sharding, are updated shard by shard with no
communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

#: what ``train.sf_z`` may say: how a swarm moves ``z`` when it moves ``x`` (docs/schedule_free.md)
Z_MODES = ("average", "shift", "reset")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself (elementwise updates need no collective)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """AdamW without a schedule: ``lr`` is warmed up over ``warmup_steps`` and then held.

    ``beta`` interpolates the gradient point between ``z`` and ``x``; ``beta2`` and ``eps`` are
    Adam's; ``weight_decay`` is decoupled and applied at ``y`` (as the reference does); the average's
    weights are ``(t + 1)^r * lr_max^weight_lr_power`` (``lr_max``: the largest learning rate so far,
    so the warm-up's small steps weigh little). ``momentum``: ScheduleFree+'s inner momentum (0: none,
    the original method).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 2.5e-3,
        beta: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        r: float = 0.0,
        weight_lr_power: float = 2.0,
        momentum: float = 0.0,
    ):
        defaults = dict(
            lr=lr,
            beta=beta,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            r=r,
            weight_lr_power=weight_lr_power,
            momentum=momentum,
            k=0,  # steps taken
            weight_sum=0.0,
            lr_max=0.0,
        )
        super().__init__(params, defaults)
        with torch.no_grad():  # state from the start: x = z = y, so gather and load work before a step
            for group in self.param_groups:
                for p in group["params"]:
                    self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "z" in state:
            return
        state["x"] = p.detach().clone()
        state["z"] = p.detach().clone()
        state["exp_avg_sq"] = torch.zeros_like(p)
        if group["momentum"]:
            state["exp_avg"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            k, beta, beta2 = group["k"], group["beta"], group["beta2"]
            warmup = group["warmup_steps"]
            lr = group["lr"] * ((k + 1) / warmup if k < warmup else 1.0)
            group["lr_max"] = lr_max = max(lr, group["lr_max"])
            weight = (k + 1) ** group["r"] * lr_max ** group["weight_lr_power"]
            group["weight_sum"] += weight
            c = weight / group["weight_sum"] if group["weight_sum"] else 0.0
            bias2 = 1 - beta2 ** (k + 1)
            momentum = group["momentum"]
            bias1 = 1 - momentum ** (k + 1) if momentum else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._init_state(p, group)
                state = self.state[p]
                grad, y = local_part(p.grad), local_part(p)
                x, z, v = local_part(state["x"]), local_part(state["z"]), local_part(state["exp_avg_sq"])
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = v.div(bias2).sqrt_().add_(group["eps"])
                if momentum:
                    m = local_part(state["exp_avg"])
                    m.mul_(momentum).add_(grad, alpha=1 - momentum)
                    direction = m.div(bias1).div_(denom)
                else:
                    direction = grad.div(denom)
                if group["weight_decay"]:
                    direction.add_(y, alpha=group["weight_decay"])
                z.sub_(direction, alpha=lr)
                x.lerp_(z, c)
                torch.lerp(z, x, beta, out=y)
            group["k"] = k + 1
        return loss

    # ---- the three sequences, for the trainer (node/trainer.py)

    def sequences(self, name: str) -> list[torch.Tensor]:
        """Every parameter's ``x`` or ``z`` (state tensors, DTensors under FSDP), in parameter order."""
        return [self.state[p][name] for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def sync_y(self) -> None:
        """Set every parameter to ``y = lerp(z, x, beta)`` of the state as it is (after ``x`` or ``z``
        was loaded or moved): ``y`` is a function of ``x`` and ``z``, bit for bit."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                torch.lerp(local_part(state["z"]), local_part(state["x"]), group["beta"], out=local_part(p))

    @torch.no_grad()
    def show_x(self) -> None:
        """Put ``x`` in the parameters (to evaluate the model); :meth:`sync_y` puts ``y`` back exactly."""
        for group in self.param_groups:
            for p in group["params"]:
                local_part(p).copy_(local_part(self.state[p]["x"]))

    def averaging_weights(self) -> dict[str, float]:
        """How much history ``x`` averages: the sum of the average's weights and the largest learning
        rate so far (what the next step's ``c`` is computed from)."""
        group = self.param_groups[0]
        return {"weight_sum": float(group["weight_sum"]), "lr_max": float(group["lr_max"])}

    def adopt_weights(self, weights: dict[str, float] | None) -> None:
        """Take the averaging weights of an ``x`` adopted from another site (a catch-up), when it
        averages more history than this site's own: otherwise the next step's ``c`` -- 1 for a site
        that never stepped -- would replace the adopted average by this site's own ``z``. Values that are
        not finite and non-negative are ignored (they come over the network)."""
        if not weights:
            return
        try:
            weight_sum, lr_max = float(weights["weight_sum"]), float(weights["lr_max"])
        except (KeyError, TypeError, ValueError):
            return
        if not (math.isfinite(weight_sum) and math.isfinite(lr_max) and weight_sum >= 0 and lr_max >= 0):
            return
        for group in self.param_groups:
            if weight_sum > group["weight_sum"]:
                group["weight_sum"] = weight_sum
                group["lr_max"] = max(group["lr_max"], lr_max)

    @torch.no_grad()
    def adopt_x_from_parameters(self) -> None:
        """After a checkpoint was loaded into the model (which holds ``x``, see the trainer's
        ``state_dict``): make the parameters the state's ``x`` and put ``y`` back in them."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "x" not in state:
                    state["x"] = p.detach().clone()
                else:
                    local_part(state["x"]).copy_(local_part(p))
                if "z" not in state:  # a checkpoint written before the first step holds no z
                    state["z"] = p.detach().clone()
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if group["momentum"] and "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
        self.sync_y()
