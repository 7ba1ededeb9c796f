"""A real site that ends its trainer between windows and starts it again (docs/release.md).

One bootstrap and one site replay a trace with two windows and a dirty hour between them, with
``release.mode: idle`` (release at each window's end). Between the windows the site's supervisor
(the agent) holds no trainer: no forked node, no p2pd. At the second window it forks the trainer
again, which resumes from the release's checkpoint with the same state digest, and the ledger books
the released stretch at ``energy.released_kw`` and the restart at training power.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from greenswarm.jsonlines import read_json_lines
from tests.conftest import Swarm, site_config, wait_until, write_trace

pytestmark = [pytest.mark.release, pytest.mark.swarm]

#: 15-minute steps: three windows (30 min, 1 h, 1 h) with a dirty hour after each of the first two
TRACE = {"A": [50.0] * 2 + [300.0] * 4 + [50.0] * 4 + [300.0] * 4 + [50.0] * 4 + [300.0]}
SPEEDUP = 360.0  # 10 wall seconds a clock hour


def _trainers(agent: psutil.Process) -> list[psutil.Process]:
    """The agent's children that are the site's trainer (a fork: the same command line) or its
    daemons."""
    out = []
    for child in agent.children(recursive=True):
        try:
            if child.cmdline() == agent.cmdline() or "p2pd" in child.name():
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_site_releases_between_windows_and_resumes_the_same_state(swarm: Swarm, tmp_path: Path) -> None:
    """First gap: the agent alone, then the same state back. Second gap: the release's checkpoint
    is damaged; the trainer falls back to the previous one and says so. Third window: the agent is
    killed; its trainer stops and leaves nothing."""
    trace = write_trace(tmp_path / "trace.csv", TRACE, step_s=900)
    start_file = tmp_path / "start"
    peers = swarm.bootstrap()
    run_dir = tmp_path / "site"
    cfg = site_config(
        "site", "A", trace, peers, run_dir, speedup=SPEEDUP, start_file=start_file, sync_s=600.0,
        release={"mode": "idle"},
    )  # fmt: skip
    swarm.node("site", swarm.write_config("site", cfg))
    swarm.start_replay(["site"], start_file)
    agent = psutil.Process(swarm.procs["site"].pid)
    journal = run_dir / "releases.jsonl"

    def events(kind: str) -> list[dict]:
        return [e for e in read_json_lines(journal) if e.get("event") == kind]

    rss = [0]  # the trainer's largest resident set in its first window

    def released() -> bool:
        for p in _trainers(agent):
            try:
                rss.append(p.memory_info().rss if "p2pd" not in p.name() else 0)
            except psutil.NoSuchProcess:
                pass
        return bool(events("release"))

    wait_until(released, 60, "the first release")
    wait_until(lambda: not _trainers(agent), 15, "the trainer and its daemons to end")
    if not events("restart"):  # (still released: the agent alone, holding no model)
        assert agent.memory_info().rss < max(rss), (agent.memory_info().rss, max(rss))

    wait_until(lambda: len(events("release")) == 2, 60, "the second release")
    (restart,) = events("restart")
    assert restart["state_digest"] == restart["state_digest_after"], restart
    assert restart["released_s"] > 0 and restart["restart_wall_s"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())  # (written at the second release)
    seconds, kwh = summary["seconds_by_state"], summary["kwh_by_state"]
    assert seconds["RELEASED"] > 0 and kwh["RELEASED"] == 0.0  # energy.released_kw: 0
    assert seconds["RESTARTING"] > 0
    assert kwh["RESTARTING"] == pytest.approx(2.024 * seconds["RESTARTING"] / 3600.0)

    checkpoint = run_dir / "checkpoint.pt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    wait_until(lambda: len(events("restart")) == 2, 60, "the second restart")
    log = swarm.log("site")
    assert "does not match its digest" in log or "is unreadable" in log
    assert "using the previous checkpoint" in log
    assert "starting the trainer again" in log and "IDLE -> RELEASED" in log

    trainers = _trainers(agent)
    assert trainers, "no trainer in the third window"
    os.kill(agent.pid, signal.SIGKILL)  # the agent alone
    swarm.procs["site"].wait()
    wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in trainers), 30,
               "the trainer of a killed agent to stop")  # fmt: skip
