"""Opening trace files as operators hold them: plain, gzip'ed, xz'ed or bzip2'ed CSV.

Grid-data exports are often kept compressed (a year of 5-minute data per zone is tens of MB of
text), and a cron job that fetches them may write ``zone.csv.gz`` as the provider serves it. The
compression is recognised from the file's first bytes, not its name: a file renamed without its
suffix still reads, and a name that promises a compression its bytes do not have fails with an
error saying so, instead of a confusing complaint about the CSV inside.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import lzma
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from greenswarm.errors import TraceError

#: compression -> the magic bytes its files start with
MAGIC: dict[str, bytes] = {"gzip": b"\x1f\x8b", "xz": b"\xfd7zXZ\x00", "bzip2": b"BZh"}
#: file name suffixes that promise a compression
SUFFIXES: dict[str, str] = {".gz": "gzip", ".gzip": "gzip", ".xz": "xz", ".bz2": "bzip2"}
_OPENERS = {"gzip": gzip.open, "xz": lzma.open, "bzip2": bz2.open}

#: what a damaged compressed stream raises while it is read (gzip's BadGzipFile is an OSError; a
#: truncated stream ends in EOFError; bzip2 reports bad data as OSError)
DECOMPRESSION_ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, lzma.LZMAError)


def compression_of(path: Path) -> str | None:
    """``gzip``, ``xz``, ``bzip2`` or None (plain), from the file's first bytes."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    return next((kind for kind, magic in MAGIC.items() if head.startswith(magic)), None)


def open_text(path: Path, name: str, what: str = "trace file") -> tuple[TextIO, str | None]:
    """``path`` opened as UTF-8 text (a byte-order mark skipped, newlines as csv wants them),
    decompressed on the fly; and its compression (None: plain). ``name`` is how errors name it,
    ``what`` what it should be."""
    try:
        kind = compression_of(path)
    except FileNotFoundError:
        raise TraceError(f"{name}: no such {what}") from None
    except IsADirectoryError:
        raise TraceError(f"{name}: is a directory, not a {what}") from None
    except OSError as err:
        raise TraceError(f"{name}: cannot read {what} ({err.strerror or err})") from None
    promised = SUFFIXES.get(path.suffix.lower())
    if promised is not None and kind != promised:
        found = f"{kind}-compressed" if kind else "not compressed"
        raise TraceError(f"{name}: the name says {promised}, but the file is {found}")
    if kind is None:
        return open(path, newline="", encoding="utf-8-sig"), None
    binary = _OPENERS[kind](path, "rb")
    return io.TextIOWrapper(binary, encoding="utf-8-sig", newline=""), kind


@contextmanager
def reading_errors(name: str, compression: str | None, line: Callable[[], int]) -> Iterator[None]:
    """What reading a (compressed) CSV can raise, as one :class:`TraceError` naming the file and the
    line (``line()``: the reader's line number; 0 while the first compressed block is decoded)."""
    try:
        yield
    except csv.Error as err:
        raise TraceError(f"{name}:{line()}: malformed CSV ({err})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{name}: not a UTF-8 text file") from None
    except DECOMPRESSION_ERRORS as err:
        if compression is None:
            raise
        where = f"{name}:{line()}" if line() else name
        raise TraceError(f"{where}: damaged {compression} data ({err})") from None
