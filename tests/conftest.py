"""Shared fixtures: a harness that starts real greenswarm processes and reaps every one of them.

Multi-peer tests run the real commands (``python -m greenswarm bootstrap|node|progress``) with real
p2pd daemons on 127.0.0.1 and ephemeral ports. Each process starts in its own session, so killing
the session kills its p2pd daemons too; after every test the harness checks that no p2pd started
during the test is still alive, and fails the test if one is (after killing it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from greenswarm.averaging.config import LOOPBACK_TIMEOUTS
from greenswarm.scheduler.clock import WAITING_FOR_START, write_start_file
from tests._lanes import lanes

REPO = Path(__file__).resolve().parents[1]

#: below the untrained model's loss: ln(259) = 5.56 for the byte vocabulary the test and demo models
#: use, and their first step logs ~5.55. A site's reported loss is an EMA of its steps' losses, so a
#: site that trained from scratch only reaches this after enough steps (see :func:`loss_fell`)
UNTRAINED_LOSS = 5.45
#: a loss that shows the swarm learned: reached by the sites that trained and averaged longest
#: (~3 in a quiet run, ~3.6 beside a second soak, when sites trained flat out; ~2.9-3.1 at 5 steps/s,
#: test_overlap's sites), never by one that took only a few steps
LEARNED_LOSS = 4.5
#: a test site's cap on inner steps per wall second (``train.max_steps_per_s``). Flat out, each test
#: site took a core (~20 steps/s of the tiny model here, ~50 ms of CPU each) whatever its test needed,
#: and took fewer steps whenever another test loaded the machine (docs/testing.md rows 30-69); the
#: tests need tens of steps per window, and 5/s gives them that on a quiet machine and under load
#: alike, at a quarter of a core. (It cut the suite's CPU, not its wall time: issue #40's notes)
TEST_STEPS_PER_S = 5.0


def loss_fell(site: dict) -> bool:
    """Whether a site's summary shows its loss fell from where it started.

    The summary's ``loss`` is an EMA (weight 0.1) of the steps' losses, starting at ``first_loss``.
    A site that started untrained (``first_loss`` at or above ``UNTRAINED_LOSS``) must be below its
    own first loss; a fixed bar would measure the machine instead, since how far the EMA moves depends
    on how many steps the window held (in ``greenswarm demo``, CAISO's first window held 3 steps, 3072
    tokens, in a full soak beside a second one: loss 5.459 from ~5.55). A site that started from the
    swarm's model, adopted as it entered its window, must stay below the untrained model's: its own
    few steps on small batches can sit above its first one. One step leaves nothing to compare.
    """
    if site["local_steps"] < 2:
        return True
    return site["loss"] < max(site["first_loss"], UNTRAINED_LOSS)


#: every process this test process starts inherits this variable with this value (the harness's
#: commands, in-process DHTs' p2pd daemons, their orphans): whose daemons are whose is read from it, so a
#: second test process on the machine -- a parallel worker, a soak beside -- is never blamed or killed
OWNER_ENV = "GREENSWARM_TEST_OWNER"
OWNER = os.environ[OWNER_ENV] = str(os.getpid())

#: processes a harness started (directly or not) that outlived it: filled by :meth:`Swarm.close`,
#: checked and emptied by the ``no_orphan_daemons`` fixture
LEFT: list[str] = []


def owned(proc: psutil.Process) -> bool:
    """Whether ``proc`` was started (directly or not) by this test process."""
    try:
        return f"{OWNER_ENV}={OWNER}".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()
    except OSError:
        return False


def _p2pd_started_after(t0: float) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "create_time"]):
        try:
            if proc.info["name"] == "p2pd" and proc.info["create_time"] >= t0 - 1 and owned(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return found


#: test modules that keep a core or more busy -- several training sites (or torchrun ranks) at once,
#: measured 62-94 % of this 2-core machine while they ran alone when sites trained flat out (the rest of
#: the suite: 17-49 %, mostly waiting on replays, retries and polls) -- and test_deadline_node, whose
#: plans price hours by the throughput its sites measure. They carry the ``cpu_bound`` marker, and a
#: parallel run gives each of the two lanes below to one xdist worker, its modules one after another,
#: first; the third worker takes everything else beside them. Until test sites were paced
#: (``TEST_STEPS_PER_S``) this was one exclusive lane: a flat-out site took a core, and two such modules
#: side by side halved each other's step rates (test_fsdp's three-rank site missed its rounds, row 36;
#: test_deadline_node's shared target came in 3 trace hours late, row 35). A paced site needs a quarter
#: of a core, and the whole suite passed beside two busy processes (the soak of 3f984f5), so two lanes
#: now run side by side: the one lane's length was the suite's, and it was its replays, not its CPU.
#: The lanes are balanced by their modules' times in CI; within each, the modules that ever missed a
#: mark beside load come last, when the third worker has finished the heavy modules it starts with
CPU_LANES = (
    (
        "test_bootstrap_loss",
        "test_certified_swarm",
        "test_calibrated_node",
        "test_shards",
        "test_hardening",
        "test_demo",
        "test_release_node",
    ),
    (
        "test_nat",
        "test_overlap",
        "test_shutdown",
        "test_schedule_free_swarm",
        "test_swarm",
        "test_fault_campaign",
        "test_fsdp",
        "test_deadline_node",
    ),
)
CPU_BOUND = frozenset(module for lane in CPU_LANES for module in lane)
#: the other modules that train sites or start fresh Pythons: the third worker's first, beside the
#: lanes' first modules (none of which ever missed a mark beside a training site), so the lanes' tails
#: meet light tests or none
OTHER_FIRST = ("test_launchers", "test_metrics", "test_export", "test_live_signal_node")


def _lane(module: str) -> int | None:
    """Which of :data:`CPU_LANES` holds ``module`` (None: the other modules')."""
    return next((i for i, lane in enumerate(CPU_LANES) if module in lane), None)


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


def _queue_position(item: pytest.Item) -> tuple[int, int, int]:
    """Where a test is queued: the :data:`CPU_LANES` first, each in its order; then the other modules,
    :data:`OTHER_FIRST` first (file order otherwise)."""
    module = _module(item.nodeid)
    lane = _lane(module)
    if lane is not None:
        return (0, lane, CPU_LANES[lane].index(module))
    return (1, 0, OTHER_FIRST.index(module) if module in OTHER_FIRST else len(OTHER_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the :data:`CPU_BOUND` modules' tests, and queue them first (a parallel run gives each lane to
    one worker: they are the longest), in the order :func:`_queue_position` gives."""
    for item in items:
        if _module(item.nodeid) in CPU_BOUND:
            item.add_marker(pytest.mark.cpu_bound)
    items.sort(key=_queue_position)  # (stable: file order otherwise)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """pyproject's ``-n auto``: a worker for each lane that fits the machine (tests/_lanes.py) and one
    for the other modules."""
    return lanes()[0] + 1


def pytest_report_header(config: pytest.Config) -> str | None:
    return _lanes_line(config)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``-q`` (CI's command) there is no header: the layout's line is said all the same, once."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line = _lanes_line(config)
    if line is not None and reporter is not None and config.get_verbosity() < 0:
        reporter.write_line(line)


def _lanes_line(config: pytest.Config) -> str | None:
    """Which layout of :data:`CPU_LANES` this parallel run has, and why (None in a worker or without
    xdist's load scheduling)."""
    if config.getoption("dist", None) != "load" or hasattr(config, "workerinput"):  # (None: no xdist)
        return None
    count, why = lanes()
    return f"cpu-bound lanes side by side: {count} ({why})"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pyproject's ``-n auto`` (xdist's default ``--dist load``; any other ``--dist`` is xdist's own):
    loadscope (a module's tests on one worker, its module fixtures set up once), with each of the
    :data:`CPU_LANES` one scope, queued first (in collection order): one worker each, the last worker
    takes the other modules one by one, and a lane's worker takes them too once its lane is done. Where
    the machine has no room for two lanes (tests/_lanes.py) they run as one, one after the other. Not
    xdist's ``loadgroup``: it regroups by rewriting each item's ``_nodeid``, which pytest 9 no longer
    reads, so its groups silently fell apart (test_hardening's module fixture ran on both workers)."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":
        return None
    side_by_side = lanes()[0] == 2

    class CpuBoundFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            lane = _lane(_module(nodeid))
            if lane is None:
                return nodeid.split("::", 1)[0]
            return f"cpu_bound_{lane if side_by_side else 0}"

    config.option.loadscopereorder = False  # the collection's order: the lanes first
    return CpuBoundFirst(config, log)


@pytest.fixture(autouse=True)
def no_orphan_daemons() -> Iterator[None]:
    """Fail any test that leaves a p2pd daemon behind (and kill it, so others are not affected)."""
    t0 = time.time()
    yield
    deadline = time.monotonic() + 10
    left = _p2pd_started_after(t0)
    while left and time.monotonic() < deadline:  # daemons of a cleanly stopped peer exit within moments
        time.sleep(0.5)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in left:
        proc.kill()
    escaped = list(LEFT)
    LEFT.clear()
    if left or escaped:
        pytest.fail(
            f"left running after the test: {len(left)} p2pd daemon(s); "
            f"{len(escaped)} process(es) that outlived their command: {escaped}"
        )


class Swarm:
    """Starts greenswarm commands as separate processes and reaps them all at the end of a test."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def command(
        self, name: str, *args: str, prefix: list[str] | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        cmd = (prefix or [sys.executable, "-m", "greenswarm"]) + list(args)
        proc = subprocess.Popen(
            cmd,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # noqa: SIM115
            env={**self.env, **(env or {})},
            cwd=self.tmp,
        )
        self.procs[name] = proc
        return proc

    def bootstrap(
        self,
        name: str = "bootstrap",
        swarm: str = "test",
        listen: str = "/ip4/127.0.0.1/tcp/0",
        key: str = "",
        *extra: str,
    ) -> list[str]:
        """Start a bootstrap peer and return its --initial-peers multiaddrs (``key``: identity file
        name, default ``<name>.key``; reuse one with a fixed ``listen`` to restart the same peer;
        ``extra``: more flags, e.g. ``--authority``)."""
        self.command(
            name,
            "bootstrap",
            "--listen",
            listen,
            "--identity",
            str(self.tmp / (key or f"{name}.key")),
            "--swarm",
            swarm,
            "--json",
            *extra,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in self.logs[name].read_text().splitlines():
                if line.startswith("{"):
                    return json.loads(line)["initial_peers"]
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"bootstrap exited: {self.logs[name].read_text()[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError("bootstrap did not start")

    def write_config(self, name: str, cfg: dict[str, Any]) -> Path:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def node(
        self,
        name: str,
        config: Path,
        *extra: str,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start a site node; ``env`` adds variables (e.g. ``GREENSWARM_FAULTS``) for this one."""
        if prefix:
            return self.command(
                name, "-m", "greenswarm", "node", "--config", str(config), *extra, prefix=prefix, env=env
            )
        return self.command(name, "node", "--config", str(config), *extra, env=env)

    def run(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        """Run a short greenswarm command to completion (e.g. ``progress --json``)."""
        return self.run_in([], *args, timeout=timeout)

    def run_in(self, prefix: list[str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        """Like :meth:`run`, inside another context (``prefix``: e.g. ``ip netns exec NS``)."""
        return subprocess.run(
            [*prefix, sys.executable, "-m", "greenswarm", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.tmp,
            start_new_session=True,
        )

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            dumped = dump_stacks(self.procs[name].pid)  # what it waits on, into its log (the tail below)
            raise AssertionError(
                f"{name} did not finish in {timeout} s; stacks of {dumped} of its Python processes at "
                f"the timeout are at its log's end; log:\n{self.log(name)[-12000:]}"
            ) from None

    def stop(self, *names: str, timeout: float = 90) -> dict[str, int]:
        """Stop these commands as an operator does (``kill PID``: SIGTERM to the command alone, which a
        node takes as "checkpoint, write the summary, leave") and return their exit codes. A test whose
        question is answered stops its sites here instead of waiting out the rest of their trace."""
        for name in names:
            if self.procs[name].poll() is None:
                with contextlib.suppress(ProcessLookupError):  # (it may end between the two)
                    os.kill(_rank_zero(self.procs[name].pid), signal.SIGTERM)
        return {name: self.wait(name, timeout) for name in names}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a process's whole session (its p2pd daemons included)."""
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.procs[name].wait()

    def log(self, name: str) -> str:
        return self.logs[name].read_text()

    def start_replay(
        self, names: list[str], start_file: Path, lead_s: float = 0.5, timeout: float = 180
    ) -> float:
        """Start the replay of sites ``names`` (configured with ``start_file``) once every one of them has
        joined the swarm and waits for it -- however long that took on a busy machine -- and return the
        replay's start (Unix seconds): the shared moment their trace time begins."""
        deadline = time.monotonic() + timeout
        waiting = list(names)
        while waiting:
            waiting = [n for n in waiting if WAITING_FOR_START not in self.log(n)]
            for name in waiting:
                if self.procs[name].poll() is not None:
                    raise AssertionError(
                        f"{name} exited before the replay started:\n{self.log(name)[-3000:]}"
                    )
            if waiting and time.monotonic() > deadline:
                raise AssertionError(f"{', '.join(waiting)} not ready to start the replay in {timeout:.0f} s")
            time.sleep(0.1)
        start_wall = time.time() + lead_s
        write_start_file(start_file, start_wall)
        return start_wall

    def close(self) -> None:
        """Stop every command (SIGTERM to its session, then SIGKILL) and record in :data:`LEFT` any
        process it had started that is still alive afterwards -- also those outside its session, such
        as torch's shared-memory manager, which starts a session of its own."""
        started = []
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    started += psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    pass
        self._stop_all()
        gone_by = time.monotonic() + 5
        alive = [p for p in started if _alive(p)]
        while alive and time.monotonic() < gone_by:
            if all(_is_shm_manager(p) for p in alive) and not _escaped():  # (see _is_shm_manager)
                for proc in alive:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
                alive = []
                break
            time.sleep(0.2)
            alive = [p for p in alive if _alive(p)]
        for proc in alive:
            LEFT.append(f"{proc.pid} {proc.name()}")
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def dump_stacks(pid: int, settle_s: float = 1.0) -> int:
    """Ask ``pid`` and every process under it that catches SIGUSR1 as greenswarm's do (its DHT and
    averager helpers, a torchrun group's ranks: :func:`greenswarm.procs.stacks_on_request`) for every
    thread's stack, which each prints to the stderr it shares with the command's log; return how many
    were asked. Not a process that does not catch it (torchrun's agent, a Python still starting:
    SIGUSR1 would end them), nor a p2pd daemon (Go catches every signal, and ignores this one)."""
    from greenswarm.procs import STACKS_SIGNAL

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    asked = 0
    for proc in procs:
        try:
            if proc.name() == "p2pd" or not _catches(proc.pid, STACKS_SIGNAL):
                continue
            proc.send_signal(STACKS_SIGNAL)
            asked += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    time.sleep(settle_s)  # (each writes its own; a second is plenty for a few threads each)
    return asked


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


def _rank_zero(pid: int) -> int:
    """The process to stop a site through: under torchrun its rank-0 worker (see
    :func:`~greenswarm.node.launchers.torchrun_rank_zero`), otherwise ``pid`` itself."""
    from greenswarm.node.launchers import torchrun_rank_zero

    found = torchrun_rank_zero(pid)
    return pid if found is None else found


def progress_listings(output: str) -> list[list[dict]]:
    """The complete JSON listings ``greenswarm progress --watch --json`` has printed so far."""
    listings = []
    for line in output.splitlines():
        try:
            listings.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written, or a log line
            continue
    return [x for x in listings if isinstance(x, list)]


class ProgressWatch:
    """One ``greenswarm progress --watch 0.5 --json`` reader for a whole test, started again if it
    exits (it could not reach the swarm).

    A fresh ``greenswarm progress`` per question starts a DHT and a p2pd daemon and takes seconds to
    answer on a busy machine, longer than a short record lives: a site's last record expires
    ``progress_ttl_s`` after it stops, so what a site recorded near the end of its run could be missed
    between two questions. One reader prints a listing every half second.
    """

    def __init__(self, swarm: Swarm, *args: str, name: str = "watch"):
        self.swarm, self.args, self.name = swarm, args, name
        self.names: list[str] = []
        self._start()

    def _start(self) -> None:
        self.names.append(f"{self.name}{len(self.names)}")
        self.swarm.command(self.names[-1], "progress", *self.args, "--watch", "0.5", "--json")

    def listings(self) -> list[list[dict]]:
        """Every listing printed so far, oldest first."""
        if self.swarm.procs[self.names[-1]].poll() is not None:
            self._start()
        return [listing for name in self.names for listing in progress_listings(self.swarm.log(name))]

    def stop(self) -> None:
        self.swarm.kill(self.names[-1], signal.SIGTERM)


def _is_shm_manager(proc: psutil.Process) -> bool:
    """Whether ``proc`` is torch's shared-memory manager. It ends by itself 2 s after its last client
    disconnects (libshm's idle timeout), so once every other process of a test's commands is gone, and
    none of this test process's escaped (:func:`_escaped`), it has no client left and would end unasked:
    :meth:`Swarm.close` ends it then instead of waiting 2 s in every test's teardown. A manager with a
    client left is still waited for, and recorded."""
    try:
        return proc.name() == "torch_shm_manager"
    except psutil.NoSuchProcess:
        return False


def _escaped() -> list[psutil.Process]:
    """Processes this test process started (:func:`owned`) that left its tree (reparented when their
    parent ended) and still run, torch's shared-memory managers aside: a client such a manager may
    still serve."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    escaped = []
    for proc in psutil.process_iter():
        if proc.pid not in mine and owned(proc) and _alive(proc) and not _is_shm_manager(proc):
            escaped.append(proc)
    return escaped


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    harness = Swarm(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now: for a peer that must come back at the same address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def federated_rounds(run_dir: Path) -> int:
    """Rounds a site has applied with others so far, from its round log (``run_dir/rounds.jsonl``)."""
    from greenswarm.node.round_log import read_rounds

    if not (run_dir / "rounds.jsonl").exists():
        return 0
    return sum(
        1 for r in read_rounds(run_dir / "rounds.jsonl") if r["action"] == "apply" and len(r["members"]) > 1
    )


def shared_globals(root: Path, names: list[str]) -> dict[str, list[Path]]:
    """The global models every one of ``names`` kept (``node.keep_globals``, in ``root/NAME/globals``):
    file stem (outer step and lineage) -> each site's file. Only the names are read: a file being
    written is complete once its site has stopped."""
    kept: dict[str, list[Path]] = {}
    for name in names:
        for path in sorted((root / name / "globals").glob("outer-*.pt")):
            kept.setdefault(path.stem, []).append(path)
    return {stem: paths for stem, paths in kept.items() if len(paths) == len(names)}


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def write_trace(
    path: Path, regions: dict[str, list[float]], start: str = "2026-01-01T00:00:00Z", step_s: int = 300
) -> Path:
    """A wide CSV trace with one value per ``step_s`` per region (all lists the same length)."""
    from datetime import datetime, timedelta

    t0 = datetime.fromisoformat(start.replace("Z", "+00:00"))
    names = list(regions)
    rows = ["time," + ",".join(names)]
    for i in range(len(regions[names[0]])):
        stamp = (t0 + timedelta(seconds=i * step_s)).isoformat().replace("+00:00", "Z")
        rows.append(stamp + "," + ",".join(str(regions[n][i]) for n in names))
    path.write_text("\n".join(rows) + "\n")
    return path


def site_config(
    name: str,
    region: str,
    trace: Path,
    peers: list[str],
    run_dir: Path,
    *,
    speedup: float,
    start_wall: float | None = None,
    start_file: Path | None = None,
    sync_s: float,
    shard: int = 0,
    shards: int = 1,
    **sections: Any,
) -> dict:
    """A small, fast site config for multi-process tests (tiny model, one thread, replay clock that
    starts at ``start_wall``, or when :meth:`Swarm.start_replay` writes ``start_file``)."""
    clock: dict[str, Any] = {"kind": "replay", "speedup": speedup}
    clock.update({"start_file": str(start_file)} if start_file is not None else {"start_wall": start_wall})
    cfg: dict[str, Any] = {
        "name": name,
        "region": region,
        "swarm": {"name": "test", "initial_peers": peers, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},
        "data": {"shard_index": shard, "num_shards": shards, "seq_len": 64},
        "train": {"threads": 1, "batch_size": 4, "micro_batch_size": 4, "max_steps_per_s": TEST_STEPS_PER_S},
        "scheduler": {
            "trace": str(trace),
            "clock": clock,
        },
        "averaging": {"sync_interval_s": sync_s, **LOOPBACK_TIMEOUTS},
        "node": {
            "run_dir": str(run_dir),
            "progress_refresh_s": 1.0,
            "progress_ttl_s": 8.0,
            "log_every_s": 5.0,
        },
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg
