"""Atomic, verified checkpoints: a crash while writing, or a damaged disk, never costs the last good state.

Each save writes ``checkpoint.pt.tmp``, fsyncs it, keeps the previous file as ``checkpoint.prev.pt``
and renames the new one into place (rename is atomic on POSIX). The payload carries a blake2b
digest of its own contents (every tensor's bytes, dtype and shape, and every other value), checked
on load: a torn write *and* a flipped byte inside tensor data (which ``torch.load`` returns without
complaint) are detected, and the previous file is used. The file stays a plain ``torch.save``
archive, so ``torch.load("checkpoint.pt")`` works for anyone who wants the weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from greenswarm.digests import content_digest

log = logging.getLogger(__name__)

FORMAT = 2


class Checkpointer:
    """Saves and restores one site's checkpoint in ``directory``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / "checkpoint.pt"
        self.previous = self.directory / "checkpoint.prev.pt"

    def save(self, payload: dict[str, Any]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "digest": content_digest(payload), **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        if self.path.exists():
            os.replace(self.path, self.previous)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the renames themselves durable
        finally:
            os.close(dir_fd)
        return self.path

    def load(self) -> dict[str, Any] | None:
        """The newest readable checkpoint, or None when there is none."""
        for path in (self.path, self.previous):
            if not path.exists():
                continue
            try:
                payload = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as e:  # torn or corrupted file: say so and try the previous one
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
                continue
            if not isinstance(payload, dict) or payload.get("format") != FORMAT:
                log.warning("checkpoint %s has an unknown format; ignoring it", path)
                continue
            content = {k: v for k, v in payload.items() if k not in ("format", "digest")}
            if payload.get("digest") != content_digest(content):
                log.warning(
                    "checkpoint %s does not match its digest (damaged); trying the previous one", path
                )
                continue
            return content
        return None
