"""A node killed with SIGKILL restarts from its last checkpoint: same outer step, same global model."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import Swarm, site_config, write_trace

pytestmark = pytest.mark.swarm


def _wait_for(swarm: Swarm, name: str, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, swarm.log(name))
        if match:
            return match
        assert swarm.procs[name].poll() is None, swarm.log(name)[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {name}'s log:\n{swarm.log(name)[-3000:]}")


def test_killed_node_resumes_round_count_and_parameters(swarm: Swarm, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * 12}, step_s=3600)  # 12 h, always in window
    peers = swarm.bootstrap()
    cfg = site_config(
        "site-a",
        "GREEN",
        trace,
        peers,
        tmp_path / "site-a",
        speedup=300.0,
        start_wall=time.time() + 8,
        sync_s=900.0,
    )
    config = swarm.write_config("site-a", cfg)

    swarm.node("site-a", config)
    _wait_for(swarm, "site-a", r"outer step 3 alone", timeout=120)
    swarm.kill("site-a", signal.SIGKILL)  # no chance to clean up: the checkpoint on disk is all there is

    saved = torch.load(tmp_path / "site-a" / "checkpoint.pt", weights_only=False)
    saved_round = saved["site"]["outer_round"]
    saved_digest = hashlib.sha256(saved["outer"][0].numpy().tobytes()).hexdigest()[:12]
    assert saved_round >= 3

    swarm.node("site-a-again", config)
    resumed = _wait_for(
        swarm,
        "site-a-again",
        r"resumed from \S+: outer step (\d+), (\d+) local steps, "
        r"global digest (\w+)",
        timeout=90,
    )
    assert int(resumed.group(1)) == saved_round
    assert int(resumed.group(2)) == saved["site"]["local_steps"]
    assert resumed.group(3) == saved_digest
    _wait_for(swarm, "site-a-again", rf"outer step {saved_round + 1} alone", timeout=90)  # and trains on

    swarm.kill("site-a-again", signal.SIGTERM)  # a clean stop: final checkpoint and summary
    assert swarm.wait("site-a-again", timeout=60) == 0
    summary = json.loads((tmp_path / "site-a" / "summary.json").read_text())
    assert summary["outer_round"] >= saved_round + 1
