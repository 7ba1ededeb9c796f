"""The site's state: what it should be doing given its own window and the swarm's."""

from __future__ import annotations

from enum import StrEnum


class SiteState(StrEnum):
    """IDLE: outside a window, no training, the trainer held (process, model and optimizer kept).
    SOLO: in a window with no other site in one, train locally and keep outer state. FEDERATED: in a
    window with others, train and average. RELEASED: outside a window with the trainer ended after a
    checkpoint, its GPUs given back (:mod:`greenswarm.scheduler.release`). RESTARTING: the trainer
    starting again after a release, until its first decision, at training power."""

    IDLE = "IDLE"
    SOLO = "SOLO"
    FEDERATED = "FEDERATED"
    RELEASED = "RELEASED"
    RESTARTING = "RESTARTING"


#: the states in which a site trains
TRAINING_STATES = (SiteState.SOLO, SiteState.FEDERATED)


def decide_state(in_window: bool, others_in_window: int) -> SiteState:
    """The state follows from two facts only, so every site reaches the same verdict from the same view."""
    if not in_window:
        return SiteState.IDLE
    return SiteState.SOLO if others_in_window <= 0 else SiteState.FEDERATED
