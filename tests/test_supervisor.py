"""A node forked again by its supervisor starts, whatever its killed predecessor's helpers held.

hivemind's cross-process future locks are made once, at import, in the supervisor, and so are shared
by every process forked from it. A helper of a crashed node that was killed while it held one left it
held for good, and the next node's DHT process then waited forever to report that it was ready: the
restart hung in ``join_swarm`` (seen once in the tenth soak; ``benchmarks/restart_soak.py`` then hung
2 restarts in 79 on a loaded machine, waiting on two different ones of those locks).
Here the helper's death is made certain: a process takes the lock and is SIGKILLed, then the real
supervisor forks a node that starts and stops a real hivemind DHT. The program runs in a process of
its own, so the supervisor's subreaper flag and signal handlers stay out of pytest.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.faults]

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time

    import hivemind
    from hivemind.utils.mpfuture import MPFuture

    from greenswarm.node.supervisor import supervise

    helper = os.fork()
    if helper == 0:  # a helper of the previous node, killed in the middle of sending a result
        MPFuture._update_lock.acquire()
        time.sleep(120)
        os._exit(0)
    while MPFuture._update_lock.acquire(block=False):  # wait until the helper holds it
        MPFuture._update_lock.release()
        time.sleep(0.01)
    os.kill(helper, signal.SIGKILL)
    os.waitpid(helper, 0)

    def node():
        signal.alarm(30)  # a hang becomes a death by SIGALRM, which the supervisor reports
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dht.shutdown()
        print("the node's DHT started", flush=True)
        return 0

    sys.exit(supervise(node, max_restarts=0, window_s=60.0))
    """
)


def test_a_restarted_node_does_not_wait_on_a_lock_its_predecessor_died_holding() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "the node's DHT started" in done.stdout


#: a supervisor whose node has finished, stopped by an operator (``kill PID``) as it leaves: the stop
#: lands after ``supervise`` returned, where the command's own handler (``interrupt_on_termination``,
#: as ``greenswarm``'s main installs it) used to be back and raised
LATE_STOP = textwrap.dedent(
    """
    import os, signal, sys, time

    from greenswarm.node.supervisor import supervise
    from greenswarm.procs import interrupt_on_termination

    interrupt_on_termination()
    code = supervise(lambda: 0, max_restarts=0, window_s=60.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # (a Python handler runs here, if one is installed)
    print("exiting with", code, flush=True)
    sys.exit(code)
    """
)


def test_a_stop_that_reaches_a_finished_node_leaves_its_status() -> None:
    """A node that finished exits 0 even if a stop reaches its supervisor while it exits (it exited
    130 before: a fresh-clone run's test_swarm, whose sites finished at their last window as the test
    stopped them)."""
    done = subprocess.run([sys.executable, "-c", LATE_STOP], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "exiting with 0" in done.stdout and "Traceback" not in done.stderr


def test_a_supervising_loop_left_by_an_exception_gives_the_handlers_back() -> None:
    """An exception leaving the loop (a bug, a KeyboardInterrupt in an in-process caller) restores the
    handlers it replaced; a decided status ignores stops for the rest of the exit (SIG_IGN: a Python
    handler is put back to the default action as the interpreter finalizes)."""
    from greenswarm.procs import restore_or_settle

    def mine(_signum: int, _frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        restore_or_settle({signal.SIGTERM: mine}, ValueError("the loop's bug"))
        assert signal.getsignal(signal.SIGTERM) is mine
        restore_or_settle({signal.SIGTERM: mine}, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_program_ignores_stops_once_its_status_is_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    """``greenswarm`` as the program (``main()`` with no argv, as its console script and ``python -m``
    call it) ignores stops once its command returned: the interpreter puts Python's handlers back to
    the default action as it finalizes, where a stop killed a finished process (-15: 6 of 6 stops
    sent to a process that had loaded torch and hivemind, with a handler that did nothing; 0 of 6 with
    SIG_IGN). A caller that passes its own argv (a test, in its process) keeps its handlers."""
    from greenswarm.cli import main

    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in stops}
    argv = ["greenswarm", "windows", "--trace", "builtin", "--region", "CAISO_NORTH", "--json"]
    try:
        assert main(argv[1:]) == 0
        assert all(signal.getsignal(sig) is not signal.SIG_IGN for sig in stops)
        monkeypatch.setattr(sys, "argv", argv)
        assert main() == 0
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in stops)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
