"""In-window training throughput of a real site node (swarm on) against a plain torch loop.

Both sides train the same model (``tiny`` preset, byte tokenizer) on the same data (the standard
library's sources, sequences of 128, batches of 8) with AdamW, gradient clipping and one torch thread.

* plain: a bare torch loop in this process -- no greenswarm code on the training path;
* swarm: ``--sites`` real site nodes (separate processes, each with its p2pd daemon) joined through
  a real bootstrap DHT, on a CSV trace that is always below the threshold, replaying trace time
  ``--speedup`` x faster than real time and averaging every ``--sync`` clock seconds (by default a
  round every 30 wall seconds). Throughput is measured from the node's own step timestamps, between
  its first steps and its last one, so every outer round, checkpoint and progress record in between
  counts against it, and start-up does not.

Repeats interleave the two sides (plain, swarm, plain, swarm...) so that drift in machine load hits
both; medians are printed with their ratio (the goal is >= 0.97). Every child process (p2pd
daemons included) is reaped at the end, also on Ctrl-C.

    python benchmarks/throughput.py --seconds 75 --repeats 3 [--sites 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

SKIP_STEPS = 3  # steps excluded at the start of each measurement (allocator and data warm-up)
TRACE_START = "2026-01-01T00:00:00Z"  # a multiple of every sync interval used here: rounds align
TRACE_STEP_S = 60
REGIONS = ("BENCH_A", "BENCH_B", "BENCH_C", "BENCH_D")


# --------------------------------------------------------------------------------------- plain torch


def plain_tokens_per_s(seconds: float, preset: str = "tiny") -> dict[str, float]:
    """A bare torch training loop on the node's model (``preset``) and data: tokens/s over ``seconds``."""
    import torch

    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.model import ModelConfig, build_model, causal_lm_loss
    from greenswarm.node.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    model = build_model(ModelConfig(preset=preset), ByteTokenizer.vocab_size)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = iter(TokenBatches(DataConfig(), ByteTokenizer(), 8))

    def step() -> int:
        batch = next(batches)
        loss = causal_lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # a training loop reads its loss
        return batch.shape[0] * (batch.shape[1] - 1)

    for _ in range(SKIP_STEPS):
        step()
    tokens, started = 0, time.monotonic()
    times = [started]
    while times[-1] - started < seconds:
        tokens += step()
        times.append(time.monotonic())
    elapsed = times[-1] - started
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return {
        "tokens_per_s": tokens / elapsed,
        "steps": len(gaps),
        "seconds": elapsed,
        "median_step_s": gaps[len(gaps) // 2],
    }


# --------------------------------------------------------------------------------------- swarm on


def run_site_worker(config: str, out: str) -> int:
    """``--site``: run one real site node from ``config``, recording when each step and round ended."""
    from greenswarm.node.site import SiteNode
    from greenswarm.procs import setup_logging

    setup_logging()

    class TimedSite(SiteNode):
        """The production node, plus timestamps: nothing else is changed."""

        step_times: list[float] = []
        rounds: list[tuple[float, float, str]] = []

        def _train_step(self) -> None:
            super()._train_step()
            self.step_times.append(time.monotonic())

        def _end_round(self, state: Any) -> None:
            started = time.monotonic()
            super()._end_round(state)
            self.rounds.append((started, time.monotonic(), state.value))

    node, summary = run_node(TimedSite, config)
    Path(out).write_text(
        json.dumps(
            {
                "summary": summary,
                "step_times": TimedSite.step_times,
                "rounds": TimedSite.rounds,
                "tokens_per_step": node.trainer.tokens_per_step,
            }
        )
    )
    return 0


def run_node(node_class: Any, config: str) -> tuple[Any, dict[str, Any] | None]:
    """Run a site node of ``node_class`` (SiteNode or a timed subclass) from ``config`` to its end, as
    ``greenswarm node`` would (clean stop on SIGTERM, children reaped); the node and its summary."""
    from greenswarm.node.config import load_site_config
    from greenswarm.procs import on_termination, reap_children

    node = node_class(load_site_config(config))
    on_termination(node.request_stop)
    try:
        return node, node.run()
    finally:
        reap_children()


def write_trace(path: Path, regions: list[str], clock_seconds: float) -> Path:
    """A wide CSV trace, 50 gCO2/kWh everywhere (always in a window), covering ``clock_seconds``."""
    from datetime import datetime, timedelta

    t0 = datetime.fromisoformat(TRACE_START.replace("Z", "+00:00"))
    rows = ["time," + ",".join(regions)]
    for i in range(max(2, math.ceil(clock_seconds / TRACE_STEP_S))):
        stamp = (t0 + timedelta(seconds=i * TRACE_STEP_S)).isoformat().replace("+00:00", "Z")
        rows.append(stamp + "," + ",".join("50" for _ in regions))
    path.write_text("\n".join(rows) + "\n")
    return path


def site_config(i: int, n: int, swarm: str, peers: list[str], trace: Path, run_dir: Path, args: Any) -> dict:
    """A site as ``greenswarm node`` would load it: the plain loop's model, data and optimizer."""
    return {
        "name": f"bench-{i}",
        "region": REGIONS[i],
        "swarm": {"name": swarm, "initial_peers": peers, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},
        "data": {"shard_index": i, "num_shards": n},
        "train": {"device": "cpu", "threads": 1, "batch_size": 8, "micro_batch_size": 8},
        "scheduler": {
            "trace": str(trace),
            "threshold": 100.0,
            "clock": {"kind": "replay", "speedup": args.speedup, "start_wall": args._start_wall},
        },
        "averaging": {"sync_interval_s": args.sync},
        "node": {"run_dir": str(run_dir), "log_every_s": 10.0},
    }


def _kill_session(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a worker and everything in its session (its p2pd daemon and hivemind helpers)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the session, even if the leader is gone
    except ProcessLookupError:
        pass
    proc.wait()


def swarm_run(repeat: int, args: Any, workdir: Path) -> list[dict[str, Any]]:
    """One bootstrap peer and ``args.sites`` site processes for ``args.seconds``; per-site measurements."""
    from greenswarm.network import start_dht, visible_peer_maddrs
    from greenswarm.node.progress import record_validators

    swarm = f"bench{repeat}"
    root = workdir / f"repeat{repeat}"
    root.mkdir(parents=True)
    trace = write_trace(root / "trace.csv", list(REGIONS[: args.sites]), args.seconds * args.speedup)
    dht = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators(swarm))
    procs: list[subprocess.Popen] = []
    try:
        peers = visible_peer_maddrs(dht)
        args._start_wall = time.time()  # sites share the replay's start; trace time 0 is now
        outs = []
        for i in range(args.sites):
            config = root / f"site{i}.yaml"
            config.write_text(
                yaml.safe_dump(site_config(i, args.sites, swarm, peers, trace, root / f"run{i}", args))
            )
            outs.append(root / f"site{i}.json")
            log = open(root / f"site{i}.log", "w")  # noqa: SIM115 - the child owns it from here
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--site", str(config), "--out", str(outs[-1])],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                )
            )
            log.close()
        for i, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=args.seconds + 120)
            except subprocess.TimeoutExpired:
                code = -1
            if code != 0:
                tail = (root / f"site{i}.log").read_text()[-3000:]
                raise RuntimeError(f"site {i} exited with {code}; log tail:\n{tail}")
        return [measure(json.loads(out.read_text())) for out in outs]
    finally:
        for proc in procs:
            _kill_session(proc)
        dht.shutdown()


