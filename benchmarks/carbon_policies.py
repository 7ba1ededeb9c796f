"""The deadline policy on a grid of real years: how much of perfect foresight's saving each forecaster
captures, and how far it can fall behind simply running at once.

For every zone file in ``--trace-dir`` (one region each, e.g. the Electricity Maps 2023 exports), every
job shape (``24 h within 72 h``, ``100 h within 168 h``, ``500 h within 2000 h``: site-hours of work
within a deadline) and one start per month (the 15th, 00:00 UTC, from the 15th of January so that every
forecaster has 14 days of history), it simulates one site under ``simulate --policy deadline`` with
each forecaster, and at equal work:

    captured = (run_at_once - policy) / (run_at_once - foresight)
    vs_once  = policy / run_at_once

``run_at_once`` trains from the start without pause; ``foresight`` takes the cleanest hours knowing
the future. A case whose policy does not finish its work by the deadline counts as missed and is
reported, never as a saving (it is left out of the captured figures); a case where foresight saves
nothing (``run_at_once == foresight``) has no captured share and is left out of it too.

    python benchmarks/carbon_policies.py --trace-dir ../shared/data/traces/electricitymaps-2023 [--json]

JSON keys per forecaster: ``forecasters.<name>.median_captured``, ``p10_captured``,
``worst_captured``, ``worst_vs_run_at_once``, ``missed_deadlines``, ``cases``; and
``median_vs_run_at_once``, ``worse_than_run_at_once`` and ``worse_by_2pct`` (counts of cases).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from greenswarm.simulation.report import simulate  # noqa: E402
from greenswarm.traces import load_trace  # noqa: E402
from greenswarm.traces.merge import trace_files  # noqa: E402

SHAPES = {"24h-in-72h": (24.0, 72.0), "100h-in-168h": (100.0, 168.0), "500h-in-2000h": (500.0, 2000.0)}
FORECASTERS = ("persistence", "seasonal", "climatology", "profile")


def starts(trace, deadline_h: float, history_days: float = 14.0) -> list[float]:
    """The 15th of each month, 00:00 UTC, with ``history_days`` behind it and the deadline inside."""
    year = datetime.fromtimestamp(trace.start, UTC).year
    out = []
    for month in range(1, 13):
        t = datetime(year, month, 15, tzinfo=UTC).timestamp()
        if t - trace.start >= history_days * 86400 and t + deadline_h * 3600 <= trace.end:
            out.append(t)
    return out


def one_case(trace, region: str, start: float, work_h: float, deadline_h: float, forecaster: str) -> dict:
    # the choice of hours alone: training energy, no idle draw while waiting (simulate's default for
    # deadline; a site whose GPUs do other work meanwhile), so waiting is judged on when it trains
    report = simulate(
        trace,
        [region],
        "deadline",
        work_h=work_h,
        start=start,
        deadline_h=deadline_h,
        forecast=forecaster,
        idle_kw=0.0,
    ).report
    once = float(report["baselines"][region])
    foresight = report["foresight_kg"]
    kg = float(report["emissions_kg"])
    saving = None if foresight is None else once - foresight
    return {
        "region": region,
        "start": start,
        "forecaster": forecaster,
        "finished": bool(report["finished"]),
        "kg": kg,
        "run_at_once_kg": once,
        "foresight_kg": foresight,
        "captured": (once - kg) / saving if saving and saving > 1e-9 and report["finished"] else None,
        "vs_run_at_once": kg / once if once > 0 and report["finished"] else None,
    }


def summarise(cases: list[dict]) -> dict:
    captured = np.array([c["captured"] for c in cases if c["captured"] is not None])
    ratios = [c["vs_run_at_once"] for c in cases if c["vs_run_at_once"] is not None]
    return {
        "median_captured": float(np.median(captured)) if captured.size else None,
        "p10_captured": float(np.percentile(captured, 10)) if captured.size else None,
        "worst_captured": float(captured.min()) if captured.size else None,
        "worst_vs_run_at_once": max(ratios) if ratios else None,
        "median_vs_run_at_once": float(np.median(ratios)) if ratios else None,
        "worse_than_run_at_once": sum(r > 1.0 + 1e-9 for r in ratios),
        "worse_by_2pct": sum(r > 1.02 for r in ratios),
        "missed_deadlines": sum(not c["finished"] for c in cases),
        "cases": len(cases),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace-dir", required=True, help="a directory of one-zone trace files")
    parser.add_argument("--forecasters", default=",".join(FORECASTERS), help="comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {', '.join(SHAPES)}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [f.strip() for f in args.forecasters.split(",") if f.strip()]
    shapes = {s.strip(): SHAPES[s.strip()] for s in args.shapes.split(",") if s.strip()}
    began = time.monotonic()
    cases: list[dict] = []
    for path in trace_files(Path(args.trace_dir)):
        trace = load_trace(str(path))
        region = trace.regions[0]
        for shape, (work_h, deadline_h) in shapes.items():
            for start in starts(trace, deadline_h):
                for name in names:
                    case = one_case(trace, region, start, work_h, deadline_h, name)
                    cases.append({**case, "shape": shape})
    result = {
        "trace_dir": args.trace_dir,
        "shapes": {k: {"work_h": w, "deadline_h": d} for k, (w, d) in shapes.items()},
        "forecasters": {n: summarise([c for c in cases if c["forecaster"] == n]) for n in names},
        "by_shape": {
            s: {n: summarise([c for c in cases if c["forecaster"] == n and c["shape"] == s]) for n in names}
            for s in shapes
        },
        "seconds": time.monotonic() - began,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{len(cases)} cases in {result['seconds']:.0f} s ({args.trace_dir})")
    print(
        f"{'forecaster':<14}{'shape':<15}{'median':>8}{'p10':>8}{'worst':>8}{'worst/once':>12}{'missed':>8}"
    )
    for s, per in [("all", result["forecasters"]), *result["by_shape"].items()]:
        for n, r in per.items():
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(
                f"{n:<14}{s:<15}{fmt(r['median_captured']):>8}{fmt(r['p10_captured']):>8}"
                f"{fmt(r['worst_captured']):>8}{fmt(r['worst_vs_run_at_once']):>12}{r['missed_deadlines']:>8}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
