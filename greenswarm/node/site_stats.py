"""A site's own counters: training progress, and how its rounds ended.

They go into the checkpoint, so a restarted site goes on counting, and into its progress record and
summary (:mod:`greenswarm.node.telemetry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from greenswarm.node.trainer import StepStats

#: how a site's rounds ended, counted (all start at zero)
#: (refused_states: states served for adoption that their lineage's holders had not signed)
COUNTERS = (
    "federated_rounds",
    "solo_rounds",
    "failed_rounds",
    "catch_ups",
    "resyncs",
    "refused_updates",
    "refused_states",
)


@dataclass
class SiteStats:
    """A site's counters: training progress, and how its rounds ended (see ``COUNTERS``)."""

    local_steps: int = 0
    tokens: int = 0
    tokens_since_sync: int = 0  # tokens trained since the last outer step (the round's weight)
    steps_since_sync: int = 0  # inner steps taken since the last outer step (fednova's tau)
    loss: float | None = None  # exponential moving average of the training loss
    # the first step's loss: where this site started, untrained or from the swarm's model it adopted
    # on entering its first window (the EMA moves slowly away from it)
    first_loss: float | None = None
    first_step_s: float | None = None  # seconds from the node's start to its first step
    eval_loss: float | None = None  # the global model's held-out loss at its last evaluation
    eval_round: int | None = None  # ... the outer step of the global model it measured
    eval_digest: str | None = None  # ... and that model's digest (GlobalState.digest)
    eval_tokens: int | None = None  # ... and how many held-out tokens the loss averages over
    eval_set: str | None = None  # ... and which (a fingerprint of the held-out tokens)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # this process's averaging attempts and their seconds (matchmaking and all-reduce; not checkpointed):
    # counted with the round's outcome, so a scrape never sees a round ended without its attempt
    attempts: int = 0
    attempt_s: float = 0.0

    def add_step(self, step: StepStats) -> None:
        self.local_steps += 1
        self.tokens += step.tokens
        self.tokens_since_sync += step.tokens
        self.steps_since_sync += 1
        if self.first_loss is None:
            self.first_loss = step.loss
        self.loss = step.loss if self.loss is None else 0.9 * self.loss + 0.1 * step.loss

    def add_attempt(self, seconds: float) -> None:
        """A federated round's averaging attempt ended (its outcome is counted next)."""
        self.attempts += 1
        self.attempt_s += seconds

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps (its ``site`` entry, beside the global state's position)."""
        return {
            "local_steps": self.local_steps,
            "tokens": self.tokens,
            # the local progress a restart resumes is not yet in any outer step: it keeps its weight
            "tokens_since_sync": self.tokens_since_sync,
            "steps_since_sync": self.steps_since_sync,
            "loss": self.loss,
            "first_loss": self.first_loss,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, site: dict[str, Any]) -> None:
        self.local_steps, self.tokens, self.loss = site["local_steps"], site["tokens"], site["loss"]
        self.first_loss = site.get("first_loss")  # absent from checkpoints written before it was kept
        self.tokens_since_sync = site.get("tokens_since_sync", 0)  # (likewise)
        self.steps_since_sync = site.get("steps_since_sync", 0)  # (likewise)
        self.counts.update(site["counts"])
