"""A trainer that an agent started as a command ends at once (``procs.exit_at_once``), as a forked
node does: its children reaped, its buffered output flushed, no interpreter teardown (docs/testing.md
row 68: a Slurm job's trainer took 62 s to end after printing its summary)."""

from __future__ import annotations

import subprocess
import sys

import psutil

COMMAND = """\
import atexit
import subprocess
import sys

from greenswarm.procs import exit_at_once

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
atexit.register(lambda: print("teardown ran", flush=True))  # the interpreter's teardown: skipped
print("child", child.pid)
print("summary")  # buffered (stdout is a pipe): flushed before the exit
exit_at_once(3)
"""


def test_exit_at_once_reaps_flushes_and_skips_the_teardown() -> None:
    out = subprocess.run([sys.executable, "-c", COMMAND], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[1:] == ["summary"], out.stdout
    child = int(lines[0].split()[1])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
