"""Schedule-free against cosine when nobody knows the run's length: the swarm's held-out loss against
tokens, for three sites that train only in their regions' windows of a replayed trace.

The trace is the anchor's (``../shared/data/traces/curtail-llm/mci.csv``, WattTime marginal
intensity, 18 h; the built-in trace when ../shared is missing), its first three regions one site each.
A site is in a window as the node's own rule says (``SchedulerConfig().window_policy()``: below
100 gCO2/kWh, left after 10 minutes above). Every ``--round-minutes`` of trace time, each site in a
window takes ``--steps`` inner steps with the node's inner trainer (tiny or small model, same init, a
shard of the corpus each: tinyshakespeare from ../shared, else the standard library's sources; the
fourth shard is held out), then the sites in a window combine their pseudo-gradients token-weighted
and take the outer step (``--outers``: DiLoCo, Nesterov with lr 0.7 and momentum 0.9, the node's
default; and FedAvg, the plain mean) -- alone if a site is alone, as a node's solo round does. A site
entering a window adopts the global state first, as a node's catch-up loads it
(``InnerTrainer.load_full_parameters``: what ``train.sf_z`` says it moves, and a schedule-free x's
averaging weights, served by the sites that took the last round); its optimizer's own moments and step
count stay its own, as they do in a node. What this assumes, and a node does differently: rounds start
at fixed instants, not when a group forms; a window that opens or closes
between two rounds counts from the next one; no round fails; no wire coding (fp32).

Optimizers compared, every other setting equal (``--lr`` for all, warm-up 20 steps):

* ``cosine-known`` -- AdamW, cosine to 0.1 x lr over exactly the inner steps each site will take
  (known here only because the benchmark knows the trace's future: a real run never does);
* ``cosine-2x-long`` / ``cosine-2x-short`` -- the same with the length guessed 2x too long (it never
  decays far) and 2x too short (it sits at the floor for the second half);
* ``constant`` -- AdamW at lr after warm-up (today's default);
* ``sf`` -- Schedule-Free AdamW, the swarm averaging x and z (``sf_z: average``);
  ``sf-shift`` -- averaging x only, z moved by x's outer step; ``sf-reset`` -- x only, z set to x;
  ``sf-momentum`` -- ``sf`` with ScheduleFree+'s inner momentum (0.9); ``sf-keep`` -- ``sf`` where a
  site entering its window keeps averaging into the adopted x (``sf_keep_average``).

The schedule of windows, and so the tokens, is the same for every optimizer: losses compare at equal
tokens. In-process and sequential per run (runs in ``--jobs`` processes), deterministic for a seed.
Printed: per optimizer the final held-out loss (median, min .. max over seeds), its median ratio to
``cosine-known`` of the same seed, and the median loss at a quarter and at half the tokens; ``--png``
plots the median held-out loss against tokens.

    python benchmarks/schedule_free.py [--preset tiny] [--seeds 0 1 2] [--steps 10] [--round-minutes 30] \\
        [--optimizers ...] [--jobs 2] [--png docs/img/schedule-free-tiny.png] [--json | --json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITES = 3
#: name -> the train config's fields (a cosine's total_steps is set per site from the windows)
OPTIMIZERS: dict[str, dict] = {
    "cosine-known": {"schedule": "cosine", "length": 1.0},
    "cosine-2x-long": {"schedule": "cosine", "length": 2.0},
    "cosine-2x-short": {"schedule": "cosine", "length": 0.5},
    "constant": {},
    "sf": {"optimizer": "adamw-schedulefree", "sf_z": "average"},
    "sf-shift": {"optimizer": "adamw-schedulefree", "sf_z": "shift"},
    "sf-reset": {"optimizer": "adamw-schedulefree", "sf_z": "reset"},
    "sf-momentum": {"optimizer": "adamw-schedulefree", "sf_z": "average", "sf_momentum": 0.9},
    "sf-keep": {"optimizer": "adamw-schedulefree", "sf_z": "average", "sf_keep_average": True},
}
#: the outer step: DiLoCo (Nesterov, lr 0.7, momentum 0.9; the node's default) or FedAvg (the plain mean)
OUTERS = ("diloco", "fedavg")
WARMUP = 20


def _data_source() -> str:
    corpus = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
    return str(corpus) if corpus.exists() else "stdlib"


def _trace_spec() -> str:
    anchor = REPO.parent / "shared" / "data" / "traces" / "curtail-llm" / "mci.csv"
    return str(anchor) if anchor.exists() else "builtin"


def windows(round_minutes: float) -> tuple[list[str], list[list[bool]]]:
    """The regions, and for each round instant which sites are in a window (the node's window rule)."""
    from greenswarm.scheduler.config import SchedulerConfig
    from greenswarm.scheduler.policy import WindowSchedule
    from greenswarm.traces import load_trace

    spec = _trace_spec()
    trace = load_trace(spec)
    regions = trace.regions[:SITES]
    policy = SchedulerConfig(trace=spec).window_policy()
    schedules = [WindowSchedule(trace, region, policy) for region in regions]
    step = round_minutes * 60
    instants = [trace.start + i * step for i in range(int((trace.end - trace.start) // step))]
    return regions, [[s.in_window(t) for s in schedules] for t in instants]


def run(name: str, outer_kind: str, seed: int, args: argparse.Namespace) -> dict:
    """One swarm of three through the trace with optimizer ``name`` and outer step ``outer_kind``; the
    held-out loss after each round."""
    import torch

    from greenswarm.averaging.outer import OuterOptimizer
    from greenswarm.node.config import TrainConfig
    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.distributed import World
    from greenswarm.node.model import ModelConfig
    from greenswarm.node.trainer import InnerTrainer

    began = time.perf_counter()
    torch.manual_seed(seed)
    _, plan = windows(args.round_minutes)
    steps_of = [args.steps * sum(row[i] for row in plan) for i in range(SITES)]  # each site's whole run
    source, shards = _data_source(), SITES + 1
    spec = dict(OPTIMIZERS[name])
    length, lr = spec.pop("length", None), args.lr
    trainers = []
    for i in range(SITES):
        cfg = TrainConfig(
            batch_size=args.batch, micro_batch_size=args.batch, threads=1, lr=lr, warmup_steps=WARMUP, **spec
        )
        cfg.device = args.device
        if length is not None:
            cfg.total_steps = max(WARMUP + 1, round(steps_of[i] * length))
        cfg.validate()
        trainers.append(
            InnerTrainer(
                ModelConfig(preset=args.preset, seed=seed),
                DataConfig(source=source, shard_index=i, num_shards=shards, seed=seed, seq_len=args.seq_len),
                cfg,
                World.from_environment(args.device),
            )
        )
    outer = OuterOptimizer.from_config(trainers[0].full_parameters(), outer_kind, 0.7, 0.9, True)
    numel = trainers[0].num_parameters
    evaluator = InnerTrainer(
        ModelConfig(preset=args.preset, seed=seed),
        DataConfig(source=source, seq_len=args.seq_len),
        TrainConfig(threads=1, device=args.device),
        World.from_environment(args.device),
    )
    held_out = iter(
        TokenBatches(
            DataConfig(source=source, shard_index=SITES, num_shards=shards, seq_len=args.seq_len),
            evaluator.tokenizer,
            8,
        )
    )
    batches = [next(held_out) for _ in range(args.eval_batches)]

    def held_out_loss() -> float:
        """The global model's loss (x, the first part of a schedule-free global state)."""
        evaluator.load_full_parameters(outer.params[:numel])
        return evaluator.evaluate(batches)

    curve, tokens, was_in = [(0, held_out_loss())], 0, [False] * SITES
    for row in plan:
        deltas = []
        # the sites that took the last round hold the global state, and serve it with (schedule-free)
        # the averaging weights of their x: a site entering its window adopts both, as a node's catch-up
        holders = [trainers[j].averaging_weights() for j in range(SITES) if was_in[j]]
        served = max((w for w in holders if w), key=lambda w: w["weight_sum"], default=None)
        for i, trainer in enumerate(trainers):
            if not row[i]:
                was_in[i] = False
                continue
            if not was_in[i]:
                trainer.load_full_parameters(outer.params, weights=served)  # entering a window: catch up
                was_in[i] = True
            trained = sum(trainer.step().tokens for _ in range(args.steps))
            tokens += trained
            deltas.append((outer.pseudo_gradient(trainer.full_parameters()), trained))
        if not deltas:
            continue
        total = sum(weight for _, weight in deltas)
        averaged = torch.zeros_like(outer.params)
        for delta, weight in deltas:
            averaged.add_(delta, alpha=weight / total)
        outer.step(averaged)
        for i, trainer in enumerate(trainers):
            if row[i]:
                trainer.load_full_parameters(outer.params)
        curve.append((tokens, held_out_loss()))
    return {
        "optimizer": name,
        "outer": outer_kind,
        "seed": seed,
        "preset": args.preset,
        "curve": curve,
        "eval_loss": curve[-1][1],
        "tokens": tokens,
        "site_steps": steps_of,
        "seconds": time.perf_counter() - began,
    }


def _loss_at(curve: list, tokens: float) -> float:
    """The held-out loss of the first evaluation at or past ``tokens``."""
    return next(loss for seen, loss in curve if seen >= tokens)


def summarize(results: list[dict], names: list[str], outers: list[str]) -> list[dict]:
    rows = []
    by_seed = {(r["optimizer"], r["outer"], r["seed"]): r for r in results}
    for outer in outers:
        for name in names:
            runs = [r for r in results if r["optimizer"] == name and r["outer"] == outer]
            if not runs:
                continue
            final = [r["eval_loss"] for r in runs]
            ratios = [
                r["eval_loss"] / by_seed[("cosine-known", outer, r["seed"])]["eval_loss"]
                for r in runs
                if ("cosine-known", outer, r["seed"]) in by_seed
            ]
            total = runs[0]["tokens"]
            rows.append(
                {
                    "outer": outer,
                    "optimizer": name,
                    "median": statistics.median(final),
                    "min": min(final),
                    "max": max(final),
                    "vs_cosine_known": statistics.median(ratios) if ratios else None,
                    "at_quarter": statistics.median(_loss_at(r["curve"], total / 4) for r in runs),
                    "at_half": statistics.median(_loss_at(r["curve"], total / 2) for r in runs),
                    "seeds": len(runs),
                }
            )
    return rows


def plot(results: list[dict], names: list[str], outers: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(outers), figsize=(6.5 * len(outers), 5), sharey=True, squeeze=False)
    for ax, outer in zip(axes[0], outers, strict=True):
        for name in names:
            runs = [r for r in results if r["optimizer"] == name and r["outer"] == outer]
            if not runs:
                continue
            points = len(min((r["curve"] for r in runs), key=len))
            xs = [runs[0]["curve"][k][0] / 1e6 for k in range(points)]
            ys = [statistics.median(r["curve"][k][1] for r in runs) for k in range(points)]
            style = "-" if name.startswith("sf") else "--"
            width = 2.2 if name in ("sf", "cosine-known") else 1.2
            ax.plot(xs[1:], ys[1:], style, label=name, linewidth=width)
        ax.set_xlabel("tokens trained by the swarm (millions)")
        ax.set_title(f"outer step: {outer}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out loss of the global model (median over seeds)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--outers", nargs="+", default=list(OUTERS), choices=list(OUTERS))
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round of a site in a window")
    parser.add_argument("--round-minutes", type=float, default=30.0, help="trace minutes between rounds")
    parser.add_argument("--batch", type=int, default=8, help="sequences per inner step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one process each)")
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where the sites train"
    )
    parser.add_argument("--png", type=Path, help="plot the median held-out loss against tokens here")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--json-out", type=Path, help="also write the whole report as JSON here")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="run nothing: summarize (and --png) the runs of earlier --json-out reports",
    )
    args = parser.parse_args()

    regions, plan = windows(args.round_minutes)
    if not args.json:
        counts = ", ".join(f"{r}: {sum(row[i] for row in plan)}" for i, r in enumerate(regions))
        print(
            f"trace {_trace_spec()}; {len(plan)} rounds of {args.round_minutes:g} min; in a window: {counts}"
        )
    began = time.perf_counter()
    jobs = [(name, outer, seed) for seed in args.seeds for outer in args.outers for name in args.optimizers]
    results: list[dict] = []
    if args.from_json:
        jobs = []
        for path in args.from_json:
            results += json.loads(path.read_text())["runs"]
        args.outers = [o for o in OUTERS if any(r["outer"] == o for r in results)]
        args.optimizers = [n for n in OPTIMIZERS if any(r["optimizer"] == n for r in results)]
        args.seeds = sorted({r["seed"] for r in results})
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run, name, outer, seed, args) for name, outer, seed in jobs]
        for future in futures:
            result = future.result()
            results.append(result)
            if not args.json:
                print(
                    f"  {result['outer']:<7} {result['optimizer']:<16} seed {result['seed']}: "
                    f"held-out {result['eval_loss']:.4f} "
                    f"after {result['tokens']:,} tokens ({result['seconds']:.0f} s)",
                    flush=True,
                )
    rows = summarize(results, args.optimizers, args.outers)
    report = {
        "preset": args.preset,
        "trace": _trace_spec(),
        "regions": regions,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
        "runs": results,
        "seconds": time.perf_counter() - began,
    }
    if args.png:
        title = (
            f"{args.preset} model, 3 sites on {Path(_trace_spec()).name} ({', '.join(regions)}), "
            f"{len(args.seeds)} seeds"
        )
        plot(results, args.optimizers, args.outers, args.png, title)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1, default=str))
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return
    print(f"\n{'outer':<7} {'optimizer':<16} {'held-out (median)':>17} {'min .. max':>17} "
          f"{'vs cosine-known':>15} {'at 1/4':>7} {'at 1/2':>7}")  # fmt: skip
    for row in rows:
        ratio = f"{row['vs_cosine_known']:.4f}" if row["vs_cosine_known"] else "-"
        print(
            f"{row['outer']:<7} {row['optimizer']:<16} {row['median']:>17.4f} {row['min']:>8.4f} .. "
            f"{row['max']:<6.4f} {ratio:>15} {row['at_quarter']:>7.4f} {row['at_half']:>7.4f}"
        )
    print(f"\n{len(results)} runs " + ("read" if args.from_json else f"in {report['seconds']:.0f} s"))


if __name__ == "__main__":
    main()
