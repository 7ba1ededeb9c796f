"""The rank command protocol: rank 0 names each operation, every rank of the site runs it.

Under ``torchrun`` every rank holds a shard of the model (:mod:`greenswarm.node.distributed`), and
gathering, loading, saving or evaluating it are collectives that all ranks must enter together.
Only rank 0 talks to the swarm, so it decides what comes next: it broadcasts one :class:`Op`, then
runs it; the other ranks sit in :meth:`SiteRanks.follow`, receive the same operation and run it too.
In a single process the broadcast is a no-op and the call is a plain method call.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from greenswarm.node.distributed import World
from greenswarm.node.trainer import InnerTrainer, StepStats


class Op(enum.Enum):
    """One operation every rank of a site runs together."""

    TRAIN = "train"  # one inner step
    GATHER = "gather"  # the full flat parameters (on rank 0)
    LOAD = "load"  # load full flat parameters into every shard
    SHIFT = "shift"  # add a full flat vector to the parameters of every shard
    SAVE = "save"  # the trainer's state, for the checkpoint
    RESTORE = "restore"  # load the trainer's state from a checkpoint
    ASSIGN = "assign"  # claimed shards given to or taken from the ranks' readers
    STATUS = "status"  # every rank's claimed-shard reader (queue, positions), on rank 0
    IDLE = "idle"  # nothing: keeps the followers' collectives from timing out in long idles
    STOP = "stop"  # followers return


class SiteRanks:
    """Runs operations on every rank of the site; rank 0 calls the methods, the others :meth:`follow`."""

    def __init__(self, world: World, trainer: InnerTrainer):
        self.world, self.trainer = world, trainer

    # ---- rank 0

    def train(self) -> StepStats:
        return self.run(Op.TRAIN)

    def gather(self) -> torch.Tensor:
        return self.run(Op.GATHER)

    def load(self, flat: torch.Tensor, weights: dict[str, float] | None = None) -> None:
        """Load a flat vector (``weights``: a schedule-free state's averaging weights, adopted with it)."""
        self.run(Op.LOAD, (flat, weights))

    def shift(self, flat: torch.Tensor) -> None:
        """Add ``flat`` to the parameters in place (an overlapped round's rebase: one pass, no gather)."""
        self.run(Op.SHIFT, flat)

    def save(self, own: bool = False) -> dict[str, Any]:
        """The trainer's state (``own``: with tensors later steps do not change; see the trainer)."""
        return self.run(Op.SAVE, own)

    def restore(self, state: dict[str, Any]) -> None:
        self.run(Op.RESTORE, state)

    def idle(self) -> None:
        self.run(Op.IDLE)

    def assign(self, plan: dict[int, list[tuple[str, int, Any, Any]]]) -> None:
        """Give claimed shards to, or take them from, the ranks' readers (``plan``: rank -> actions)."""
        self.run(Op.ASSIGN, plan)

    def data_status(self) -> list[dict[str, Any]] | None:
        """Each rank's claimed-shard reader (None with fixed shards)."""
        return self.run(Op.STATUS)

    def stop(self) -> None:
        """Release the followers (a no-op in a single process)."""
        if self.world.distributed:
            self.run(Op.STOP)

    def run(self, op: Op, arg: Any = None) -> Any:
        """Announce ``op`` to the other ranks (rank 0), then run it here."""
        if self.world.distributed:
            self.world.broadcast(op.value)
        return self._execute(op, arg)

    # ---- ranks > 0

    def follow(self) -> None:
        """Run whatever rank 0 announces until it says stop (the argument stays on rank 0: the
        trainer's collectives scatter what the other ranks need)."""
        while True:
            op = Op(self.world.broadcast(None))
            if op is Op.STOP:
                return
            self._execute(op, None)

    def _execute(self, op: Op, arg: Any) -> Any:
        trainer = self.trainer
        if op is Op.TRAIN:
            return trainer.step()
        if op is Op.GATHER:
            return trainer.full_parameters()
        if op is Op.LOAD:
            flat, weights = arg if arg is not None else (None, None)
            return trainer.load_full_parameters(flat, weights=weights)
        if op is Op.SHIFT:
            return trainer.load_full_parameters(arg, add=True)
        if op is Op.SAVE:
            return trainer.state_dict(own=bool(arg))  # (arg stays on rank 0: False elsewhere)
        if op is Op.RESTORE:
            return trainer.load_state_dict(arg)
        if op is Op.ASSIGN:
            return trainer.assign_shards(arg)  # (broadcast inside: arg stays on rank 0)
        if op is Op.STATUS:
            return trainer.data_status()
        return None  # IDLE, STOP
