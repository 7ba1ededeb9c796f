"""Checkpoints written beside training: the loop takes a snapshot, a thread digests and writes it.

Writing a checkpoint of a ~100 M-parameter site (model, inner optimizer, global parameters and outer
momentum: about 2 GB) costs seconds: a blake2b digest of every byte, the serialization, the fsync.
With rounds that run beside training (``averaging.overlap``) those seconds were most of what still
held the loop after a round. Here the loop only copies the state (a snapshot, consistent because it
is taken at one point of the loop, as a blocking save's state is) and hands it to one writer thread,
which writes it exactly as :class:`~greenswarm.node.checkpoint.Checkpointer` always does (atomic,
verified) and then runs what must follow that file (keeping it among the best, keeping the global
model). hashlib and file writes release the GIL, so the writer runs beside the steps.

At most one snapshot waits while another is written: a third waits for the writer (a site whose
writes take longer than its rounds must not pile up copies of its model). A failed write is raised
on the loop's thread at the next :meth:`BackgroundWriter.submit` or :meth:`~BackgroundWriter.flush`,
as a failed blocking save would be, never swallowed. A crash while a snapshot waits or is written
resumes from the previous checkpoint, which is consistent in itself: the same as a crash during a
blocking save, a little more often.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from greenswarm.node.checkpoint import Checkpointer

log = logging.getLogger(__name__)


def snapshot(obj: Any) -> Any:
    """A copy of a nested payload that training can no longer change: every tensor cloned (detached,
    on the CPU), containers rebuilt, other values shared (they are immutable or replaced, not mutated)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(item) for item in obj)
    return obj


class BackgroundWriter:
    """One thread that writes snapshots with a :class:`Checkpointer`, in the order they were handed in."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer
        self._waiting: tuple[dict[str, Any] | None, Callable[[], None] | None] | None = None
        self._writing = False
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, payload: dict[str, Any] | None, then: Callable[[], None] | None = None) -> None:
        """Write ``payload`` (a :func:`snapshot`; None: nothing to write), then call ``then`` on the
        writer's thread. Waits only while another snapshot is already waiting."""
        with self._cond:
            self._raise_failure()
            while self._waiting is not None:
                self._cond.wait()
                self._raise_failure()
            self._waiting = (payload, then)
            self._cond.notify_all()

    def wait_for_slot(self) -> None:
        """Wait until no snapshot waits (the loop calls it before it takes one: at most two exist)."""
        with self._cond:
            while self._waiting is not None:
                self._cond.wait()
            self._raise_failure()

    def flush(self) -> None:
        """Wait until everything handed in is written (before a blocking save, at the end)."""
        with self._cond:
            while self._waiting is not None or self._writing:
                self._cond.wait()
            self._raise_failure()

    def close(self) -> None:
        """Write what was handed in, then end the thread."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                (payload, then), self._waiting = self._waiting, None
                self._writing = True
                self._cond.notify_all()
            try:
                if payload is not None:
                    self.checkpointer.save(payload)
                del payload  # free the snapshot before what follows
                if then is not None:
                    then()
            except BaseException as e:  # surfaced on the loop's thread
                log.error("writing the checkpoint in the background failed: %s", e)
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()
