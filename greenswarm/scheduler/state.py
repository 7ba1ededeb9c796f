"""The site's state: what it should be doing given its own window and the swarm's."""

from __future__ import annotations

from enum import StrEnum


class SiteState(StrEnum):
    """IDLE: outside a window, no training, GPUs released. SOLO: in a window with no other site in one,
    train locally and keep outer state. FEDERATED: in a window with others, train and average."""

    IDLE = "IDLE"
    SOLO = "SOLO"
    FEDERATED = "FEDERATED"


def decide_state(in_window: bool, others_in_window: int) -> SiteState:
    """The state follows from two facts only, so every site reaches the same verdict from the same view."""
    if not in_window:
        return SiteState.IDLE
    return SiteState.SOLO if others_in_window <= 0 else SiteState.FEDERATED
