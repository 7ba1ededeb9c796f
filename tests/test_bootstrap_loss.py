"""The bootstrap peer dies and comes back (issue #6): sites that reach each other keep averaging, and
after the restart -- same identity, same address -- every site is listed again."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from greenswarm.node.round_log import read_rounds
from tests.conftest import Swarm, free_port, site_config, wait_until, write_trace

pytestmark = [pytest.mark.swarm, pytest.mark.faults]

AVERAGED = re.compile(r"outer step \d+ averaged with 1 site")


def _averaged(swarm: Swarm, name: str) -> int:
    return len(AVERAGED.findall(swarm.log(name)))


def _failures(run_dir: Path, killed_at: float, restarted_at: float) -> str:
    """A site's failed rounds: each one's slot, its time from the kill and from the restart, and why."""
    lines = [
        f"slot {r['slot']}: {r['wall_time'] - killed_at:+.1f} s from the kill, "
        f"{r['wall_time'] - restarted_at:+.1f} s from the restart, round {r['round_s']} s: {r['reason']}"
        for r in read_rounds(run_dir / "rounds.jsonl")
        if r["action"] == "fail"
    ]
    return "failed rounds:\n" + "\n".join(lines)


def test_sites_survive_the_bootstrap_and_reregister(swarm: Swarm, tmp_path: Path) -> None:
    listen = f"/ip4/127.0.0.1/tcp/{free_port()}"
    peers = swarm.bootstrap("bootstrap", listen=listen, key="boot.key")
    # always green, and longer than the scenario ever takes (40 h: 480 s at 300x): the sites train until
    # the test has seen what it waits for and stops them, however slow the machine is
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * 40}, step_s=3600)
    start = tmp_path / "start"
    sites = ["site-a", "site-b"]
    for i, name in enumerate(sites):
        cfg = site_config(name, "GREEN", trace, peers, tmp_path / name, speedup=300.0, start_file=start,
                          sync_s=900.0, shard=i, shards=2, node={"rejoin_s": 2.0})  # fmt: skip
        swarm.node(name, swarm.write_config(name, cfg))
    swarm.start_replay(sites, start)
    wait_until(lambda: all(_averaged(swarm, n) >= 1 for n in sites), 90, "a first averaged round")

    killed_at = time.time()
    swarm.kill("bootstrap", signal.SIGKILL)  # the entry point is gone, daemon and all
    at_kill = {n: _averaged(swarm, n) for n in sites}
    wait_until(
        lambda: all(_averaged(swarm, n) >= at_kill[n] + 2 for n in sites), 40, "rounds without the bootstrap"
    )

    restarted_at = time.time()
    again = swarm.bootstrap("bootstrap-again", listen=listen, key="boot.key")  # same identity, same address
    assert again == peers
    listed: list = []

    def both_listed() -> bool:
        nonlocal listed
        out = swarm.run("progress", "--initial-peers", *again, "--swarm", "test", "--json")
        listed = json.loads(out.stdout) if out.returncode == 0 else []
        return sorted(r["site"] for r in listed) == sites

    try:  # (each try is a new `greenswarm progress`: seconds apiece on a loaded machine)
        wait_until(both_listed, 90, "both sites listed through the restarted bootstrap")
    except AssertionError as e:
        raise AssertionError(f"{e} (last listed: {listed})") from None
    for name in sites:
        os.kill(swarm.procs[name].pid, signal.SIGTERM)  # `kill PID`: a clean stop, summary written
    for name in sites:
        assert swarm.wait(name, timeout=120) == 0, swarm.log(name)[-3000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["federated_rounds"] >= at_kill[name] + 2, summary
        # rounds around the kill may fail, and say so (a failure shows when each failed, and why)
        assert summary["failed_rounds"] <= 2, _failures(tmp_path / name, killed_at, restarted_at)
