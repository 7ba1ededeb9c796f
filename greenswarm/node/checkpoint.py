"""Atomic, verified checkpoints: a crash while writing, or a damaged disk, never costs the last good state.

Each save writes ``checkpoint.pt.tmp``, fsyncs it, keeps the previous file as ``checkpoint.prev.pt``
and renames the new one into place (rename is atomic on POSIX). The payload carries a blake2b
digest of its own contents (every tensor's bytes, dtype and shape, and every other value), checked
on load: a torn write *and* a flipped byte inside tensor data (which ``torch.load`` returns without
complaint) are detected, and the previous file is used. A process killed between syncing the new
file and renaming it leaves a complete ``checkpoint.pt.tmp``; it verifies, so the next start resumes
from it and loses nothing. The file stays a plain ``torch.save``
archive, so ``torch.load("checkpoint.pt")`` works for anyone who wants the weights.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from greenswarm.digests import content_digest
from greenswarm.errors import StorageError
from greenswarm.faults import FaultPlan

log = logging.getLogger(__name__)

FORMAT = 2


class Checkpointer:
    """Saves and restores one site's checkpoint in ``directory``."""

    def __init__(self, directory: str | Path, faults: FaultPlan | None = None):
        self.directory = Path(directory)
        self.path = self.directory / "checkpoint.pt"
        self.previous = self.directory / "checkpoint.prev.pt"
        self.pending = self.directory / "checkpoint.pt.tmp"  # a save in progress
        self.loaded: Path | None = None  # the file the last load read
        self._faults = faults or FaultPlan()

    def save(self, payload: dict[str, Any]) -> Path:
        """Write ``payload`` as the new ``checkpoint.pt`` and keep the old one as ``checkpoint.prev.pt``.

        Only new files are written and renamed, never an existing one rewritten: a hard link to an
        earlier checkpoint (``run_dir/best``) keeps its contents.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        content = {"format": FORMAT, "digest": content_digest(payload), **payload}  # (not a write error)
        try:
            # a new file, never the old one truncated: a reader may have the old one mapped
            self.pending.unlink(missing_ok=True)
            with open(self.pending, "xb") as f:
                torch.save(content, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as e:  # torch reports a full disk as "unexpected pos" (RuntimeError)
            self.pending.unlink(missing_ok=True)  # a torn file, and the space it took
            free = shutil.disk_usage(self.directory).free
            raise StorageError(
                f"could not write the checkpoint {self.pending} ({free / 2**20:,.0f} MiB free on its disk): "
                f"{str(e).strip()}; {self.path} still holds the last one"
            ) from e
        if self.path.exists():
            os.replace(self.path, self.previous)
        self._faults.hit("checkpoint")  # the moment with no checkpoint.pt on disk
        os.replace(self.pending, self.path)
        fsync_directory(self.directory)  # make the renames themselves durable
        return self.path

    def load(self, mmap: bool = False) -> dict[str, Any] | None:
        """The newest verified checkpoint, or None when there is none (``mmap``: see :meth:`read`).

        A complete, verified ``checkpoint.pt.tmp`` is the newest of all: the process died after
        writing and syncing it but before renaming it into place (a torn one fails verification and
        is skipped). Then ``checkpoint.pt``, then ``checkpoint.prev.pt``.
        """
        for path in (self.pending, self.path, self.previous):
            content = self.read(path, mmap=mmap)
            if content is not None:
                if path == self.pending:
                    log.warning("using %s: a save was interrupted after it was written", path)
                elif path == self.previous and self.path.exists():
                    log.warning("using the previous checkpoint %s instead", path)
                self.loaded = path
                return content
        return None

    @staticmethod
    def read(path: str | Path, mmap: bool = False) -> dict[str, Any] | None:
        """The verified payload of one checkpoint file, or None when it is missing, unreadable or damaged.

        ``mmap``: map the file's tensors instead of reading them into memory (copy-on-write), for a
        reader that uses a small part of a big checkpoint (``greenswarm export`` needs the global model,
        not every rank's optimizer state); the digest check still reads every byte once.

        The one check behind :meth:`load`, for any file this class wrote (e.g. the best checkpoints
        kept by :class:`~greenswarm.node.evaluation.BestCheckpoints`, which are links or copies of it):
        a file that fails it is reported and never trusted.
        """
        path = Path(path)
        if not path.exists():
            return None
        try:
            payload = _load(path, mmap)
        except Exception as e:  # torn or corrupted file: say so; the caller decides what to try next
            log.warning("checkpoint %s is unreadable (%s)", path, e)
            return None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            log.warning("checkpoint %s has an unknown format; ignoring it", path)
            return None
        content = {k: v for k, v in payload.items() if k not in ("format", "digest")}
        if payload.get("digest") != content_digest(content):
            log.warning("checkpoint %s does not match its digest (damaged); ignoring it", path)
            return None
        return content


def _load(path: Path, mmap: bool) -> Any:
    """``torch.load`` of a checkpoint, mapped when asked and the file and its filesystem allow it."""
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except (RuntimeError, OSError, ValueError) as e:  # an old (non-zip) file, a filesystem without mmap
            log.debug("cannot map %s (%s); reading it", path, e)
    return torch.load(path, map_location="cpu", weights_only=False)


def fsync_directory(directory: str | Path) -> None:
    """Make renames and new links inside ``directory`` durable (a file's fsync does not cover its name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
