"""Build the run report and write it: :func:`write_report` for programs (the demo), :func:`run_report`
for ``greenswarm report``."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from greenswarm.report import figures
from greenswarm.report.page import (
    SECTIONS,
    Section,
    figure_section,
    render,
    rounds_section,
    sites_section,
    totals_section,
)
from greenswarm.report.runs import ReportError, SiteRun, read_runs

log = logging.getLogger(__name__)

TITLE = "greenswarm run report"


def build_sections(runs: list[SiteRun]) -> tuple[list[Section], list[dict[str, Any]]]:
    """Every section of the page, in order, and the totals as plain data."""
    heading = dict(SECTIONS)
    no_history = "No site has a history.jsonl with points, so there is nothing to draw here."
    totals, data = totals_section(runs)
    sections = [
        sites_section(runs),
        figure_section(
            "loss",
            heading["loss"],
            lambda: figures.loss_figure(runs),
            "training loss against tokens, per site",
            "The node's moving average of its training loss at each history point, against the tokens the "
            "site had trained; dots: the global model's held-out loss, where the sites evaluated it.",
            "No site recorded a training loss (none trained, or none has a history.jsonl).",
        ),
        figure_section(
            "states",
            heading["states"],
            lambda: figures.states_figure(runs),
            "each site's state over time, on its region's intensity and threshold",
            "Blue: the region's carbon intensity as the site read it; dashed red: the threshold below which "
            "it may train; shading: the state it was in (grey IDLE, orange SOLO, green FEDERATED).",
            no_history,
        ),
        rounds_section(runs, figures.rounds_figure(runs)),
        figure_section(
            "emissions",
            heading["emissions"],
            lambda: figures.emissions_figure(runs),
            "cumulative emissions against the continuous baselines at equal work",
            "Solid: what each site emitted, idle included; dashed: the same site training at once from the "
            "run's start for as long as it trained (equal work). Right: the swarm's total, its training "
            "part, and the sum of the baselines.",
            no_history,
        ),
        totals,
    ]
    return sections, data


def write_report(paths: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Read the run directories, write the page to ``out`` (atomically: a reader never sees half a
    page) and return what it holds: where, which sites, which sections lack what, the totals."""
    runs = read_runs(paths)
    sections, totals = build_sections(runs)
    page = render(TITLE, time.time(), runs, sections)
    target = Path(out).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as err:
        raise ReportError(f"{out}: cannot write the report ({err.strerror or err})") from None
    return {
        "out": str(target.resolve()),
        "bytes": target.stat().st_size,
        "sites": [
            {"site": r.label, "region": r.region, "run_dir": str(r.path), "notes": list(r.notes)}
            for r in runs
        ],
        "sections": {s.id: "missing: " + s.missing if s.missing else "shown" for s in sections},
        "totals": totals,
    }


def run_report(paths: list[str], out: str, as_json: bool = False) -> int:
    """``greenswarm report``: write the page and say where (one JSON object with ``--json``)."""
    written = write_report(paths, out)
    if as_json:
        print(json.dumps(written))
    else:
        incomplete = [
            f"#{k} ({v[len('missing: ') :]})" for k, v in written["sections"].items() if v != "shown"
        ]
        print(f"report of {len(written['sites'])} site(s) written to {written['out']}")
        if incomplete:
            print("incomplete: " + "; ".join(incomplete))
    return 0