def measure(record: dict[str, Any]) -> dict[str, Any]:
    """In-window tokens/s between the node's first steps and its last one, and where the time went."""
    times = record["step_times"]
    summary = record["summary"]
    if len(times) < SKIP_STEPS + 2:
        raise RuntimeError(f"the site took only {len(times)} steps; run longer (--seconds)")
    window = times[-1] - times[SKIP_STEPS]
    steps = len(times) - 1 - SKIP_STEPS
    rounds = [end - start for start, end, _ in record["rounds"] if times[SKIP_STEPS] <= start < times[-1]]
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return {
        "tokens_per_s": steps * record["tokens_per_step"] / window,
        "steps": steps,
        "seconds": window,
        "median_step_s": gaps[len(gaps) // 2],
        "rounds": len(rounds),
        "round_wall_s": rounds,  # outer step + averaging + checkpoint, as the training loop saw it
        "first_step_s": summary["first_step_s"],
        "median_round_s": summary["median_round_s"],  # averaging only (federated rounds)
        "federated_rounds": summary["federated_rounds"],
        "solo_rounds": summary["solo_rounds"],
        "failed_rounds": summary["failed_rounds"],
    }


# --------------------------------------------------------------------------------------- main


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=75.0, help="wall seconds of each swarm run (75)")
    parser.add_argument("--plain-seconds", type=float, default=30.0, help="wall seconds of a plain run (30)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved plain/swarm repeats (3)")
    parser.add_argument("--sites", type=int, default=1, choices=range(1, len(REGIONS) + 1), help="sites (1)")
    parser.add_argument("--speedup", type=float, default=20.0, help="replay speed-up (20)")
    parser.add_argument("--sync", type=float, default=600.0, help="clock seconds between rounds (600)")
    parser.add_argument("--workdir", help="keep configs, logs and checkpoints here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--site", help=argparse.SUPPRESS)  # internal: run one site worker
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.site:
        return run_site_worker(args.site, args.out)

    from greenswarm.procs import reap_children

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="greenswarm-bench-"))
    plain: list[dict[str, float]] = []
    swarm: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            plain.append(plain_tokens_per_s(args.plain_seconds))
            sites = swarm_run(repeat, args, workdir)
            swarm.extend(sites)
            if not args.json:
                print(
                    f"repeat {repeat + 1}/{args.repeats}: "
                    f"plain {plain[-1]['tokens_per_s']:,.0f} tok/s, swarm "
                    + ", ".join(f"{s['tokens_per_s']:,.0f}" for s in sites)
                    + " tok/s",
                    flush=True,
                )
    finally:
        reap_children()
    plain_tps = _median([p["tokens_per_s"] for p in plain])
    swarm_tps = _median([s["tokens_per_s"] for s in swarm])
    result = {
        "plain_tokens_per_s": plain_tps,
        "swarm_tokens_per_s": swarm_tps,
        "ratio": swarm_tps / plain_tps,
        "goal": 0.97,
        "plain_step_s": _median([p["median_step_s"] for p in plain]),
        "swarm_step_s": _median([s["median_step_s"] for s in swarm]),
        "step_ratio": _median([p["median_step_s"] for p in plain])
        / _median([s["median_step_s"] for s in swarm]),
        "first_step_s": _median([s["first_step_s"] for s in swarm]),
        "round_wall_s": _median([r for s in swarm for r in s["round_wall_s"]]),
        "median_round_s": _median([s["median_round_s"] for s in swarm]),
        "rounds_per_run": _median([s["rounds"] for s in swarm]),
        "load_average": os.getloadavg(),
        "failed_rounds": sum(s["failed_rounds"] for s in swarm),
        "settings": {
            "seconds": args.seconds,
            "plain_seconds": args.plain_seconds,
            "repeats": args.repeats,
            "sites": args.sites,
            "speedup": args.speedup,
            "sync_interval_s": args.sync,
            "round_every_wall_s": args.sync / args.speedup,
            "cpus": os.cpu_count(),
        },
        "plain_runs": [p["tokens_per_s"] for p in plain],
        "swarm_runs": [s["tokens_per_s"] for s in swarm],
        "workdir": str(workdir),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    def fmt(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    print(
        f"plain torch loop    {plain_tps:10,.0f} tokens/s  (median of {len(plain)}; "
        f"median step {fmt(result['plain_step_s'], '.4f')} s)"
    )
    print(
        f"site node, swarm on {swarm_tps:10,.0f} tokens/s  (median of {len(swarm)}; "
        f"median step {fmt(result['swarm_step_s'], '.4f')} s; {args.sites} site(s), a round every "
        f"{args.sync / args.speedup:g} wall s)"
    )
    print(f"ratio               {result['ratio']:10.3f}  (goal >= 0.97)")
    print(
        f"median step ratio   {result['step_ratio']:10.3f}  (plain median step / node median step: the same "
        "comparison without rare stalls, robust to other load on the machine)"
    )
    print(f"node start -> first training step  {fmt(result['first_step_s'])} s")
    print(f"outer round as the loop sees it    {fmt(result['round_wall_s'], '.3f')} s (median)")
    print(f"averaging round (federated)        {fmt(result['median_round_s'], '.3f')} s (median_round_s)")
    print(f"rounds per run {fmt(result['rounds_per_run'], 'g')}, failed rounds {result['failed_rounds']}")
    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    print(f"load average at the end: {load} on {os.cpu_count()} CPUs (other work on the machine adds noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
