"""Sites of one, two and three ranks (torchrun, FSDP2 over gloo on the CPU) with different micro-batches
average in one swarm, in overlapped rounds (so the sharded rebase, every rank adding its shard of the
shift, runs too), each rank reading shards its site claimed through the DHT: every round all three
applied leaves them with the same global model, bit for bit, and they trained while their rounds ran;
then ``greenswarm export`` turns the three-rank site's checkpoint into a model transformers loads.

What must match across sites, and what may differ, is in docs/data.md ("Sites that differ").
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from greenswarm.node.round_log import read_rounds
from tests.conftest import Swarm, federated_rounds, shared_globals, site_config, wait_until, write_trace

pytestmark = pytest.mark.swarm

# a round every 6 wall s. The test stops the sites once they have shown what it asks (two rounds all three
# applied, each having trained through a round): 4-5 rounds on a quiet machine. The trace only bounds a
# failure: 16 rounds, for a three-rank site that steps slowly on 2 cores
SPEEDUP, HOURS = 300.0, 8
#: name -> (ranks, batch, micro-batch): one rank of 4, two of 4 in micro-batches of 2, three of 2 in 1s
SITES = {"one": (1, 4, 4), "two": (2, 8, 2), "three": (3, 6, 1)}


@pytest.mark.export
@pytest.mark.shards
@pytest.mark.overlap
def test_sites_of_one_two_and_three_ranks_average_together(swarm: Swarm, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * HOURS}, step_s=3600)
    peers = swarm.bootstrap()
    start_file = tmp_path / "start"
    for name, (ranks, batch, micro) in SITES.items():
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
        ]
        cfg = site_config(
            name,
            "GREEN",
            trace,
            peers,
            tmp_path / name,
            speedup=SPEEDUP,
            start_file=start_file,
            sync_s=1800.0,
            node={"keep_globals": 100},
            averaging={"overlap": True},
            # 6 readers in all, each holding the shard it reads and the next: 15 claimable shards
            data={"sharding": "claim", "num_shards": 16, "lease_s": 30.0, "claim_settle_s": 0.5},
            train={"batch_size": batch, "micro_batch_size": micro},
        )
        swarm.node(name, swarm.write_config(name, cfg), prefix=torchrun if ranks > 1 else None)
    end_wall = swarm.start_replay(list(SITES), start_file) + HOURS * 3600 / SPEEDUP

    def applied(name: str) -> list[dict]:
        path = tmp_path / name / "rounds.jsonl"
        return [r for r in read_rounds(path) if r["action"] == "apply"] if path.exists() else []

    def shown() -> bool:
        if any(swarm.procs[name].poll() is not None for name in SITES):
            return True  # (a site ended: the checks below say what it had not shown)
        together = [r for r in applied("one") if sorted(r["members"]) == sorted(SITES)]
        trained_meanwhile = all(sum(r["steps_meanwhile"] for r in applied(name)) > 0 for name in SITES)
        averaged = all(federated_rounds(tmp_path / name) >= 2 for name in SITES)
        return (
            averaged
            and trained_meanwhile
            and len(together) >= 2
            and len(shared_globals(tmp_path, list(SITES))) >= 2
        )

    wait_until(shown, end_wall - time.time(), "two rounds applied by all three sites")
    # (a stopping site ends its round in flight, measures and checkpoints: the three-rank torchrun site
    # gathers its shards to rank 0 and writes, one step at a time on 2 cores)
    codes = swarm.stop(*SITES, timeout=180)
    assert all(code == 0 for code in codes.values()), {name: swarm.log(name)[-4000:] for name in SITES}

    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in SITES}
    for name, (ranks, _, _) in SITES.items():
        assert summaries[name]["world_size"] == ranks
        assert summaries[name]["federated_rounds"] >= 2, summaries[name]
    # rounds all three took together, and every member holds the same global state after each
    rounds = {
        name: [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
        for name in SITES
    }
    together = [r for r in rounds["one"] if r["action"] == "apply" and sorted(r["members"]) == sorted(SITES)]
    assert len(together) >= 2, rounds["one"]
    digests: dict[tuple[int, str], set[str]] = {}
    for entry in itertools.chain.from_iterable(rounds.values()):
        if entry["action"] == "apply":
            digests.setdefault((entry["outer_round"], entry["lineage"]), set()).add(entry["digest"])
    assert all(len(d) == 1 for d in digests.values()), digests
    # ... bit for bit, sharded or not: the global models each kept after the same outer step
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for name in SITES:
        for path in (tmp_path / name / "globals").glob("outer-*.pt"):
            kept.setdefault(path.stem, {})[name] = torch.load(path)
    shared = {step: by_site for step, by_site in kept.items() if len(by_site) == len(SITES)}
    assert len(shared) >= 2, sorted(kept)
    for step, by_site in shared.items():
        first, *others = by_site.values()
        assert all(torch.equal(first, other) for other in others), step
    # the rounds ran beside training: sites took inner steps while their groups averaged
    for name in SITES:
        assert sum(e["steps_meanwhile"] for e in applied(name)) > 0, (name, applied(name))
    # each rank read shards of its own: a site of N ranks in N shards at least, and no token range of a
    # shard read twice. (A shard may pass from one site to another -- read to its epoch's end, or left
    # with its lease -- so "read by one site only" is not the rule; each range read once is.)
    journal = [
        json.loads(line)
        for name in SITES
        for line in (tmp_path / name / "shards.jsonl").read_text().splitlines()
    ]
    for name, (ranks, _, _) in SITES.items():
        assert len({line["shard"] for line in journal if line["site"] == name}) >= ranks, name
    for shard in {line["shard"] for line in journal}:
        chain = sorted((line for line in journal if line["shard"] == shard), key=lambda line: line["from"])
        for before, after in itertools.pairwise(chain):
            assert before["to"] <= after["from"], ("a token range read twice", before, after)

    # the sharded site's checkpoint exports like any other: transformers loads the global model it holds
    from transformers import AutoModelForCausalLM

    from greenswarm.node.checkpoint import Checkpointer
    from greenswarm.node.export import export_run
    from greenswarm.node.model import ModelConfig, build_model

    report = export_run(tmp_path / "three", tmp_path / "exported")
    assert report["outer_round"] == summaries["three"]["outer_round"]
    flat = Checkpointer(tmp_path / "three").load()["outer"][0]
    reference = build_model(ModelConfig(), 259)
    torch.nn.utils.vector_to_parameters(flat, reference.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    tokens = torch.arange(0, 120).reshape(2, -1)
    with torch.no_grad():
        diff = (loaded(input_ids=tokens).logits - reference.eval()(input_ids=tokens).logits).abs().max()
    assert diff.item() <= 1e-5, diff
