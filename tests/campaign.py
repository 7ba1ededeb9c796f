"""A fault campaign: a real three-site swarm on loopback whose sites are killed (or frozen) at named
points, restarted, and checked -- used by ``tests/test_fault_campaign.py`` (a few faults, one per
kind of point) and ``benchmarks/fault_campaign.py`` (20 randomized ones).

Each site runs with ``GREENSWARM_FAULTS`` set to its next planned fault (``kill:allreduce@2`` ...),
so the site itself dies -- node, hivemind processes and p2pd daemons together -- at exactly that
point; the campaign notices, inspects what the dead site left on disk, and restarts it with its next
fault. A ``stop`` fault freezes the site (SIGSTOP); the campaign thaws it after ``stop_s`` and
restarts it cleanly (SIGTERM) a few rounds later. Afterwards every site's round log
(``rounds.jsonl``) is read to check that no two sites ever held different global models for the same
outer step and lineage, and how long survivors waited in any round.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from greenswarm.averaging.config import LOOPBACK_TIMEOUTS
from greenswarm.faults import PROCESS_POINTS, signal_site
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.round_log import read_rounds
from tests.conftest import Swarm, site_config, write_trace

SITES = ("site-0", "site-1", "site-2")
ACTIONS = ("apply", "resync", "fail", "solo")  # what a round log entry says a round did
SPEEDUP, SYNC_S = 300.0, 600.0  # a round every 2 wall seconds
ARM_TIMEOUT_S = 150.0  # a (re)started site must average with the others within this: start-up included
#: the files a finished checkpoint write leaves (``checkpoint.pt.tmp`` is one under way)
CHECKPOINT_FILES = ("checkpoint.pt", "checkpoint.prev.pt")
# the trace's length: longer than a campaign may take (run()'s 240 s, then finish() waits up to
# ARM_TIMEOUT_S after the last restart), so sites are stopped by finish() and never by the trace's end.
# At 24 h (288 wall s) a site restarted late on a loaded machine (restarts then took ~60 s) reached
# the trace's end before it could average again, and the campaign counted it as never back.
WINDOW_H = 48  # 576 wall s at SPEEDUP
VISITS = {  # which visit of each point a planned fault fires on: early enough to come up soon
    "step": (15, 120),
    "matchmaking": (1, 3),
    "allreduce": (1, 3),
    "checkpoint": (1, 3),
    "serve-state": (1, 1),
}


@dataclass
class Fault:
    site: str
    action: str  # kill | stop
    point: str
    visit: int

    @property
    def plan(self) -> str:
        return f"{self.action}:{self.point}@{self.visit}"


@dataclass
class FaultResult:
    """What one fault did: when it fired, what the dead (or frozen) site left, how it came back."""

    fault: Fault
    fired: bool = False  # False: the point did not come up in time and the site was killed from outside
    fired_after_s: float | None = None  # since the site's (re)start
    checkpoint: dict[str, str] = field(default_factory=dict)  # file -> ok | missing | damaged | torn
    resumed_outer_round: int | None = None
    nan: bool = False
    exit_code: int | None = None  # the dead site's exit status (-9: killed at its point)
    left_processes: int = 0  # processes of the dead site still alive after it died
    restart_to_round_s: float | None = None  # respawn -> first round averaged with others
    resumed_as_saved: bool | None = None  # the restart resumed the outer step its checkpoint held


def plan_faults(n: int, seed: int, stop_share: float = 0.25) -> list[Fault]:
    """``n`` faults over random sites, points and visits (every point at least once when n >= 5);
    about ``stop_share`` of those at network points freeze the site instead of killing it."""
    rng = random.Random(seed)
    extra = max(0, n - len(PROCESS_POINTS))
    points = list(PROCESS_POINTS) + [rng.choice(PROCESS_POINTS) for _ in range(extra)]
    rng.shuffle(points)
    faults = []
    for point in points[:n]:
        network = point in ("matchmaking", "allreduce", "serve-state")
        action = "stop" if network and rng.random() < stop_share else "kill"
        faults.append(Fault(rng.choice(SITES), action, point, rng.randint(*VISITS[point])))
    return faults


def inspect_checkpoints(run_dir: Path) -> tuple[dict[str, str], int | None, bool]:
    """Each checkpoint file's state, the outer step a restart resumes from, and whether it holds NaN.

    A ``checkpoint.pt.tmp`` that does not verify is ``torn``, not damaged: the writer thread was
    still writing it when the kill landed (at any point of the loop, since it writes beside
    training), and the restart skips it by design. ``damaged`` is kept for a file that had been
    completed (``checkpoint.pt``, ``checkpoint.prev.pt``) and no longer verifies."""
    checkpointer = Checkpointer(run_dir)
    states = {}
    for path in (checkpointer.path, checkpointer.previous, checkpointer.pending):
        if not path.exists():
            states[path.name] = "missing"
        elif checkpointer.read(path) is not None:
            states[path.name] = "ok"
        else:
            states[path.name] = "torn" if path == checkpointer.pending else "damaged"
    payload = checkpointer.load()
    if payload is None:
        return states, None, False
    tensors = [*payload["outer"], *payload["trainer"]["model"].values()]
    nan = any(not torch.isfinite(t).all() for t in tensors if torch.is_tensor(t) and t.is_floating_point())
    return states, int(payload["site"]["outer_round"]), nan


def _had_checkpoint(result: FaultResult) -> bool:
    """Whether the dead site had completed a checkpoint (``checkpoint.pt`` or ``checkpoint.prev.pt``)."""
    return any(result.checkpoint.get(name, "missing") != "missing" for name in CHECKPOINT_FILES)


def _session_alive(pid: int, grace_s: float = 3.0) -> int:
    """Processes of the session ``pid`` leads (zombies excluded) that outlive ``grace_s``: a process
    SIGKILLed a moment ago may not have been reaped yet."""
    deadline = time.monotonic() + grace_s
    while (alive := _count_session(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _count_session(pid: int) -> int:
    alive = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                alive += 1
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return alive


class Campaign:
    """Runs the sites of one campaign under a :class:`~tests.conftest.Swarm` harness."""

    def __init__(
        self, swarm: Swarm, workdir: Path, faults: list[Fault], fire_timeout_s: float = 90.0, **sections: Any
    ):
        """``sections``: more config for every site (e.g. ``averaging={"overlap": True}``)."""
        self.swarm, self.workdir = swarm, workdir
        self.sections = sections
        self.queue = {site: [f for f in faults if f.site == site] for site in SITES}
        self.results: list[FaultResult] = []
        self.fire_timeout_s = fire_timeout_s
        self.stop_s = LOOPBACK_TIMEOUTS["allreduce_timeout_s"] / 2
        self.incarnation = dict.fromkeys(SITES, 0)
        self.spawned: dict[str, float] = {}  # site -> wall time of its current process's spawn
        self.configs: dict[str, Path] = {}
        self.restarts: list[tuple[str, float, int]] = []  # (site, spawn wall time, pid) after a fault

    # ---- running ----

    def start(self, hours: float = WINDOW_H) -> None:
        trace = write_trace(self.workdir / "green.csv", {"GREEN": [10.0] * int(hours)}, step_s=3600)
        peers = self.swarm.bootstrap()
        start_file = self.workdir / "start"
        for i, site in enumerate(SITES):
            # restart: never -- a fault here takes the whole site down, as a machine failure would
            node = {"progress_ttl_s": 4.0, "restart": "never"}
            cfg = site_config(
                site, "GREEN", trace, peers, self.workdir / site, speedup=SPEEDUP, start_file=start_file,
                sync_s=SYNC_S, shard=i, shards=len(SITES), node=node, **self.sections,
            )  # fmt: skip
            self.configs[site] = self.swarm.write_config(site, cfg)
            self._spawn(site)
        self.swarm.start_replay([self.current[site] for site in SITES], start_file)  # restarts read it too

    def _spawn(self, site: str) -> None:
        fault = self.queue[site][0] if self.queue[site] else None
        # the fault waits until the site has averaged once in this life: every restart is measured
        # back to a round before the site falls again
        env = {"GREENSWARM_FAULTS": f"after-rounds@1,{fault.plan}"} if fault else {}
        name = f"{site}#{self.incarnation[site]}"
        self.incarnation[site] += 1
        self.spawned[site] = time.time()
        self.swarm.node(name, self.configs[site], env=env)
        self.current = getattr(self, "current", {})
        self.current[site] = name

    def run(self, timeout_s: float) -> None:
        """Until every planned fault has happened (or ``timeout_s``); restart sites as they fall."""
        deadline = time.monotonic() + timeout_s
        while any(self.queue.values()) and time.monotonic() < deadline:
            for site in SITES:
                if self.queue[site]:
                    self._watch(site)
            time.sleep(0.1)

    def _watch(self, site: str) -> None:
        name = self.current[site]
        proc = self.swarm.procs[name]
        fault = self.queue[site][0]
        age = time.time() - self.spawned[site]
        if proc.poll() is not None:  # died at its point (or crashed: exit_code says which)
            fired = proc.returncode == -signal.SIGKILL or self._recorded(site, proc.pid, fault)
            result = FaultResult(fault, fired=fired, fired_after_s=age)
            result.exit_code = proc.returncode
            self._after_death(site, result)
        elif _stopped(proc.pid):
            self._after_stop(site, FaultResult(fault, fired=True, fired_after_s=age))
        elif self._overdue(site):  # the point never came up: kill from outside, say so
            self.swarm.kill(name, signal.SIGKILL)
            self._after_death(site, FaultResult(fault, fired=False, fired_after_s=age))

    def _recorded(self, site: str, pid: int, fault: Fault) -> bool:
        """Whether this life of ``site`` recorded ``fault`` as firing before it died. The kill signals
        the site's children first and itself last; a C++ thread that writes to a child's pipe in that
        instant can abort the process (SIGABRT, "terminate called ... Broken pipe") before its own
        SIGKILL lands: the fault fired all the same, and ``exit_code`` says how the process ended."""
        path = self.workdir / site / "faults.jsonl"
        if not path.exists():
            return False
        return any(
            e.get("pid") == pid and e.get("point") == fault.point and e.get("action") == fault.action
            for e in read_rounds(path)
        )

    def _overdue(self, site: str) -> bool:
        """Whether the site's fault should have fired by now: ``fire_timeout_s`` after it was armed
        (the site's first averaged round in this life, which ``after-rounds@1`` waits for), or
        ``ARM_TIMEOUT_S`` after the spawn for a site that never averaged. Counting from the spawn
        alone made a slow start on a busy machine look like a fault that never came up."""
        now = time.time()
        armed = self._first_averaged(site)
        if armed is None:
            return now - self.spawned[site] > ARM_TIMEOUT_S
        return now - armed > self.fire_timeout_s

    def _first_averaged(self, site: str) -> float | None:
        """Wall time of the current process's first round averaged with others, applied or resynced
        from them (None: none yet)."""
        pid = self.swarm.procs[self.current[site]].pid
        for e in read_rounds(self.workdir / site / "rounds.jsonl"):
            averaged = e["action"] == "resync" or (e["action"] == "apply" and len(e["members"]) > 1)
            if e["pid"] == pid and averaged:  # what arms after-rounds@1 (FaultPlan.round_done)
                return e["wall_time"]
        return None

    def _after_death(self, site: str, result: FaultResult) -> None:
        name = self.current[site]
        result.left_processes = _session_alive(self.swarm.procs[name].pid)
        self.swarm.kill(name, signal.SIGKILL)  # reap (and clean up anything left, counted above)
        result.checkpoint, result.resumed_outer_round, result.nan = inspect_checkpoints(self.workdir / site)
        self._next(site, result)

    def _after_stop(self, site: str, result: FaultResult) -> None:
        name = self.current[site]
        time.sleep(self.stop_s)  # frozen: the others must give up on it and go on
        signal_site(self.swarm.procs[name].pid, signal.SIGCONT)  # the whole tree, as it was frozen
        thawed = time.time()
        deadline = time.monotonic() + 10 * SYNC_S / SPEEDUP
        while time.monotonic() < deadline and not self._round_since(site, thawed):
            time.sleep(0.1)  # thawed: it must notice that its round failed, and end one again
        self.swarm.kill(name, signal.SIGTERM)  # then a clean stop (final checkpoint) and a restart
        self.swarm.wait(name, timeout=60)
        result.left_processes = _session_alive(self.swarm.procs[name].pid)
        result.checkpoint, result.resumed_outer_round, result.nan = inspect_checkpoints(self.workdir / site)
        self._next(site, result)

    def _next(self, site: str, result: FaultResult) -> None:
        self.results.append(result)
        self.queue[site].pop(0)
        self._spawn(site)
        self.restarts.append((site, self.spawned[site], self.swarm.procs[self.current[site]].pid))

    def finish(self, settle_s: float) -> None:
        """Wait until every restarted site has averaged again, let the swarm run ``settle_s`` more
        without faults, then stop every site cleanly.

        A site that is not back is given up on ``ARM_TIMEOUT_S`` after its spawn, the start-up
        allowance every life gets while faults are armed (:meth:`_overdue`). A fixed 60 s from here
        was shorter than that: a site respawned just before, on a loaded machine, took about a minute
        to join, and the report counted it as never averaging again."""
        deadline = max(self.spawned.values()) + ARM_TIMEOUT_S
        while time.time() < deadline and not self._all_back():
            time.sleep(0.5)
        time.sleep(settle_s)
        for site in SITES:
            self.swarm.kill(self.current[site], signal.SIGTERM)
        for site in SITES:
            self.swarm.wait(self.current[site], timeout=60)

    def _round_since(self, site: str, wall: float) -> bool:
        """Whether the site's current process has ended a round (any outcome) since wall time ``wall``."""
        pid = self.swarm.procs[self.current[site]].pid
        return any(
            e["pid"] == pid and e["wall_time"] > wall
            for e in read_rounds(self.workdir / site / "rounds.jsonl")
        )

    def _all_back(self) -> bool:
        for site in SITES:
            pid = self.swarm.procs[self.current[site]].pid
            entries = read_rounds(self.workdir / site / "rounds.jsonl")
            if not any(e["pid"] == pid and len(e["members"]) > 1 for e in entries):
                return False
        return True

    # ---- checking ----

    def report(self) -> dict[str, Any]:
        rounds = {site: read_rounds(self.workdir / site / "rounds.jsonl") for site in SITES}
        self._restart_times(rounds)
        states: dict[tuple[int, str], set[str]] = {}
        for entries in rounds.values():
            for e in entries:
                if e["action"] in ("apply", "resync", "solo"):
                    states.setdefault((e["outer_round"], e["lineage"]), set()).add(e["digest"])
        diverged = sorted(f"{r}/{lineage}" for (r, lineage), d in states.items() if len(d) > 1)
        federated = [e for entries in rounds.values() for e in entries if e["round_s"] is not None]
        allreduce = [e["allreduce_s"] for e in federated if e["allreduce_s"] is not None]
        restart = [r.restart_to_round_s for r in self.results if r.restart_to_round_s is not None]
        final = {site: rounds[site][-1] if rounds[site] else None for site in SITES}
        return {
            "faults": [dict(asdict(r), fault=asdict(r.fault) | {"plan": r.fault.plan}) for r in self.results],
            "fired": sum(r.fired for r in self.results),
            "damaged_checkpoints": sum(s == "damaged" for r in self.results for s in r.checkpoint.values()),
            "torn_writes": sum(s == "torn" for r in self.results for s in r.checkpoint.values()),
            # a site killed before its first checkpoint was complete (both files missing: the writer
            # renames a finished file into place and never deletes one) starts fresh, as it must, and
            # takes the swarm's state; seen beside two busy processes, where an overlapped site's first
            # background write was still under way at its second all-reduce (docs/testing.md row 80)
            "unrecoverable": sum(r.resumed_outer_round is None and _had_checkpoint(r) for r in self.results),
            "fresh_starts": sum(not _had_checkpoint(r) for r in self.results),
            "resumed_otherwise": sum(r.resumed_as_saved is False for r in self.results),
            "nan": sum(r.nan for r in self.results),
            "left_processes": sum(r.left_processes for r in self.results),
            "states_checked": len(states),
            "diverged": diverged,
            "rounds": {a: sum(e["action"] == a for x in rounds.values() for e in x) for a in ACTIONS},
            "max_allreduce_s": max(allreduce, default=None),
            "allreduce_timeout_s": LOOPBACK_TIMEOUTS["allreduce_timeout_s"],
            "max_round_s": max((e["round_s"] for e in federated), default=None),
            "max_blocked_s": max((e["blocked_s"] for x in rounds.values() for e in x), default=None),
            "restart_to_round_s": restart,
            "median_restart_to_round_s": statistics.median(restart) if restart else None,
            "final": {s: (e["outer_round"], e["digest"]) if e else None for s, e in final.items()},
        }  # fmt: skip

    def _restart_times(self, rounds: dict[str, list[dict[str, Any]]]) -> None:
        """Each restart's time from respawn to its first round averaged with another site."""
        for (site, spawned, pid), result in zip(self.restarts, self.results, strict=False):
            name = next(n for n, p in self.swarm.procs.items() if p.pid == pid)
            resumed = re.search(r"resumed from \S+: outer step (\d+)", self.swarm.log(name))
            if resumed:
                result.resumed_as_saved = int(resumed.group(1)) == result.resumed_outer_round
            else:  # (a site with no complete checkpoint resumes nothing: it starts fresh)
                result.resumed_as_saved = result.resumed_outer_round is None
            back = [e for e in rounds[site] if e["pid"] == pid and e["action"] in ("apply", "resync")]
            first = next((e for e in back if len(e["members"]) > 1), None)
            if first is not None:
                result.restart_to_round_s = round(first["wall_time"] - spawned, 2)


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def dump(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2))


