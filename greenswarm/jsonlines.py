"""Reading JSON-lines logs that a process may have been killed while appending to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """Every complete object line of ``path`` ([] when it does not exist); a torn or garbled line is
    skipped, since a writer killed mid-line leaves one."""
    entries = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries
