"""How the agent starts the site's trainer: ``node.launcher``.

* ``local`` (the default): the supervisor forks the trainer from itself, having paid for the
  imports once (:mod:`greenswarm.node.supervisor`): the fastest restart, one machine.
* ``command``: the operator's own command, ``node.start_command``, run by a shell in the foreground;
  it must run the trainer and exit with the trainer's status (``ssh gpu-host {trainer}``, a container
  runtime, a cluster's batch system that waits for its job). Placeholders: ``{trainer}`` (the
  trainer's own command line, shell-quoted), ``{config}``, ``{run_dir}``, ``{site}``. A stop signal
  goes to the command's process group, or ``node.stop_command`` runs instead (same placeholders and
  ``{signal}``, the signal's number), e.g. to cancel a batch job. Every trainer it starts is a fresh
  Python: its restarts pay for the imports (about 5 s here).

* ``slurm``: the trainer is a Slurm batch job, so its GPUs go back to the cluster whenever it is
  released: ``sbatch --wait`` (which exits with the job's status) submits it, named
  ``greenswarm-<site>``, with ``node.sbatch_args`` (``--gres=gpu:4``, ``--partition=...``) and its
  output in ``run_dir/slurm-<job>.out``; the job's script ``exec``s the trainer, so a stop is
  ``scancel --batch --signal`` to that job name, and the job ends with the trainer's status.
  A job that Slurm itself ends (a time limit, a preemption) ends by a signal, and is submitted again
  like a crashed trainer.

With ``node.ranks`` above 1 the trainer is a torchrun group (``--standalone --nproc-per-node``): the
agent cannot fork one, so under ``local`` it starts torchrun itself (a fresh Python, its restarts pay
for the imports), with no shell in between, ending with the agent if the agent dies; a stop goes to
the rank-0 worker once it is ready to stop cleanly (named ``gs-rank0``), which stops the other ranks
and lets torchrun exit 0 (torchrun would pass the signal to every rank and exit with an error).
Under ``command`` and ``slurm`` the ``{trainer}`` placeholder is the torchrun command line.

The trainer ends with :data:`~greenswarm.node.releasing.RELEASED_EXIT` when it releases (a torchrun
group's ranks with 0, and the marker says it: :func:`~greenswarm.node.releasing.released_by`); the
agent then waits for the next window (:func:`~greenswarm.node.releasing.wait_for_window`) and starts it
again. A trainer killed by a signal (the shell's status 128 + n) is started again, within
``node.max_restarts``; any other status ends the agent with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import psutil

from greenswarm.node.releasing import LAUNCHED_ENV, RANK0_READY, RELEASED_EXIT, released_by
from greenswarm.node.supervisor import PRESENCE_STOP_S, STOP_SIGNALS, CrashBudget, end_child, fork_child
from greenswarm.procs import ending_with_parent, reap_children, restore_or_settle

log = logging.getLogger("greenswarm.launcher")

#: how long a stop waits for a starting torchrun group's rank 0 before it signals torchrun itself
GROUP_STOP_WAIT_S = 60.0
#: seconds what a trainer left behind gets to end cleanly before it is killed
REAP_S = 30.0


def trainer_command(
    config: str,
    initial_peers: list[str] | None,
    overrides: list[str],
    run_dir: str,
    ranks: int = 1,
    max_restarts: int = 0,
) -> list[str]:
    """The trainer's command line: this node's own, with no supervisor of its own (the agent is);
    under torchrun when it has several ``ranks``, which starts the whole group again (from its
    checkpoint) up to ``max_restarts`` times when a rank fails (torchrun's status says only "failed",
    not how, so the agent cannot tell a crash from an error)."""
    python = [sys.executable]
    if ranks > 1:
        python += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        python += ["--max-restarts", str(max_restarts)]
    cmd = [*python, "-m", "greenswarm", "node", "--config", config, "--run-dir", run_dir]
    if initial_peers:
        cmd += ["--initial-peers", *initial_peers]
    for item in [*overrides, "node.restart=never", "node.launcher=local"]:
        cmd += ["--set", item]
    return cmd


def expand(template: str, **values: str) -> str:
    """``template`` with its ``{name}`` placeholders filled."""
    return template.format(**values)


def slurm_commands(sbatch_args: list[str]) -> tuple[str, str]:
    """The start and stop command templates of ``node.launcher: slurm`` (placeholders as for
    ``command``)."""
    start = (
        "sbatch --wait --parsable --job-name=greenswarm-{site} --output={run_dir}/slurm-%j.out "
        + " ".join(shlex.quote(a).replace("{", "{{").replace("}", "}}") for a in sbatch_args)
        + " --wrap {trainer_wrap}"
    )
    stop = "scancel --batch --signal={signal} --name=greenswarm-{site}"  # (the trainer is the batch step)
    return start, stop


def torchrun_rank_zero(pid: int) -> int | None:
    """The rank-0 worker among ``pid``'s descendants (a torchrun group's), or None: the process that
    stops a group cleanly (it stops its other ranks, and torchrun then exits 0)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:  # (a helper that ends while it is read is skipped, not the search)
        try:
            if (
                child.environ().get("RANK") == "0"
                and psutil.Process(child.ppid()).environ().get("RANK") != "0"
            ):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _named(pid: int, name: str) -> bool:
    """Whether process ``pid`` runs under the name ``name`` (see :data:`RANK0_READY`)."""
    try:
        return psutil.Process(pid).name() == name
    except psutil.Error:
        return False


