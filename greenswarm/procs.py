"""Process hygiene: signal handling and reaping every child (p2pd daemons included).

hivemind starts a p2pd daemon per DHT and leaves it running if its parent dies abruptly, so every
greenswarm command ends by terminating whatever descendants it still has.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def reap_children(timeout: float = 3.0, pid: int | None = None) -> int:
    """Terminate (then kill) all descendants of ``pid`` (default: this process); return how many."""
    children = descendants(pid)
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


def on_termination(callback: Callable[[], None]) -> None:
    """Call ``callback`` on SIGINT/SIGTERM (once; a second signal interrupts for real)."""

    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if os.getpid() != owner:  # a forked child (hivemind's DHT/averager) inherited this: just exit
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        log.info("received %s: finishing cleanly", signal.Signals(signum).name)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        callback()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


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
