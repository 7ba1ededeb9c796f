"""Restart a crashed node at once, from a process that has already paid for the imports.

A node killed by a signal it did not ask for -- the OOM killer, a segfault in a kernel, ``kill -9`` --
must come back quickly: until it does, its window goes unused and its group is one site short.
Starting a fresh Python costs about 5 s on a small machine before the first training step (torch,
hivemind and transformers imports), more than the rest of a restart together. So ``greenswarm
node`` runs as a small supervisor that imports everything once, then forks the node; when the node
dies by a signal, the supervisor reaps whatever the node left behind (it is a child subreaper, so
orphaned helpers and p2pd daemons are reparented to it) and forks a new node at once, which resumes
from its checkpoint (``node.restart: on-crash``, the default).

Only deaths by a signal are restarted. A node that *exits* -- done, stopped, or failed with an
error that would recur (a bad config, a missing corpus) -- ends the supervisor with the same status.
More than ``node.max_restarts`` crashes within ``node.restart_window_s`` end it too (status 1), so
a crash loop is reported rather than hidden. SIGINT/SIGTERM/SIGHUP are passed to the node, which
stops cleanly; the supervisor then exits with the node's status.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from greenswarm.hivemind_internals import fresh_future_locks
from greenswarm.node.releasing import RELEASED_EXIT
from greenswarm.procs import reap_children, restore_or_settle

log = logging.getLogger("greenswarm.supervisor")

PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # passed on to the node
#: seconds a released site's presence gets to leave the swarm when the window opens before it is
#: killed (it holds nothing that must be saved; a presence still joining the swarm leaves at once)
PRESENCE_STOP_S = 5.0


def become_subreaper() -> bool:
    """Let orphaned descendants be reparented to this process (Linux), so it can reap them."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def supervise(
    run_node: Callable[[], int],
    max_restarts: int,
    window_s: float,
    preload: Callable[[], Any] | None = None,
    released: Callable[[Callable[[], bool]], bool] | None = None,
    presence: Callable[[], int] | None = None,
) -> int:
    """Run ``run_node`` in a forked child and fork a new one whenever it dies by a signal.

    ``preload`` runs once, here, before the first fork (imports); it must not start threads, which
    a fork would not carry over. A node that exits with
    :data:`~greenswarm.node.releasing.RELEASED_EXIT` ended its trainer for a gap between windows:
    ``released`` (given a function that says whether a stop was asked for) waits here, holding no
    model, until the next window (True: fork the node again) or the end (False: exit 0), while
    ``presence`` (:mod:`greenswarm.node.presence`) runs in a forked child for the gap: the site's
    record and its last global state in the swarm.
    """
    if preload is not None:
        preload()
    become_subreaper()
    stopping: list[int] = []
    child = 0

    def forward(signum: int, _frame: object) -> None:
        """Pass a stop to the node, or note it while there is none (between nodes, while released)."""
        stopping.append(signum)
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    crashes = CrashBudget(max_restarts, window_s)
    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}  # for this whole life
    leaving: BaseException | None = None
    try:
        while True:
            _collect_exited()  # what ended since the last look (the shared-memory manager ends late)
            if stopping:  # asked to stop while no node ran (after a release, or between two)
                return 0
            child = fork_child(run_node)
            status = _wait(child)
            child = 0  # (a stop signal from here on has no node to go to)
            reap_children(timeout=2.0)  # whatever the node left: helpers, daemons (reparented to us)
            _collect_exited()
            if os.WIFEXITED(status):
                code = os.WEXITSTATUS(status)
                if code != RELEASED_EXIT or released is None:
                    return code
                if stopping:  # the node released (its state is on disk) as the stop came
                    return 0
                child = fork_child(presence) if presence is not None else 0
                try:
                    again = released(lambda: bool(stopping)) and not stopping
                finally:
                    end_child(child, timeout_s=PRESENCE_STOP_S)
                    child = 0
                if again:
                    continue
                return 0  # the end while released: the trace, node.stop_at, or a stop
            signum = os.WTERMSIG(status)
            if stopping:  # we were asked to stop and passed it on: the node is gone, so are we
                return 128 + stopping[0]
            if not crashes.allow(signal.Signals(signum).name):
                return 1
    except BaseException as error:
        leaving = error
        raise
    finally:
        restore_or_settle(previous, leaving)  # (a status decided: a stop from here on leaves it as it is)


class CrashBudget:
    """At most ``max_restarts`` restarts after crashes within any ``window_s`` seconds: a crash loop
    is reported, not hidden."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = max_restarts, window_s
        self.crashes: list[float] = []

    def allow(self, how: str) -> bool:
        """The node died (``how``: the signal's name): whether to start it again (said either way)."""
        now = time.monotonic()
        self.crashes = [t for t in self.crashes if now - t < self.window_s] + [now]
        if len(self.crashes) > self.max_restarts:
            log.error(
                "the node died (%s) %d times within %.0f s; not restarting it again",
                how,
                len(self.crashes),
                self.window_s,
            )
            return False
        log.warning(
            "the node died (%s); restarting it from its last checkpoint (%d of %d restarts in %.0f s)",
            how,
            len(self.crashes),
            self.max_restarts,
            self.window_s,
        )
        return True


def fork_child(run: Callable[[], int]) -> int:
    """Run ``run`` in a forked child with the default stop signals; its pid."""
    child = os.fork()
    if child:
        return child
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    code = 1
    try:
        fresh_future_locks()  # not the ones a killed predecessor's helper may have died holding
        code = run()
    except BaseException:  # a crash: say where, as Python would have
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def end_child(child: int, timeout_s: float = 30.0) -> None:
    """Stop a forked helper (the presence): SIGTERM, then SIGKILL after ``timeout_s``; reap what it
    left."""
    if not child:
        return
    try:
        os.kill(child, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
    reap_children(timeout=2.0)


def _collect_exited() -> None:
    """Collect the exit status of every child that has ended, so none stays a zombie: as a subreaper
    this process inherits helpers it did not start (torch's shared-memory manager ends by itself,
    after the reaping) and nothing else would wait for them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children left
            return
        if pid == 0:  # children left, none ended yet
            return


def _wait(pid: int) -> int:
    """The wait status of ``pid``, retrying when a forwarded signal interrupts the wait."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return status
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
