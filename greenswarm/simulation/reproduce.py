"""``greenswarm reproduce``: greenswarm's ledger applied to the curtail-llm anchor's own run.

The anchor's schedule (its event and loss logs, :mod:`greenswarm.simulation.anchor`) is accounted on
its trace with greenswarm's conventions and put next to the numbers the paper published. If the
two agree, greenswarm's emissions accounting is the anchor's, and every comparison that follows
(``greenswarm simulate``) is like for like.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from greenswarm.console import wide_console
from greenswarm.errors import ConfigError
from greenswarm.scheduler.config import ANCHOR_IDLE_KW, ANCHOR_TRAIN_KW
from greenswarm.scheduler.energy import baseline_emissions_g
from greenswarm.simulation.anchor import DEFAULT_GAP_S, PUBLISHED, anchor_runs
from greenswarm.simulation.engine import account
from greenswarm.traces.trace import Trace


def reproduce(
    events: Path,
    trace: Trace,
    *,
    regions: dict[str, str] | None = None,
    offset_s: float = 0.0,
    gap_s: float = DEFAULT_GAP_S,
    threshold: float = 100.0,
    train_kw: float = ANCHOR_TRAIN_KW,
    idle_kw: float = ANCHOR_IDLE_KW,
    baseline_h: float = PUBLISHED["site_hours"],
) -> dict[str, Any]:
    """Ours vs published: wall hours, site-hours, kWh, kg, in-window share, and the single-site
    baselines over ``baseline_h`` hours (the paper's 17.78 h by default, so that the baselines test
    the ledger's integration of the trace on the paper's terms; the site-hours row tests reading
    the logs separately)."""
    runs, start, end = anchor_runs(
        events, trace, regions=regions, offset_s=offset_s, gap_s=gap_s, train_kw=train_kw, idle_kw=idle_kw
    )
    totals = account(runs, trace, threshold)
    energy = sum(t.energy_kwh for t in totals)
    work_h = sum(t.work_s for t in totals) / 3600.0
    ours: dict[str, Any] = {
        "wall_hours": (end - start) / 3600.0,
        "site_hours": work_h,
        "energy_kwh": energy,
        "emissions_kg": sum(t.emissions_g for t in totals) / 1000.0,
        "in_window_share": sum(t.in_window_kwh for t in totals) / energy if energy else 0.0,
        # the paper's baselines: one site continuously from the trace's start for the hours it names
        "baselines_kg": {
            r: baseline_emissions_g(trace, r, trace.start, trace.start + baseline_h * 3600.0, train_kw)
            / 1000.0
            for r in trace.regions
        },
    }
    rows = []
    for key, value in ours.items():
        if key == "baselines_kg":
            for region, kg in value.items():
                pub = PUBLISHED["baselines_kg"].get(region)
                rows.append(_row(f"baseline {region}, {baseline_h:g} h (kg)", kg, pub))
        else:
            rows.append(_row(key, value, PUBLISHED.get(key)))
    return {
        "events": str(events),
        "trace": trace.source,
        "clients": {r.name: r.region for r in runs},
        "ours": ours,
        "published": PUBLISHED,
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows if r["error"] is not None),
    }


def _row(name: str, ours: float, published: float | None) -> dict[str, Any]:
    error = None if not published else ours / published - 1.0
    return {"quantity": name, "ours": ours, "published": published, "error": error}


def print_reproduction(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"curtail-llm run accounted by greenswarm ({report['trace']})")
    for col in ("quantity", "greenswarm", "published", "difference"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for r in report["rows"]:
        table.add_row(
            r["quantity"],
            f"{r['ours']:.4g}",
            "-" if r["published"] is None else f"{r['published']:g}",
            "-" if r["error"] is None else f"{r['error']:+.2%}",
        )
    console = wide_console()
    console.print(table)
    clients = ", ".join(f"{c} = {r}" for c, r in report["clients"].items())
    console.print(f"clients: {clients}; largest difference {report['max_abs_error']:.2%}", highlight=False)


def _client_regions(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        client, sep, region = part.partition("=")
        if not sep or not client.strip() or not region.strip():
            raise ConfigError(f"expected CLIENT=REGION pairs, got {part!r}", where="--regions")
        out[client.strip()] = region.strip()
    return out


def run_reproduce(
    events: str,
    trace: str,
    *,
    regions: str | None = None,
    offset_s: float = 0.0,
    gap_s: float = DEFAULT_GAP_S,
    trace_options: dict[str, Any] | None = None,
    as_json: bool = False,
) -> int:
    """``greenswarm reproduce``: load, account, print the table (or one JSON object)."""
    import math

    from greenswarm.traces.readers import load_trace

    if not (math.isfinite(gap_s) and gap_s > 0):
        raise ConfigError(f"must be a number of seconds > 0, got {gap_s:g}", where="--gap-s")
    if not math.isfinite(offset_s):
        raise ConfigError(f"must be a finite number of seconds, got {offset_s:g}", where="--offset-s")
    loaded = load_trace(trace, **(trace_options or {}))
    report = reproduce(Path(events), loaded, regions=_client_regions(regions), offset_s=offset_s, gap_s=gap_s)
    if as_json:
        print(json.dumps(report))
    else:
        print_reproduction(report)
    return 0
