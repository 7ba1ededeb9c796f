"""A site's entry-point check (:class:`EntryWatch`) answers every time, even when the garbage collector
runs in the DHT process while the check waits on the p2p daemon, and it re-joins a bootstrap that came
back (issue #22: a collected check never answered, so that site never re-joined).

Real DHTs and p2p daemons on 127.0.0.1, in a Python process of the test's own (so nothing a hard kill
leaves behind stays in pytest's process); the bootstrap is killed hard (process and daemon), then
started again with the same identity and address."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.network import start_dht
from greenswarm.node.rejoin import EntryWatch
from tests.conftest import REPO, free_port, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.faults]

CHECKS = 12  # before the fix, a check was lost within the first two or three of these


async def _collect(_dht: Any, _node: Any) -> int:
    """The fault: a full garbage collection in the DHT process, at whatever point a check has reached."""
    return gc.collect()


def _kill_hard(dht: Any) -> None:
    """As SIGKILL would: the DHT's process and its p2p daemon, with no goodbye to anyone.

    The DHT process is reaped through its own ``multiprocessing`` handle (``join``), not by psutil:
    a handle whose child someone else reaped still believes it alive, and later polls (every
    ``Process.start``) and terminates (at exit, or when hivemind's ``__del__`` shuts it down) its pid.
    By then the pid can belong to another of this process's children (``pid_max`` is 32768 here)."""
    for child in psutil.Process(dht.pid).children(recursive=True):
        child.kill()
    os.kill(dht.pid, signal.SIGKILL)
    dht.join(10)
    assert not dht.is_alive()


def _checks_while_collecting(site: Any, watch: EntryWatch, count: int) -> None:
    """Run ``count`` checks, collecting garbage in the DHT process again and again while each is out
    (one collection at a time: a full one takes a while in a process that holds torch)."""
    target = watch.checks + count
    deadline = time.monotonic() + count * (watch.period_s + watch.CHECK_TIMEOUT_S) + 30
    collecting = None
    while watch.checks < target:
        watch.poll()
        if collecting is None or collecting.done():
            collecting = site.run_coroutine(_collect, return_future=True)
        # a check is bounded by CHECK_TIMEOUT_S in the DHT process; one lost to the collector never answers
        limit = watch.CHECK_TIMEOUT_S + 10
        lost = watch._probe is not None and time.monotonic() - watch._started > limit
        assert not lost, f"check {watch.checks + 1}: no answer in {limit:.0f} s (answered: {watch.checks})"
        assert time.monotonic() < deadline, f"only {watch.checks - target + count} of {count} checks ran"
        time.sleep(0.05)


def scenario(workdir: str) -> None:
    """The whole scenario; runs in a Python process of its own (see the test below)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    listen = f"/ip4/127.0.0.1/tcp/{free_port()}"
    key = Path(workdir) / "boot.key"
    load_or_create_identity(key)
    boot = start_dht([], host_maddrs=[listen], identity_path=str(key))
    peers = [str(a) for a in boot.get_visible_maddrs()]
    site = start_dht(peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    again = None
    try:
        watch = EntryWatch(site, peers, period_s=0.2)
        _checks_while_collecting(site, watch, 2)  # connected: nothing to report
        assert watch.rejoins == 0

        _kill_hard(boot)
        _checks_while_collecting(site, watch, CHECKS)  # every one dials a dead address, and answers

        again = start_dht([], host_maddrs=[listen], identity_path=str(key))  # same identity and address
        assert [str(a) for a in again.get_visible_maddrs()] == peers

        def rejoined() -> bool:
            _checks_while_collecting(site, watch, 1)
            return watch.rejoins >= 1

        wait_until(rejoined, 60, "the site re-joining the bootstrap that came back")
        print(f"SCENARIO PASSED: {watch.checks} checks, {watch.rejoins} re-join(s)", flush=True)
    finally:
        for dht in (site, again):
            if dht is not None:
                dht.shutdown()


def test_checks_always_answer_and_a_returning_bootstrap_is_rejoined(tmp_path: Path) -> None:
    # in a process of its own: killing a DHT process and forcing collections leave nothing in pytest's
    # process that a later test (one that starts and signals commands) could trip over
    code = f"from tests.test_entry_watch import scenario; scenario({str(tmp_path)!r})"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "SCENARIO PASSED" in out, out[-4000:]
    assert "no initial peer is reachable" in out, out[-4000:]
