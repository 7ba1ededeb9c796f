"""``greenswarm progress --shards``: the swarm's claimed shards, who holds each and how far it is read.

Reads every site's shard record (:mod:`greenswarm.node.shard_records`) and merges them by the same
rules the sites apply, one table per corpus (sites of one swarm normally share one). A person gets a
table; a script gets JSON with every live claim of each shard (more than one only while crossed
claims settle).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from greenswarm.node.shard_records import ShardRecord, SwarmShards, merge, record_of, shards_key

#: a table lists every shard up to this many; beyond, only the held ones (the rest are summed up)
ROWS_SHOWN = 64


def fetch_shard_records(dht: Any, swarm: str) -> list[ShardRecord]:
    """Every site's shard record of swarm ``swarm`` (any corpus), as the DHT holds them now."""
    found = dht.get(shards_key(swarm), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    records = [record_of(getattr(item, "value", None)) for item in found.value.values()]
    return [r for r in records if r is not None]


def shard_listing(records: Sequence[ShardRecord], now: float | None = None) -> list[dict[str, Any]]:
    """One entry per corpus: its dataset id, shard count, sites and a row per shard."""
    from hivemind.utils import get_dht_time

    now = get_dht_time() if now is None else now
    listing = []
    for dataset in sorted({r.dataset for r in records}):
        view = merge(records, dataset, now)
        sites = sorted({r.site for r in records if r.dataset == dataset})
        listing.append(
            {
                "dataset": dataset,
                "count": view.count,
                "sites": sites,
                "epoch": _swarm_epoch(view),
                "shards": view.as_rows(),
            }
        )
    return listing


def _swarm_epoch(view: SwarmShards) -> int:
    """The epoch the swarm reads now: the lowest next epoch of any shard but the held-out ones."""
    return min((view.next_epoch(k) for k in range(view.count) if k not in view.excluded), default=0)


def shards_table(entry: dict[str, Any], now: float | None = None) -> Table:
    """A table of one corpus's shards."""
    now = time.time() if now is None else now
    rows = entry["shards"]
    held = [r for r in rows if r["site"]]
    shown = rows if len(rows) <= ROWS_SHOWN else held
    table = Table(
        title=f"shards of dataset {entry['dataset']}",
        caption=f"{entry['count']} shards, {len(held)} held by {len({r['site'] for r in held})} site(s); "
        f"the swarm reads epoch {entry['epoch']}",
        header_style="bold",
    )
    for col, justify in [
        ("shard", "right"),
        ("epoch", "right"),
        ("read", "right"),
        ("held by", "left"),
        ("lease", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in shown:
        size = row["documents"]
        read = f"{row['document']:,}" + (f" of {size:,} ({row['document'] / size:.0%})" if size else "")
        holder = row["site"] or ("[dim]held out[/]" if row["held_out"] else "[dim]free[/]")
        if len(row["claims"]) > 1:
            holder += f" [yellow](+{len(row['claims']) - 1} crossed claim)[/]"
        lease = f"{max(0.0, row['lease_until'] - now):.0f}s" if row["lease_until"] else "-"
        table.add_row(str(row["shard"]), str(row["epoch"]), read, holder, lease)
    if len(shown) < len(rows):
        table.caption += f"; {len(rows) - len(shown)} shards nobody holds are not shown"
    return table


def shards_summary(listing: Sequence[dict[str, Any]]) -> str:
    """One line per corpus for the sites table's foot: how many shards are held, which epoch."""
    lines = []
    for entry in listing:
        held = [r for r in entry["shards"] if r["site"]]
        lines.append(
            f"shards: {len(held)} of {entry['count']} held, the swarm reads epoch {entry['epoch']} "
            f"(dataset {entry['dataset']}; greenswarm progress --shards)"
        )
    return "\n".join(lines)


def listing_json(listing: Sequence[dict[str, Any]], indent: int | None = 2) -> str:
    """``{"at": wall time of the reading, "datasets": [...]}``."""
    return json.dumps({"at": time.time(), "datasets": list(listing)}, indent=indent)
