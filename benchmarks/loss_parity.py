"""Loss parity: three sites averaging in a compressed wire format vs the same run in fp32.

Each run starts a DHT in this process and three site processes on 127.0.0.1. Every site trains the
``tiny`` model (same init) with the node's inner trainer (AdamW, batches of 8 x 128 tokens) on its own
shard of the corpus (tinyshakespeare from ../shared when present, else the standard library's
sources), and every ``--inner`` steps averages its pseudo-gradient with the other two through
greenswarm's averager (real processes, real hivemind all-reduce, the exact runner, the chosen wire
format, error feedback as the node does it) and applies the DiLoCo outer step. Equal steps in every
run: ``--rounds`` x ``--inner`` inner steps per site. At the end each site evaluates the global model
on the same held-out shard; the three sites must hold identical global parameters (their digests are
compared).

Printed: final held-out loss per wire format and seed, and the ratio to fp32 of the same seed
(goal <= 1.01), with the median and spread over seeds.

    python benchmarks/loss_parity.py [--wires fp32 int8 int7-zstd] [--seeds 0 1 2] [--rounds 8] [--inner 25]

``--delays 0 2`` compares rounds that block (0) with overlapped ones (``averaging.overlap``, see
docs/overlap.md) whose result is applied K inner steps after the snapshot, as a node that trains on
while its round runs does: the averaged step moves the global model, and the K steps taken meanwhile
are kept on top of it (``local = global_new + (local_now - snapshot)``). K is fixed here, so the
comparison is deterministic; a node's own ``steps_meanwhile`` (rounds.jsonl) says which K is real.
Equal inner steps either way. ``--preset`` picks the model (tiny; small is ~99 M parameters).

    python benchmarks/loss_parity.py --wires fp32 --delays 0 2 --seeds 0 1 2 [--preset small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITES = 3


def _data_source() -> str:
    corpus = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
    return str(corpus) if corpus.exists() else "stdlib"


def site(args: argparse.Namespace) -> None:
    """One site: train, average every --inner steps, evaluate the global model, print one JSON line."""
    import torch

    from greenswarm.averaging.agreement import state_digest
    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.config import LOOPBACK_TIMEOUTS, AveragingConfig
    from greenswarm.averaging.outer import OuterOptimizer
    from greenswarm.network import start_dht
    from greenswarm.node.config import TrainConfig
    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.distributed import World
    from greenswarm.node.model import ModelConfig, causal_lm_loss
    from greenswarm.node.trainer import InnerTrainer

    torch.manual_seed(args.seed)
    data = DataConfig(source=_data_source(), shard_index=args.index, num_shards=SITES + 1, seed=args.seed)
    trainer = InnerTrainer(
        ModelConfig(preset=args.preset, seed=args.seed),
        data,
        TrainConfig(threads=1),
        World.from_environment("cpu"),
    )
    outer = OuterOptimizer.from_config(trainer.full_parameters(), "diloco", 0.7, 0.9, True)
    cfg = AveragingConfig(
        wire=args.wire, **{**LOOPBACK_TIMEOUTS, "matchmaking_s": 8.0, "request_timeout_s": 2.0}
    )
    dht = start_dht([args.peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = SwarmAverager(dht, f"parity-{args.tag}", outer.numel, cfg, lambda: ({}, []))
    feedback = torch.zeros(outer.numel)
    failed, wires = 0, []
    pending = None  # (outcome, local snapshot): a round whose step waits for --delay more inner steps

    def apply(outcome, snapshot) -> None:
        outer.step(outcome.averaged)
        feedback.copy_(outcome.residual)
        wires.append(outcome.wire)
        # the steps taken since the snapshot stay on top of the new global model (none when blocking)
        trainer.load_full_parameters(outer.params + (trainer.full_parameters() - snapshot))

    for r in range(args.rounds):
        for i in range(args.inner):
            trainer.step()
            if pending is not None and i + 1 == args.delay:
                apply(*pending)
                pending = None
        if pending is not None:  # a delay of a whole round or more: at the next boundary at the latest
            apply(*pending)
            pending = None
        snapshot = trainer.full_parameters().clone()
        delta = outer.pseudo_gradient(snapshot)
        outcome = averager.average(delta + feedback, 1.0, r, f"parity-{args.tag}", SITES, {})
        if not outcome.ok:
            failed += 1
            continue
        if args.delay:
            pending = (outcome, snapshot)
        else:
            apply(outcome, snapshot)
    if pending is not None:
        apply(*pending)
    # held-out loss of the global model (the shard no site trained on)
    trainer.load_full_parameters(outer.params)
    trainer.model.eval()
    held_out = iter(
        TokenBatches(
            DataConfig(source=_data_source(), shard_index=SITES, num_shards=SITES + 1), trainer.tokenizer, 8
        )
    )
    with torch.no_grad():
        losses = [float(causal_lm_loss(trainer.model, next(held_out))) for _ in range(args.eval_batches)]
    print(
        json.dumps(
            {
                "eval_loss": statistics.fmean(losses),
                "failed_rounds": failed,
                "wires": sorted(set(wires)),
                "digest": state_digest(outer.state_tensors()),
            }
        ),
        flush=True,
    )
    averager.shutdown()
    dht.shutdown()


def run(wire: str, seed: int, args: argparse.Namespace, delay: int = 0) -> dict:
    from greenswarm.network import start_dht

    dht = start_dht([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer = str(dht.get_visible_maddrs()[0])
    tag = f"{wire}-{seed}-{delay}-{int(time.time())}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--site",
                "--peer",
                peer,
                "--wire",
                wire,
                "--seed",
                str(seed),
                "--index",
                str(i),
                "--tag",
                tag,
                "--rounds",
                str(args.rounds),
                "--inner",
                str(args.inner),
                "--eval-batches",
                str(args.eval_batches),
                "--delay",
                str(delay),
                "--preset",
                args.preset,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        for i in range(SITES)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        dht.shutdown()
    return {
        "eval_loss": statistics.fmean(o["eval_loss"] for o in outs),
        "failed_rounds": max(o["failed_rounds"] for o in outs),
        "wires": sorted({w for o in outs for w in o["wires"]}),
        "sites_identical": len({o["digest"] for o in outs}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wires", nargs="+", default=["fp32", "int8", "int7-zstd"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--preset", default="tiny", help="model preset (tiny; small is ~99 M parameters)")
    parser.add_argument("--delays", nargs="+", type=int, default=[0], help="0: blocking; K: overlapped")
    parser.add_argument("--delay", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--site", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--wire", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.site:
        site(args)
        return
    results: dict[str, dict[int, dict]] = {}
    variants = [(w, d) for w in args.wires for d in args.delays]
    label = {(w, d): w if args.delays == [0] else f"{w}/delay{d}" for w, d in variants}
    for seed in args.seeds:  # seeds outermost: machine-load drift hits every variant alike
        for wire, delay in variants:
            name = label[wire, delay]
            results.setdefault(name, {})[seed] = run(wire, seed, args, delay)
            print(f"# {name} seed {seed}: {results[name][seed]}", file=sys.stderr, flush=True)
    base = label[variants[0]]
    summary = {}
    for wire, by_seed in results.items():
        ratios = [by_seed[s]["eval_loss"] / results[base][s]["eval_loss"] for s in args.seeds]
        summary[wire] = {
            "eval_loss": {s: r["eval_loss"] for s, r in by_seed.items()},
            f"ratio_to_{base}": ratios,
            "median_ratio": statistics.median(ratios),
            "spread": [min(ratios), max(ratios)],
            "failed_rounds": sum(r["failed_rounds"] for r in by_seed.values()),
            "sites_identical": all(r["sites_identical"] for r in by_seed.values()),
            "wires": sorted({w for r in by_seed.values() for w in r["wires"]}),
        }
    if args.json:
        print(
            json.dumps(
                {
                    "preset": args.preset,
                    "rounds": args.rounds,
                    "inner": args.inner,
                    "seeds": args.seeds,
                    "wires": summary,
                },
                indent=1,
            )
        )
        return
    print(f"{args.preset}: {args.rounds} rounds x {args.inner} inner steps, 3 sites, seeds {args.seeds}")
    print(f"{'variant':<16}{'median ratio':>13}{'spread':>20}  losses")
    for wire, s in summary.items():
        losses = " ".join(f"{v:.4f}" for v in s["eval_loss"].values())
        print(
            f"{wire:<16}{s['median_ratio']:>13.4f}   [{s['spread'][0]:.4f}, {s['spread'][1]:.4f}]  {losses}"
            f"  failed={s['failed_rounds']} identical={s['sites_identical']}"
        )


if __name__ == "__main__":
    main()
