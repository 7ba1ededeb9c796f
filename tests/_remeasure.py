"""Measure a site's checkpointed global model again, in a process of its own, as the site measured it.

``python -m tests._remeasure [--set KEY=VALUE ...] CONFIG.yaml ...`` prints one JSON line per site
config (with the overrides its site was started with): the outer step and lineage of the newest
checkpoint in its ``node.run_dir`` and the held-out loss of its global model, measured by the node's
own :class:`~greenswarm.node.global_eval.GlobalEvaluator` on the site's held-out set, at the site's
thread count and on the device its site measures on (a GPU's last bits may differ from a CPU's).
``test_demo`` compares it with the loss the site published for that model: a loss is a property of the
model, not of the process that measured it (global_eval.py). Each line starts ``REMEASURED`` (a
library that prints is not read as a result).
"""

from __future__ import annotations

import argparse
import json

import torch

from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import load_site_config
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import HeldOut
from greenswarm.node.global_eval import GlobalEvaluator
from greenswarm.node.model import build_model
from greenswarm.node.tokenizer import load_tokenizer


def remeasure(config: str, overrides: list[str]) -> dict[str, object]:
    cfg = load_site_config(config, overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # (the site's own: a sum's order can depend on it)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    numel = sum(p.numel() for p in build_model(cfg.model, tokenizer.vocab_size).parameters())
    device = cfg.eval.device  # (as the site's: auto is where its one rank trains)
    if device == "auto":
        device = World.from_environment(cfg.train.device).device
    evaluator = GlobalEvaluator(
        cfg.eval, cfg.model, HeldOut(cfg.eval, cfg.data, tokenizer), tokenizer.vocab_size, numel, device
    )
    payload = Checkpointer(cfg.node.run_dir).load()
    assert payload is not None, f"{cfg.node.run_dir}: no checkpoint"
    loss, tokens = evaluator.loss_of(payload["outer"][0].to(device))
    site = payload["site"]
    return {"outer_round": site["outer_round"], "lineage": site["lineage"], "loss": loss, "tokens": tokens}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()
    for path in args.configs:
        print("REMEASURED " + json.dumps(remeasure(path, args.overrides)), flush=True)
