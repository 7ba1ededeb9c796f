"""How fast a released site trains again: window opens to first inner step, over many restarts.

Starts a bootstrap peer and one site on 127.0.0.1 (tests/conftest.py's ``Swarm``, which reaps every
process at the end) replaying a trace of ``--restarts + 1`` short windows with dirty gaps between
them (half a window each), with ``release.mode: idle`` (release at every window's end). Each
restart's journal line in ``run_dir/releases.jsonl`` says how long it took from the agent noticing
the window to the first step, and where the seconds went (model built, checkpoint loaded, state
digest checked, joined the swarm, first step). Prints p50 and p95 of the total and the median of each phase.

    python benchmarks/release_restart.py [--preset tiny] [--restarts 10] [--window-s 12] [--json]

A window of ``--window-s`` wall seconds must hold a restart and a few steps; ``small`` needs ~40.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_S = 900  # the trace's step (clock seconds)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run(preset: str, restarts: int, window_s: float, threads: int) -> dict:
    from greenswarm.jsonlines import read_json_lines
    from tests.conftest import Swarm, site_config, wait_until, write_trace

    speedup = 2 * STEP_S / window_s  # a window is two steps
    values = ([50.0] * 2 + [300.0]) * (restarts + 1) + [300.0]  # a gap is half a window
    with tempfile.TemporaryDirectory(prefix="greenswarm-restart-") as tmp:
        root = Path(tmp)
        swarm = Swarm(root)
        try:
            trace = write_trace(root / "trace.csv", {"A": values}, step_s=STEP_S)
            start_file = root / "start"
            peers = swarm.bootstrap()
            run_dir = root / "site"
            cfg = site_config(
                "site", "A", trace, peers, run_dir, speedup=speedup, start_file=start_file,
                sync_s=STEP_S / 2, release={"mode": "idle"},
            )  # fmt: skip
            cfg["model"] = {"preset": preset}
            cfg["train"]["threads"] = threads
            swarm.node("site", swarm.write_config("site", cfg))
            swarm.start_replay(["site"], start_file)
            began = time.monotonic()
            journal = run_dir / "releases.jsonl"

            def restarted() -> int:
                if swarm.procs["site"].poll() is not None:
                    raise RuntimeError(f"the site exited:\n{swarm.log('site')[-3000:]}")
                return sum(1 for e in read_json_lines(journal) if e.get("event") == "restart")

            limit_s = len(values) * window_s / 2 + 120
            try:
                wait_until(lambda: restarted() >= restarts, limit_s, f"{restarts} restarts")
            except AssertionError:
                log = swarm.log("site")[-3000:]
                raise RuntimeError(f"{restarted()} restarts in {limit_s:.0f} s:\n{log}") from None
            wall_s = time.monotonic() - began
        finally:
            swarm.close()
        entries = [e for e in read_json_lines(journal) if e.get("event") == "restart"][:restarts]
    totals = [float(e["restart_wall_s"]) for e in entries]
    phases: dict[str, list[float]] = {}
    for e in entries:
        for name, seconds in e.get("phases_s", {}).items():
            phases.setdefault(name, []).append(float(seconds))
    digests_equal = sum(e.get("state_digest") == e.get("state_digest_after") for e in entries)
    return {
        "preset": preset,
        "restarts": len(entries),
        "restart_s_p50": statistics.median(totals),
        "restart_s_p95": percentile(totals, 0.95),
        "restart_s_max": max(totals),
        "phases_s_median": {k: statistics.median(v) for k, v in phases.items()},
        "digests_equal": digests_equal,
        "speedup": speedup,
        "wall_s": wall_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model.preset of the site (tiny, small, ...)")
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--window-s", type=float, default=12.0, help="wall seconds of each window")
    parser.add_argument("--threads", type=int, default=1, help="train.threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.restarts < 1 or args.window_s <= 0:
        parser.error("--restarts must be >= 1 and --window-s > 0")
    report = run(args.preset, args.restarts, args.window_s, args.threads)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['restarts']} restarts of a released '{report['preset']}' site: window opens to first "
            f"step p50 {report['restart_s_p50']:.2f} s, p95 {report['restart_s_p95']:.2f} s, "
            f"max {report['restart_s_max']:.2f} s; state digest unchanged in {report['digests_equal']}"
        )
        for name, seconds in report["phases_s_median"].items():
            print(f"  {name:<28} {seconds:6.2f} s (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
