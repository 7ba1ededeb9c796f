"""The inner loop: a causal LM trained with AdamW on this site's shard, sharded with FSDP2 under torchrun.

The node sees the model only through :class:`InnerTrainer`: one optimizer step at a time, and the
full parameters as one flat CPU vector (gathered to rank 0 under FSDP) so the outer step and the
averager never care how the model is laid out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from greenswarm.averaging.outer import flatten
from greenswarm.faults import FaultPlan
from greenswarm.node.data import DataConfig, TokenBatches, sub_shard
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig, build_model, causal_lm_loss, count_parameters, model_identity
from greenswarm.node.shard_reader import ClaimedBatches, apply_plan
from greenswarm.node.tokenizer import load_tokenizer


@dataclass
class StepStats:
    loss: float
    tokens: int  # tokens this site trained on in the step (all ranks)
    # claimed shards (data.sharding: claim): each rank's reader after the step (queue, positions), on rank 0
    data: list[dict[str, Any]] | None = None


def _shard_with_fsdp(model: torch.nn.Module) -> None:
    """FSDP2: shard each transformer block, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    blocks = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


class InnerTrainer:
    """Owns the model, the inner optimizer and the token stream of this process."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        data_cfg: DataConfig,
        train_cfg: Any,
        world: World,
        faults: FaultPlan | None = None,
    ):
        self.world, self.cfg = world, train_cfg
        self._faults = faults or FaultPlan()
        if train_cfg.threads:
            torch.set_num_threads(train_cfg.threads)
        self.tokenizer = load_tokenizer(model_cfg.tokenizer)
        self.model = build_model(model_cfg, self.tokenizer.vocab_size, device=world.device)
        self.num_parameters = count_parameters(self.model)
        self.shapes = [p.shape for p in self.model.parameters()]
        self.names = [name for name, _ in self.model.named_parameters()]  # the flat vector's order
        self.identity = model_identity(
            self.model, self.tokenizer.fingerprint, model_cfg
        )  # what every site must share
        if world.distributed:
            _shard_with_fsdp(self.model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train_cfg.lr,
            betas=(train_cfg.beta1, train_cfg.beta2),
            weight_decay=train_cfg.weight_decay,
        )
        per_rank = train_cfg.batch_size // world.world_size
        if per_rank < 1 or train_cfg.batch_size % world.world_size:
            raise ValueError(
                f"train.batch_size {train_cfg.batch_size} must be a multiple of {world.world_size} ranks"
            )
        self.accumulation = max(1, per_rank // train_cfg.micro_batch_size)
        self.micro_batch = min(train_cfg.micro_batch_size, per_rank)
        self.batches: TokenBatches | ClaimedBatches
        if data_cfg.claimed:  # every rank reads whole shards that rank 0 claims for it (node/shard_claims.py)
            self.batches = ClaimedBatches(data_cfg, self.tokenizer, self.micro_batch)
        else:
            self.batches = TokenBatches(
                sub_shard(data_cfg, world.rank, world.world_size), self.tokenizer, self.micro_batch
            )
        self._iterator = iter(self.batches)
        self.steps = 0
        self.tokens_per_step = self.micro_batch * self.accumulation * data_cfg.seq_len * world.world_size

    def _lr(self) -> float:
        warmup = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (self.steps + 1) / warmup) if warmup else self.cfg.lr

    def step(self) -> StepStats:
        """One optimizer step over ``accumulation`` micro-batches (a collective under FSDP)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        total = 0.0
        autocast = self._autocast()
        for _ in range(self.accumulation):
            batch = next(self._iterator).to(self.world.device, non_blocking=True)
            with autocast:
                loss = causal_lm_loss(self.model, batch) / self.accumulation
            loss.backward()
            total += float(loss.detach())
        self._faults.hit("step")  # mid inner step: gradients computed, parameters not yet updated
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        claimed = isinstance(self.batches, ClaimedBatches)
        moved = float(claimed and self.batches.take_moved())  # a reader's queue changed in this step
        if self.world.distributed:
            box = torch.tensor([total, moved], device=self.world.device)
            torch.distributed.all_reduce(box)
            total, moved = float(box[0]) / self.world.world_size, float(box[1])
        if not math.isfinite(total):
            raise FloatingPointError(f"inner loss is {total} at step {self.steps}")
        # the readers' queues for rank 0, gathered only in a step that changed one (the flag rode on the
        # loss's all-reduce): most steps move inside one shard, and cost no gather
        data = self.data_status() if moved else None
        return StepStats(loss=total, tokens=self.tokens_per_step, data=data)

    # ---- claimed shards (data.sharding: claim)

    def data_status(self) -> list[dict[str, Any]] | None:
        """Every rank's claimed-shard reader (its queue and where each queued shard is), on rank 0;
        None elsewhere and for fixed shards. A collective under torchrun."""
        if not isinstance(self.batches, ClaimedBatches):
            return None
        statuses = self._gather_objects(self.batches.status())
        return statuses if self.world.is_leader else None

    def assign_shards(self, plan: dict[int, list[tuple[str, int, Any, Any]]] | None) -> None:
        """Rank 0's ``plan`` (rank -> [(action, shard, position, token)]: "assign", "withdraw" or "clear";
        node/shard_claims.py) applied by each rank to its own reader. A collective under torchrun."""
        plan = self.world.broadcast(plan)
        if isinstance(self.batches, ClaimedBatches) and plan:
            apply_plan(self.batches, plan.get(self.world.rank, []))

    def _autocast(self) -> torch.autocast:
        """bf16 autocast when ``train.precision`` asks for it (parameters stay fp32), else a no-op."""
        return torch.autocast(
            self.world.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"
        )

    @torch.no_grad()
    def evaluate(self, batches: Sequence[torch.Tensor]) -> float:
        """Mean causal-LM loss of the current model over ``batches``, in the training precision.

        A collective under FSDP: every rank must call it with the same batches (the forward gathers the
        sharded parameters), so every rank computes the same value; rank 0's is broadcast so all ranks
        return exactly one number. The model is in eval mode only for the call, and no parameter,
        gradient or optimizer state changes, so training continues exactly as without it.
        """
        if not batches:
            raise ValueError("evaluate needs at least one batch")
        was_training = self.model.training
        self.model.eval()
        try:
            total = torch.zeros((), device=self.world.device)
            for batch in batches:
                with self._autocast():
                    total += causal_lm_loss(self.model, batch.to(self.world.device, non_blocking=True))
            loss = float(total) / len(batches)
        finally:
            self.model.train(was_training)
        return float(self.world.broadcast(loss))

    # ---- the model as one flat vector ----

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return p.full_tensor() if isinstance(p, DTensor) else p

    @torch.no_grad()
    def full_parameters(self) -> torch.Tensor | None:
        """All parameters as one flat fp32 CPU vector on rank 0 (None elsewhere); a collective."""
        tensors = [self._full(p.detach()).to("cpu", torch.float32) for p in self.model.parameters()]
        return flatten(tensors) if self.world.is_leader else None

    @torch.no_grad()
    def load_full_parameters(self, flat: torch.Tensor | None, add: bool = False) -> None:
        """Set all parameters from rank 0's flat vector (ignored elsewhere), or ``add`` it to them; a
        collective."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        offset = 0
        for p, shape in zip(self.model.parameters(), self.shapes, strict=True):
            n = int(torch.Size(shape).numel())
            if isinstance(p, DTensor):
                full = flat[offset : offset + n].view(shape) if self.world.is_leader else torch.empty(shape)
                full = full.to(p.device_mesh.device_type, p.dtype)
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
                target, value = p.to_local(), shard.to_local().to(p.to_local().device)
            else:
                target, value = p, flat[offset : offset + n].view(shape).to(p.device, p.dtype)
            if add:
                target.add_(value)
            else:
                target.copy_(value)
            offset += n

    # ---- checkpoints ----

    def state_dict(self, own: bool = False) -> dict[str, Any] | None:
        """Full model + optimizer + data position on rank 0 (a collective under FSDP). ``own``: with
        tensors of its own, which later steps do not change (a checkpoint written in the background);
        otherwise a single-process site's tensors are its live parameters and optimizer state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if own:  # copy only what is live: a sharded or GPU site's state dict is a CPU copy already
            live = {t.data_ptr() for t in self._live_tensors()}
            model_sd, optim_sd = _owned(model_sd, live), _owned(optim_sd, live)
        positions = self._gather_objects(self.batches.state_dict())
        if not self.world.is_leader:
            return None
        return {"model": model_sd, "optimizer": optim_sd, "data": positions, "steps": self.steps}

    def _live_tensors(self) -> list[torch.Tensor]:
        """Every tensor a training step changes in place: parameters, buffers, optimizer state."""
        from torch.distributed.tensor import DTensor

        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in self.model.parameters()]
        tensors += list(self.model.buffers())
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tensors.append(value.to_local() if isinstance(value, DTensor) else value)
        return tensors

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore from rank 0's :meth:`state_dict` (a collective under FSDP)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world.distributed)
        state = state if self.world.is_leader else {}
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state.get("model", {}),
            optim_state_dict=state.get("optimizer", {}),
            options=options,
        )
        positions = self.world.broadcast(state.get("data"))
        self.steps = int(self.world.broadcast(state.get("steps", 0)))
        if positions:
            self.batches.load_state_dict(positions[self.world.rank])
            self._iterator = iter(self.batches)

    def _gather_objects(self, obj: Any) -> list[Any]:
        if not self.world.distributed:
            return [obj]
        out: list[Any] = [None] * self.world.world_size
        torch.distributed.all_gather_object(out, obj)
        return out


def _owned(obj: Any, live: set[int]) -> Any:
    """``obj`` (a nested state dict) with a copy of every tensor whose memory is in ``live``."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.data_ptr() in live else obj
    if isinstance(obj, dict):
        return {key: _owned(value, live) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_owned(item, live) for item in obj)
    return obj
