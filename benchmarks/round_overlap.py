"""How much training time rounds cost: real site nodes, rounds blocking or overlapped with training.

``--sites`` real site nodes (separate processes, each with its p2pd daemon) join through a real
bootstrap DHT on a trace that is always below the threshold (every site in a window all along, so
every round is federated) and average every ``--sync`` wall seconds, with ``averaging.overlap`` on
or off. Beside them, in the same run, the same number of plain torch loops (same model, batch,
optimizer and threads, run as concurrent processes, so background work that slows a step counts
against the node) give the baseline. Per site, from the node's own step timestamps:

* ``train_share``: seconds inside training steps / in-window wall seconds (first measured step to
  the last);
* ``throughput_ratio``: the node's tokens per in-window wall second, rounds and all / a plain loop's
  tokens per second;
* ``blocked_s_median``: how long training waited per round (``blocked_s`` in ``rounds.jsonl``);
* ``rounds``, ``failed_rounds``, and ``state_flaps``: FEDERATED <-> SOLO transitions while every site
  stayed in its window (each one a round this site ran alone because its view of the others went
  stale).

    python benchmarks/round_overlap.py --preset small --sites 2 --seconds 600 --sync 60 --overlap --json

``--checkpoint-every S`` sets ``node.checkpoint_every_s`` (default 0: a checkpoint after every outer
step, whose writing, ~2 GB at ``small``, competes with the steps for the CPU).

``--nat`` (needs root) runs the sites behind NAT instead: tests/netns.py's topology, the bootstrap
in the hub namespace, each site in a namespace of its own, reached through the bootstrap's relay,
every link shaped to ``--mbit`` with tbf (each site's link carries its upload and its download):

    sudo python benchmarks/round_overlap.py --preset small --sites 3 --nat --mbit 50 --json

Medians over sites are printed; every child process (p2pd daemons included) is reaped at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REGIONS, _kill_session, plain_tokens_per_s, run_node, write_trace  # noqa: E402  (a sibling)

LISTEN = {False: "127.0.0.1", True: "0.0.0.0"}  # by --nat
SKIP_STEPS = 2  # steps left out at the start of a site's measurement (allocator and data warm-up)
SPEEDUP = 10.0  # replay speed: a round every --sync wall seconds is --sync * SPEEDUP clock seconds
BATCH, THREADS = 8, 1


# --------------------------------------------------------------------------------------- plain torch


def run_plain_worker(preset: str, seconds: float, out: str) -> int:
    """``--plain``: a bare torch loop on the node's model and data for ``seconds`` (throughput.py's)."""
    Path(out).write_text(json.dumps(plain_tokens_per_s(seconds, preset)))
    return 0


# --------------------------------------------------------------------------------------- site nodes


def run_site_worker(config: str, out: str) -> int:
    """``--site``: one real site node, recording each training step's start and end and each change of
    state. Nothing else about the node changes."""
    from greenswarm.node.site import SiteNode
    from greenswarm.procs import setup_logging

    setup_logging()
    steps: list[tuple[float, float]] = []
    states: list[tuple[float, str]] = []

    class TimedSite(SiteNode):
        def _train_step(self) -> None:
            began = time.monotonic()
            super()._train_step()
            steps.append((began, time.monotonic()))

        def _update_state(self, now: float) -> Any:
            state = super()._update_state(now)
            if not states or states[-1][1] != state.value:
                states.append((time.monotonic(), state.value))
            return state

    node, summary = run_node(TimedSite, config)
    record = {
        "summary": summary,
        "steps": steps,
        "states": states,
        "tokens_per_step": node.trainer.tokens_per_step,
    }
    Path(out).write_text(json.dumps(record))
    return 0


def site_config(i: int, swarm: str, peers: list[str], trace: Path, run_dir: Path, args: Any) -> dict:
    return {
        "name": f"bench-{i}",
        "region": REGIONS[i],
        # behind NAT a site listens on its namespace's address, finds no public one and uses the relay
        "swarm": {"name": swarm, "initial_peers": peers, "host_maddrs": [f"/ip4/{LISTEN[args.nat]}/tcp/0"]},
        "model": {"preset": args.preset},
        "data": {"shard_index": i, "num_shards": args.sites},
        "train": {"device": "cpu", "threads": THREADS, "batch_size": BATCH, "micro_batch_size": BATCH},
        "scheduler": {
            "trace": str(trace),
            "threshold": 100.0,
            "clock": {"kind": "replay", "speedup": SPEEDUP, "start_wall": args._start_wall},
        },
        "averaging": {"sync_interval_s": args.sync * SPEEDUP, "overlap": args.overlap},
        "node": {"run_dir": str(run_dir), "log_every_s": 30.0, "checkpoint_every_s": args.checkpoint_every},
    }


def _spawn(argv: list[str], log_path: Path, prefix: list[str] | None = None) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [*(prefix or []), sys.executable, __file__, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )


def run(args: Any, workdir: Path) -> dict[str, Any]:
    """The plain loops, then the sites, on the same machine in the same process tree."""
    from greenswarm.network import start_dht, visible_peer_maddrs
    from greenswarm.node.progress import record_validators

    procs: list[subprocess.Popen] = []
    try:
        plain = []
        for i in range(args.sites):  # as many concurrent plain loops as there will be sites
            plain.append(workdir / f"plain{i}.json")
            procs.append(
                _spawn(
                    [
                        "--plain",
                        args.preset,
                        "--plain-seconds",
                        str(args.plain_seconds),
                        "--out",
                        str(plain[-1]),
                    ],
                    workdir / f"plain{i}.log",
                )
            )
        for proc in procs:
            proc.wait(timeout=args.plain_seconds + 600)
        plain_tps = [json.loads(p.read_text())["tokens_per_s"] for p in plain]
        procs.clear()

        swarm = "overlap"
        trace = write_trace(workdir / "trace.csv", list(REGIONS[: args.sites]), args.seconds * SPEEDUP)
        topo = dht = None
        try:
            if args.nat:
                from nat_rounds import HUB_PORT, _bootstrap  # a sibling: the same hub bootstrap

                from tests import netns

                topo = netns.make_topology(args.sites)
                if args.mbit:
                    topo.shape(args.mbit)
                listen, announce = f"/ip4/0.0.0.0/tcp/{HUB_PORT}", [f"/ip4/{netns.HUB_ADDR}/tcp/{HUB_PORT}"]
                boot, peer = _bootstrap(
                    topo.exec_prefix(topo.hub), listen, announce, workdir, dict(os.environ)
                )
                procs.append(boot)
                peers = [peer]
            else:
                dht = start_dht(
                    [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators(swarm)
                )
                peers = visible_peer_maddrs(dht)
            args._start_wall = time.time()
            outs, sites_procs = [], []
            for i in range(args.sites):
                config = workdir / f"site{i}.yaml"
                config.write_text(
                    yaml.safe_dump(site_config(i, swarm, peers, trace, workdir / f"run{i}", args))
                )
                outs.append(workdir / f"site{i}.json")
                prefix = topo.exec_prefix(topo.sites[i].ns) if topo is not None else None
                sites_procs.append(
                    _spawn(["--site", str(config), "--out", str(outs[-1])], workdir / f"site{i}.log", prefix)
                )
            procs.extend(sites_procs)
            for i, proc in enumerate(sites_procs):  # each stops at the trace's end, as a site does
                code = proc.wait(timeout=args.seconds + 600)
                if code != 0:
                    tail = (workdir / f"site{i}.log").read_text()[-3000:]
                    raise RuntimeError(f"site {i} exited with {code}; log tail:\n{tail}")
            records = [json.loads(out.read_text()) for out in outs]
            # every site in its window and in the swarm: from the last site's first FEDERATED to the first
            # site's last step (CLOCK_MONOTONIC is one clock for every process on the machine)
            joined = max(min((t for t, s in r["states"] if s == "FEDERATED"), default=0.0) for r in records)
            left = min(r["steps"][-1][1] for r in records)
            sites = [measure(r, workdir / f"run{i}", joined, left) for i, r in enumerate(records)]
        finally:
            if dht is not None:
                dht.shutdown()
            for proc in procs:
                _kill_session(proc)
            procs.clear()
            if topo is not None:
                topo.close()
    finally:
        for proc in procs:
            _kill_session(proc)
    return {"plain_tokens_per_s": plain_tps, "sites": sites}


def measure(record: dict[str, Any], run_dir: Path, joined: float, left: float) -> dict[str, Any]:
    """One site's figures (see the module's docstring); state flaps count between ``joined`` and ``left``."""
    from greenswarm.node.round_log import read_rounds

    steps = record["steps"][SKIP_STEPS:]
    if len(steps) < 3:
        raise RuntimeError(f"the site took only {len(record['steps'])} steps; run longer (--seconds)")
    start, end = steps[0][0], steps[-1][1]
    rounds = [e for e in read_rounds(run_dir / "rounds.jsonl") if e["action"] != "solo"]
    states = record["states"]
    flaps = sum(
        1
        for (_, a), (t, b) in zip(states, states[1:], strict=False)
        if {a, b} == {"FEDERATED", "SOLO"} and joined < t < left
    )
    return {
        "train_share": sum(b - a for a, b in steps) / (end - start),
        "tokens_per_s": len(steps) * record["tokens_per_step"] / (end - start),
        "in_window_s": end - start,
        "steps": len(steps),
        "rounds": len(rounds),
        "failed_rounds": sum(e["action"] == "fail" for e in rounds),
        "blocked_s": [e["blocked_s"] for e in rounds],
        "steps_meanwhile": [e.get("steps_meanwhile", 0) for e in rounds],
        "state_flaps": flaps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model preset (tiny; small is ~99 M parameters)")
    parser.add_argument("--sites", type=int, default=2, choices=range(1, len(REGIONS) + 1), help="sites (2)")
    parser.add_argument("--seconds", type=float, default=300.0, help="wall seconds the sites run (300)")
    parser.add_argument(
        "--plain-seconds", type=float, default=60.0, help="wall seconds of the plain loops (60)"
    )
    parser.add_argument("--sync", type=float, default=60.0, help="wall seconds between rounds (60)")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="averaging.overlap on (default) or off",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=0.0,
        metavar="S",
        help="node.checkpoint_every_s: wall s between checkpoints (0, the default: after every outer step)",
    )
    parser.add_argument("--nat", action="store_true", help="sites behind NAT, through the relay (root)")
    parser.add_argument(
        "--mbit", type=float, default=50.0, help="with --nat: every link's rate (50; 0: unshaped)"
    )
    parser.add_argument("--workdir", help="keep configs, logs and round logs here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--site", help=argparse.SUPPRESS)  # internal: one site worker
    parser.add_argument("--plain", help=argparse.SUPPRESS)  # internal: one plain loop, of this preset
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.site:
        return run_site_worker(args.site, args.out)
    if args.plain:
        return run_plain_worker(args.plain, args.plain_seconds, args.out)

    from greenswarm.procs import reap_children

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="greenswarm-overlap-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        raw = run(args, workdir)
    finally:
        reap_children()
    plain = statistics.median(raw["plain_tokens_per_s"])
    sites = raw["sites"]
    blocked = [b for s in sites for b in s["blocked_s"]]
    result = {
        "overlap": args.overlap,
        "train_share": statistics.median(s["train_share"] for s in sites),
        "throughput_ratio": statistics.median(s["tokens_per_s"] / plain for s in sites),
        "blocked_s_median": statistics.median(blocked) if blocked else None,
        "rounds": sum(s["rounds"] for s in sites),
        "failed_rounds": sum(s["failed_rounds"] for s in sites),
        "state_flaps": sum(s["state_flaps"] for s in sites),
        "plain_tokens_per_s": plain,
        "sites": sites,
        "settings": {
            "preset": args.preset,
            "sites": args.sites,
            "seconds": args.seconds,
            "sync_wall_s": args.sync,
            "checkpoint_every_s": args.checkpoint_every,
            "nat_mbit": args.mbit if args.nat else None,
            "threads": THREADS,
            "batch": BATCH,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "workdir": str(workdir),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mode = "overlapped" if args.overlap else "blocking"
    where = f"behind NAT, links at {args.mbit:g} Mbit/s" if args.nat else "on loopback"
    print(
        f"{args.sites} site(s) {where}, {args.preset}, {mode} rounds every {args.sync:g} wall s, "
        f"{args.seconds:g} s"
    )
    print(f"train_share        {result['train_share']:.3f}  (median over sites)")
    print(
        f"throughput_ratio   {result['throughput_ratio']:.3f}  (node tokens/s / plain {plain:,.0f} tokens/s)"
    )
    bm = result["blocked_s_median"]
    print(f"blocked_s_median   {'-' if bm is None else format(bm, '.2f')} s per round")
    print(f"rounds {result['rounds']}, failed {result['failed_rounds']}, state flaps {result['state_flaps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
