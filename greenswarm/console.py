"""Where reports go: the terminal (rich) and PNG plots (matplotlib).

A leaf module: it imports nothing from greenswarm but :mod:`greenswarm.errors`, so ``greenswarm
progress``, ``windows``, ``simulate``, ``reproduce`` and the demo share these helpers without the
scheduler or the simulator importing the node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from greenswarm.errors import GreenswarmError


def wide_console() -> Console:
    """A console that does not squeeze tables into 80 columns when output goes to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def pyplot():  # noqa: ANN201 - matplotlib.pyplot, imported late: plotting is optional work
    """matplotlib's pyplot on the file-only Agg backend, its chatter kept below warnings."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(max(logging.getLogger().level, logging.WARNING))
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: Path) -> None:
    """Write ``fig`` as a PNG; an unwritable path is one clear line, not a traceback."""
    try:
        fig.savefig(out, dpi=110)
    except OSError as err:
        raise GreenswarmError(f"{out}: cannot write plot ({err.strerror or err})") from None
