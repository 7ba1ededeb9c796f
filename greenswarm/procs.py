"""Process hygiene: signal handling and reaping every child (p2pd daemons included).

hivemind starts a p2pd daemon per DHT and leaves it running if its parent dies abruptly, so every
greenswarm command ends by terminating whatever descendants it still has.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import psutil

log = logging.getLogger(__name__)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


#: descendants that must outlive the reaping: torch's shared-memory manager (hivemind shares memory
#: through it) ends by itself once its last client has gone, and a client whose manager was killed
#: aborts the interpreter when it frees shared memory at exit
_SPARED = frozenset({"torch_shm_manager"})


#: prctl's option that signals the calling thread's process when the thread that forked it ends
PR_SET_PDEATHSIG = 1
#: prctl's option that names the calling thread (the process's name, for its main thread)
PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    """Name this process as ``ps -o comm`` and psutil show it (Linux; 15 bytes at most; nothing
    elsewhere): a forked helper has its parent's command line, and its name tells it apart."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def ending_with_parent(parent: int) -> Callable[[], None]:
    """What a started command runs before its exec (``preexec_fn``): SIGTERM when ``parent`` dies,
    even by SIGKILL -- a torchrun group would otherwise train on with nobody to stop it (torchrun
    passes the SIGTERM to its ranks, which stop cleanly). The signal is tied to the thread that forks.
    ``prctl`` is looked up before the fork; a parent that died before it was set is caught by the
    parent check after."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def end_with_parent() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0 or os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return end_with_parent


def reap_children(timeout: float = 3.0, pid: int | None = None) -> int:
    """Terminate (then kill) all descendants of ``pid`` (default: this process); return how many."""
    children = []
    for child in descendants(pid):
        try:
            if child.name() not in _SPARED:
                children.append(child)
        except psutil.NoSuchProcess:
            continue
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return len(children)


def exit_at_once(code: int) -> NoReturn:
    """End this process now with ``code``, as a forked node ends
    (:func:`greenswarm.node.supervisor.fork_child`), with no interpreter teardown: its children reaped
    and its output flushed first.

    For a trainer that an agent started as a command (a Slurm job, the operator's command, a torchrun
    rank), once everything it wrote is closed. Why: the teardown runs torch's library finalizers and
    frees every module, which took 1.6 s on a quiet machine and 4 s beside two busy processes, with
    nothing left to do; a batch job ends only when it is over, and CI saw a Slurm job end 62 s after
    its trainer had printed its summary, holding the agent's stop past its test's 90 s
    (docs/testing.md row 68)."""
    reap_children()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_with_parent(interval_s: float = 0.5, on_orphaned: Callable[[], None] | None = None) -> None:
    """In a forked helper process (hivemind's DHT or averager): once the parent is gone -- killed with
    SIGKILL, say, so it could not shut its helpers down -- end this process's own children (the p2pd
    daemon) and exit, instead of living on as an orphan holding ports and memory. With
    ``on_orphaned``, call that instead (a node asks itself to stop cleanly)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        if on_orphaned is not None:
            log.warning("the supervising process is gone: stopping")
            on_orphaned()
            return
        reap_children(timeout=1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _stop_signals() -> list[int]:
    """SIGINT, SIGTERM, and SIGHUP unless it is ignored (``nohup``: the user asked to survive it)."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    return sigs


#: set by every stop handler below, once a stop arrived: a SIGTERM or Ctrl-C to the process group also
#: reached this process's p2p daemons, so shutting a helper down waits a moment for its daemon to go
#: (:func:`greenswarm.network.end_helper`) -- and only then, not on every clean stop
_stopping = threading.Event()
_stopped_at: list[float] = []  # when (monotonic) the first stop signal arrived


def _mark_stopping() -> None:
    if not _stopping.is_set():
        _stopped_at.append(time.monotonic())
        _stopping.set()


def stopping() -> bool:
    """Whether a stop signal (SIGINT, SIGTERM, SIGHUP) has reached this process."""
    return _stopping.is_set()


def stopped_for() -> float | None:
    """Seconds since the first stop signal reached this process (None: none has)."""
    return time.monotonic() - _stopped_at[0] if _stopped_at else None


def on_termination(callback: Callable[[], None], repeat_after_s: float = 2.0) -> None:
    """Call ``callback`` on SIGINT/SIGTERM/SIGHUP, once. A repeat within ``repeat_after_s`` is the same
    stop arriving twice (Ctrl-C reaches a whole process group, and a supervisor passes it on too) and
    is ignored; a later one interrupts for real."""

    owner = os.getpid()
    first: list[float] = []

    def handler(signum: int, _frame: object) -> None:
        if os.getpid() != owner:  # a forked helper (hivemind's DHT/averager) inherited this: ignore it
            return  # its owner shuts it down, or it ends itself when the owner is gone (exit_with_parent)
        if first:
            if time.monotonic() - first[0] < repeat_after_s:
                return
            log.warning("received %s again: stopping now", signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(owner, signum)
            return
        first.append(time.monotonic())
        _mark_stopping()
        log.info("received %s: finishing cleanly", signal.Signals(signum).name)
        callback()

    for sig in _stop_signals():
        signal.signal(sig, handler)


def restore_or_settle(previous: dict[int, Any], leaving: BaseException | None) -> None:
    """Leave a supervising loop's stop handlers: restore ``previous`` if it is leaving by an exception,
    or, once it has decided the command's status, ignore stops for the rest of the exit
    (:func:`settle_stops`).

    Why: a node or agent that has finished (its summary written, its status known) still spends
    moments, seconds on a loaded machine, reaping its helpers and exiting. A ``kill PID`` then found
    the restored handler of :func:`interrupt_on_termination`, which raised, or, later in the
    interpreter's exit, the default action (test_swarm, in fresh-clone runs: a site's trainer
    finished at its last window and the operator's stop reached its supervisor as it left). A stop
    has nothing left to stop by then, and a node's stop is a clean exit, 0, whenever it comes. Call it
    in the loop's ``finally``, with ``leaving`` the exception that is leaving it (None on a return):
    the caller's ``except BaseException`` names it, since :func:`sys.exc_info` would also show an
    exception that a caller of the loop is handling."""
    if leaving is not None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        return
    settle_stops(list(previous))


def settle_stops(signals: list[int] | None = None) -> None:
    """Ignore stop signals (``SIG_IGN``) for the rest of a process whose status is decided. Not a
    Python handler that does nothing: the interpreter puts every Python handler back to the default
    action as it finalizes, where a SIGTERM then kills the process (-15) after it had finished its
    work (measured: 6 of 6 such stops with a no-op handler, none with ``SIG_IGN``). ``SIG_IGN`` is
    inherited by a program exec'd afterwards; a process that settles execs none."""
    for sig in signals if signals is not None else _stop_signals():
        signal.signal(sig, signal.SIG_IGN)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C: every ``except KeyboardInterrupt`` catches it.

    Why not a plain ``KeyboardInterrupt``: CPython marks the process as "interrupted" whenever an
    exact ``KeyboardInterrupt`` leaves any ``exec``/``eval`` of source text, and dataclasses and
    namedtuples are built that way (as a module that defines them is imported, say). Under
    ``python -m`` it then kills itself with SIGINT at exit, silently, even though the command
    caught the interrupt, stopped cleanly and returned 130; a SIGTERM that landed in such an
    ``exec`` made ``python -m greenswarm demo`` die of SIGINT (``test_shutdown``: "demo exited
    with -2", the kernel's trace showing the demo sending SIGINT to itself). The flag is set for
    that exact type only, so a subclass leaves it alone.
    """


#: set by :func:`interrupt_on_termination`'s handler before it raises: a loop that must end on a stop
#: checks it too (:func:`raise_if_terminated`), because a raise can land where a library swallows it
#: (a ``try/except BaseException``), after which SIGTERM is ignored for the cleanup's sake
_terminated = threading.Event()


def raise_if_terminated() -> None:
    """Raise :class:`Terminated` if SIGTERM or SIGHUP arrived, even if its first raise was lost."""
    if _terminated.is_set():
        raise Terminated("SIGTERM")


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP interrupt like Ctrl-C (raising :class:`Terminated`), so a command's
    ``finally`` blocks run (stopping its DHT, its children and their p2pd daemons) instead of the
    process vanishing and leaving them. Commands with their own clean stop (node, bootstrap) replace
    this with :func:`on_termination`."""

    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if os.getpid() != owner:  # a forked helper: its owner shuts it down (see on_termination)
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):  # cleanup must not be cut short by a repeat
            signal.signal(sig, signal.SIG_IGN)
        _mark_stopping()
        _terminated.set()
        raise Terminated(signal.Signals(signum).name)

    def interrupt(signum: int, frame: Any) -> None:
        if os.getpid() == owner:
            _mark_stopping()
        signal.default_int_handler(signum, frame)  # Python's own KeyboardInterrupt, as a shell expects

    for sig in _stop_signals():
        signal.signal(sig, interrupt if sig == signal.SIGINT else handler)


#: the signal that makes a greenswarm process print every thread's Python stack to its stderr (its log)
STACKS_SIGNAL = signal.SIGUSR1


def stacks_on_request() -> None:
    """``kill -USR1 PID`` prints every thread's stack to stderr and the process goes on: what a node
    that does not stop is waiting on, without a debugger. It is CPython's C-level handler, so it
    answers even while a thread holds the GIL in native code (docs/testing.md row 32's hang), and a
    forked helper (hivemind's DHT and averager processes) inherits it and answers for itself."""
    stream = sys.__stderr__  # (fd 2, even where sys.stderr is replaced: an in-process run under pytest)
    with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):  # no fd 2: no stacks
        faulthandler.register(STACKS_SIGNAL, file=stream, all_threads=True)


