"""A command stopped with SIGTERM or SIGHUP exits 130, wherever the signal lands.

``interrupt_on_termination`` turns SIGTERM and SIGHUP into an interrupt so a command's ``finally``
blocks run. When that interrupt was an exact ``KeyboardInterrupt`` and it left an ``exec`` of source
text (dataclasses and namedtuples are built that way), CPython remembered it and, under
``python -m``, killed the process with SIGINT at exit, silently, after the command had caught it and
returned 130: ``test_shutdown`` saw ``python -m greenswarm demo`` exit with -2 about one run in ten.
This starts a real ``python -m`` process whose signal always lands in such an ``exec`` (on the old
handler it exited -2 every time).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

COMMAND = """\
import signal
import sys

from greenswarm.procs import interrupt_on_termination

# the signal arrives while this text runs under exec, as one can while a dataclass is being built
SOURCE = "print('ready', flush=True)\\nwhile True:\\n    pass\\n"


def main() -> int:
    # a test run started under nohup (or by a shell's background job) hands down an ignored SIGHUP,
    # which greenswarm rightly keeps ignoring; this command is about a signal that arrives
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    interrupt_on_termination()
    try:
        exec(SOURCE, {})
    except KeyboardInterrupt:
        return 130
    return 0


sys.exit(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_inside_exec_exits_130_not_sigint(tmp_path: Path, sig: signal.Signals) -> None:
    (tmp_path / "stopping_command.py").write_text(COMMAND)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stopping_command"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, output)
