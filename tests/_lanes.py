"""How many cpu-bound lanes the suite runs side by side: two when the machine gives it two cores, one
when other processes hold them (conftest's ``CPU_LANES``, xdist's ``-n auto``).

Why: the two lanes share two cores with the rest of the suite, and that only holds while nothing else
takes them. Every run of the two-lane layout beside two busy processes found 3-4 failures, each time in
other tests and all of one kind: a replayed round every 3-10 wall s no longer held a slow site's inner
step, its catch-up and a matchmaking (docs/testing.md, "The hog run"); the one-lane layout passed the
same hog twice (2009 s and 2049 s). So the suite reads the machine once, at its start, and runs the
layout that fits it; ``GREENSWARM_TEST_LANES=1|2`` chooses instead (to reproduce a run).
"""

from __future__ import annotations

import functools
import os
import statistics
import time

LANES_ENV = "GREENSWARM_TEST_LANES"


def busy_elsewhere(samples: int = 20, every_s: float = 0.025) -> int:
    """How many tasks other than this one are running or ready to: the median of ``samples`` readings
    of the kernel's ``procs_running`` (/proc/stat), less this process (0 where there is no /proc)."""
    readings = []
    for _ in range(samples):
        try:
            with open("/proc/stat") as stat:
                line = next(x for x in stat if x.startswith("procs_running "))
        except (OSError, StopIteration):
            return 0
        readings.append(int(line.split()[1]) - 1)
        time.sleep(every_s)
    return max(0, round(statistics.median(readings)))


@functools.cache
def lanes() -> tuple[int, str]:
    """The number of cpu-bound lanes to run side by side (1 or 2), and why (for the run's header)."""
    chosen = os.environ.get(LANES_ENV)
    if chosen in ("1", "2"):
        return int(chosen), f"{LANES_ENV}={chosen}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = busy_elsewhere()
    free = cores - busy
    why = f"{cores} cores, {busy} busy beside the suite at its start"
    return (2 if free >= 2 else 1), why
