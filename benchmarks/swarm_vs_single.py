"""Is the swarm's model as good as one site's? The demo's swarm against one site, at equal tokens.

For each seed, three runs of the same model (``tiny``), data (the standard library's sources in 16
shards, the last held out) and optimizer settings (the demo's: AdamW, lr 1e-3, batches of 8 x 128
tokens):

* **swarm** -- ``greenswarm demo`` itself: a bootstrap and three real site nodes replaying the anchor's
  trace (``../shared/data/traces/curtail-llm/mci.csv``, its first three regions; the built-in model of
  it when ../shared is missing), training only in their windows, averaging when windows overlap,
  catching up, training SOLO, banking progress when a window closes. Everything a node does.
* **windows-only** -- the same demo with one site (the first region), alone: it trains in its own
  windows and takes every outer step by itself.
* **continuous** -- one site that trains without pause (in this process, with the node's own inner
  trainer and data reader: the 15 training shards in order) for exactly the swarm's total tokens:
  what a single site with the same budget of tokens gets. ``continuous-3x`` is the same with the
  swarm's three batches in one (24 sequences per step, a third of the steps): data-parallel training.

Every held-out loss is the node's own measurement (:class:`greenswarm.node.global_eval.GlobalEvaluator`:
the global model's bits, fp32, the same 8 x 8 x 128 held-out tokens); the node's runs measure their
global model after every outer step and at the end. Printed: per run the final held-out loss (median,
min .. max over seeds), its ratio to the continuous site's loss at the same tokens (goal for the
swarm: <= 1.01), tokens per kg CO2, and the trace hours it took; then what the swarm's runs did
(rounds, catch-ups, tokens not averaged). ``--png`` draws held-out loss against tokens and against
trace hours.

What this assumes: the continuous site trains at the swarm sites' median speed in trace time (trace
seconds per step, from their ledgers) and emits as a carbon-unaware site in the first region would,
from the trace's start (the trace's last value holds past its end) at the sites' ``energy.train_kw``.
The demo's sites share this machine's cores, so their speed in tokens per trace hour is this machine's,
not a GPU site's; the windows-only site has the cores to itself (more tokens per window). Losses are
compared at equal tokens, which these differences do not touch.

    python benchmarks/swarm_vs_single.py [--seeds 0 1 2] [--minutes 3] [--png docs/img/swarm-vs-single.png]
        [--set averaging.outer=fedavg ...] [--json | --json-out FILE] [--from-json FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH, SEQ_LEN, SHARDS, EVAL_BATCHES = 8, 128, 16, 8
KINDS = ("swarm", "continuous", "continuous-3x", "windows-only")


def _trace() -> str:
    anchor = REPO.parent / "shared" / "data" / "traces" / "curtail-llm" / "mci.csv"
    return str(anchor) if anchor.exists() else "builtin"


# ---- the node's runs (greenswarm demo)


def demo(workdir: Path, seed: int, args: argparse.Namespace, regions: str | None = None) -> dict[str, Any]:
    """One ``greenswarm demo`` run; its report, each site's evaluations and history."""
    from greenswarm.jsonlines import read_json_lines

    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "greenswarm", "demo", "--trace", args.trace, "--minutes", str(args.minutes),
        "--seed", str(seed), "--workdir", str(workdir), "--json", "--no-live",
        *(["--regions", regions] if regions else []),
        *[arg for override in args.set for arg in ("--set", override)],
    ]  # fmt: skip
    with open(workdir / "demo.out", "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=args.minutes * 60 + 900)
    if done.returncode:
        raise SystemExit(f"demo failed ({done.returncode}); see {workdir / 'demo.out'}")
    report = json.loads((workdir / "report.json").read_text())
    sites = {}
    for site in report["sites"]:
        run_dir = workdir / site["site"]
        history = read_json_lines(run_dir / "history.jsonl")
        sites[site["site"]] = {
            "evals": read_json_lines(run_dir / "evals.jsonl"),
            "points": [p for p in history if p.get("kind") == "point"],
            "start": next((p for p in history if p.get("kind") == "start"), {}),
        }
    return {"report": report, "sites": sites}


def _tokens_at(points: list[dict[str, Any]], clock: float) -> float:
    """A site's trained tokens at trace time ``clock`` (its history, linear between points)."""
    before = [p for p in points if p["clock"] <= clock]
    after = [p for p in points if p["clock"] > clock]
    if not before:
        return 0.0
    a = before[-1]
    if not after:
        return float(a["tokens"])
    b = after[0]
    share = (clock - a["clock"]) / (b["clock"] - a["clock"]) if b["clock"] > a["clock"] else 0.0
    return a["tokens"] + share * (b["tokens"] - a["tokens"])


def node_curve(run: dict[str, Any]) -> list[tuple[float, float, float]]:
    """(tokens the run's sites had trained, trace hours, held-out loss) of its newest global model as
    it moved: every site's evaluations in trace order, each kept when its outer step is at or past
    the newest yet; tokens summed over the sites at that time."""
    sites = run["sites"].values()
    events = sorted((e["clock_time"], e["outer_round"], e["loss"]) for site in sites for e in site["evals"])
    start = min((s["start"].get("clock", events[0][0]) for s in sites), default=0.0) if events else 0.0
    curve, head = [], -1
    for clock, outer_round, loss in events:
        if outer_round < head:
            continue
        head = outer_round
        tokens = sum(_tokens_at(s["points"], clock) for s in sites)
        curve.append((tokens, (clock - start) / 3600.0, loss))
    return curve


def describe_node_run(run: dict[str, Any]) -> dict[str, Any]:
    report = run["report"]
    total, quality = report["total"], report["quality"] or {}
    sites = report["sites"]
    trained_s = sum(s["seconds_by_state"].get(k, 0.0) for s in sites for k in ("SOLO", "FEDERATED"))
    training_g = sum(s["emissions_g_by_state"].get(k, 0.0) for s in sites for k in ("SOLO", "FEDERATED"))
    return {
        "eval_loss": quality.get("eval_loss"),
        "outer_round": quality.get("outer_round"),
        "held_by": quality.get("sites"),
        "tokens": total["tokens"],
        "tokens_not_averaged": quality.get("tokens_not_averaged"),
        "emissions_g": total["emissions_g"],
        "training_g": training_g,
        "tokens_per_kg": total["tokens"] / (total["emissions_g"] / 1000.0) if total["emissions_g"] else None,
        "hours": report["hours"],
        "trace_s_per_step": trained_s / total["local_steps"] if total["local_steps"] else None,
        "rounds": {k: total[k] for k in ("federated_rounds", "solo_rounds", "failed_rounds", "catch_ups")},
        "site_losses": {s["site"]: (s.get("eval_loss"), s.get("eval_round")) for s in sites},
        "curve": node_curve(run),
        "regions": report["regions"],
        "train_kw": next(iter(run["sites"].values()))["start"].get("train_kw"),
    }


# ---- the continuous site (in this process)


def continuous(seed: int, tokens: int, batch: int, eval_at: list[int]) -> list[tuple[int, float]]:
    """Train one site without pause until ``tokens`` (rounded down to whole steps of ``batch``
    sequences); (tokens, held-out loss) at each of ``eval_at`` (to the step below it) and at the end."""
    import torch

    from greenswarm.node.config import TrainConfig
    from greenswarm.node.data import DataConfig
    from greenswarm.node.distributed import World
    from greenswarm.node.evaluation import EvalConfig, HeldOut
    from greenswarm.node.global_eval import GlobalEvaluator
    from greenswarm.node.model import ModelConfig
    from greenswarm.node.trainer import InnerTrainer

    torch.manual_seed(seed)
    model = ModelConfig(preset="tiny", seed=seed)
    data = DataConfig(source="stdlib", seq_len=SEQ_LEN, seed=seed, sharding="claim", num_shards=SHARDS)
    train = TrainConfig(batch_size=batch, micro_batch_size=BATCH, threads=1, lr=1e-3, warmup_steps=20)
    trainer = InnerTrainer(model, data, train, World.from_environment("cpu"))
    for shard in range(SHARDS - 1):  # every training shard, in order; the last is held out
        trainer.batches.assign(shard, (0, 0, 0))
    evaluator = GlobalEvaluator(
        EvalConfig(batches=EVAL_BATCHES, batch_size=BATCH),
        model,
        HeldOut(EvalConfig(batches=EVAL_BATCHES, batch_size=BATCH), data, trainer.tokenizer),
        trainer.tokenizer.vocab_size,
        numel=sum(s.numel() for s in trainer.shapes),
        device="cpu",
    )
    per_step = batch * SEQ_LEN
    steps = tokens // per_step
    marks = sorted({min(steps, t // per_step) for t in eval_at} | {steps})
    curve, done = [], 0
    for mark in marks:
        while done < mark:
            trainer.step()
            done += 1
        curve.append((done * per_step, evaluator.loss_of(trainer.full_parameters())[0]))
    return curve


def _loss_at(curve: list[tuple[int, float]], tokens: float) -> float:
    """The continuous site's loss at ``tokens`` (its evaluations, linear between them)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][1]


def one_seed(seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from greenswarm.scheduler.energy import baseline_emissions_g
    from greenswarm.traces import load_trace

    began = time.perf_counter()
    swarm = describe_node_run(demo(workdir / f"seed-{seed}" / "swarm", seed, args))
    first = swarm["regions"][0]
    alone = describe_node_run(demo(workdir / f"seed-{seed}" / "windows-only", seed, args, regions=first))
    total = swarm["tokens"]
    every = max(BATCH * SEQ_LEN, total // 24)
    marks = [*range(every, total, every), alone["tokens"], total]
    runs: dict[str, Any] = {"swarm": swarm, "windows-only": alone}
    trace = load_trace(args.trace)
    for kind, batch in (("continuous", BATCH), ("continuous-3x", 3 * BATCH)):
        curve = continuous(seed, total, batch, marks)
        steps = curve[-1][0] / (batch * SEQ_LEN)
        seconds = steps * (batch / BATCH) * swarm["trace_s_per_step"]  # a step of 3x the batch takes 3x
        grams = baseline_emissions_g(trace, first, trace.start, trace.start + seconds, swarm["train_kw"])
        runs[kind] = {
            "eval_loss": curve[-1][1],
            "tokens": curve[-1][0],
            "emissions_g": grams,
            "tokens_per_kg": curve[-1][0] / (grams / 1000.0) if grams else None,
            "hours": seconds / 3600.0,
            "curve": [
                (t, t / (batch * SEQ_LEN) * (batch / BATCH) * swarm["trace_s_per_step"] / 3600.0, loss)
                for t, loss in curve
            ],  # fmt: skip
        }
    reference = runs["continuous"]["curve"]
    for run in runs.values():
        at = _loss_at([(t, loss) for t, _, loss in reference], run["tokens"])
        run["continuous_at_tokens"] = at
        run["ratio"] = run["eval_loss"] / at if run["eval_loss"] is not None else None
    return {"seed": seed, "runs": runs, "seconds": time.perf_counter() - began}


# ---- the report


def _spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}} .. {max(values):{fmt}})"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| run | tokens | held-out loss: median (min .. max) | vs continuous at equal tokens | "
        "tokens per kg CO2 | trace hours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        runs = [r["runs"][kind] for r in results]
        loss, ratio = (
            _spread([r["eval_loss"] for r in runs], ".4f"),
            _spread([r["ratio"] for r in runs], ".4f"),
        )
        per_kg, hours = (
            _spread([r["tokens_per_kg"] for r in runs], ",.0f"),
            _spread([r["hours"] for r in runs], ".1f"),
        )
        tokens = statistics.median(r["tokens"] for r in runs)
        lines.append(f"| {kind} | {tokens:,.0f} | {loss} | {ratio} | {per_kg} | {hours} |")
    lines.append("")
    for r in results:
        swarm = r["runs"]["swarm"]
        lines.append(
            f"seed {r['seed']}: swarm outer step {swarm['outer_round']} held by "
            f"{', '.join(swarm['held_by'] or [])}; "
            f"rounds {swarm['rounds']}; {swarm['tokens_not_averaged']:,} tokens not averaged; "
            f"each site's last global model: {swarm['site_losses']}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"swarm": "tab:green", "continuous": "tab:blue", "continuous-3x": "tab:purple",
              "windows-only": "tab:orange"}  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind in KINDS:
        for i, r in enumerate(results):
            curve = r["runs"][kind]["curve"]
            label = kind if i == 0 else None
            style = {"color": colors[kind], "alpha": 0.8, "lw": 1.2, "label": label}
            if kind in ("swarm", "windows-only"):  # a global model holds until the next outer step
                style["drawstyle"] = "steps-post"
            losses = [loss for _, _, loss in curve]
            left.plot([t for t, _, _ in curve], losses, **style)
            right.plot([h for _, h, _ in curve], losses, **style)
    left.set_xlabel("tokens trained (all sites)")
    right.set_xlabel("trace hours")
    for ax in (left, right):
        ax.set_ylabel("held-out loss of the global model")
        ax.grid(alpha=0.3)
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    left.legend()
    seeds = ", ".join(str(r["seed"]) for r in results)
    fig.suptitle(f"swarm vs one site, tiny model, anchor trace, seeds {seeds} (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=3.0, help="wall minutes of each demo run")
    parser.add_argument("--trace", default=_trace())
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the node's runs (greenswarm demo --set)")  # fmt: skip
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--png", help="draw held-out loss against tokens and trace hours here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--json-out", help="write the results as JSON to this file")
    parser.add_argument("--from-json", help="print and draw the results of an earlier --json-out")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())["results"]
    else:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-vs-single-"))
        results = []
        for seed in args.seeds:
            results.append(one_seed(seed, args, workdir))
            print(f"seed {seed}: {results[-1]['seconds']:.0f} s", file=sys.stderr)
    out = {
        "trace": getattr(args, "trace", None),
        "minutes": args.minutes,
        "set": args.set,
        "results": results,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out))
    if args.json:
        print(json.dumps(out))
    else:
        print(table(results))
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
