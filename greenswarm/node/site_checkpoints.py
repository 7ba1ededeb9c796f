"""A site's checkpoints: what it saves after every change of its global model and reads back at start.

One checkpoint holds everything a restarted site needs to go on as if it had not stopped: every
rank's trainer state (model, inner optimizer, data position), the global state (parameters, outer
momentum, outer step, lineage and the ancestors it serves), the energy ledger, the counters, and a
round this site averaged in but did not apply (:class:`~greenswarm.node.state_sync.PendingRound`):
forgetting it across a restart would count its update twice on the next catch-up.

A checkpoint follows every outer step, or (``node.checkpoint_every_s``) the first outer step after
that many wall seconds. After each outer step this component also keeps the best checkpoints by
held-out loss (when an evaluation is due) and, when ``node.keep_globals`` asks, the last global
models named by outer step and lineage. With ``background`` (rounds that run beside training,
``averaging.overlap``) the loop only takes the state and the held-out loss after an outer step; a
:class:`~greenswarm.node.checkpoint_writer.BackgroundWriter` writes the file and keeps what follows it.
Every other save (the last one, at a stop) waits for the writer and is written at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from greenswarm.digests import content_digest
from greenswarm.errors import GreenswarmError
from greenswarm.faults import FaultPlan
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.checkpoint_writer import BackgroundWriter, snapshot
from greenswarm.node.config import SiteConfig
from greenswarm.node.evaluation import BestCheckpoints
from greenswarm.node.global_state import GlobalState
from greenswarm.node.ranks import SiteRanks
from greenswarm.node.shard_claims import ShardClaims
from greenswarm.node.site_stats import SiteStats
from greenswarm.node.state_sync import StateSync
from greenswarm.scheduler.energy import EnergyLedger


class SiteCheckpoints:
    """Saves, resumes and keeps one site's checkpoints (rank 0; the ranks save their own parts)."""

    def __init__(
        self,
        cfg: SiteConfig,
        faults: FaultPlan,
        ranks: SiteRanks,
        state: GlobalState,
        sync: StateSync,
        stats: SiteStats,
        ledger: EnergyLedger,
        log: logging.Logger | None = None,
        background: bool = False,
    ):
        self.run_dir = Path(cfg.node.run_dir)
        self.checkpointer = Checkpointer(self.run_dir, faults)
        self.best = BestCheckpoints(cfg.eval, self.checkpointer)
        self.keep_globals = cfg.node.keep_globals
        self.ranks, self.state, self.sync, self.stats, self.ledger = ranks, state, sync, stats, ledger
        self.log = log or logging.getLogger(__name__)
        self.writer = BackgroundWriter(self.checkpointer) if background else None
        self.every_s = cfg.node.checkpoint_every_s
        self.layout = cfg.train.state_layout
        self._last_save: float | None = None  # monotonic time of the last checkpoint written (None: none)
        self._unsaved = False  # an outer step's state was not written (the cadence skipped it)
        # claimed shards (data.sharding: claim; set once the site joined): a checkpoint on disk commits
        # the readers' positions it holds (node/shard_claims.py), and keeps the claims' tokens
        self.shards: ShardClaims | None = None
        self.resumed_shards: dict[str, Any] | None = None  # the claims' part of the checkpoint resumed

    def resume(self) -> bool:
        """Restore the newest verified checkpoint, if there is one."""
        payload = self.checkpointer.load()
        if payload is None:
            return False
        held, layout = int(payload["outer"][0].numel()), payload.get("layout", "params")
        if held != self.state.numel or layout != self.layout:  # before any rank loads another state
            raise GreenswarmError(
                f"{self.checkpointer.path} holds a global state of {held:,} values ({layout}) and this "
                f"site's is {self.state.numel:,} ({self.layout}): it was written with another model or "
                "inner optimizer (train.optimizer, train.sf_z); set them back, or give this run another "
                "node.run_dir"
            )
        self.ranks.restore(payload["trainer"])
        self.state.adopt(payload["site"], payload["outer"])
        self.stats.load_state_dict(payload["site"])
        self.ledger.load_state_dict(payload["ledger"])
        self.sync.load_state_dict(payload.get("sync", {}))  # (a checkpoint from before it kept one)
        self.resumed_shards = payload.get("shards")
        self.log.info(
            "resumed from %s: outer step %d, %d local steps, global digest %s",
            self.checkpointer.loaded or self.checkpointer.path,
            self.state.outer_round,
            self.stats.local_steps,
            self.state.digest(),
        )
        return True

    def save(self) -> None:
        """Write the site's checkpoint now (after any background write still under way). An earlier
        background write that failed was logged when it failed; this newer checkpoint replaces it."""
        if self.writer is not None:
            try:
                self.writer.flush()
            except Exception as e:
                self.log.warning("an earlier checkpoint write failed (%s); writing this one now", e)
        payload = self._payload()
        self.checkpointer.save(payload)
        self._last_save, self._unsaved = time.monotonic(), False
        self._commit(payload)

    def after_step(self, evaluate: Callable[[], float | None]) -> float | None:
        """After an outer step: evaluate when due, save (every step, or as ``node.checkpoint_every_s``
        says, and always for a step whose loss is kept among the best), keep the best checkpoints and
        the global model when asked. Returns the held-out loss when one was measured."""
        outer_round, lineage = self.state.outer_round, self.state.lineage
        loss = self.best.measure(outer_round, evaluate)  # evaluating changes nothing the payload holds
        save = self._save_due() or self.best.would_keep(outer_round, lineage, loss)
        if self.writer is not None:
            self.writer.wait_for_slot()  # a snapshot is model-sized: no third one while two are held
        payload: dict[str, Any] | None = None
        if save:
            payload = self._payload(own=self.writer is not None)
            params = payload["outer"][0]
            self._last_save = time.monotonic()
            if self.writer is None:
                self.checkpointer.save(payload)
        elif self.keep_globals and self.writer is not None:  # kept later, on the writer's thread
            params = self.state.params.clone()
        else:
            params = self.state.params
        self._unsaved = not save

        def after_written() -> None:
            if payload is not None:
                self._commit(payload)
                self.best.keep_if_best(outer_round, lineage, loss)
            self._keep_global(outer_round, lineage, params)

        if self.writer is None:
            after_written()
        else:
            self.writer.submit(payload, after_written)
        return loss

    def save_if_behind(self) -> None:
        """Write the checkpoint now if an outer step since the last one was not written (the node
        calls it when it goes IDLE: its newest state must not wait on no disk for a whole idle gap,
        and idle is the cheapest time to write it)."""
        if self._unsaved:
            self.save()

    def _save_due(self) -> bool:
        """Whether an outer step's checkpoint is due: the first one since the start (a restart too:
        the checkpoint it resumed from may be old), or ``every_s`` seconds after the last one."""
        return self._last_save is None or time.monotonic() - self._last_save >= self.every_s

    def close(self) -> None:
        """Finish a background write under way and end its thread (the node is closing)."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except Exception:  # the writer logged it; the node is closing for a reason of its own
                pass

    def _commit(self, payload: dict[str, Any]) -> None:
        """The checkpoint holding ``payload`` is on disk: what its readers read is the swarm's to know."""
        if self.shards is not None:
            self.shards.commit((payload.get("trainer") or {}).get("data"))

    def _payload(self, own: bool = False) -> dict[str, Any]:
        """Everything a restarted site needs, taken now (``own``: nothing in it changes afterwards)."""
        trainer_state = self.ranks.save(own=own)  # every rank takes part (FSDP gathers its shards)
        counters = {
            "ledger": self.ledger.state_dict(),
            "site": {**self.state.position(), **self.stats.state_dict()},
        }
        return {
            "trainer": trainer_state,
            "outer": self.state.tensors(),
            **(snapshot(counters) if own else counters),
            # remembered rounds: their tensors are never changed in place (a round is dropped or added)
            "sync": self.sync.state_dict(),
            **({"shards": self.shards.state_dict()} if self.shards is not None else {}),
            "layout": self.layout,  # what the global state holds (train.optimizer, train.sf_z)
        }

    def state_digest(self) -> str:
        """A digest of everything a checkpoint restores but the energy ledger (which books the time
        between a save and a load) and the shard claims (the swarm's leases, taken again after a
        start; the readers' positions are the trainer's): equal before a release and after the
        restart it ends with."""
        payload = self._payload()
        payload.pop("ledger")
        payload.pop("shards", None)
        return content_digest(payload)

    def _keep_global(self, outer_round: int, lineage: str, params: torch.Tensor) -> None:
        """Keep outer step ``outer_round``'s global model (``params``) if ``node.keep_globals`` asks
        (named by step and lineage)."""
        if not self.keep_globals:
            return
        directory = self.run_dir / "globals"
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(params, directory / f"outer-{outer_round:06d}-{lineage}.pt")
        for old in sorted(directory.glob("outer-*.pt"))[: -self.keep_globals]:
            old.unlink(missing_ok=True)