_restarting = threading.Lock()  # (one at a time: the setting is the process's, not a thread's)


@contextlib.contextmanager
def restarting_system_calls() -> Iterator[None]:
    """Inside, a signal with a Python handler (SIGTERM, Ctrl-C, ...) no longer fails an interrupted
    system call with EINTR: the kernel restarts the call (``SA_RESTART``), and the handler runs as the
    call returns to the interpreter. For C code that handles EINTR wrongly (see
    :func:`start_shared_memory_manager`); nothing is blocked, so no child inherits a signal mask. On
    leaving, each handler interrupts system calls again, as Python installs its own handlers; not
    reentrant, and meant for handlers installed with ``signal.signal`` (asyncio's keep restarting)."""
    with _restarting:
        handled = [sig for sig in signal.valid_signals() if callable(signal.getsignal(sig))]
        for sig in handled:
            signal.siginterrupt(sig, False)
        try:
            yield
        finally:
            for sig in handled:
                signal.siginterrupt(sig, True)


#: the process that last made sure torch's shared-memory manager runs: torch's record of it is
#: inherited by a forked child, which then only confirms it with one round trip
_shm_manager_pid: int | None = None


def start_shared_memory_manager() -> None:
    """Start torch's shared-memory manager (``torch_shm_manager``) for this process now, with
    :func:`restarting_system_calls`. Call it before the first DHT or averager: hivemind shares memory
    from the start (each future's state), under torch's ``file_system`` strategy, which hivemind sets.

    Why: torch's libshm starts the manager on a process's first shared tensor and reads the manager's
    socket name from a pipe; when a signal interrupts that read (EINTR) it re-checks the stale return
    value forever instead of reading again, in C++, holding the GIL. The process spins at full CPU and
    no Python signal handler runs again: a ``greenswarm demo`` that got its SIGTERM while its progress
    reader started its DHT never stopped (``test_shutdown``, "demo did not finish in 60 s" with an
    empty log; py-spy showed it in ``UntypedStorage._share_filename_cpu_``). The manager takes
    0.3-2 s to start on a loaded 2-core machine, so a stop during any command's start-up could land
    there. ``tests/test_signals.py`` peppers the start with signals: it hung every time before.
    """
    global _shm_manager_pid
    if _shm_manager_pid == os.getpid():
        return
    import torch
    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        return  # file descriptors are passed directly: no manager to start
    with restarting_system_calls():
        torch.empty(1, dtype=torch.uint8).share_memory_()
    _shm_manager_pid = os.getpid()


def setup_logging(verbose: bool = False) -> None:
    """One readable format; hivemind's per-attempt tracebacks are hidden unless ``verbose``
    (greenswarm reports every failed round itself, with its reason)."""
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not verbose:
        for name in ("hivemind.averaging", "hivemind.dht", "hivemind.p2p", "hivemind.utils"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
