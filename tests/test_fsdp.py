"""A two-rank FSDP2 site (torchrun, gloo, CPU) joins a swarm with a one-rank site and averages with it,
in overlapped rounds (so the sharded rebase, every rank adding its shard of the shift, runs too); then
``greenswarm export`` turns the sharded site's checkpoint into a model transformers loads."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import Swarm, site_config, write_trace

pytestmark = pytest.mark.swarm

SPEEDUP, HOURS = 300.0, 2


@pytest.mark.export
def test_two_rank_fsdp_site_averages_with_a_one_rank_site(swarm: Swarm, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * HOURS}, step_s=3600)
    peers = swarm.bootstrap()
    start_file = tmp_path / "start"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for name, shard, prefix in (("site-fsdp", 0, torchrun), ("site-single", 1, None)):
        cfg = site_config(
            name,
            "GREEN",
            trace,
            peers,
            tmp_path / name,
            speedup=SPEEDUP,
            start_file=start_file,
            sync_s=900.0,
            shard=shard,
            shards=2,
            node={"keep_globals": 100},
            averaging={"overlap": True},
        )
        swarm.node(name, swarm.write_config(name, cfg), prefix=prefix)
    end_wall = swarm.start_replay(["site-fsdp", "site-single"], start_file) + HOURS * 3600 / SPEEDUP
    for name in ("site-fsdp", "site-single"):
        assert swarm.wait(name, timeout=end_wall + 120 - time.time()) == 0, swarm.log(name)[-4000:]

    fsdp = json.loads((tmp_path / "site-fsdp" / "summary.json").read_text())
    single = json.loads((tmp_path / "site-single" / "summary.json").read_text())
    assert fsdp["world_size"] == 2 and single["world_size"] == 1
    assert fsdp["federated_rounds"] >= 2 and single["federated_rounds"] >= 2, (fsdp, single)
    # after a shared round both hold the same global model, though one is sharded over two ranks
    shared = 0
    for path in (tmp_path / "site-fsdp" / "globals").glob("outer-*.pt"):
        other = tmp_path / "site-single" / "globals" / path.name
        if other.exists():
            assert torch.allclose(torch.load(path), torch.load(other), atol=5e-4, rtol=0), path.name
            shared += 1
    assert shared >= 2

    # the sharded site's checkpoint exports like any other: transformers loads the global model it holds
    from transformers import AutoModelForCausalLM

    from greenswarm.node.checkpoint import Checkpointer
    from greenswarm.node.export import export_run
    from greenswarm.node.model import ModelConfig, build_model

    report = export_run(tmp_path / "site-fsdp", tmp_path / "exported")
    assert report["outer_round"] == fsdp["outer_round"]
    flat = Checkpointer(tmp_path / "site-fsdp").load()["outer"][0]
    reference = build_model(ModelConfig(), 259)
    torch.nn.utils.vector_to_parameters(flat, reference.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    tokens = torch.arange(0, 120).reshape(2, -1)
    with torch.no_grad():
        diff = (loaded(input_ids=tokens).logits - reference.eval()(input_ids=tokens).logits).abs().max()
    assert diff.item() <= 1e-5, diff
