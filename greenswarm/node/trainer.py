"""The inner loop: a causal LM trained with AdamW (or Schedule-Free AdamW) on this site's shard, sharded
with FSDP2 under torchrun.

The node sees the model only through :class:`InnerTrainer`: one optimizer step at a time, and the
model as one flat CPU vector (gathered to rank 0 under FSDP) so the outer step and the averager never
care how the model is laid out. With AdamW the vector is the parameters; with Schedule-Free it is the
average ``x`` (the model to evaluate and export), followed by the base sequence ``z`` when the swarm
averages it too (``train.sf_z: average``; docs/schedule_free.md), and the parameters themselves hold
the gradient point ``y``, which the optimizer computes from the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from greenswarm.averaging.outer import flatten
from greenswarm.errors import GreenswarmError
from greenswarm.faults import FaultPlan
from greenswarm.node.data import DataConfig, TokenBatches, sub_shard
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig, build_model, causal_lm_loss, count_parameters, model_identity
from greenswarm.node.schedule_free import ScheduleFreeAdamW, local_part
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
            self.model, self.tokenizer.fingerprint, model_cfg, _layout(train_cfg)
        )  # what every site must share
        if world.distributed:
            _shard_with_fsdp(self.model)
        self.model.train()
        self.optimizer: torch.optim.Optimizer
        self.schedule_free: ScheduleFreeAdamW | None = None
        if getattr(train_cfg, "schedule_free", False):
            self.optimizer = self.schedule_free = ScheduleFreeAdamW(
                self.model.parameters(),
                lr=train_cfg.lr,
                beta=train_cfg.sf_beta,
                beta2=train_cfg.beta2,
                weight_decay=train_cfg.weight_decay,
                warmup_steps=train_cfg.warmup_steps,
                momentum=train_cfg.sf_momentum,
            )
        else:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=train_cfg.lr,
                betas=(train_cfg.beta1, train_cfg.beta2),
                weight_decay=train_cfg.weight_decay,
            )
        self.layout = _layout(train_cfg)
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
        """AdamW's learning rate for the next step."""
        return self._lr_at(self.steps + 1)

    def _lr_at(self, step: int) -> float:
        """AdamW's learning rate for step ``step`` (from 1): linear warm-up, then held or cosine-decayed."""
        cfg = self.cfg
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return cfg.lr * step / cfg.warmup_steps
        if getattr(cfg, "schedule", "constant") != "cosine":
            return cfg.lr
        done = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * done))

    def step(self) -> StepStats:
        """One optimizer step over ``accumulation`` micro-batches (a collective under FSDP)."""
        if self.schedule_free is None:  # (Schedule-Free warms up inside: its average weighs by it)
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
        self._reshard()
        if self.schedule_free is not None:
            self.schedule_free.show_x()  # the model is x; y comes back bit for bit below
        try:
            total = torch.zeros((), device=self.world.device)
            for batch in batches:
                with self._autocast():
                    total += causal_lm_loss(self.model, batch.to(self.world.device, non_blocking=True))
            loss = float(total) / len(batches)
        finally:
            self.model.train(was_training)
            self._reshard()
            if self.schedule_free is not None:
                self.schedule_free.sync_y()
        return float(self.world.broadcast(loss))

    def _reshard(self) -> None:
        """Free FSDP2's gathered copies of the parameters. A forward without backward (evaluation)
        leaves the root's (embeddings, norm, head) gathered, and the next forward would reuse that copy
        -- after a load, or schedule-free's y written back over x, stale values -- and while it is
        gathered the root's parameters are not DTensors, so a load would miss their shards."""
        if not self.world.distributed:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ---- the model as one flat vector ----

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return p.full_tensor() if isinstance(p, DTensor) else p

    def _vectors(self) -> list[list[torch.Tensor]]:
        """The tensors the flat vector holds, in its order: the parameters; or schedule-free ``x``,
        and ``z`` after it when the swarm averages ``z`` too."""
        if self.schedule_free is None:
            return [list(self.model.parameters())]
        names = ["x", "z"] if self.layout == "x+z" else ["x"]
        return [self.schedule_free.sequences(name) for name in names]

    @torch.no_grad()
    def full_parameters(self) -> torch.Tensor | None:
        """The model as one flat fp32 CPU vector on rank 0 (None elsewhere; see the module's docstring
        for what it holds); a collective."""
        tensors = [self._full(t.detach()).to("cpu", torch.float32) for ts in self._vectors() for t in ts]
        return flatten(tensors) if self.world.is_leader else None

    def averaging_weights(self) -> dict[str, float] | None:
        """Schedule-free: how much history ``x`` averages (served with the global state, so that a site
        adopting it continues the average instead of restarting it); None for AdamW."""
        return self.schedule_free.averaging_weights() if self.schedule_free is not None else None

    @torch.no_grad()
    def load_full_parameters(
        self, flat: torch.Tensor | None, add: bool = False, weights: dict[str, float] | None = None
    ) -> None:
        """Set the model from rank 0's flat vector (ignored elsewhere), or ``add`` it to it; a
        collective. Schedule-free: the vector sets ``x``; ``z`` is set from it too (``sf_z:
        average``), moved by as much as ``x`` moved (``shift``) or set to ``x`` (``reset``); adding
        moves both alike; the parameters become ``y`` of the two; and with ``train.sf_keep_average``,
        ``weights`` (rank 0's: another site's :meth:`averaging_weights`, with a state adopted from it)
        are taken when they average more history than this site's."""
        self._reshard()  # (no gathered copy may hold the old values, see _reshard)
        if self.schedule_free is None:
            for target, value in self._scatter(flat, list(self.model.parameters()), 0):
                target.add_(value) if add else target.copy_(value)
            return
        if self.cfg.sf_keep_average and not add:
            self.schedule_free.adopt_weights(self.world.broadcast(weights))
        xs, zs = self.schedule_free.sequences("x"), self.schedule_free.sequences("z")
        if self.layout == "x+z":  # z's values follow x's in the vector
            numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
            z_values: Iterator[tuple[torch.Tensor, torch.Tensor | None]] = self._scatter(flat, zs, numel)
        else:  # one vector: z moves with x's values (scattered once)
            z_values = ((local_part(z), None) for z in zs)
        for (x, value), (z, z_value) in zip(self._scatter(flat, xs, 0), z_values, strict=True):
            if add:
                x.add_(value)
                z.add_(value if z_value is None else z_value)
            elif z_value is not None:  # average
                x.copy_(value)
                z.copy_(z_value)
            elif self.cfg.sf_z == "reset":
                x.copy_(value)
                z.copy_(value)
            else:  # shift: z keeps its lead over x
                z.sub_(x).add_(value)
                x.copy_(value)
        self.schedule_free.sync_y()

    def _scatter(
        self, flat: torch.Tensor | None, targets: list[torch.Tensor], offset: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(local tensor, its values) for each of ``targets`` (one per parameter, each shaped like it)
        from rank 0's ``flat`` starting at ``offset``: each rank's shard of a sharded one. One parameter
        at a time (a collective each under FSDP), so no more than one full tensor is held at once."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for t, shape in zip(targets, self.shapes, strict=True):
            n = int(torch.Size(shape).numel())
            if isinstance(t, DTensor):
                full = flat[offset : offset + n].view(shape) if self.world.is_leader else torch.empty(shape)
                full = full.to(t.device_mesh.device_type, t.dtype)
                shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=0)
                yield t.to_local(), shard.to_local().to(t.to_local().device)
            else:
                yield t, flat[offset : offset + n].view(shape).to(t.device, t.dtype)
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
        if self.schedule_free is not None and self.world.is_leader:
            # the model a checkpoint holds is x, the one to evaluate and export; y is recomputed from x
            # and z on restore, bit for bit (node/schedule_free.py)
            for name in list(model_sd):
                if name in optim_sd["state"]:  # (a new dict: the optimizer's own must keep its x)
                    entry = dict(optim_sd["state"][name])
                    model_sd[name] = entry.pop("x")
                    optim_sd["state"][name] = entry
            for alias, name in self._aliases().items():  # a tied weight (lm_head) is its owner's x too
                model_sd[alias] = model_sd[name].clone()  # (its own tensor, as get_state_dict gives it)
        positions = self._gather_objects(self.batches.state_dict())
        if not self.world.is_leader:
            return None
        return {"model": model_sd, "optimizer": optim_sd, "data": positions, "steps": self.steps}

    def _aliases(self) -> dict[str, str]:
        """Second names of shared parameters (a head tied to the embeddings) -> the name they are
        trained under."""
        owners = {id(p): name for name, p in self.model.named_parameters()}
        return {
            name: owners[id(p)]
            for name, p in self.model.named_parameters(remove_duplicate=False)
            if owners[id(p)] != name
        }

    def _live_tensors(self) -> list[torch.Tensor]:
        """Every tensor a training step changes in place: parameters, buffers, optimizer state."""

        tensors = [local_part(t) for t in self.model.parameters()]
        tensors += list(self.model.buffers())
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tensors.append(local_part(value))
        return tensors

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore from rank 0's :meth:`state_dict` (a collective under FSDP)."""
        state = state if self.world.is_leader else {}
        if self.world.distributed:
            self._load_sharded(state)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state.get("model", {}),
                optim_state_dict=state.get("optimizer", {}),
                options=StateDictOptions(full_state_dict=True),
            )
        for group in self.optimizer.param_groups:  # this start's settings, not the checkpoint's: a
            for key in _SETTINGS:  # restart is how an operator changes them
                if key in self.optimizer.defaults:
                    group[key] = self.optimizer.defaults[key]
        if self.schedule_free is not None:
            self.schedule_free.adopt_x_from_parameters()  # the model loaded x: make it the state's
        positions = self.world.broadcast(state.get("data"))
        self.steps = int(self.world.broadcast(state.get("steps", 0)))
        if self.schedule_free is None and self.steps:
            # the rate the last step used, as the saved groups held it (each step sets its own): a
            # state restored mid warm-up (or decay) is then the state saved, digest included, not
            # one with the configured peak in its groups (every release of a site still warming up
            # was reported as "not the state released")
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr_at(self.steps)
        if positions:
            self.batches.load_state_dict(positions[self.world.rank])
            self._iterator = iter(self.batches)

    @torch.no_grad()
    def _load_sharded(self, state: dict[str, Any]) -> None:
        """Rank 0's full model and optimizer state, each rank keeping its shards.

        Not ``set_state_dict(broadcast_from_rank0=True)``: with torch 2.13 it fails on a model whose
        head is tied to its embeddings (the ranks fall out of step in its broadcasts). Here rank 0 first
        says what there is (which state entries are tensors to shard, which are values, and the
        optimizer's groups), then every tensor is scattered as the flat vector is
        (``distribute_tensor`` from rank 0), so no rank ever holds more than one full tensor."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        leader = self.world.is_leader
        model_sd, optim_sd = state.get("model", {}), state.get("optimizer", {})

        def kinds(entry: dict[str, Any]) -> dict[str, tuple]:
            return {
                key: ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) and v.dim() else ("value", v)
                for key, v in entry.items()
            }

        params = dict(self.model.named_parameters())  # (a tied head once, under its owner's name)
        plan = self.world.broadcast(
            {
                "state": {name: kinds(entry) for name, entry in optim_sd.get("state", {}).items()},
                "groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in optim_sd.get("param_groups", [])
                ],
                "missing": [name for name in params if name not in model_sd],
            }
            if leader
            else None
        )
        if plan["missing"] or len(plan["groups"]) != len(self.optimizer.param_groups):
            raise GreenswarmError(  # (on every rank: none of them loads a half)
                "the checkpoint's trainer state lacks "
                f"{', '.join(plan['missing'][:3]) or 'parameter groups'}: it was written for another model"
            )

        def scattered(
            full: torch.Tensor | None, like: torch.Tensor, shape: tuple, dtype: torch.dtype
        ) -> torch.Tensor:
            full = full if leader and full is not None else torch.empty(shape, dtype=dtype)
            if not isinstance(like, DTensor):
                return self.world.broadcast(full).to(like.device)
            full = full.to(like.device_mesh.device_type, dtype)
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=0)

        for name, p in params.items():
            value = scattered(model_sd.get(name), p, tuple(p.shape), p.dtype)
            local_part(p).copy_(local_part(value))
        for p in params.values():  # a parameter the checkpoint holds no state for starts fresh, as in
            self.optimizer.state[p] = {}  # one process (load_state_dict replaces all of it)
        for name, entry in plan["state"].items():
            p = params[name]
            self.optimizer.state[p] = {
                key: scattered(optim_sd["state"][name][key] if leader else None, p, kind[1], kind[2])
                if kind[0] == "tensor"
                else kind[1]
                for key, kind in entry.items()
            }
        for group, saved in zip(self.optimizer.param_groups, plan["groups"], strict=True):
            group.update(saved)

    def _gather_objects(self, obj: Any) -> list[Any]:
        if not self.world.distributed:
            return [obj]
        out: list[Any] = [None] * self.world.world_size
        torch.distributed.all_gather_object(out, obj)
        return out


#: optimizer settings a restart takes from its config (the step count and the average's weights are the
#: checkpoint's)
_SETTINGS = ("lr", "betas", "beta", "beta2", "eps", "weight_decay", "warmup_steps", "momentum")


def _layout(train_cfg: Any) -> str:
    """``train_cfg.state_layout`` (see TrainConfig), or ``params`` for a bare config without one."""
    return str(getattr(train_cfg, "state_layout", "params"))


def _owned(obj: Any, live: set[int]) -> Any:
    """``obj`` (a nested state dict) with a copy of every tensor whose memory is in ``live``."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.data_ptr() in live else obj
    if isinstance(obj, dict):
        return {key: _owned(value, live) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_owned(item, live) for item in obj)
    return obj
