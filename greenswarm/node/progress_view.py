"""Rendering progress records: a rich table for people, JSON for scripts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.table import Table

from greenswarm.console import wide_console
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.shards_view import (
    fetch_shard_records,
    listing_json,
    shard_listing,
    shards_summary,
    shards_table,
)
from greenswarm.timefmt import utc_short

STATE_STYLE = {
    "IDLE": "dim",
    "RELEASED": "blue",
    "RESTARTING": "magenta",
    "SOLO": "yellow",
    "FEDERATED": "bold green",
}


def progress_table(records: Sequence[ProgressRecord], title: str = "") -> Table:
    table = Table(title=title or None, header_style="bold")
    refusals = any(r.refused for r in records)  # a column only when some site refused an update
    plans = any(r.next_start is not None for r in records)  # ... or follows a deadline plan
    held_out = any(r.eval_loss is not None for r in records)  # ... or measures the global model
    for col, justify in [
        ("site", "left"),
        ("region", "left"),
        ("state", "left"),
        ("outer", "right"),
        ("steps", "right"),
        ("tokens", "right"),
        ("loss", "right"),
        *([("held-out", "right")] if held_out else []),
        ("wire", "left"),
        ("window end", "left"),
        *([("next start", "left")] if plans else []),
        ("energy kWh", "right"),
        ("CO2 g", "right"),
        ("clock", "left"),
        ("seen", "right"),
        *([("refused", "right")] if refusals else []),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    now = time.time()
    for r in records:
        table.add_row(
            r.site,
            r.region,
            f"[{STATE_STYLE.get(r.state, '')}]{r.state}[/]",
            str(r.outer_round),
            f"{r.local_steps:,}",
            f"{r.tokens:,}",
            "-" if r.loss is None else f"{r.loss:.3f}",
            *([held_out_cell(r)] if held_out else []),
            r.wire or "-",
            utc_short(r.window_end),
            *([utc_short(r.next_start)] if plans else []),
            f"{r.energy_kwh:.2f}",
            f"{r.emissions_g:,.0f}",
            utc_short(r.clock_time),
            f"{max(0.0, now - r.wall_time):.0f}s ago",
            *([f"[red]{r.refused}[/]" if r.refused else "0"] if refusals else []),
        )
    return table


def held_out_cell(record: ProgressRecord) -> str:
    """The global model's held-out loss and the outer step it was of, e.g. ``2.314 @12``."""
    if record.eval_loss is None:
        return "-"
    step = f" @{record.eval_round}" if record.eval_round is not None else ""
    return f"{record.eval_loss:.3f}{step}"


def records_json(records: Sequence[ProgressRecord], indent: int | None = 2) -> str:
    return json.dumps([r.to_wire() for r in records], indent=indent)


def show_progress(
    initial_peers: list[str],
    swarm: str,
    as_json: bool,
    watch: float | None,
    authority: str | None = None,
    revocations: str | None = None,
    shards: bool = False,
) -> int:
    """``greenswarm progress``: read the live records once (or every ``watch`` seconds) and print them.
    With ``authority`` (the swarm authority's public key) only certified members' records are shown,
    and none of a member that the swarm's revocation list (``revocations``, and the newest on the DHT)
    names. With ``shards``, the swarm's claimed shards instead (:mod:`greenswarm.node.shards_view`)."""
    from rich.live import Live

    from greenswarm.node import progress
    from greenswarm.node.progress import open_reader
    from greenswarm.node.revocations import RevocationWatch
    from greenswarm.security.admission import Admission

    admission = Admission.from_files(swarm, authority) if authority else None
    if admission is not None:
        admission.load_revocations(revocations)
    dht = open_reader(initial_peers, swarm, admission=admission)
    watch_list = RevocationWatch(dht, admission, "") if admission is not None else None
    if watch_list is not None:
        watch_list.poll_now()

    def members_records() -> list:
        """The live records, less those of members the revocation list names."""
        records = progress.fetch_records(dht, swarm)
        if admission is None:
            return records
        return [r for r in records if admission.revoked(r.peer_id) is None]

    def members_shards() -> list:
        """The shard records, less those of members the revocation list names."""
        records = fetch_shard_records(dht, swarm)
        if admission is None:
            return records
        return [r for r in records if admission.revoked(r.peer_id) is None]

    console = wide_console()
    if shards:
        try:
            return _show_shards(members_shards, swarm, as_json, watch, console)
        except KeyboardInterrupt:
            return 0
        finally:
            if watch_list is not None:
                watch_list.close()
            dht.shutdown()
    try:
        if watch is None:
            records = members_records()
            for _ in range(6):  # a just-started client may need a moment before lookups find the records
                if records:
                    break
                time.sleep(0.5)
                records = members_records()
            if as_json:
                print(records_json(records))
            elif records:
                console.print(progress_table(records, title=f"swarm '{swarm}'"))
                summary = shards_summary(shard_listing(members_shards()))
                if summary:
                    console.print(summary)
            else:
                hint = "" if authority else " (a certified swarm's records need --authority KEY.pub)"
                console.print(f"no live sites in swarm '{swarm}'{hint}")
            return 0
        if as_json:
            while True:
                print(records_json(members_records(), indent=None), flush=True)
                time.sleep(watch)
        if not console.is_terminal:  # a pipe or a file: one table per refresh, no cursor tricks
            while True:
                console.print(progress_table(members_records(), title=f"swarm '{swarm}' at {time.ctime()}"))
                time.sleep(watch)
        with Live(
            progress_table([], title=f"swarm '{swarm}'"), console=console, refresh_per_second=4
        ) as live:
            while True:
                live.update(progress_table(members_records(), title=f"swarm '{swarm}'"))
                time.sleep(watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if watch_list is not None:
            watch_list.close()
        dht.shutdown()


def _show_shards(
    records: Callable[[], list], swarm: str, as_json: bool, watch: float | None, console: Any
) -> int:
    """``greenswarm progress --shards``: the claimed shards' table (or JSON), once or every ``watch`` s."""
    while True:
        listing = shard_listing(records())
        for _ in range(6 if watch is None and not listing else 0):  # a just-started reader may need a moment
            time.sleep(0.5)
            listing = shard_listing(records())
        if as_json:
            print(listing_json(listing, indent=None if watch is not None else 2), flush=True)
        elif not listing:
            console.print(f"no site of swarm '{swarm}' claims shards (data.sharding: claim)")
        else:
            for entry in listing:
                console.print(shards_table(entry))
        if watch is None:
            return 0
        time.sleep(watch)
