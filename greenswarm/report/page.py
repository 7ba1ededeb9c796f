"""The run report as one static HTML page: figures embedded as base64 PNG, styles inline, no script.

Nothing is fetched when the page opens (no CDN, no font, no script), so it shows the same offline, in
a mail attachment or years later. Each section has a stable id (``#sites``, ``#loss``, ``#states``,
``#rounds``, ``#emissions``, ``#totals``), which tests and links rely on. Every text that comes from a
run directory is escaped.
"""

from __future__ import annotations

import base64
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

from greenswarm.report.runs import HISTORY, ROUNDS, SUMMARY, SiteRun
from greenswarm.timefmt import utc_minute, utc_second

#: the sections, in page order: id, heading
SECTIONS = (
    ("sites", "Sites and their run directories"),
    ("loss", "Loss against tokens"),
    ("states", "States over time, on each region's intensity and threshold"),
    ("rounds", "Rounds and their members"),
    ("emissions", "Cumulative emissions against continuous training at equal work"),
    ("totals", "Totals"),
)
#: the most round slots the rounds table shows (the newest): a production run of thousands of rounds
#: would otherwise make a page of thousands of rows. The figure shows every round; rounds.jsonl has
#: every line.
MAX_ROUND_ROWS = 200

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto;
       max-width: 1180px; padding: 1.2em 1.6em 3em; color: #222; background: #fff; }
