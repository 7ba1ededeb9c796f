"""What sites say about the swarm's shards in the DHT, and the rules every site reads it by.

A swarm that claims its data (``data.sharding: claim``) cuts its corpus into ``data.num_shards``
shards. Each site keeps one signed record under the DHT key ``<swarm>_shards`` (subkey: the site's
own RSA key, so only it can overwrite it; fields typed by the progress schema):

* ``leases`` -- the shards it holds now: when it claimed each (DHT time), until when the lease
  runs unless renewed, and a token that names the claim across the site's restarts;
* ``positions`` -- for every shard it knows of, the furthest *committed* position: where the next
  unread token is, as saved in a checkpoint that is on disk (the site's own shards, and what it
  read in others' records: every live site carries the swarm's positions, so a crashed site's last
  word outlives its record);
* ``sizes`` -- documents in an epoch of each shard some reader has read to the end.

The rules, which every site applies alike to what it reads:

* **a lease is live** while its ``until`` is ahead of the reader's DHT time (wall clock);
* **the holder of a shard** is the live lease with the earliest ``claimed_at`` (then the smaller
  peer id, then token): a site that claimed a shard someone else holds, because their claims
  crossed in the DHT, sees that after its settle time and withdraws before it reads;
* **a shard's position** is the furthest any record gives: positions only move forward, and one
  is published only for what a saved checkpoint holds;
* **which shard next**: a free shard (no live lease but the claimant's own) whose next epoch is the
  lowest, so every shard is read once per epoch before any is read again; ties are broken by a hash
  of the claimant's peer id and the shard, so sites that claim at once rarely reach for the same one.

Positions are ``(epoch, document, offset)`` (:data:`~greenswarm.node.shard_reader.Position`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from greenswarm.node.shard_reader import START, Position

RECORD_VERSION = 1


def shards_key(swarm: str) -> str:
    """The DHT key of swarm ``swarm``'s shard records (the progress schema's ``shards`` field)."""
    return f"{swarm}_shards"


def dataset_id(settings: dict[str, Any], excluded: Iterable[int]) -> str:
    """A short digest of one claimed corpus: its settings (what a position means) and the shards no
    site claims (the held-out shard). Sites read only records of their own dataset id."""
    blob = json.dumps({"settings": settings, "excluded": sorted(excluded)}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Lease:
    """One site's hold on one shard."""

    shard: int
    claimed_at: float  # DHT (wall) time of the claim: the earliest live claim holds the shard
    until: float  # the lease ends then unless renewed
    token: str  # names this claim across its site's restarts (kept in the site's memory and record)
    rank: int = 0  # the site's rank that reads it

    def live(self, now: float) -> bool:
        return self.until > now

    def to_wire(self) -> dict[str, Any]:
        return {
            "shard": int(self.shard),
            "claimed_at": float(self.claimed_at),
            "until": float(self.until),
            "token": self.token,
            "rank": int(self.rank),
        }

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> Lease:
        return cls(
            int(value["shard"]),
            float(value["claimed_at"]),
            float(value["until"]),
            str(value["token"]),
            int(value.get("rank", 0)),
        )


