"""Measure a site's checkpointed global model again, in a process of its own, as the site measured it.

``python -m tests._remeasure CONFIG.yaml ...`` prints one JSON line per site config: the outer step and
lineage of the newest checkpoint in its ``node.run_dir`` and the held-out loss of its global model,
measured by the node's own :class:`~greenswarm.node.global_eval.GlobalEvaluator` on the site's held-out
set at the site's thread count. ``test_demo`` compares it with the loss the site published for that
model: a loss is a property of the model, not of the process that measured it (global_eval.py).
"""

from __future__ import annotations

import json
import sys

import torch

from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import load_site_config
from greenswarm.node.evaluation import HeldOut
from greenswarm.node.global_eval import GlobalEvaluator
from greenswarm.node.model import build_model
from greenswarm.node.tokenizer import load_tokenizer


def remeasure(config: str) -> dict[str, object]:
    cfg = load_site_config(config)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # (the site's own: a sum's order can depend on it)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    numel = sum(p.numel() for p in build_model(cfg.model, tokenizer.vocab_size).parameters())
    evaluator = GlobalEvaluator(
        cfg.eval, cfg.model, HeldOut(cfg.eval, cfg.data, tokenizer), tokenizer.vocab_size, numel, "cpu"
    )
    payload = Checkpointer(cfg.node.run_dir).load()
    assert payload is not None, f"{cfg.node.run_dir}: no checkpoint"
    loss, tokens = evaluator.loss_of(payload["outer"][0])
    site = payload["site"]
    return {"outer_round": site["outer_round"], "lineage": site["lineage"], "loss": loss, "tokens": tokens}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(json.dumps(remeasure(path)), flush=True)