h1 { margin-bottom: 0.2em; }
.meta { color: #555; margin-top: 0; }
nav { margin: 0.8em 0 1.4em; }
nav a { margin-right: 1.1em; color: #1565c0; text-decoration: none; }
section { margin-top: 2.2em; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
figure { margin: 0.6em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, .note { color: #555; font-size: 0.92em; }
.missing { color: #8a5300; background: #fff8e1; padding: 0.5em 0.8em; border-left: 3px solid #f9a825; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.55em; vertical-align: top; }
th { background: #f5f5f5; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td:first-child { white-space: nowrap; }
tr.total td { font-weight: bold; background: #fafafa; }
.apply { color: #2e7d32; } .solo { color: #e65100; } .fail { color: #c62828; } .resync { color: #6a1b9a; }
"""


@dataclass
class Section:
    """One section's body, and whether it shows what it is for (``missing``: why not)."""

    id: str
    heading: str
    body: str
    missing: str | None = None


def _num(value: float | int | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _table(
    headers: list[str], rows: list[list[str]], numeric: set[int], classes: list[str] | None = None
) -> str:
    """A table; ``rows`` are already escaped HTML cells, ``numeric`` the columns aligned right."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for n, row in enumerate(rows):
        cells = "".join(
            f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row)
        )
        cls = f' class="{classes[n]}"' if classes and classes[n] else ""
        body.append(f"<tr{cls}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="scroll">{table}</div>'


def figure(image: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(image).decode("ascii")
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{escape(alt)}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def missing(text: str) -> str:
    return f'<p class="missing">{escape(text)}</p>'


def figure_section(
    id_: str, heading: str, draw: Callable[[], bytes | None], alt: str, caption: str, absent: str
) -> Section:
    """A section holding one figure, or the reason it has none."""
    image = draw()
    if image is None:
        return Section(id_, heading, missing(absent), absent)
    return Section(id_, heading, figure(image, alt, caption))


def sites_section(runs: list[SiteRun]) -> Section:
    rows = []
    for run in runs:
        files = [
            name if (run.path / name).is_file() else f"<b>no {name}</b>"
            for name in (SUMMARY, HISTORY, ROUNDS)
        ]
        notes = "<br>".join(escape(n) for n in run.notes) or "-"
        span = "-" if run.t0 is None or run.t1 is None else f"{utc_minute(run.t0)} to {utc_minute(run.t1)}"
        rows.append(
            [
                escape(run.label),
                escape(run.region),
                f"<code>{escape(str(run.path))}</code>",
                ", ".join(files),
                span,
                notes,
            ]
        )
    table = _table(["site", "region", "run directory", "files", "clock time", "notes"], rows, set())
    return Section("sites", SECTIONS[0][1], table)


def _action(entry: dict[str, Any]) -> str:
    action = escape(str(entry.get("action", "?")))
    return f'<span class="{action}">{action}</span>'


def _round_rows(runs: list[SiteRun]) -> tuple[list[list[str]], int]:
    """One row per round slot (what each site did in it) for the newest :data:`MAX_ROUND_ROWS` slots,
    newest last; and how many slots there were in all (only the rows shown are built)."""
    by_slot: dict[int, list[tuple[SiteRun, dict[str, Any]]]] = {}
    for run in runs:
        for entry in run.rounds:
            if isinstance(entry.get("slot"), int):
                by_slot.setdefault(entry["slot"], []).append((run, entry))
    slots = sorted(by_slot)
    rows = []
    for slot in slots[-MAX_ROUND_ROWS:]:
        done = by_slot[slot]
        sync = next((r.sync_interval_s for r, _ in done if r.sync_interval_s), None)
        when = utc_minute(slot * sync) if sync else "-"
        members = sorted({m for _, e in done if e.get("action") != "solo" for m in e.get("members") or []})
        actions = " · ".join(f"{escape(r.label)} {_action(e)}" for r, e in done)
        wires = sorted({e["wire"] for _, e in done if e.get("wire")})
        seconds = [e["round_s"] for _, e in done if isinstance(e.get("round_s"), int | float)]
        notes = sorted(
            {e["reason"] for _, e in done if e.get("reason")}
            | {f"refused {k}: {v}" for _, e in done for k, v in (e.get("refused") or {}).items()}
        )
        rows.append(
            [
                when,
                str(slot),
                escape(", ".join(members)) or "-",
                actions,
                escape(", ".join(wires)) or "-",
                _num(statistics.median(seconds), ".2f") if seconds else "-",
                escape("; ".join(notes)) or "-",
            ]
        )
    return rows, len(slots)


def rounds_section(runs: list[SiteRun], image: bytes | None) -> Section:
    rows, count = _round_rows(runs)
    if not rows:
        text = "No site recorded a round (no rounds.jsonl, or an empty one)."
        return Section("rounds", SECTIONS[3][1], missing(text), text)
    parts = []
    if image is not None:
        parts.append(
            figure(
                image,
                "each site's rounds on clock time",
                "Each mark is a round a site ended, at its boundary; a vertical line joins the members of "
                "one averaging group.",
            )
        )
    counts = {
        a: sum(1 for r in runs for e in r.rounds if e.get("action") == a)
        for a in ("apply", "solo", "resync", "fail")
    }
    parts.append(
        '<p class="note">'
        + escape(
            f"{count:,} round slot(s); site-rounds averaged {counts['apply']:,}, alone {counts['solo']:,}, "
            f"resynced {counts['resync']:,}, failed {counts['fail']:,}."
        )
        + "</p>"
    )
    if count > len(rows):
        where = "the figure above shows every round, and " if image is not None else ""
        parts.append(
            '<p class="note" id="rounds-left-out">'
            + escape(
                f"The table shows the newest {len(rows):,} round slots; the {count - len(rows):,} earlier "
                f"ones are left out here ({where}each site's rounds.jsonl has every one)."
            )
            + "</p>"
        )
    headers = [
        "boundary (UTC)",
        "slot",
        "group members",
        "what each site did",
        "wire",
        "median round s",
        "notes",
    ]
    parts.append(_table(headers, rows, {1, 5}))
    return Section("rounds", SECTIONS[3][1], "".join(parts))


#: the states whose hours the totals table shows (a restart's are in its energy, not here)
HOUR_STATES = ("IDLE", "RELEASED", "SOLO", "FEDERATED")
COUNTS = ("outer_round", "federated_rounds", "solo_rounds", "failed_rounds")
SUMS = ("tokens", "energy_kwh", "training_g", "idle_g", "emissions_g", "at_once_g")


def site_totals(run: SiteRun) -> dict[str, Any]:
    """One site's final figures, as plain data (None: the run directory could not say)."""
    seconds = run.seconds_by_state()
    training_g, idle_g = run.emissions_split()
    at_once = run.equal_work_g()
    return {
        "site": run.label,
        "region": run.region,
        "hours": {s: seconds.get(s, 0.0) / 3600.0 for s in HOUR_STATES} if seconds else None,
        **{key: run.total(key) for key in COUNTS},
        "tokens": run.total("tokens"),
        "first_loss": (run.summary or {}).get("first_loss"),
        "loss": run.total("loss"),
        "energy_kwh": run.total("energy_kwh"),
        "training_g": training_g,
        "idle_g": idle_g,
        "emissions_g": run.total("emissions_g"),
        "at_once_g": at_once,
        "training_vs_at_once": training_g / at_once if training_g is not None and at_once else None,
    }


def swarm_totals(sites: list[dict[str, Any]]) -> dict[str, Any]:
    """The sites' figures summed; a sum some site cannot give is None (a partial sum would mislead)."""

    def add(key: str) -> float | None:
        values = [s[key] for s in sites]
        return None if not values or any(v is None for v in values) else sum(values)

    out: dict[str, Any] = {"site": "total", "region": "", "hours": None, "first_loss": None, "loss": None}
    out.update({key: add(key) for key in (*COUNTS, *SUMS)})
    out["outer_round"] = None  # (steps of one global model, not a quantity to add)
    hours = [s["hours"] for s in sites]
    if hours and all(h is not None for h in hours):
        out["hours"] = {k: sum(h[k] for h in hours) for k in HOUR_STATES}
    training, at_once = out["training_g"], out["at_once_g"]
    out["training_vs_at_once"] = training / at_once if training is not None and at_once else None
    return out


def _totals_row(d: dict[str, Any]) -> list[str]:
    hours = d["hours"]
    loss = "-" if d["loss"] is None else f"{d['loss']:.3f}"
    if d["first_loss"] is not None and d["loss"] is not None:
        loss = f"{d['first_loss']:.3f} → {d['loss']:.3f}"
    return [
        escape(d["site"]),
        escape(d["region"]),
        " / ".join(_num(hours[s], ".1f") for s in HOUR_STATES) if hours else "-",
        _num(d["outer_round"], "d"),
        " / ".join(_num(d[k], "d") for k in ("federated_rounds", "solo_rounds", "failed_rounds")),
        _num(d["tokens"]),
        loss,
        _num(d["energy_kwh"], ",.2f"),
        _num(d["training_g"]),
        _num(d["idle_g"]),
        _num(d["emissions_g"]),
        _num(d["at_once_g"]),
        _num(d["training_vs_at_once"], ".2f"),
    ]


def totals_section(runs: list[SiteRun]) -> tuple[Section, list[dict[str, Any]]]:
    sites = [site_totals(r) for r in runs]
    data = [*sites, swarm_totals(sites)]
    rows = [_totals_row(d) for d in data]
    headers = [
        "site",
        "region",
        "hours idle / released / solo / fed.",
        "outer steps",
        "rounds fed. / solo / failed",
        "tokens",
        "loss first → last",
        "kWh",
        "gCO2 training",
        "gCO2 idle",
        "gCO2 total",
        "gCO2 at once (equal work)",
        "training ÷ at once",
    ]
    table = _table(headers, rows, set(range(2, 13)), ["" for _ in rows[:-1]] + ["total"])
    note = (
        '<p class="note">"At once, equal work": the same site training continuously from the run\'s start, '
        "at the run's measured training draw, for as long as it trained in its windows, in its own region. "
        "Idle emissions are what a site drew between windows with its model kept on the device.</p>"
    )
    return Section("totals", SECTIONS[5][1], table + note), data


def render(title: str, generated: float, runs: list[SiteRun], sections: list[Section]) -> str:
    """The whole page."""
    nav = "".join(f'<a href="#{s.id}">{escape(s.heading.split(",")[0])}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{escape(s.heading)}</h2>{s.body}</section>' for s in sections)
    sites = ", ".join(f"{r.label} ({r.region})" for r in runs)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<p class="meta">{len(runs)} site(s): {escape(sites)}. Written {escape(utc_second(generated))} '
        "by greenswarm report.</p>"
        f"<nav>{nav}</nav>{body}</body></html>\n"
    )
