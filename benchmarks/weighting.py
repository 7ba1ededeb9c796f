"""Uneven work, fairly weighted: which ``averaging.weighting`` gives the best held-out loss when the
sites of a swarm train at 1x, 2x and 4x the throughput, at equal total tokens.

Three sites train the ``tiny`` model (same init) with the node's inner trainer, each on its own shard
of the corpus (tinyshakespeare from ../shared when present, else the standard library's sources; the
fourth shard, which no site trains on, is held out), and at the end of every round their
pseudo-gradients are combined and the DiLoCo outer step applied (Nesterov, lr 0.7, momentum 0.9), as
a node does. Throughput is made uneven honestly, in two scenarios:

* ``steps`` -- the same micro-batch at every site; in a round the sites take ``--inner`` x 1, 2 and 4
  inner steps (a faster GPU, or a slow site held back by a rate limit, in the same wall time);
* ``batch`` -- the same ``--inner`` steps at every site, with 1, 2 and 4 times the batch (more GPUs).

Each site then trained 1/7, 2/7 and 4/7 of the round's tokens, in both scenarios. The combination
is the node's own (:mod:`greenswarm.averaging.weighting` for what each site sends, with what weight,
and the group's scale; :func:`~greenswarm.averaging.aggregation.bounded_weights` for the weights the
reducers count; their weighted mean in sorted peer order), for each weighting:

* ``tokens`` -- the token-weighted mean of the updates (today's default);
* ``fednova`` -- each update divided by its inner steps, token-weighted, times the token-weighted mean
  of the steps (in ``batch`` every site takes the same steps: it must match ``tokens``);
* ``equal`` -- the plain mean.

The schedule is the same for every weighting, so every run of a scenario trains the same tokens:
the final held-out loss of the global model compares the weightings at equal total tokens. In-process
and sequential, in fp32 without wire coding, so a run is deterministic for its seed: this measures
the rule, not the wire (``tests/test_weighting.py`` checks that the node combines through the same
functions). Printed: each run's final held-out loss, then per scenario and weighting the median and
spread (min .. max) over seeds, the median ratio to ``tokens`` of the same seed, and the median loss
after half the rounds (the loss must still be falling for the comparison to mean much).

    python benchmarks/weighting.py [--seeds 0 1 2] [--rounds 12] [--inner 6] [--micro-batch 4] \
        [--json | --json-out FILE]
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

SPEEDS = (1, 2, 4)  # each site's throughput, relative to the slowest
SCENARIOS = ("steps", "batch")
WEIGHTINGS = ("tokens", "fednova", "equal")


def _data_source() -> str:
    corpus = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
    return str(corpus) if corpus.exists() else "stdlib"


def combine(weighting: str, sites: dict[str, tuple]) -> tuple:
    """The group's step from each site's ``(delta, tokens, steps)``, combined as a node's round does:
    what each member sends (:func:`outgoing`), the weights every reducer counts from the gathered
    claims (:func:`bounded_weights`), their weighted mean, and the group's scale (:func:`group_scale`).
    Returns (step, scale)."""
    import torch

    from greenswarm.averaging.aggregation import bounded_weights
    from greenswarm.averaging.config import AveragingConfig
    from greenswarm.averaging.weighting import group_scale, outgoing, scaled

    cfg = AveragingConfig(weighting=weighting)
    rules = {**cfg.rules(), "interval_s": cfg.sync_interval_s}
    sent, gathered = {}, {}
    for peer, (delta, tokens, steps) in sites.items():
        sent[peer], weight = outgoing(weighting, delta, tokens, steps)
        gathered[peer] = {"tokens": max(float(weight), 1e-6), "steps": steps, "rules": rules}
    weights, _ = bounded_weights(gathered, rules, cfg.sync_interval_s)
    peers = sorted(sites)
    averaged = torch.zeros_like(next(iter(sent.values())))
    for peer in peers:  # hivemind's reducer: a running sum of weight x part, over the summed weights
        averaged.add_(sent[peer], alpha=weights[peer])
    averaged.div_(sum(weights[p] for p in peers))
    scale = group_scale(weighting, peers, gathered, weights, cfg.aggregate, cfg.trim)
    return scaled(averaged, scale), scale


def run(scenario: str, weighting: str, seed: int, args: argparse.Namespace) -> dict:
    """One swarm of three at 1x, 2x, 4x: train, combine by ``weighting``, evaluate the global model."""
    import torch

    from greenswarm.averaging.outer import OuterOptimizer
    from greenswarm.node.config import TrainConfig
    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.distributed import World
    from greenswarm.node.model import ModelConfig, causal_lm_loss
    from greenswarm.node.trainer import InnerTrainer

    began = time.perf_counter()
    torch.manual_seed(seed)
    source = _data_source()
    shards = len(SPEEDS) + 1
    trainers, steps = [], []
    for i, speed in enumerate(SPEEDS):
        batch = args.micro_batch * (speed if scenario == "batch" else 1)
        trainers.append(
            InnerTrainer(
                ModelConfig(preset="tiny", seed=seed),
                DataConfig(source=source, shard_index=i, num_shards=shards, seed=seed),
                TrainConfig(batch_size=batch, micro_batch_size=batch, threads=1),
                World.from_environment("cpu"),
            )
        )
        steps.append(args.inner * (speed if scenario == "steps" else 1))
    outer = OuterOptimizer.from_config(trainers[0].full_parameters(), "diloco", 0.7, 0.9, True)

    def held_out_loss() -> float:
        """The global model's loss on the held-out shard's first batches (the same ones every time);
        site 0 holds the global model right after a round, and trains on unchanged afterwards."""
        evaluator = trainers[0]
        batches = iter(
            TokenBatches(
                DataConfig(source=source, shard_index=len(SPEEDS), num_shards=shards), evaluator.tokenizer, 8
            )
        )
        evaluator.model.eval()
        with torch.no_grad():
            losses = [float(causal_lm_loss(evaluator.model, next(batches))) for _ in range(args.eval_batches)]
        evaluator.model.train()
        return statistics.fmean(losses)

    tokens_total, scales, mid_loss = 0, [], None
    for done in range(1, args.rounds + 1):
        sites = {}
        for i, trainer in enumerate(trainers):
            tokens = sum(trainer.step().tokens for _ in range(steps[i]))
            sites[f"site-{i}"] = (outer.pseudo_gradient(trainer.full_parameters()), tokens, steps[i])
            tokens_total += tokens
        step, scale = combine(weighting, sites)
        scales.append(scale)
        outer.step(step)
        for trainer in trainers:
            trainer.load_full_parameters(outer.params)
        if done == args.rounds // 2:
            mid_loss = held_out_loss()  # (still falling at the end? compare with the final loss)
    return {
        "scenario": scenario,
        "weighting": weighting,
        "seed": seed,
        "eval_loss": held_out_loss(),
        "mid_loss": mid_loss,
        "tokens": tokens_total,
        "mean_scale": statistics.fmean(scales),
        "seconds": time.perf_counter() - began,
    }


def summarize(results: list[dict], scenarios: list[str], weightings: list[str]) -> list[dict]:
    """Per scenario and weighting: the median and spread of the final loss over seeds, and the median
    ratio to ``tokens`` of the same scenario and seed."""
    baseline = {(r["scenario"], r["seed"]): r["eval_loss"] for r in results if r["weighting"] == "tokens"}
    for r in results:
        base = baseline.get((r["scenario"], r["seed"]))
        r["vs_tokens"] = r["eval_loss"] / base if base else None
    table = []
    for scenario in scenarios:
        for weighting in weightings:
            runs = [r for r in results if r["scenario"] == scenario and r["weighting"] == weighting]
            if not runs:
                continue
            losses = [r["eval_loss"] for r in runs]
            ratios = [r["vs_tokens"] for r in runs if r["vs_tokens"] is not None]
            table.append(
                {
                    "scenario": scenario,
                    "weighting": weighting,
                    "median_loss": statistics.median(losses),
                    "min_loss": min(losses),
                    "max_loss": max(losses),
                    "median_vs_tokens": statistics.median(ratios) if ratios else None,
                    "median_mid_loss": statistics.median(r["mid_loss"] for r in runs)
                    if all(r["mid_loss"] is not None for r in runs)
                    else None,
                    "tokens": runs[0]["tokens"],
                    "mean_scale": statistics.fmean(r["mean_scale"] for r in runs),
                }
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner", type=int, default=6, help="inner steps a round of the 1x site")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences a step of the 1x site")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--weightings", nargs="+", default=list(WEIGHTINGS), choices=WEIGHTINGS)
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    args = parser.parse_args()

    began = time.perf_counter()
    results = []
    for seed in args.seeds:
        for scenario in args.scenarios:
            for weighting in args.weightings:
                results.append(run(scenario, weighting, seed, args))
                r = results[-1]
                mid = "" if r["mid_loss"] is None else f", {r['mid_loss']:.4f} halfway"
                print(
                    f"  {scenario:5s} {weighting:7s} seed {seed}: held-out loss {r['eval_loss']:.4f}{mid} "
                    f"({r['tokens']:,} tokens, {r['seconds']:.0f} s)",
                    file=sys.stderr if args.json else sys.stdout,
                    flush=True,
                )
    table = summarize(results, args.scenarios, args.weightings)
    report = {
        "seeds": args.seeds,
        "rounds": args.rounds,
        "inner": args.inner,
        "micro_batch": args.micro_batch,
        "speeds": list(SPEEDS),
        "source": Path(_data_source()).name,
        "wall_s": time.perf_counter() - began,
        "table": table,
    }
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({**report, "runs": results}, indent=1) + "\n")
    if args.json:
        print(json.dumps({**report, "runs": results}))
        return
    print(
        f"\n{len(args.seeds)} seeds, {args.rounds} rounds, sites at {'x, '.join(map(str, SPEEDS))}x "
        f"throughput (1x: {args.inner} inner steps of {args.micro_batch} sequences a round), "
        f"{report['wall_s']:.0f} s"
    )
    half = args.rounds // 2
    print(
        "| scenario | weighting | held-out loss (median) | min .. max | vs tokens (median) "
        f"| after {half} rounds (median) | tokens a run |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in table:
        ratio, mid = row["median_vs_tokens"], row["median_mid_loss"]
        print(
            f"| {row['scenario']} | {row['weighting']} | {row['median_loss']:.4f} | {row['min_loss']:.4f} .. "
            f"{row['max_loss']:.4f} | {ratio:.4f} | {'-' if mid is None else f'{mid:.4f}'} | "
            f"{row['tokens']:,} |"
        )


if __name__ == "__main__":
    main()
