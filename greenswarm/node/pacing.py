"""A cap on the site's inner steps per wall second (``train.max_steps_per_s``).

Why a site would train slower than it can: an operator who shares the machine with other work, a
demo on a laptop that must stay usable, and a test swarm whose question needs a few steps per window,
not every step the CPU can take: a capped site's step rate does not depend on the load beside it
until the machine saturates (docs/testing.md, issue #40; it did not shorten the suite). The pause
comes after a step, on the node's stop event, so a stop request still ends it at once.

What it does not change: the energy ledger books the site's state (a paced site in its window holds
its GPUs, and is booked at the state's draw), and the deadline plan prices hours with the throughput
the site measures, which the cap sets.
"""

from __future__ import annotations

import threading
import time


class StepPace:
    """Spaces inner steps at least ``1 / max_steps_per_s`` wall seconds apart (0: no cap)."""

    def __init__(self, max_steps_per_s: float):
        self.interval_s = 1.0 / max_steps_per_s if max_steps_per_s > 0 else 0.0

    def pause(self, began: float, stop: threading.Event) -> None:
        """After a step that began at ``began`` (``time.monotonic()``): wait out the rest of its interval,
        or until ``stop`` is set."""
        if not self.interval_s:
            return
        left = began + self.interval_s - time.monotonic()
        if left > 0:
            stop.wait(left)
