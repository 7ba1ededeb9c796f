"""Atomic checkpoints: a crash while writing never destroys the last good checkpoint.

Each save writes ``checkpoint.pt.tmp``, fsyncs it, keeps the previous file as ``checkpoint.prev.pt``
and renames the new one into place (rename is atomic on POSIX). Loading falls back to the previous
file when the newest one cannot be read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1


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
            torch.save({"format": FORMAT, **payload}, f)
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
            return payload
        return None
