"""Robust aggregation: what one attacker of four does to the global model, with the mean and with the
trimmed mean, and what the trimmed mean costs when nobody attacks.

Four sites train the ``tiny`` model (same init) with the node's inner trainer, each on its own shard
of the corpus (tinyshakespeare from ../shared when present, else the standard library's sources),
and every ``--inner`` steps their pseudo-gradients are combined and the DiLoCo outer step applied
(Nesterov, lr 0.7, momentum 0.9), as a node does. The combination is what every reducer of a round
computes from the same inputs (:mod:`greenswarm.averaging.aggregation`): the token-weighted mean
(equal tokens here), or the coordinate-wise trimmed mean with ``--trim`` (0.25: one of four left out
at each end). In-process and sequential, so a run is deterministic for its seed: this measures the
rule, not the wire (``tests/test_hardening.py`` runs the trimmed mean in a real swarm).

The attacker (site 3) replaces its update before it is combined:

* ``none`` -- honest;
* ``flip`` -- -10x its update (a norm 10x the others', within ``averaging.max_norm_ratio`` 100);
* ``scale`` -- 50x its update (within the norm bound too).

Printed: the global model's final held-out loss (the shard no site trains on) per rule, attack and
seed; the median and spread over seeds; and each run's ratio to the mean with no attacker of the
same seed (the parity goal for the trimmed mean with no attacker: <= 1.01). Also the reducer's cost:
seconds to combine one round's updates by each rule.

    python benchmarks/robust_aggregation.py [--seeds 0 1 2] [--rounds 12] [--inner 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITES = 4
ATTACKS = {"none": 1.0, "flip": -10.0, "scale": 50.0}


def _data_source() -> str:
    corpus = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
    return str(corpus) if corpus.exists() else "stdlib"


def run(rule: str, attack: str, seed: int, args: argparse.Namespace) -> dict:
    """One swarm of four: train, combine by ``rule`` with ``attack`` at site 3, evaluate the global model."""
    import torch

    from greenswarm.averaging.aggregation import trimmed_mean
    from greenswarm.averaging.outer import OuterOptimizer
    from greenswarm.node.config import TrainConfig
    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.distributed import World
    from greenswarm.node.model import ModelConfig, causal_lm_loss
    from greenswarm.node.trainer import InnerTrainer

    torch.manual_seed(seed)
    source = _data_source()
    trainers = [
        InnerTrainer(
            ModelConfig(preset="tiny", seed=seed),
            DataConfig(source=source, shard_index=i, num_shards=SITES + 1, seed=seed),
            TrainConfig(threads=1),
            World.from_environment("cpu"),
        )
        for i in range(SITES)
    ]
    outer = OuterOptimizer.from_config(trainers[0].full_parameters(), "diloco", 0.7, 0.9, True)
    combine_s = []
    for _ in range(args.rounds):
        deltas = []
        for i, trainer in enumerate(trainers):
            for _ in range(args.inner):
                trainer.step()
            delta = outer.pseudo_gradient(trainer.full_parameters())
            deltas.append(delta * ATTACKS[attack] if i == SITES - 1 else delta)
        stacked = torch.stack(deltas)
        began = time.perf_counter()
        averaged = trimmed_mean(stacked, args.trim) if rule == "trimmed-mean" else stacked.mean(dim=0)
        combine_s.append(time.perf_counter() - began)
        outer.step(averaged)
        for trainer in trainers:
            trainer.load_full_parameters(outer.params)
    evaluator = trainers[0]
    evaluator.load_full_parameters(outer.params)
    evaluator.model.eval()
    held_out = iter(
        TokenBatches(
            DataConfig(source=source, shard_index=SITES, num_shards=SITES + 1), evaluator.tokenizer, 8
        )
    )
    with torch.no_grad():
        losses = [float(causal_lm_loss(evaluator.model, next(held_out))) for _ in range(args.eval_batches)]
    return {
        "rule": rule,
        "attack": attack,
        "seed": seed,
        "eval_loss": statistics.fmean(losses),
        "combine_s": statistics.median(combine_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--trim", type=float, default=0.25)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results = []
    for seed in args.seeds:
        for rule in ("mean", "trimmed-mean"):
            for attack in args.attacks:
                results.append(run(rule, attack, seed, args))
                if not args.json:
                    r = results[-1]
                    print(
                        f"  {rule:12s} {attack:6s} seed {seed}: held-out loss {r['eval_loss']:.4f}",
                        flush=True,
                    )
    baseline = {r["seed"]: r["eval_loss"] for r in results if r["rule"] == "mean" and r["attack"] == "none"}
    for r in results:
        r["vs_clean_mean"] = r["eval_loss"] / baseline[r["seed"]] if r["seed"] in baseline else None
    table = []
    for rule in ("mean", "trimmed-mean"):
        for attack in args.attacks:
            runs = [r for r in results if r["rule"] == rule and r["attack"] == attack]
            losses = [r["eval_loss"] for r in runs]
            ratios = [r["vs_clean_mean"] for r in runs if r["vs_clean_mean"] is not None]
            table.append(
                {
                    "rule": rule,
                    "attack": attack,
                    "median_loss": statistics.median(losses),
                    "min_loss": min(losses),
                    "max_loss": max(losses),
                    "median_vs_clean_mean": statistics.median(ratios) if ratios else None,
                    "combine_ms": 1000 * statistics.median(r["combine_s"] for r in runs),
                }
            )
    report = {
        "seeds": args.seeds,
        "rounds": args.rounds,
        "inner": args.inner,
        "trim": args.trim,
        "table": table,
    }
    if args.json:
        print(json.dumps({**report, "runs": results}))
        return
    print(
        f"\n{len(args.seeds)} seeds, {args.rounds} rounds x {args.inner} inner steps, {SITES} sites, "
        f"trim {args.trim}"
    )
    print("| rule | attacker | held-out loss (median) | min .. max | vs the clean mean | combine (ms) |")
    print("|---|---|---:|---:|---:|---:|")
    for row in table:
        ratio = row["median_vs_clean_mean"]
        print(
            f"| {row['rule']} | {row['attack']} | {row['median_loss']:.4f} | {row['min_loss']:.4f} .. "
            f"{row['max_loss']:.4f} | {ratio:.4f} | {row['combine_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
