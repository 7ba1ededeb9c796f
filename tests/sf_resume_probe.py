"""A schedule-free site's trainer, killed and restarted (run by tests/test_schedule_free_swarm.py, alone
or under torchrun, where FSDP2 shards the model and the optimizer's x, z and moments with it).

For each optimizer (schedule-free, and AdamW, whose sharded restore this also covers), in DIR/<optimizer>:
``train DIR``: train ``SAVE_AT`` steps, write a checkpoint (the node's Checkpointer, every rank's shards
gathered to rank 0), evaluate twice, train on and write the state's digest after each later step to
digests.json; then die by SIGKILL in the middle of the run (every rank, nothing cleaned up).
``resume DIR``: start a fresh trainer, load the checkpoint, write the digest it resumed with and the
digests of the same later steps to resumed.json. A digest covers the gathered parameters (y), the
flat vector a round gathers (x and z), every optimizer state tensor, the step count and the optimizer's
groups (the average's weights), so equal digests mean the same state bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import TrainConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig
from greenswarm.node.trainer import InnerTrainer

SAVE_AT, LATER = 5, 4


def digest(t: InnerTrainer) -> str | None:
    """On rank 0: the state's digest (a collective: every rank gathers its shards)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    parts = [full(p) for p in t.model.parameters()]
    for p in t.model.parameters():
        parts += [full(v) for _, v in sorted(t.optimizer.state[p].items()) if torch.is_tensor(v)]
    vector = t.full_parameters()  # x then z (train.sf_z: average), or the parameters
    if not t.world.is_leader:
        return None
    h = hashlib.sha256()
    for p in parts:
        h.update(p.detach().cpu().numpy().tobytes())
    h.update(vector.numpy().tobytes())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]
    h.update(repr((groups, t.steps)).encode())
    return h.hexdigest()


def run(mode: str, out: Path, optimizer: str, world: World) -> None:
    cfg = TrainConfig(batch_size=4, micro_batch_size=2, optimizer=optimizer, warmup_steps=2)
    cfg.sf_momentum = 0.9 if optimizer == "adamw-schedulefree" else 0.0  # (ScheduleFree+'s first moment too)
    trainer = InnerTrainer(ModelConfig(preset="tiny"), DataConfig(source="stdlib", seed=3), cfg, world)
    checkpointer = Checkpointer(out)
    if mode == "train":
        for _ in range(SAVE_AT):
            trainer.step()
        state = trainer.state_dict()
        if world.is_leader:
            checkpointer.save({"trainer": state})
        # evaluating (at x) must change nothing the next steps see: under FSDP2 a forward without
        # backward leaves the root's parameters gathered, and a stale copy would train the next step
        # (the resumed run below does not evaluate, so its digests would differ)
        held_out = [
            torch.randint(0, 259, (2, 64), generator=torch.Generator().manual_seed(k)) for k in range(2)
        ]
        trainer.evaluate(held_out)
        trainer.evaluate(held_out)
    else:
        trainer.load_state_dict(checkpointer.load()["trainer"] if world.is_leader else None)
    saved, later = digest(trainer), []
    for _ in range(LATER):
        trainer.step()
        later.append(digest(trainer))
    if world.is_leader:
        (out / ("digests.json" if mode == "train" else "resumed.json")).write_text(
            json.dumps({"saved": saved, "later": later})
        )


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    world = World.from_environment("cpu")
    torch.set_num_threads(1)
    for optimizer in ("adamw-schedulefree", "adamw"):
        (out / optimizer).mkdir(parents=True, exist_ok=True)
        run(mode, out / optimizer, optimizer, world)
    if mode == "train":
        if world.distributed:
            torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run, as a crash: no clean stop, nothing flushed
    if world.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
