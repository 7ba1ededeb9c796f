"""Schedule-free sites in real processes: a sharded (torchrun, FSDP2 over gloo) trainer killed by SIGKILL
resumes its state bit for bit, and a swarm of a one-rank site and a late two-rank site averages x and z
(``train.sf_z: average``): the late site catches up by adopting both, every round leaves the two with
the same global state, and the export is x.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import Swarm, federated_rounds, shared_globals, site_config, wait_until, write_trace

pytestmark = pytest.mark.schedulefree

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
SF = {"optimizer": "adamw-schedulefree", "sf_z": "average", "warmup_steps": 5}


def test_a_sharded_site_killed_mid_run_resumes_its_optimizer_state_exactly(tmp_path: Path) -> None:
    """Two ranks train, checkpoint, train 4 more steps (their digests recorded), and are killed; a fresh
    pair loads the checkpoint and reproduces the same digests: schedule-free (with ScheduleFree+'s
    first moment) and AdamW alike."""
    probe = [*TORCHRUN, str(REPO / "tests" / "sf_resume_probe.py")]
    killed = subprocess.run(
        [*probe, "train", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert killed.returncode != 0, "the probe was to die by SIGKILL"
    resumed = subprocess.run(
        [*probe, "resume", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for optimizer in ("adamw-schedulefree", "adamw"):
        before = json.loads((tmp_path / optimizer / "digests.json").read_text())
        after = json.loads((tmp_path / optimizer / "resumed.json").read_text())
        assert after["saved"] == before["saved"], optimizer  # the state it resumed with
        assert after["later"] == before["later"], optimizer  # and the steps it took after


#: a round every 6 wall seconds; the sites' 3 hours together hold 6 rounds. It was 2 hours, 4 rounds: a
#: soak beside two busy processes lost 2 of them to hivemind's matchmaking race (early's search failed
#: while late's group took it in, so late's all-reduce waited out its parts; the round after, late was
#: still in that one) and early averaged 1 (docs/testing.md row 63). Each site must still average 2
SPEEDUP, HOURS = 300.0, 4


@pytest.mark.swarm
def test_schedule_free_sites_average_x_and_z_and_a_late_site_adopts_both(
    swarm: Swarm, tmp_path: Path
) -> None:
    trace = write_trace(
        tmp_path / "green.csv", {"EARLY": [10.0] * HOURS, "LATE": [900.0] + [10.0] * (HOURS - 1)}, step_s=3600
    )
    peers = swarm.bootstrap()
    start_file = tmp_path / "start"
    sites = {"early": ("EARLY", 1), "late": ("LATE", 2)}
    for name, (region, ranks) in sites.items():
        cfg = site_config(
            name,
            region,
            trace,
            peers,
            tmp_path / name,
            speedup=SPEEDUP,
            start_file=start_file,
            sync_s=1800.0,
            shard=0 if name == "early" else 1,
            shards=2,
            train={**SF, "batch_size": 4, "micro_batch_size": 2 if ranks > 1 else 4},
            node={"keep_globals": 100},
            averaging={"overlap": ranks > 1},  # (the sharded site rebases x and z while it trains)
        )
        swarm.node(name, swarm.write_config(name, cfg), prefix=TORCHRUN if ranks > 1 else None)
    end_wall = swarm.start_replay(list(sites), start_file) + HOURS * 3600 / SPEEDUP

    def shown() -> bool:
        """Both sites averaged twice, late adopted the swarm's state, and both kept two global states."""
        if any(swarm.procs[name].poll() is not None for name in sites):
            return True  # (a site ended: the checks below say what it had not shown)
        return (
            all(federated_rounds(tmp_path / name) >= 2 for name in sites)
            and "caught up with early" in swarm.log("late")
            and len(shared_globals(tmp_path, list(sites))) >= 2
        )

    # the trace only bounds a failure: the sites are stopped once the question is answered
    wait_until(shown, end_wall + 180 - time.time(), "two rounds averaged by both sites")
    codes = swarm.stop(*sites, timeout=180)
    assert all(code == 0 for code in codes.values()), {name: swarm.log(name)[-4000:] for name in sites}

    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in sites}
    assert summaries["late"]["world_size"] == 2
    assert summaries["late"]["catch_ups"] >= 1, summaries["late"]  # it adopted the swarm's x and z
    for name in sites:
        assert summaries[name]["federated_rounds"] >= 2, summaries[name]
    # every round's global state is the same at both, bit for bit, and holds x then z
    rounds = [
        json.loads(line)
        for name in sites
        for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()
    ]
    digests: dict[tuple[int, str], set[str]] = {}
    for entry in rounds:
        if entry["action"] == "apply":
            digests.setdefault((entry["outer_round"], entry["lineage"]), set()).add(entry["digest"])
    assert sum(len(d) == 1 for d in digests.values()) >= 2 and all(len(d) == 1 for d in digests.values()), (
        digests
    )
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for name in sites:
        for path in (tmp_path / name / "globals").glob("outer-*.pt"):
            kept.setdefault(path.stem, {})[name] = torch.load(path)
    shared = {step: by_site for step, by_site in kept.items() if len(by_site) == len(sites)}
    assert len(shared) >= 2, sorted(kept)
    for step, (a, b) in ((step, tuple(by_site.values())) for step, by_site in shared.items()):
        assert torch.equal(a, b), step
    # the late site's export is x, the first half of its global state
    from transformers import AutoModelForCausalLM

    from greenswarm.node.checkpoint import Checkpointer
    from greenswarm.node.export import export_run

    export_run(tmp_path / "late", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    exported = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = Checkpointer(tmp_path / "late").load()["outer"][0]
    assert state.numel() == 2 * exported.numel()
    assert torch.equal(exported, state[: exported.numel()])
    # z is not x: averaging z too carried something x alone would not
    assert not torch.equal(state[: exported.numel()], state[exported.numel() :])
