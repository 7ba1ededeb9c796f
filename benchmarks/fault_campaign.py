"""Fault campaign: randomized kills (and freezes) across the named points of a real three-site swarm.

A bootstrap peer and three site processes on 127.0.0.1 (tiny model, a round every 2 wall seconds,
an always-green trace). ``--faults`` faults are drawn with ``--seed`` over sites, points (mid inner
step, matchmaking, mid all-reduce, checkpoint write, serving state) and visits; most are SIGKILL of
the whole site, some are SIGSTOP (thawed after half the all-reduce timeout). Each site dies at its
point by itself (``GREENSWARM_FAULTS``), is inspected and restarted with its next fault; see
``tests/campaign.py``.

Printed: one line per fault (point, whether it fired, the checkpoint files it left, the outer step a
restart resumes from, NaN, processes left, restart -> averaging again), then the totals the issue asks
for: damaged checkpoints, NaN, sites that diverged (two digests for one outer step and lineage, over
every round of every site), the longest all-reduce a survivor waited vs. the configured timeout, and
the median restart -> contributing to a round again. ``--json FILE`` writes the whole report.

    python benchmarks/fault_campaign.py [--faults 20] [--seed 0] [--json report.json]

``--supervised SECONDS`` measures the other restart path instead: the sites run under their
supervisor (``node.restart: on-crash``), and only the node process dies (at ``--points``, once it
has averaged in its life) -- a crash, an OOM kill -- while the supervisor, which holds the imports,
forks a new one. Printed: seconds from each kill to averaging with others again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.campaign import Campaign, plan_faults, supervised_restarts  # noqa: E402
from tests.conftest import Swarm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="wall seconds for all faults")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    parser.add_argument("--supervised", type=float, metavar="SECONDS", help="measure supervised restarts")
    parser.add_argument("--points", nargs="+", default=["step", "allreduce", "matchmaking"])
    args = parser.parse_args()
    if args.supervised:
        return _supervised(args)

    workdir = Path(tempfile.mkdtemp(prefix="greenswarm-faults-"))
    swarm = Swarm(workdir)
    faults = plan_faults(args.faults, args.seed)
    try:
        campaign = Campaign(swarm, workdir, faults)
        campaign.start(hours=48)
        campaign.run(timeout_s=args.timeout)
        campaign.finish(settle_s=10)
        report = campaign.report()
    finally:
        swarm.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))

    print(f"{'#':>2} {'site':7} {'fault':22} {'fired':5} {'after':>6} {'ckpt / prev / tmp':24} "
          f"{'resume':>6} {'nan':3} {'left':>4} {'back':>6}")  # fmt: skip
    for i, r in enumerate(report["faults"], 1):
        files = ("checkpoint.pt", "checkpoint.prev.pt", "checkpoint.pt.tmp")
        ck = "/".join(r["checkpoint"].get(f, "?") for f in files)
        back = "-" if r["restart_to_round_s"] is None else f"{r['restart_to_round_s']:.1f}s"
        print(
            f"{i:>2} {r['fault']['site']:7} {r['fault']['plan']:22} {'yes' if r['fired'] else 'NO':5} "
            f"{r['fired_after_s']:5.1f}s {ck:24} {r['resumed_outer_round']!s:>6} "
            f"{'NaN' if r['nan'] else '-':3} {r['left_processes']:>4} {back:>6}"
        )
    print()
    print(f"faults fired at their point: {report['fired']}/{len(report['faults'])}")
    print(f"damaged checkpoints: {report['damaged_checkpoints']}, unrecoverable restarts: "
          f"{report['unrecoverable']}, restarts not at their checkpoint: {report['resumed_otherwise']}, "
          f"NaN: {report['nan']}, "
          f"processes left: {report['left_processes']}")  # fmt: skip
    print(f"global states checked: {report['states_checked']}, diverged: {len(report['diverged'])} "
          f"{report['diverged'] or ''}")  # fmt: skip
    print(f"rounds: {report['rounds']}")
    print(f"longest all-reduce wait: {report['max_allreduce_s']:.2f} s "
          f"(timeout {report['allreduce_timeout_s']:.0f} s); "
          f"longest round attempt {report['max_round_s']:.2f} s; "
          f"longest training pause {report['max_blocked_s']:.2f} s")  # fmt: skip
    times = report["restart_to_round_s"]
    if times:
        print(f"restart -> averaging again: median {report['median_restart_to_round_s']:.1f} s "
              f"over {len(times)} restarts (min {min(times):.1f}, max {max(times):.1f})")  # fmt: skip
    if args.keep:
        print(f"work directory: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = (
        report["fired"] == len(report["faults"])
        and not (report["damaged_checkpoints"] or report["unrecoverable"] or report["nan"])
        and not report["resumed_otherwise"]
        and not report["diverged"]
        and not report["left_processes"]
    )
    return 0 if ok else 1


def _supervised(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="greenswarm-restarts-"))
    swarm = Swarm(workdir)
    try:
        report = supervised_restarts(swarm, workdir, args.supervised, args.points)
    finally:
        swarm.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for r in report["restarts"]:
        back = "not back before the end" if r["seconds"] is None else f"{r['seconds']:.2f} s"
        print(f"{r['site']:7} kill at {r['point']:12} -> averaging again after {back}")
    if report["median_s"] is not None:
        times = [r["seconds"] for r in report["restarts"] if r["seconds"] is not None]
        print(f"supervised restart -> averaging again: median {report['median_s']:.2f} s over "
              f"{report['measured']} restarts (min {min(times):.2f}, max {max(times):.2f})")  # fmt: skip
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if report["measured"] else 1


if __name__ == "__main__":
    sys.exit(main())