def run_command_launcher(
    start: str | list[str],
    stop: str | None,
    values: dict[str, str],
    released: Callable[[Callable[[], bool]], bool],
    max_restarts: int,
    window_s: float,
    presence: Callable[[], int] | None = None,
) -> int:
    """Run the trainer through the operator's ``start`` command until it ends for good (see the
    module's docstring); the agent's exit status. ``start`` as a list: a command line run without a
    shell (``node.ranks``' torchrun), which ends with the agent and is stopped through its rank 0."""
    stopping: list[int] = []
    proc: subprocess.Popen | None = None
    direct = isinstance(start, list)
    told: set[int] = set()  # what a stop was passed to: rank-0 workers, process groups
    asked = [0.0]  # when the first stop came (monotonic)

    def pass_on(signum: int) -> None:
        """Pass a stop to the trainer: the operator's stop command, a torchrun group's rank 0 (once
        each: a group starting, or started again by torchrun, gets it when its rank 0 is up -- see
        :func:`_wait`), or the command's process group."""
        if proc is None or proc.poll() is not None:
            return
        if stop:
            subprocess.run(expand(stop, **values, signal=str(signum)), shell=True, check=False)
            return
        target, group = proc.pid, True
        if direct:
            rank_zero = torchrun_rank_zero(proc.pid)
            if rank_zero is not None and not _named(rank_zero, RANK0_READY):
                rank_zero = None  # (still starting: the signal would end it, and torchrun start it again)
            if rank_zero is None and time.monotonic() - asked[0] < GROUP_STOP_WAIT_S:
                return  # (torchrun alone would pass it to every rank and exit with an error)
            if rank_zero is not None:
                target, group = rank_zero, False
        if direct:  # (once to each: the wait passes it on to a group's rank 0 every second)
            if target in told:
                return
            told.add(target)
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(target, signum)
            else:
                os.kill(target, signum)

    def forward(signum: int, _frame: object) -> None:
        if not stopping:
            asked[0] = time.monotonic()
        stopping.append(signum)
        pass_on(signum)

    crashes = CrashBudget(max_restarts, window_s)
    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    leaving: BaseException | None = None
    try:
        while True:
            if stopping:  # asked to stop while no trainer ran
                return 0
            launch = uuid.uuid4().hex  # (the trainer's marker names it when it releases)
            env = dict(os.environ, **{LAUNCHED_ENV: launch})
            if isinstance(start, list):
                log.info("starting the trainer: %s", shlex.join(start))
                ending = ending_with_parent(os.getpid())
                proc = subprocess.Popen(start, start_new_session=True, env=env, preexec_fn=ending)
            else:
                command = expand(start, **values)
                log.info("starting the trainer: %s", command)
                proc = subprocess.Popen(command, shell=True, start_new_session=True, env=env)
            if stopping:  # (a stop that came while it was being started)
                pass_on(stopping[0])
            code = _wait(proc, (lambda: pass_on(stopping[0]) if stopping else None) if direct else None)
            log.info("the trainer's command ended with status %d", code)
            proc = None
            reap_children(timeout=REAP_S)  # what it left: a group's ranks whose torchrun was killed
            if code == 0 and released_by(values["run_dir"], launch):
                code = RELEASED_EXIT  # (a torchrun group's release: its ranks exit 0)
            if stopping:
                return 0 if code == RELEASED_EXIT else code if code >= 0 else 128 + stopping[0]
            if code == RELEASED_EXIT:
                helper = fork_child(presence) if presence is not None else 0  # (the site meanwhile)
                try:
                    again = released(lambda: bool(stopping)) and not stopping
                finally:
                    end_child(helper, timeout_s=PRESENCE_STOP_S)
                if again:
                    continue
                return 0  # the end while released: the trace, node.stop_at, or a stop
            killed = -code if code < 0 else code - 128 if code > 128 else 0
            if not killed or killed >= signal.NSIG:
                return code
            if not crashes.allow(signal.Signals(killed).name):
                return 1
    except BaseException as error:
        leaving = error
        raise
    finally:
        restore_or_settle(previous, leaving)  # (a status decided: a stop from here on leaves it as it is)


def _wait(proc: subprocess.Popen, every_s: Callable[[], None] | None = None) -> int:
    """The command's status, however many forwarded signals interrupt the wait; ``every_s`` runs
    every second meanwhile (a stop waiting for a torchrun group's rank 0)."""
    while True:
        try:
            return proc.wait(timeout=None if every_s is None else 1.0)
        except subprocess.TimeoutExpired:
            assert every_s is not None
            every_s()
        except InterruptedError:
            continue
