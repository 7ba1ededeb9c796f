"""Atomic, verified checkpoints: a crash while writing, or a damaged disk, never costs the last good state.

Each save writes ``checkpoint.pt.tmp``, fsyncs it, keeps the previous file as ``checkpoint.prev.pt``
and renames the new one into place (rename is atomic on POSIX). The file starts with a header --
a magic string and a blake2b digest of everything after it -- so loading detects a torn write *and*
a flipped byte inside tensor data (which ``torch.load`` would happily return), and then falls back
to the previous file.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"GSWCKPT1"
DIGEST_BYTES = 32
HEADER_BYTES = len(MAGIC) + DIGEST_BYTES
CHUNK = 1 << 22


class CorruptCheckpoint(ValueError):
    """A checkpoint file whose bytes are not what was written."""


class _HashingWriter(io.RawIOBase):
    """Writes through to ``f`` and hashes every byte (torch.save streams into it)."""

    def __init__(self, f: BinaryIO):
        self.f, self.hash = f, hashlib.blake2b(digest_size=DIGEST_BYTES)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hash.update(data)
        return self.f.write(data)


class _Window(io.RawIOBase):
    """A read-only view of ``f`` from ``offset`` on (torch.load seeks within the payload)."""

    def __init__(self, f: BinaryIO, offset: int):
        self.f, self.offset = f, offset
        self.f.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.f.readinto(buffer)

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            pos += self.offset
        return self.f.seek(pos, whence) - self.offset

    def tell(self) -> int:
        return self.f.tell() - self.offset


def _verify(f: BinaryIO, path: Path) -> None:
    """Check the header's digest against the bytes after it (streamed: checkpoints can be large)."""
    header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or not header.startswith(MAGIC):
        raise CorruptCheckpoint(f"{path} has no greenswarm checkpoint header")
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    while chunk := f.read(CHUNK):
        digest.update(chunk)
    if digest.digest() != header[len(MAGIC) :]:
        raise CorruptCheckpoint(f"{path}: contents do not match their digest (torn or damaged)")


class Checkpointer:
    """Saves and restores one site's checkpoint in ``directory``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / "checkpoint.pt"
        self.previous = self.directory / "checkpoint.prev.pt"

    def save(self, payload: dict[str, Any]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w+b") as f:
            f.write(MAGIC + bytes(DIGEST_BYTES))  # the digest is filled in once the payload is written
            writer = _HashingWriter(f)
            torch.save({"format": FORMAT, **payload}, writer)
            f.seek(len(MAGIC))
            f.write(writer.hash.digest())
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
                payload = self._read(path)
            except Exception as e:  # torn or corrupted file: say so and try the previous one
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
                continue
            if not isinstance(payload, dict) or payload.get("format") != FORMAT:
                log.warning("checkpoint %s has an unknown format; ignoring it", path)
                continue
            return payload
        return None

    @staticmethod
    def _read(path: Path) -> Any:
        with open(path, "rb") as f:
            _verify(f, path)
            return torch.load(_Window(f, HEADER_BYTES), map_location="cpu", weights_only=False)