def supervised_restarts(swarm: Swarm, workdir: Path, duration_s: float, points: list[str]) -> dict[str, Any]:
    """Three supervised sites (``node.restart: on-crash``) whose node processes die again and again --
    each life ends at its ``points[i]`` fault once it has averaged -- while their supervisors fork
    new ones. Returns each restart's seconds from the kill to averaging with others again."""
    trace = write_trace(workdir / "green.csv", {"GREEN": [10.0] * 48}, step_s=3600)
    peers = swarm.bootstrap()
    start_file = workdir / "start"
    for i, site in enumerate(SITES):
        node = {"progress_ttl_s": 4.0, "max_restarts": 10_000}
        cfg = site_config(
            site, "GREEN", trace, peers, workdir / site, speedup=SPEEDUP, start_file=start_file,
            sync_s=SYNC_S, shard=i, shards=len(SITES), node=node,
        )  # fmt: skip
        point = points[i % len(points)]
        visit = VISITS[point][0] if point != "step" else 40
        plan = f"after-rounds@1,kill:{point}@{visit}"
        swarm.node(site, swarm.write_config(site, cfg), env={"GREENSWARM_FAULTS": plan})
    swarm.start_replay(list(SITES), start_file)
    time.sleep(duration_s)  # the measurement's length: restarts keep coming until then
    for site in SITES:
        swarm.kill(site, signal.SIGTERM)
    for site in SITES:
        swarm.wait(site, timeout=60)
    restarts = []
    for site in SITES:
        kills = read_rounds(workdir / site / "faults.jsonl")
        rounds = [e for e in read_rounds(workdir / site / "rounds.jsonl") if len(e["members"]) > 1]
        for kill in kills:
            later = (e for e in rounds if e["pid"] != kill["pid"] and e["wall_time"] > kill["wall_time"])
            back = next(later, None)
            seconds = None if back is None else round(back["wall_time"] - kill["wall_time"], 2)
            restarts.append({"site": site, "point": kill["point"], "seconds": seconds})
    measured = [r["seconds"] for r in restarts if r["seconds"] is not None]
    return {
        "restarts": restarts,
        "median_s": statistics.median(measured) if measured else None,
        "measured": len(measured),
    }


