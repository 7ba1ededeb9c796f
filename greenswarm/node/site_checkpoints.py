"""A site's checkpoints: what it saves after every change of its global model and reads back at start.

One checkpoint holds everything a restarted site needs to go on as if it had not stopped: every
rank's trainer state (model, inner optimizer, data position), the global state (parameters, outer
momentum, outer step, lineage and the ancestors it serves), the energy ledger, the counters, and a
round this site averaged in but did not apply (:class:`~greenswarm.node.state_sync.PendingRound`):
forgetting it across a restart would count its update twice on the next catch-up.

After each outer step this component also keeps the best checkpoints by held-out loss (when an
evaluation is due) and, when ``node.keep_globals`` asks, the last global models named by outer step
and lineage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from greenswarm.faults import FaultPlan
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import SiteConfig
from greenswarm.node.evaluation import BestCheckpoints
from greenswarm.node.global_state import GlobalState
from greenswarm.node.ranks import SiteRanks
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
    ):
        self.run_dir = Path(cfg.node.run_dir)
        self.checkpointer = Checkpointer(self.run_dir, faults)
        self.best = BestCheckpoints(cfg.eval, self.checkpointer)
        self.keep_globals = cfg.node.keep_globals
        self.ranks, self.state, self.sync, self.stats, self.ledger = ranks, state, sync, stats, ledger
        self.log = log or logging.getLogger(__name__)

    def resume(self) -> bool:
        """Restore the newest verified checkpoint, if there is one."""
        payload = self.checkpointer.load()
        if payload is None:
            return False
        self.ranks.restore(payload["trainer"])
        self.state.adopt(payload["site"], payload["outer"])
        self.stats.load_state_dict(payload["site"])
        self.ledger.load_state_dict(payload["ledger"])
        self.sync.load_state_dict(payload.get("sync", {}))  # (a checkpoint from before it kept one)
        self.log.info(
            "resumed from %s: outer step %d, %d local steps, global digest %s",
            self.checkpointer.path,
            self.state.outer_round,
            self.stats.local_steps,
            self.state.digest(),
        )
        return True

    def save(self) -> None:
        trainer_state = self.ranks.save()  # every rank takes part (FSDP gathers its shards)
        self.checkpointer.save(
            {
                "trainer": trainer_state,
                "outer": self.state.tensors(),
                "ledger": self.ledger.state_dict(),
                "site": {**self.state.position(), **self.stats.state_dict()},
                "sync": self.sync.state_dict(),
            }
        )

    def after_step(self, evaluate: Callable[[], float]) -> float | None:
        """After an outer step: save, evaluate and keep the best checkpoints when due, keep the global
        model when asked. Returns the held-out loss when one was measured."""
        self.save()
        loss = self.best.after_step(self.state.outer_round, self.state.lineage, evaluate)
        self._keep_global()
        return loss

    def _keep_global(self) -> None:
        """Keep this outer step's global model if ``node.keep_globals`` asks (named by step and lineage)."""
        if not self.keep_globals:
            return
        directory = self.run_dir / "globals"
        directory.mkdir(parents=True, exist_ok=True)
        name = f"outer-{self.state.outer_round:06d}-{self.state.lineage}.pt"
        torch.save(self.state.params.clone(), directory / name)
        for old in sorted(directory.glob("outer-*.pt"))[: -self.keep_globals]:
            old.unlink(missing_ok=True)
