"""Every long-running command ends cleanly on SIGINT/SIGTERM, and nothing it started outlives it.

All commands run at once (one swarm, real processes): a site node stopped with ``kill PID`` (SIGTERM to
its supervisor alone, which passes it on; the node that was restarted after a crash, below) and one with
Ctrl-C (SIGINT to its whole process group), ``progress --watch``, the demo (whose sites live in sessions
of their own) and a bootstrap peer, each with ``kill PID``. Each must exit by itself with a clean
status, every process it had started (hivemind's helpers, p2pd daemons, the demo's site nodes) must be
gone, and a node must leave its final checkpoint and summary. Deaths without a word: a node killed with
SIGKILL (``node.restart: never``, the node's process alone) must not leave its helpers behind -- they
notice their parent is gone and end themselves and their daemon; a supervised node whose node process is
killed is forked again at once and resumes from its checkpoint; a node whose supervisor is killed stops
cleanly.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from greenswarm.node.checkpoint import Checkpointer
from tests.conftest import TEST_STEPS_PER_S, Swarm, site_config, wait_until, write_trace

pytestmark = [pytest.mark.swarm, pytest.mark.faults]

CLEAN = (0, 130)  # a finished command, or one interrupted (130: what a shell reports for Ctrl-C)


def _alive(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {proc.name()}")
        except psutil.NoSuchProcess:
            continue
    return alive


def test_commands_stop_cleanly_and_leave_nothing(swarm: Swarm, tmp_path: Path) -> None:
    # the demo first: it starts a bootstrap and then its three sites, the slowest start of all, and the
    # nodes train once they are up (a node stopped with kill PID is node-crash, after its
    # restart: a node-term beside it did only what node-crash does, for one more training process)
    pace = f"train.max_steps_per_s={TEST_STEPS_PER_S}"
    swarm.command(
        "demo", "demo", "--no-live", "--minutes", "3", "--workdir", str(tmp_path / "demo"), "--set", pace
    )
    peers = swarm.bootstrap("entry")
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * 24}, step_s=3600)
    start = time.time() + 4
    nodes = ("node-int", "node-kill", "node-crash", "node-orphan")
    for i, name in enumerate(nodes):
        restart = "never" if name == "node-kill" else "on-crash"
        cfg = site_config(name, "GREEN", trace, peers, tmp_path / name, speedup=300.0, start_wall=start,
                          sync_s=600.0, shard=i, shards=len(nodes), node={"restart": restart})  # fmt: skip
        swarm.node(name, swarm.write_config(name, cfg))
    swarm.command("progress", "progress", "--initial-peers", *peers, "--swarm", "test", "--watch", "1")
    swarm.bootstrap("other")

    wait_until(lambda: all("first training step" in swarm.log(n) for n in nodes), 90, "the nodes to train")
    wait_until(lambda: "node-int" in swarm.log("progress"), 60, "progress to list a site")
    demo_logs = tmp_path / "demo" / "logs"
    wait_until(
        lambda: len([p for p in demo_logs.glob("*.log") if "joined swarm" in p.read_text()]) == 3,
        90,
        "the demo's sites to join",
    )
    started = {
        name: [c.pid for c in psutil.Process(swarm.procs[name].pid).children(recursive=True)]
        for name in (*nodes, "progress", "demo", "other")
    }
    assert all(started.values()), started  # each has helpers (and daemons) that must not be left

    pid = swarm.procs
    # (a node killed before its first checkpoint -- written with its first round -- starts afresh, which
    # benchmarks/restart_soak.py and docs/testing.md cover; here it must resume from one)
    wait_until(
        lambda: (tmp_path / "node-crash" / "checkpoint.pt").exists(), 60, "node-crash's first checkpoint"
    )
    (crashed,) = psutil.Process(pid["node-crash"].pid).children()  # the node under its supervisor
    crashed.kill()  # a crash: the supervisor forks a new node, which resumes from the checkpoint
    wait_until(lambda: swarm.log("node-crash").count("first training step") == 2, 60, "the node's restart")
    assert "the node died (SIGKILL); restarting it" in swarm.log("node-crash")
    assert re.search(r"resumed from \S+checkpoint.pt", swarm.log("node-crash"))
    # the restarted node's helpers and daemon must be gone after its stop too (the first node's died)
    started["node-crash"] = [c.pid for c in psutil.Process(pid["node-crash"].pid).children(recursive=True)]
    orphaned = [c.pid for c in psutil.Process(pid["node-orphan"].pid).children(recursive=True)]
    os.kill(pid["node-orphan"].pid, signal.SIGKILL)  # the supervisor: its node must stop by itself
    swarm.kill("node-int", signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
    os.kill(pid["node-kill"].pid, signal.SIGKILL)  # the node alone, no chance to clean up
    for name in ("progress", "demo", "other"):
        os.kill(pid[name].pid, signal.SIGTERM)

    os.kill(pid["node-crash"].pid, signal.SIGTERM)  # kill PID: the supervisor passes it on
    for name in ("node-int", "node-crash", "progress", "demo", "other"):
        code = swarm.wait(name, timeout=60)
        assert code in CLEAN, f"{name} exited with {code}:\n{swarm.log(name)[-2000:]}"
    wait_until(lambda: not _alive(orphaned), 30, f"node-orphan's processes to end: {_alive(orphaned)}")
    for name, pids in started.items():
        wait_until(lambda pids=pids: not _alive(pids), 15, f"{name}'s processes to end: {_alive(pids)}")

    for name in ("node-int", "node-crash", "node-orphan"):  # a clean stop: final files
        assert Checkpointer(tmp_path / name).load() is not None
        assert (tmp_path / name / "summary.json").exists()
        stopped = r"received SIG(TERM|INT): finishing cleanly|the supervising process is gone"
        assert re.search(stopped, swarm.log(name))
    assert not (tmp_path / "node-kill" / "summary.json").exists()