def run_campaign(swarm: Swarm, workdir: Path, faults: list[Fault], **sections: Any) -> dict[str, Any]:
    """Run one campaign to its end (faults, restarts, a settled swarm) and return its report, also
    written to ``workdir/report.json``."""
    campaign = Campaign(swarm, workdir, faults, **sections)
    campaign.start()
    campaign.run(timeout_s=240)
    campaign.finish(settle_s=4)
    report = campaign.report()
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def assert_survived(report: dict[str, Any], faults: list[Fault]) -> None:
    """What every campaign must show: each fault fired; every checkpoint verifies, holds no NaN and
    is what the restart resumed; nothing was left running; no two sites diverged; every restarted site
    averaged again; and a kill between a checkpoint's renames left a complete new file to resume from."""
    summary = json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=1)
    assert len(report["faults"]) == len(faults), summary
    assert report["fired"] == len(faults), json.dumps(report["faults"], indent=1)
    assert report["damaged_checkpoints"] == report["unrecoverable"] == report["nan"] == 0, summary
    assert report["resumed_otherwise"] == 0, summary  # every restart resumed what its checkpoint held
    assert report["left_processes"] == 0, summary
    assert report["diverged"] == [], summary
    assert all(r["restart_to_round_s"] is not None for r in report["faults"]), json.dumps(report["faults"])
    for kill in (r for r in report["faults"] if r["fault"]["point"] == "checkpoint"):
        # no checkpoint.pt (it died between the renames), but a complete new file: nothing lost
        assert kill["checkpoint"] == {
            "checkpoint.pt": "missing",
            "checkpoint.prev.pt": "ok",
            "checkpoint.pt.tmp": "ok",
        }, kill
