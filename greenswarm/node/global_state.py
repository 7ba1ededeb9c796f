"""A site's view of the global model: parameters, outer momentum, and where they sit in the swarm.

Three threads touch it: the node's loop moves it (an adopted state, a resume, a blocking round's
step), an overlapped round's thread moves it (its agreed step, docs/overlap.md), and hivemind's state
server reads it at any moment to serve a newcomer. Every read or write of the tensors with the
position takes :attr:`GlobalState.lock`, so a newcomer never receives the parameters of one outer step
with the lineage of another, and a digest never hashes a half-applied step. The position alone
(outer step, lineage, slot) is one tuple, replaced whole: a progress record read without the lock
(which a round's digest may hold for a second) never pairs one step's number with another's lineage.

*Where they sit* is three fields: the outer step count, the lineage (a hash chain of the rounds
that led here, see :func:`~greenswarm.averaging.outer.next_lineage`) and the slot of the last round.
The state also keeps its last :data:`ANCESTORS` lineages and serves them, so a site that adopts it
can tell whether a round it took part in is already in it (see :mod:`greenswarm.node.state_sync`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from greenswarm.averaging.agreement import state_digest
from greenswarm.averaging.outer import GENESIS, OuterOptimizer, next_lineage
from greenswarm.averaging.screening import update_norm
from greenswarm.node.swarm_view import state_key

#: how many earlier lineages a state keeps and serves (rounds are minutes apart: this covers hours)
ANCESTORS = 64


class GlobalState:
    """The outer optimizer and the global state's position, behind one lock."""

    def __init__(self, outer: OuterOptimizer, site: str):
        self.outer = outer
        self.site = site  # named in what is served, so a newcomer can say whom it caught up with
        self._position: tuple[int, str, int] = (0, GENESIS, -1)  # outer step, lineage, round slot
        self.recent_update_norm = 0.0  # norm of the last update applied (the scale the group screens by)
        self.ancestors: deque[str] = deque(maxlen=ANCESTORS)  # earlier lineages, oldest first
        self.lock = threading.Lock()
        self._digest: str | None = None  # of the parameters as they are: apply and adopt forget it
        # (position, digest of parameters and momentum): what the site's record attests it serves there
        self._attested: tuple[tuple[int, str, int], str] | None = None
        # schedule-free: how much history the site's x averages, served with the state (the trainer's
        # ``averaging_weights``; None for AdamW), so that an adopting site continues the average
        self.averaging: Callable[[], dict[str, float] | None] | None = None

    @property
    def params(self) -> torch.Tensor:
        """The global parameters (flat fp32; written by the loop, or by an overlapped round's thread
        while the loop leaves them alone)."""
        return self.outer.params

    @property
    def outer_round(self) -> int:
        return self._position[0]

    @property
    def lineage(self) -> str:
        return self._position[1]

    @property
    def round_index(self) -> int:
        return self._position[2]

    def where(self) -> tuple[int, str, int]:
        """Outer step, lineage and round slot, as one consistent triple (no lock needed)."""
        return self._position

    @property
    def numel(self) -> int:
        return self.outer.numel

    def descends_from(self, lineage: str) -> bool:
        """Whether ``lineage`` is this state's or one of its (kept) ancestors'."""
        return lineage == self.lineage or lineage in self.ancestors

    def key(self) -> tuple[int, str]:
        """This state's place in the total order of global states (see :func:`state_key`)."""
        return state_key(self.outer_round, self.lineage)

    def digest(self) -> str:
        """A short digest of the global parameters, for logs and records: hashed once per state (a
        ~100 M-parameter model takes a noticeable part of a second), not at every line that names it."""
        cached = self._digest  # (no lock for a cached one: the round thread may hold it for a while)
        if cached is not None:
            return cached
        with self.lock:
            if self._digest is None:
                self._digest = self.outer.digest()
            return self._digest

    def attestation(self) -> tuple[tuple[int, str, int], str]:
        """(outer step, lineage, round slot) and the digest of exactly what this site serves there
        (parameters and outer momentum, :func:`~greenswarm.averaging.agreement.state_digest`): what its
        signed progress record attests, so that a newcomer can check a downloaded state against the
        records of the state's holders (:func:`~greenswarm.node.state_sync.attested`). Hashed once
        per state (twice the model's bytes), not at every record."""
        cached = self._attested
        if cached is not None and cached[0] == self._position:
            return cached
        with self.lock:
            if self._attested is None or self._attested[0] != self._position:
                self._attested = (self._position, state_digest(self.outer.state_tensors()))
            return self._attested

    def hash_unlocked(self) -> None:
        """Hash the state into the caches without holding the lock (a ~1 B-parameter state takes
        seconds, while a groupmate may be waiting on the lock to download it). For the one thread that
        moves the state at this moment (an overlapped round's, right after its step): the hashes are
        kept only if nothing moved the state meanwhile."""
        where = self._position
        digest = self.outer.digest()
        attested = state_digest(self.outer.state_tensors())
        with self.lock:
            if self._position == where:
                self._digest = self._digest if self._digest is not None else digest
                self._attested = (where, attested)

    def pseudo_gradient(self, local: torch.Tensor) -> torch.Tensor:
        """``global - local``: what local training moved since the last outer step, written over
        ``local`` (a gathered copy of the parameters, which nothing else holds: a ~100 M-parameter
        model's fresh 400 MB vector costs as much in page faults as the subtraction itself)."""
        return self.outer.pseudo_gradient(local, out=local)

    def agreement_digest(self, averaged: torch.Tensor) -> str:
        """The digest a group compares: this state and the averaged step about to be applied to it."""
        with self.lock:
            return state_digest([*self.outer.state_tensors(), averaged])

    def apply(self, averaged: torch.Tensor, slot: int, members: Sequence[str]) -> None:
        """Take the outer step ``averaged`` that ``members`` (peer ids) agreed on in round ``slot``."""
        with self.lock:
            self._digest = self._attested = None
            self.outer.step(averaged)
            self.recent_update_norm = update_norm(averaged)
            outer_round, lineage, _ = self._position
            self.ancestors.append(lineage)
            self._position = (outer_round + 1, next_lineage(lineage, slot, members), slot)

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether downloaded state tensors have this model's shape (parameters and momentum)."""
        return len(tensors) == 2 and all(t.numel() == self.numel for t in tensors)

    def adopt(self, meta: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """Make a state this site's: a peer's served one (see :meth:`served`), or a checkpoint's
        tensors with its :meth:`position`."""
        with self.lock:
            self._digest = self._attested = None
            self.outer.load_state_tensors(tensors)
            self._position = (int(meta["outer_round"]), str(meta["lineage"]), int(meta["round_index"]))
            # a peer running an older greenswarm serves none, an older checkpoint keeps none
            self.ancestors = deque((str(a) for a in meta.get("ancestors", ())), maxlen=ANCESTORS)

    def served(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What this site serves to a newcomer (called on hivemind's thread)."""
        weights = self.averaging() if self.averaging is not None else None
        with self.lock:
            meta = self.position() | {"site": self.site} | ({"averaging": weights} if weights else {})
            return meta, self._copies()

    def position(self) -> dict[str, Any]:
        """Outer step, lineage, round slot and kept ancestors, as checkpoints and served states carry them."""
        outer_round, lineage, round_index = self._position
        return {
            "outer_round": outer_round,
            "lineage": lineage,
            "round_index": round_index,
            "ancestors": list(self.ancestors),
        }

    def tensors(self) -> list[torch.Tensor]:
        """Copies of the parameters and outer momentum, taken under the lock (for a checkpoint)."""
        with self.lock:
            return self._copies()

    def _copies(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.outer.state_tensors()]
