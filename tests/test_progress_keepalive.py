"""A site's progress record stays alive while its loop is busy in a round, and only that long.

In-process, with a fake DHT that records writes: no p2pd, no network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import psutil

from greenswarm.node.progress import ProgressPublisher, ProgressRecord, record_validators
from tests.conftest import wait_until


class FakeDHT:
    """Stands in for hivemind's DHT: keeps every store (key, subkey, value, expiration)."""

    def __init__(self) -> None:
        self.writes: list[dict] = []
        self.lock = threading.Lock()

    def store(self, key, subkey, value, expiration_time, return_future=False):  # noqa: ANN001
        with self.lock:
            self.writes.append({"key": key, "value": value, "expires": expiration_time})
        return None


def _record(steps: int) -> ProgressRecord:
    return ProgressRecord(
        site="a", region="R", state="FEDERATED", peer_id="p", outer_round=0, lineage="l", round_index=0,
        local_steps=steps, tokens=0, loss=None, window_end=None, energy_kwh=0.0, emissions_g=0.0,
        clock_time=0.0, wall_time=0.0,
    )  # fmt: skip


def _publisher(dht: FakeDHT, keepalive_s: float) -> ProgressPublisher:
    return ProgressPublisher(
        dht, "s", record_validators("s"), refresh_s=0.05, ttl_s=0.4, keepalive_s=keepalive_s
    )


def test_a_busy_loop_keeps_its_last_record_alive_until_it_is_closed() -> None:
    dht = FakeDHT()
    publisher = _publisher(dht, keepalive_s=60.0)
    publisher.maybe_publish(lambda: _record(7), force=True)
    # the loop is now busy (a round): the keep-alive writes the same record again, with a new expiry
    wait_until(lambda: len(dht.writes) >= 4, timeout=10, what="keep-alive writes")
    publisher.close()
    assert not publisher._thread.is_alive()  # closed: nothing writes the record any more
    assert all(w["value"]["local_steps"] == 7 for w in dht.writes)
    assert dht.writes[-1]["expires"] > dht.writes[0]["expires"]


def test_the_keepalive_writes_only_when_due_and_only_for_keepalive_s() -> None:
    publisher = _publisher(FakeDHT(), keepalive_s=1.0)
    assert not publisher.keepalive_due(time.monotonic())  # nothing published yet
    publisher.maybe_publish(lambda: _record(1), force=True)
    publisher.close()  # freeze the state: on a slow machine the thread could write again meanwhile
    made, stored = publisher._made, publisher._stored
    assert not publisher.keepalive_due(stored + 0.01)  # just written: not due
    assert publisher.keepalive_due(stored + 0.06)  # a refresh period later, the loop still busy: due
    assert not publisher.keepalive_due(made + 1.5)  # the loop has not come back for keepalive_s: expire


def test_no_keepalive_no_thread() -> None:
    dht = FakeDHT()
    publisher = _publisher(dht, keepalive_s=0.0)
    publisher.maybe_publish(lambda: _record(1), force=True)
    assert publisher._thread is None and len(dht.writes) == 1


class UnansweredDHT:
    """A DHT read that a frozen peer holds up: a blocking read answers (nothing), a read as a future
    never does until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.blocking = 0  # blocking reads (the view's background poll)

    def get(self, key, latest=False, return_future=False):  # noqa: ANN001
        if not return_future:
            self.blocking += 1
            return None
        dht = self

        class Unanswered(Future):
            def cancel(self) -> bool:
                dht.cancelled += 1
                return super().cancel()

        return Unanswered()


def test_a_poll_at_a_rounds_boundary_gives_up_and_keeps_the_last_view() -> None:
    """A peer that does not answer held each boundary's poll for the DHT's own timeout (seconds), so a
    site began its rounds late, or not at all (a test that froze a peer saw a round skipped)."""
    from greenswarm.node.swarm_view import SwarmView

    dht = UnansweredDHT()
    view = SwarmView(dht, "s", "me", poll_s=3600.0)
    try:
        wait_until(lambda: dht.blocking == 1, 10, "the background's first poll")  # (then it sleeps)
        view._records = [_record(1)]  # what the last poll read
        began = time.monotonic()
        view.poll_now(timeout_s=0.2)
        assert time.monotonic() - began < 2.0 and dht.cancelled == 1
        assert view._records == [_record(1)]
    finally:
        view.close()


class PendingDHT(FakeDHT):
    """A DHT process (``pid``) whose writes never complete: its p2p daemon does not answer."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def store(self, key, subkey, value, expiration_time, return_future=False):  # noqa: ANN001
        super().store(key, subkey, value, expiration_time)
        return Future()


def test_the_last_record_is_not_waited_for_once_the_p2p_daemon_is_gone(tmp_path: Path) -> None:
    """A stop to the whole process group (Ctrl-C) ends the p2p daemon too: the site's last record can
    no longer arrive, and its wait held every such stop for the write's whole timeout (5 s)."""
    daemon = tmp_path / "p2pd"  # a process the DHT's owner counts as its p2p daemon, by name
    shutil.copy(shutil.which("sleep") or "/bin/sleep", daemon)
    # the DHT's process lives on after its daemon is gone, as hivemind's does
    code = f"import subprocess, time; subprocess.Popen([{str(daemon)!r}, '60']); time.sleep(60)"
    dht_process = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until(lambda: psutil.Process(dht_process.pid).children(), timeout=10, what="the daemon")
        publisher = _publisher(PendingDHT(dht_process.pid), keepalive_s=0.0)
        began = time.monotonic()
        publisher.publish_final(_record(3), lives_s=1.0, timeout=1.0)  # the daemon lives: waited for
        assert time.monotonic() - began >= 1.0
        (daemon_process,) = psutil.Process(dht_process.pid).children()
        daemon_process.kill()  # (a zombie until its parent reaps it: exited, all the same)
        wait_until(lambda: daemon_process.status() == psutil.STATUS_ZOMBIE, timeout=10, what="its end")
        began = time.monotonic()
        publisher.publish_final(_record(4), lives_s=1.0, timeout=30.0)
        assert time.monotonic() - began < 5.0  # gone: not waited for
        assert dht_process.poll() is None  # (the DHT's process itself still runs)
        assert [w["value"]["local_steps"] for w in publisher.dht.writes] == [3, 4]  # both were sent
    finally:
        dht_process.kill()
        dht_process.wait()
