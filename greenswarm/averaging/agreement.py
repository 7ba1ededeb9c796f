"""After a round, the members of the group prove that they are about to apply the same global step.

Each member hashes what it is about to apply -- its global state before the step (parameters and
outer momentum) and the averaged pseudo-gradient -- and publishes that digest on the DHT under a key
that names the round's group. It then reads the others' digests until every member's is in or the
agreement timeout passes, and decides (:func:`decide`):

* **apply**: a strict majority of the group's members (counting the ones that never answered as
  dissenters) published this site's digest;
* **resync**: a strict majority published another digest: this site's result is wrong (a lost part,
  a bad codec, a corrupted state); it downloads the majority's state after their step instead;
* **fail**: no digest has a majority: nobody trusts the round, every member keeps its local progress
  and retries at the next round.

The all-reduce is exact (:mod:`greenswarm.averaging.exact`), so members that computed the same thing
hold the same bits and compare by equality, with no tolerance to tune.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from greenswarm.digests import content_digest

log = logging.getLogger(__name__)

#: what a member publishes instead of a digest when its own all-reduce failed
FAILED = "failed"


def state_digest(tensors: Iterable[torch.Tensor]) -> str:
    """A digest of tensors' exact bytes (dtype and shape included), in order."""
    return content_digest(list(tensors))


def group_key(swarm: str, round_index: int, lineage: str, members: Sequence[str]) -> str:
    """The DHT key of one group's digests: a retried round or another group never shares it."""
    text = "|".join([str(round_index), lineage, *sorted(members)])
    return f"{swarm}_agree_{hashlib.sha256(text.encode()).hexdigest()[:20]}"


@dataclass(frozen=True)
class Verdict:
    """What a member does with its round result."""

    action: str  # "apply" | "resync" | "fail"
    digest: str | None  # the majority's digest (None when there is none)
    holders: list[str] = field(default_factory=list)  # members that published the majority digest
    reason: str = ""


def majority(published: dict[str, str], members: Sequence[str]) -> str | None:
    """The digest a strict majority of the whole group published, if one has (FAILED never counts)."""
    votes = Counter(d for peer, d in published.items() if peer in members and d != FAILED)
    if votes:
        digest, count = votes.most_common(1)[0]
        if count >= len(members) // 2 + 1:
            return digest
    return None


def decide(me: str, mine: str, published: dict[str, str], members: Sequence[str]) -> Verdict:
    """The verdict for member ``me`` whose digest is ``mine``, given what each member ``published``.

    Members missing from ``published`` count against every digest: a majority must be a majority of
    the whole group, so two members that lost contact can never both believe they hold it.
    """
    votes = Counter(d for peer, d in published.items() if peer in members and d != FAILED)
    need = len(members) // 2 + 1
    tally = ", ".join(f"{d[:8]}x{n}" for d, n in votes.most_common()) or "none"
    heard = f"{len(published)}/{len(members)} members reported; digests {tally}"
    if not votes or votes.most_common(1)[0][1] < need:
        return Verdict("fail", None, reason=f"no digest has a majority of {need} ({heard})")
    digest = votes.most_common(1)[0][0]
    holders = sorted(p for p, d in published.items() if d == digest and p != me)
    if mine == digest:
        return Verdict("apply", digest, holders, reason=heard)
    return Verdict(
        "resync", digest, holders, reason=f"this site's result differs from the majority's ({heard})"
    )


class DigestBoard:
    """Publishes this member's digest and collects the group's, on the swarm's DHT.

    Records live for ``ttl_s`` seconds; each member writes one sub-key (its peer id), so a late member
    never overwrites another's vote. A member whose reducer refused a groupmate's update says so in
    its record, so every member learns of it (each reducer sees only its own slice):
    :attr:`heard_refused` holds what the others reported in the last exchange.
    """

    def __init__(self, dht: Any, swarm: str, peer_id: str, ttl_s: float = 600.0, poll_s: float = 0.1):
        self.dht, self.swarm, self.peer_id = dht, swarm, peer_id
        self.ttl_s, self.poll_s = ttl_s, poll_s
        self.heard_refused: dict[str, str] = {}  # refused peer -> why, as other members reported it

    def exchange(
        self,
        round_index: int,
        lineage: str,
        members: Sequence[str],
        digest: str,
        timeout_s: float,
        publish: bool = True,
        refused: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """Publish ``digest`` (and the updates this member ``refused``) and return the members'
        published digests: all of them, or as soon as one digest has a strict majority (the others
        cannot change the verdict then, so a member that failed its all-reduce and will never answer
        costs nothing), or what came within ``timeout_s`` (``publish=False`` only reads: a fault hook
        for a member whose record was lost)."""
        from hivemind.utils import get_dht_time

        key = group_key(self.swarm, round_index, lineage, members)
        value: Any = digest
        if refused:
            value = {"digest": digest, "refused": {p: why[:200] for p, why in refused.items()}}
        self.heard_refused = {}
        deadline = time.monotonic() + timeout_s
        stored = not publish
        published: dict[str, str] = {}
        while True:
            if not stored:
                try:
                    stored = bool(
                        self.dht.store(key, value, get_dht_time() + self.ttl_s, subkey=self.peer_id)
                    )
                except Exception as e:  # a DHT hiccup: try again until the deadline
                    log.debug("storing the round digest failed: %r", e)
            published = {**published, **self._read(key, members)}
            if stored and publish:
                published[self.peer_id] = digest
            if set(members) <= set(published) or majority(published, members) or time.monotonic() >= deadline:
                return published
            time.sleep(self.poll_s)

    def _read(self, key: str, members: Sequence[str]) -> dict[str, str]:
        try:
            found = self.dht.get(key, latest=True)
        except Exception as e:
            log.debug("reading the round digests failed: %r", e)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, entry in found.value.items():
            value = getattr(entry, "value", None)
            if isinstance(value, dict) and subkey in members and subkey != self.peer_id:
                reported = value.get("refused")
                if isinstance(reported, dict):
                    self.heard_refused.update({str(p): str(why) for p, why in reported.items()})
                value = value.get("digest")
            if subkey in members and isinstance(value, str) and len(value) <= 64:
                out[str(subkey)] = value
        return out
