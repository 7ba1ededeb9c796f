"""The bootstrap peer keeps its identity across restarts and exits cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import psutil
import pytest

from tests.conftest import Swarm, dump_stacks

pytestmark = pytest.mark.swarm


def test_bootstrap_keeps_identity_and_exits_cleanly(swarm: Swarm, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the group) here; SIGTERM to the peer alone is in tests/test_shutdown.py."""
    first = swarm.bootstrap("boot-1")
    key = tmp_path / "boot-1.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # `kill -USR1` prints every thread's stack into the log and the peer goes on: it and its DHT
    # process answer, its p2pd daemon is not asked; the clean exit below shows nothing was harmed
    daemons = [
        p for p in psutil.Process(swarm.procs["boot-1"].pid).children(recursive=True) if p.name() == "p2pd"
    ]
    assert dump_stacks(swarm.procs["boot-1"].pid) == 2 and daemons
    assert swarm.log("boot-1").count("most recent call first") >= 2, swarm.log("boot-1")[-3000:]
    assert swarm.procs["boot-1"].poll() is None and all(p.is_running() for p in daemons)
    swarm.kill("boot-1", signal.SIGINT)
    assert swarm.wait("boot-1", timeout=30) == 0  # clean exit; the fixture checks no p2pd is left

    key.rename(tmp_path / "boot-2.key")  # the same identity file, used by a new process
    second = swarm.bootstrap("boot-2")
    peer_id = first[0].rsplit("/p2p/", 1)[1]
    assert second[0].rsplit("/p2p/", 1)[1] == peer_id
    swarm.kill("boot-2", signal.SIGTERM)
    assert swarm.wait("boot-2", timeout=30) == 0
