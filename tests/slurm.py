"""A real single-node Slurm for tests: munged, slurmctld and slurmd from Debian's packages
(``slurm-wlm``, ``munge``; .ci/run installs them), configured in a temporary directory, bound to
127.0.0.1 on free ports, and stopped (jobs cancelled first) at the end.

Skipped where the packages or root are missing, unless ``GREENSWARM_REQUIRE_SLURM`` is set (CI), where
that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting Slurm's daemons needs root"
    return None


def _munge_works() -> bool:
    try:
        encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return (
            encoded.returncode == 0
            and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@contextlib.contextmanager
def single_node_slurm(root: Path) -> Iterator[dict[str, str]]:
    """Start Slurm under ``root``; yields the environment (``SLURM_CONF``) its commands need."""
    why = _missing()
    if why is not None:
        if os.environ.get("GREENSWARM_REQUIRE_SLURM"):
            pytest.fail(f"GREENSWARM_REQUIRE_SLURM is set but {why}")
        pytest.skip(why)
    host = socket.gethostname()
    for sub in ("state", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # slurmd's spool holds each job step's UNIX socket (<spool>/<host>_<job>.<step>, at most 107 bytes):
    # under a soak's longer temporary root (/tmp/greenswarm-soak-N-xxxxxxxx/basetemp/...) the path was
    # 110 bytes, no step could start, and every job stayed pending (soak of 2725dee, 2 runs of 2)
    spool = Path(tempfile.mkdtemp(prefix="gs-slurmd-", dir="/tmp"))
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=greenswarm-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    started: list[subprocess.Popen] = []
    try:
        if not _munge_works():  # (a machine's own munged is used where one runs)
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            started.append(subprocess.Popen(["runuser", "-u", "munge", "--", _sbin("munged"), "-F"], env=env))
            _wait_for(_munge_works, 20, "munged")
        daemons = [[_sbin("slurmctld"), "-D", "-f", str(conf)]]
        daemons.append([_sbin("slurmd"), "-D", "-f", str(conf), "-N", host])
        for cmd in daemons:
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # (their logs: root/log)
            started.append(subprocess.Popen(cmd, env=env, **quiet))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

        _wait_for(idle, 60, f"a Slurm node ({(root / 'log' / 'slurmctld.log')})")
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--full", "--partition=main"], env=env, capture_output=True, check=False)
        for proc in reversed(started):
            proc.terminate()
        for proc in reversed(started):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(spool, ignore_errors=True)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start in {timeout:.0f} s")
        time.sleep(0.5)
