"""How fast ``greenswarm simulate`` is at scale: 1000 sites x one year of hourly traces.

The trace is the five Electricity Maps 2023 hourly exports in ``../shared/data`` (one year, 8760
samples each; 1000 sites spread round-robin over the five zones) when they are there, else a
seeded synthetic year of 20 regions with a diurnal cycle and weather noise. The threshold is each
run's 30th percentile of all intensities, so every region has windows; the work is a third of what
the ideal schedule could do in the year, so the work cap, the ideal and perfect foresight all
come into play.

Timed: one full :func:`greenswarm.simulation.report.simulate` call (policy, federated split, work
cap, accounting, occupancy, baselines, the threshold ideal and perfect foresight), for the
``greenswarm`` and ``curtail-llm`` policies. Baseline, in the same process: one numpy pass that
multiplies a (sites x hours) in-window mask by intensity and sums it -- the least any simulator of
this size has to do. Printed: medians of ``--repeats`` runs and their ratio to the baseline.

    python benchmarks/simulate_scale.py [--sites 1000] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from greenswarm.simulation.policies import load_policy
from greenswarm.simulation.report import simulate
from greenswarm.traces.readers import load_trace
from greenswarm.traces.trace import Trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "electricitymaps-2023"
HOURS = 365 * 24


def real_year() -> Trace | None:
    """The five 2023 exports as one trace (they share one hourly axis), or None without ../shared."""
    files = sorted(SHARED.glob("*_2023_hourly.csv"))
    if not files:
        return None
    parts = [load_trace(str(f)) for f in files]
    times = parts[0].times
    if any(len(p.times) != len(times) or not np.array_equal(p.times, times) for p in parts):
        return None
    values = {r: p.series(r) for p in parts for r in p.regions}
    return Trace.from_columns(times, values, source="electricitymaps-2023 (5 zones)")


def synthetic_year(regions: int = 20, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.arange(HOURS, dtype=np.float64)
    values = {}
    for i in range(regions):
        base = rng.uniform(80, 500)
        solar = rng.uniform(0.2, 0.8) * base * np.clip(np.sin(2 * np.pi * (t % 24 - 6) / 24), 0, None)
        weather = np.convolve(rng.normal(0, 0.15 * base, HOURS + 48), np.ones(48) / 48, mode="valid")[:HOURS]
        values[f"R{i:02d}"] = np.clip(base - solar + weather, 0, None)
    return Trace.from_columns(
        1_672_531_200.0 + t * 3600.0, values, source=f"synthetic year, {regions} regions"
    )


def numpy_pass(trace: Trace, regions: list[str], threshold: float) -> float:
    """The baseline: grams of training in window for every site and hour, in one vectorised pass."""
    grid = np.stack([trace.series(r) for r in regions])
    mask = grid < threshold
    return float(np.sum(grid * mask) * 2.024)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    trace = real_year() or synthetic_year()
    regions = [trace.regions[i % len(trace.regions)] for i in range(args.sites)]
    threshold = float(np.percentile(np.concatenate([trace.series(r) for r in trace.regions]), 30))
    in_window = sum(float(np.sum(trace.series(r) < threshold)) for r in regions)  # site-hours
    work_h = in_window / 3.0

    results: dict[str, list[float]] = {"numpy pass": [], "greenswarm": [], "curtail-llm": []}
    reports = {}
    for _ in range(args.repeats):
        results["numpy pass"].append(timed(lambda: numpy_pass(trace, regions, threshold)))
        for name in ("greenswarm", "curtail-llm"):
            policy = load_policy(name)

            def run(policy=policy, name=name) -> None:
                reports[name] = simulate(trace, regions, policy, work_h=work_h, threshold=threshold).report

            results[name].append(timed(run))
    medians = {k: statistics.median(v) for k, v in results.items()}
    out = {
        "trace": trace.source,
        "sites": args.sites,
        "hours": len(trace.times),
        "threshold": threshold,
        "work_site_hours": work_h,
        "repeats": args.repeats,
        "median_s": medians,
        "ratio_to_numpy_pass": {k: medians[k] / medians["numpy pass"] for k in ("greenswarm", "curtail-llm")},
        "emissions_kg": {k: r["emissions_kg"] for k, r in reports.items()},
        "ideal_kg": reports["greenswarm"]["ideal_kg"],
        "foresight_kg": reports["greenswarm"]["foresight_kg"],
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{out['trace']}: {args.sites} sites x {out['hours']} hourly samples, "
        f"threshold {threshold:.1f} gCO2/kWh, "
        f"work {work_h:,.0f} site-hours; medians of {args.repeats} runs"
    )
    for k, v in medians.items():
        ratio = "" if k == "numpy pass" else f"  ({out['ratio_to_numpy_pass'][k]:,.0f} x the numpy pass)"
        print(f"  {k:12s} {v:8.3f} s{ratio}")
    print(
        f"  emissions: greenswarm {out['emissions_kg']['greenswarm']:,.0f} kg, curtail-llm "
        f"{out['emissions_kg']['curtail-llm']:,.0f} kg, ideal {out['ideal_kg']:,.0f} kg, "
        f"foresight {out['foresight_kg']:,.0f} kg"
    )


if __name__ == "__main__":
    main()
