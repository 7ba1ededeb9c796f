"""A real site that ends its trainer between windows and starts it again (docs/release.md).

One bootstrap and one site replay a trace with two windows and a dirty hour between them, with
``release.mode: idle`` (release at each window's end). Between the windows the site's supervisor
(the agent) holds no trainer: no forked node, no p2pd. At the second window it forks the trainer
again, which resumes from the release's checkpoint with the same state digest, and the ledger books
the released stretch at ``energy.released_kw`` and the restart at training power.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from greenswarm.jsonlines import read_json_lines
from tests.conftest import Swarm, site_config, wait_until, write_trace

pytestmark = [pytest.mark.release, pytest.mark.swarm]

#: 15-minute steps: clean 30 min, dirty 1 h, clean 1 h, dirty 15 min
TRACE = {"A": [50.0, 50.0, 300.0, 300.0, 300.0, 300.0, 50.0, 50.0, 50.0, 50.0, 300.0]}
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
    trainer_rss = max(rss)
    wait_until(lambda: not _trainers(agent), 15, "the trainer and its daemons to end")
    if not events("restart"):  # (still released: the agent alone)
        agent_rss = agent.memory_info().rss
        assert agent_rss < trainer_rss, (agent_rss, trainer_rss)
    assert swarm.wait("site", timeout=120) == 0, swarm.log("site")[-3000:]

    log = swarm.log("site")
    (restart,) = events("restart")
    assert restart["state_digest"] == restart["state_digest_after"], restart
    assert restart["released_s"] > 0 and restart["restart_wall_s"] > 0
    assert len(events("release")) == 2  # each window's end (the trace ends in the second gap)
    assert "starting the trainer again" in log and "IDLE -> RELEASED" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    seconds, kwh = summary["seconds_by_state"], summary["kwh_by_state"]
    assert seconds["RELEASED"] > 0 and kwh["RELEASED"] == 0.0  # energy.released_kw: 0
    assert seconds["RESTARTING"] > 0
    assert kwh["RESTARTING"] == pytest.approx(2.024 * seconds["RESTARTING"] / 3600.0)