@dataclass(frozen=True)
class ShardRecord:
    """One site's record of the swarm's shards (see the module's docstring)."""

    site: str
    peer_id: str
    dataset: str
    count: int  # the corpus's shards (``data.num_shards``)
    leases: list[Lease] = field(default_factory=list)
    positions: dict[int, Position] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    excluded: list[int] = field(default_factory=list)  # shards nobody claims (held out for evaluation)
    wall_time: float = 0.0
    version: int = RECORD_VERSION

    def to_wire(self) -> dict[str, Any]:
        """Plain, strictly typed values (the schema refuses an int where a float belongs)."""
        return {
            "site": self.site,
            "peer_id": self.peer_id,
            "dataset": self.dataset,
            "count": int(self.count),
            "leases": [lease.to_wire() for lease in self.leases],
            "positions": [[int(k), *map(int, p)] for k, p in sorted(self.positions.items()) if p != START],
            "sizes": [[int(k), int(n)] for k, n in sorted(self.sizes.items())],
            "excluded": sorted(int(k) for k in self.excluded),
            "wall_time": float(self.wall_time),
            "version": int(self.version),
        }

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> ShardRecord:
        return cls(
            site=str(value["site"]),
            peer_id=str(value["peer_id"]),
            dataset=str(value["dataset"]),
            count=int(value["count"]),
            leases=[Lease.from_wire(v) for v in value.get("leases", [])],
            positions={int(k): (int(e), int(d), int(o)) for k, e, d, o in value.get("positions", [])},
            sizes={int(k): int(n) for k, n in value.get("sizes", [])},
            excluded=[int(k) for k in value.get("excluded", [])],
            wall_time=float(value.get("wall_time", 0.0)),
            version=int(value.get("version", RECORD_VERSION)),
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a shard now: the site, its peer id and its lease."""

    site: str
    peer_id: str
    lease: Lease


def claim_order(lease: Lease, peer_id: str) -> tuple[float, str, str]:
    """Earlier claims hold: the key live leases of one shard are ranked by."""
    return (lease.claimed_at, peer_id, lease.token)


@dataclass
class SwarmShards:
    """The swarm's shards as one site reads them now: furthest positions, sizes, and live holders."""

    count: int
    positions: dict[int, Position] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    holders: dict[int, Holder] = field(default_factory=dict)
    # every live lease of each shard, the holder's first: more than one only while crossed claims
    # settle (the later claimant withdraws), never for long
    claims: dict[int, list[Holder]] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)  # held out: no site claims them

    def position(self, shard: int) -> Position:
        return self.positions.get(shard, START)

    def next_epoch(self, shard: int) -> int:
        """The epoch a reader of ``shard`` would read next (a position at its epoch's last document
        counts as that epoch read, when the epoch's size is known)."""
        epoch, document, _ = self.position(shard)
        size = self.sizes.get(shard)
        return epoch + 1 if size is not None and document >= size else epoch

    def free(self, shard: int, tokens: set[str]) -> bool:
        """Whether a claimant whose own claims carry ``tokens`` may claim ``shard``."""
        holder = self.holders.get(shard)
        return holder is None or holder.lease.token in tokens

    def as_rows(self, claimable: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """One row per shard for ``greenswarm progress --shards``: epoch, documents read, holder."""
        rows = []
        for shard in claimable if claimable is not None else range(self.count):
            epoch, document, offset = self.position(shard)
            holder = self.holders.get(shard)
            rows.append(
                {
                    "shard": shard,
                    "epoch": epoch,
                    "document": document,
                    "offset": offset,
                    "documents": self.sizes.get(shard),
                    "next_epoch": self.next_epoch(shard),
                    "held_out": shard in self.excluded,
                    "site": holder.site if holder else None,
                    "peer_id": holder.peer_id if holder else None,
                    "lease_until": holder.lease.until if holder else None,
                    "claims": [
                        {
                            "site": h.site,
                            "peer_id": h.peer_id,
                            "claimed_at": h.lease.claimed_at,
                            "until": h.lease.until,
                        }
                        for h in self.claims.get(shard, [])
                    ],
                }
            )
        return rows


def merge(records: Iterable[ShardRecord], dataset: str, now: float) -> SwarmShards:
    """Every record of ``dataset`` merged by the rules (see the module's docstring). Records of another
    dataset, or another shard count, are left out."""
    records = [r for r in records if r.dataset == dataset]
    count = max((r.count for r in records), default=0)
    merged = SwarmShards(count)
    live: dict[int, list[tuple[tuple[float, str, str], Holder]]] = {}
    for record in records:
        for shard, position in record.positions.items():
            if position > merged.positions.get(shard, START):
                merged.positions[shard] = position
        for shard, size in record.sizes.items():
            merged.sizes[shard] = max(size, merged.sizes.get(shard, 0))
        merged.excluded.update(record.excluded)
        for lease in record.leases:
            if lease.live(now):
                holder = Holder(record.site, record.peer_id, lease)
                live.setdefault(lease.shard, []).append((claim_order(lease, record.peer_id), holder))
    for shard, leases in live.items():
        ordered = [holder for _, holder in sorted(leases, key=lambda item: item[0])]
        # one site may show one claim twice (a restart's records under two subkeys): once is enough
        seen: set[str] = set()
        unique = [h for h in ordered if not (h.lease.token in seen or seen.add(h.lease.token))]
        merged.claims[shard] = unique
        merged.holders[shard] = unique[0]
    return merged


def choose(
    shards: SwarmShards, claimable: Iterable[int], tokens: set[str], taken: set[int], n: int, salt: str
) -> list[int]:
    """Up to ``n`` shards to claim: free ones (no live lease but this claimant's, whose claims carry
    ``tokens``; none in ``taken``, which it holds already), lowest next epoch first, ties in an order
    of this claimant's own (``salt``: its peer id), so simultaneous claimants spread out."""
    free = [k for k in claimable if k not in taken and shards.free(k, tokens)]

    def order(shard: int) -> tuple[int, str]:
        return (
            shards.next_epoch(shard),
            hashlib.blake2b(f"{salt}/{shard}".encode(), digest_size=8).hexdigest(),
        )

    return sorted(free, key=order)[: max(0, n)]


def record_of(value: Any) -> ShardRecord | None:
    """A record from what the DHT returned, or None for anything else (another version, garbage)."""
    if not isinstance(value, dict):
        return None
    try:
        return ShardRecord.from_wire(value)
    except (KeyError, TypeError, ValueError):
        return None


def as_dict(shards: SwarmShards) -> dict[str, Any]:
    """For JSON: the merged view."""
    return {
        "count": shards.count,
        "positions": {str(k): list(v) for k, v in sorted(shards.positions.items())},
        "sizes": {str(k): v for k, v in sorted(shards.sizes.items())},
        "holders": {
            str(k): {**asdict(h.lease), "site": h.site, "peer_id": h.peer_id}
            for k, h in shards.holders.items()
        },
    }
