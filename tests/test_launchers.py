"""The trainer started and ended through an operator's launcher (``node.launcher``, docs/release.md):
``command`` (the agent runs the operator's command) and ``slurm`` (a batch job on a real single-node
Slurm). One site each, released at its first window's end and started again at the next.

Not in the cpu-bound lane (tests/conftest.py): one site, and most of each test waits on a fresh
Python's imports and the Slurm daemons; the other lane runs it early, beside the lane's modules that
never missed a mark beside a training site.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from greenswarm.jsonlines import read_json_lines
from greenswarm.scheduler.clock import WAITING_FOR_START, write_start_file
from tests.conftest import Swarm, site_config, wait_until, write_trace

pytestmark = [pytest.mark.release, pytest.mark.swarm, pytest.mark.faults]

SPEEDUP = 360.0  # 10 wall seconds a clock hour, as tests/test_release_node.py


def test_the_command_launcher_runs_the_trainer_through_the_operators_command(
    swarm: Swarm, tmp_path: Path
) -> None:
    """``node.launcher: command``: the agent runs ``node.start_command`` (here a shell that writes a
    line and runs ``{trainer}``, the trainer's own command line); each trainer is a fresh process
    that releases at its window's end and is started again at the next one."""
    # the second window lasts to the trace's end (the test stops the site once it trained again): a
    # fresh Python pays for its imports, 10-30 s here, hours of this clock
    values = [50.0] * 2 + [300.0] * 2 + [50.0] * 60
    trace = write_trace(tmp_path / "trace.csv", {"A": values}, step_s=900)
    start_file = tmp_path / "start"
    peers = swarm.bootstrap()
    run_dir = tmp_path / "site"
    starts = tmp_path / "starts.txt"
    cfg = site_config(
        "site", "A", trace, peers, run_dir, speedup=SPEEDUP, start_file=start_file, sync_s=600.0,
        release={"mode": "idle"},
        node={"launcher": "command", "start_command": f"echo {{site}} >> {starts} && exec {{trainer}}"},
    )  # fmt: skip
    swarm.node("site", swarm.write_config("site", cfg))
    swarm.start_replay(["site"], start_file)

    def restarts() -> list[dict]:
        return [e for e in read_json_lines(run_dir / "releases.jsonl") if e["event"] == "restart"]

    wait_until(restarts, 120, "the trainer's restart through the command")
    os.kill(swarm.procs["site"].pid, signal.SIGTERM)  # the agent: it passes the stop to the command
    assert swarm.wait("site", timeout=60) == 0, swarm.log("site")[-3000:]
    (restart,) = restarts()
    assert restart["state_digest"] == restart["state_digest_after"]
    assert starts.read_text().split() == ["site", "site"]  # the first trainer, and the one restarted
    assert "starting the trainer again" in swarm.log("site")


@pytest.mark.slurm
def test_the_slurm_launcher_gives_the_gpus_back_between_windows(swarm: Swarm, tmp_path: Path) -> None:
    """``node.launcher: slurm`` on a real single-node Slurm (tests/slurm.py): the trainer is a batch
    job; between windows no job of the site is queued or running (its resources are the cluster's),
    and at the next window the agent submits it again and it resumes the state it released."""
    from tests.slurm import single_node_slurm

    with single_node_slurm(tmp_path / "slurm") as slurm_env:
        swarm.env.update(slurm_env)
        values = [50.0] * 2 + [300.0] * 2 + [50.0] * 60
        trace = write_trace(tmp_path / "trace.csv", {"A": values}, step_s=900)
        start_file = tmp_path / "start"
        peers = swarm.bootstrap()
        run_dir = tmp_path / "site"
        cfg = site_config(
            "site", "A", trace, peers, run_dir, speedup=SPEEDUP, start_file=start_file, sync_s=600.0,
            release={"mode": "idle"}, node={"launcher": "slurm"},
        )  # fmt: skip
        swarm.node("site", swarm.write_config("site", cfg))

        def job_output() -> str:
            return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("slurm-*.out")))

        def jobs() -> list[str]:
            out = subprocess.run(
                ["squeue", "-h", "-n", "greenswarm-site", "-o", "%i %T"],
                env=swarm.env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            return out.stdout.split("\n")[:-1]

        wait_until(lambda: WAITING_FOR_START in job_output(), 120, "the trainer's job to be ready")
        assert len(jobs()) == 1, jobs()
        write_start_file(start_file, time.time() + 0.5)
        journal = run_dir / "releases.jsonl"

        def events(kind: str) -> list[dict]:
            return [e for e in read_json_lines(journal) if e.get("event") == kind]

        wait_until(lambda: events("release"), 60, "the release")
        wait_until(lambda: not jobs() or events("restart"), 30, "the released job to end")
        if not events("restart") and "starting the trainer again" not in swarm.log("site"):
            assert jobs() == []  # released: nothing of the site's in the cluster's queue
        wait_until(lambda: events("restart"), 120, "the trainer's job submitted again")
        (restart,) = events("restart")
        assert restart["state_digest"] == restart["state_digest_after"]
        os.kill(swarm.procs["site"].pid, signal.SIGTERM)  # the agent cancels the job with the signal
        try:  # (the job's own output and the Slurm daemon's log say where a slow end was spent)
            code = swarm.wait("site", timeout=90)
        except AssertionError as e:
            slurmd_log = tmp_path / "slurm" / "log" / "slurmd.log"
            slurmd = slurmd_log.read_text(errors="replace") if slurmd_log.exists() else "(no log)"
            job = job_output()[-3000:]
            raise AssertionError(f"{e}\njob output:\n{job}\nslurmd:\n{slurmd[-1500:]}") from None
        assert code == 0, swarm.log("site")[-3000:] + job_output()[-3000:]
        assert len(list(run_dir.glob("slurm-*.out"))) == 2 and jobs() == []


#: a stand-in for torchrun: a "rendezvous" of ``argv[1]`` seconds, then one rank (RANK=0) that stops
#: cleanly (exit 0) on SIGTERM; torchrun itself, signalled, passes it on and exits 1, as torch's does
FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
out = sys.argv[2]
rank = None
def stopped(*_):
    if rank is not None:
        rank.send_signal(signal.SIGTERM)
    open(os.path.join(out, "torchrun-stopped"), "w").close()
    sys.exit(1)
signal.signal(signal.SIGTERM, stopped)
open(os.path.join(out, "torchrun-up"), "w").close()
time.sleep(float(sys.argv[1]))
rank = subprocess.Popen([sys.executable, "-c", RANK0, out], env={**os.environ, "RANK": "0"})
sys.exit(rank.wait())
"""
RANK0 = """
import os, signal, sys, time
from greenswarm.node.releasing import RANK0_READY
from greenswarm.procs import set_process_name
out = sys.argv[1]
def stop(*_):
    open(os.path.join(out, "rank0-stopped"), "w").close()
    sys.exit(0)
time.sleep(1.0)  # a rank's start-up: a SIGTERM now would end it (no handler yet), as a real rank's would
signal.signal(signal.SIGTERM, stop)
set_process_name(RANK0_READY)
open(os.path.join(out, "rank0-up"), "w").close()
while True:
    time.sleep(0.1)
"""
AGENT = """
import sys
from greenswarm.node.launchers import run_command_launcher
code = run_command_launcher(
    [sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]], None, {"run_dir": sys.argv[3]},
    released=lambda stopped: False, max_restarts=0, window_s=60.0,
)
sys.exit(code)
"""


def _agent(tmp_path: Path, rendezvous_s: float) -> subprocess.Popen:
    fake = tmp_path / "torchrun.py"
    fake.write_text(FAKE_TORCHRUN.replace("RANK0", repr(RANK0)))
    return subprocess.Popen(
        [sys.executable, "-c", AGENT, str(fake), str(rendezvous_s), str(tmp_path)], start_new_session=True
    )


def test_a_torchrun_groups_agent_stops_it_through_rank_0_and_takes_it_along(tmp_path: Path) -> None:
    """``node.ranks``: a stop that comes while the group is still starting waits for its rank 0 to be
    ready to stop (torchrun, signalled itself, would exit with an error; a rank signalled mid-start
    dies, and torchrun would start the group again: soak of 2725dee), and an agent killed outright
    takes the group with it (PR_SET_PDEATHSIG: torchrun gets SIGTERM)."""
    (tmp_path / "stop").mkdir()
    agent = _agent(tmp_path / "stop", 5.0)
    try:
        # the agent has started torchrun (its stop handler is in place: a fresh Python's imports before
        # that take seconds under load), which is in its rendezvous: no rank 0 yet
        wait_until(lambda: (tmp_path / "stop" / "torchrun-up").exists(), 60, "the agent to start torchrun")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        assert (tmp_path / "stop" / "rank0-stopped").exists()
        assert not (tmp_path / "stop" / "torchrun-stopped").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)

    (tmp_path / "kill").mkdir()
    agent = _agent(tmp_path / "kill", 0.0)
    try:
        wait_until(lambda: (tmp_path / "kill" / "rank0-up").exists(), 60, "the rank up")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_until(lambda: (tmp_path / "kill" / "rank0-stopped").exists(), 30, "the group to stop")
        assert (tmp_path / "kill" / "torchrun-stopped").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
