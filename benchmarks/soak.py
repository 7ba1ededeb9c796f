"""Soak: run chosen pytest markers (or the whole suite) N times in a row and count what fails.

A submission lands only when CI passes, so a test that fails one run in ten costs real work. This
script measures how often each test fails instead of guessing. Every run is a fresh ``pytest``
process in a fresh temporary directory (its ``--basetemp``, ``TMPDIR`` and pytest cache), with the
environment ``.ci/run`` sets (``GREENSWARM_REQUIRE_SHARED=1`` and the rest of :data:`CI_ENV`), so a
run cannot lean on what an earlier one left behind. Outcomes are read from pytest's JUnit XML.

By default one run is one pytest process over all the markers given (``-m "swarm or faults ..."``),
so each test runs once per run and "10 runs" means 10 consecutive runs of every marker;
``--separately`` gives each marker its own pytest process per run instead. ``--full`` runs the
whole suite (the ``pytest -q`` of ``.ci/run``). ``--hog K`` keeps K busy processes spinning beside
the runs, as on a shared CI machine.

Printed: one line per run as it ends, then a table of every test that failed at least once (test
id, runs, failures, and the first line of each distinct failure, with how often it was seen), then
per marker: tests, runs, and runs in which any of its tests failed. A run that leaves a p2pd daemon
behind, or whose pytest process itself fails (crash, timeout, collection error), is a failure too.
A run during which the machine itself stopped is marked (``paused``), and its failures are the
machine's to explain before anyone's test: this sandbox's VM is sometimes snapshotted, frozen for
tens of seconds ("virtual machine fork" in the kernel log), and a watchdog thread sees any stall of
the whole machine as a gap of seconds between its ticks of 0.2 s (wall or monotonic clock).
``--json`` prints the whole report as JSON instead; ``--keep DIR`` keeps every run's JUnit XML and
pytest output there, and after a failure its tests' directories (logs, configs, round logs).

    python benchmarks/soak.py [-m swarm faults nat security compression] [--runs 10] [--hog 2]
    python benchmarks/soak.py --full --runs 3 [--hog 2] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MARKERS = ("swarm", "faults", "nat", "security", "compression")
#: what .ci/run exports: tests that would skip elsewhere must run (and fail if they cannot)
CI_ENV = {
    "GREENSWARM_REQUIRE_SHARED": "1",
    "GREENSWARM_REQUIRE_NAT": "1",
    "GREENSWARM_REQUIRE_BROWSER": "1",
    "GREENSWARM_REQUIRE_SLURM": "1",
}
RUN_ID = "<pytest run>"  # the row for failures of a run as a whole (crash, timeout, leaked daemons)
MARKER_ENV = "GREENSWARM_SOAK_RUN"  # inherited by everything a run starts: whose p2pd daemons are whose
LEAK_GRACE_S = 10.0  # a daemon whose peer was stopped cleanly exits within moments (tests/conftest.py)
VM_FORK = "virtual machine fork"  # the kernel's line when its VM was snapshotted and resumed
STALL_TICK_S, STALL_S = 0.2, 2.0  # a tick of 0.2 s that took 2 s: the machine (not a process) stopped


@dataclass
class RunResult:
    """One pytest process: what it ran and what failed in it."""

    index: int
    selection: str
    markers: list[str]  # the markers this run covered (empty: the whole suite)
    seconds: float
    returncode: int
    passed: int = 0
    skipped: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # test id -> first line of its failure
    leaked: list[str] = field(default_factory=list)  # p2pd daemons alive after the run
    paused: list[str] = field(default_factory=list)  # the machine stopped during the run (see VmWatch)


def vm_forks() -> int | None:
    """How many times the kernel log says its VM was snapshotted (None: the log cannot be read)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.count(VM_FORK) if out.returncode == 0 else None


class VmWatch:
    """Sees the whole machine stop during a run: new "virtual machine fork" lines in the kernel log,
    and ticks of a 0.2 s sleep that took seconds on either clock (a frozen VM's monotonic clock may
    not advance, its wall clock then jumps)."""

    def __init__(self) -> None:
        self.forks_before = vm_forks()
        self.stalls: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="vm-watch", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        mono, wall = time.monotonic(), time.time()
        while not self._stop.wait(STALL_TICK_S):
            now_mono, now_wall = time.monotonic(), time.time()
            gap = max(now_mono - mono, now_wall - wall)
            if gap >= STALL_S:
                at = time.strftime("%H:%M:%S", time.localtime(wall))
                self.stalls.append(f"machine stalled {gap:.1f} s at {at}")
            mono, wall = now_mono, now_wall

    def finish(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        after = vm_forks()
        forks = []
        if self.forks_before is not None and after is not None and after > self.forks_before:
            forks = [f"VM snapshotted {after - self.forks_before}x (kernel log: '{VM_FORK}')"]
        return forks + self.stalls


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:240]
    return "(no message)"


def test_id(case: ET.Element) -> str:
    """``tests/test_x.py::Class::name`` from a JUnit ``testcase`` (xunit1 carries the file)."""
    file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    parts = case.get("classname", "").split(".")
    module = Path(file).stem
    inner = parts[parts.index(module) + 1 :] if module in parts else []
    return "::".join([file, *inner, case.get("name", "?")])


def read_junit(path: Path, result: RunResult) -> None:
    """Fill ``result`` from a JUnit file; a test with a failure or an error (setup or teardown) failed."""
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = test_id(case)
        bad = [el for el in case if el.tag in ("failure", "error")]
        if bad:
            el = bad[0]
            result.failed.setdefault(tid, first_line(el.get("message", "") or el.text or ""))
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1


def run_pids(marker: str, comm: str | None = None) -> set[int]:
    """Processes started under one run (only those named ``comm``, if given): they inherit its
    ``GREENSWARM_SOAK_RUN`` marker, so other programs' processes on a shared machine are never
    counted (or killed)."""
    pids = set()
    tag = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if comm is not None and (entry / "comm").read_text().strip() != comm:
                    continue
                if tag in (entry / "environ").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def p2pd_pids(marker: str) -> set[int]:
    """p2pd daemons started under one run."""
    return run_pids(marker, "p2pd")


def run_pytest(
    index: int,
    selection: list[str],
    label: str,
    markers: list[str],
    timeout_s: float,
    keep: Path | None,
    extra: list[str],
) -> RunResult:
    """One fresh pytest process in a fresh temporary directory; its session is killed on timeout."""
    work = Path(tempfile.mkdtemp(prefix=f"greenswarm-soak-{index}-"))
    junit = work / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-o",
        "junit_family=xunit1",
        "-o",
        f"cache_dir={work / 'cache'}",
        f"--basetemp={work / 'basetemp'}",
        f"--junitxml={junit}",
        *selection,
        *extra,
    ]
    env = {**os.environ, **CI_ENV, "TMPDIR": str(work), MARKER_ENV: work.name}
    t0 = time.monotonic()
    watch = VmWatch()
    with open(work / "pytest.out", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            rc = -9 if rc == 0 else rc
        except BaseException:  # interrupted: the run is in a session of its own, so stop it here,
            with contextlib.suppress(ProcessLookupError):  # and what its tests started in theirs
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pid in run_pids(work.name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(work, ignore_errors=True)
            raise
    result = RunResult(index, label, markers, time.monotonic() - t0, rc, paused=watch.finish())
    if junit.exists():
        try:
            read_junit(junit, result)
        except ET.ParseError as exc:
            result.failed[RUN_ID] = f"unreadable JUnit XML: {exc}"
    if rc not in (0, 1) or (rc == 1 and not result.failed):
        tail = (work / "pytest.out").read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        why = "timed out" if rc == -9 else f"pytest exited with status {rc}"
        result.failed.setdefault(RUN_ID, f"{why}: {tail[0][:200]}")
    deadline = time.monotonic() + LEAK_GRACE_S
    while (left := p2pd_pids(work.name)) and time.monotonic() < deadline:
        time.sleep(0.5)  # the last test's daemons may still be on their way out
    result.leaked = sorted(str(p) for p in left)
    if result.leaked:
        result.failed.setdefault(RUN_ID, f"{len(result.leaked)} p2pd daemon(s) left running after the run")
        for pid in result.leaked:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    if keep:
        _keep(
            work,
            keep / f"run-{index:02d}-{re.sub(r'[^a-z0-9]+', '-', label.lower())[:40]}",
            bool(result.failed),
        )
    shutil.rmtree(work, ignore_errors=True)
    return result


def _keep(work: Path, dest: Path, failed: bool) -> None:
    """Keep a run's JUnit XML and output; after a failure also its tests' directories (logs, configs,
    round logs), without sockets or checkpoints."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("junit.xml", "pytest.out"):
        if (work / name).exists():
            shutil.copy2(work / name, dest / name)
    if failed and (work / "basetemp").is_dir():

        def skip(folder: str, names: list[str]) -> list[str]:
            return [n for n in names if n.endswith(".pt") or _special(Path(folder) / n)]

        shutil.copytree(work / "basetemp", dest / "basetemp", symlinks=True, ignore=skip, dirs_exist_ok=True)


def _special(path: Path) -> bool:
    """Sockets, pipes and dangling links: nothing to keep, and copying them fails."""
    try:
        return not (path.is_dir() or path.is_file())
    except OSError:
        return True


def collect(markers: list[str]) -> dict[str, set[str]]:
    """Which test ids carry each marker (pytest's own selection, so the counts match its ``-m``)."""
    found: dict[str, set[str]] = {}
    for marker in markers:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m", marker],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, **CI_ENV},
        ).stdout
        found[marker] = {line.strip() for line in out.splitlines() if "::" in line}
    return found


def normalize(message: str) -> str:
    """Group failures that differ only in numbers (ports, pids, seconds, addresses)."""
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "N", message)


def report(runs: list[RunResult], by_marker: dict[str, set[str]], args: argparse.Namespace) -> dict:
    failures: dict[str, list[str]] = defaultdict(list)
    for run in runs:
        for tid, message in run.failed.items():
            failures[tid].append(message)
    rows = []
    for tid, messages in sorted(failures.items()):
        distinct: dict[str, list] = {}
        for m in messages:
            distinct.setdefault(normalize(m), [m, 0])[1] += 1
        runs_of_test = sum(1 for r in runs if tid in r.failed or _ran(tid, r, by_marker))
        rows.append(
            {
                "test": tid,
                "runs": runs_of_test,
                "failures": len(messages),
                "distinct": [{"first_line": m, "count": n} for m, n in distinct.values()],
            }
        )
    markers = {}
    for marker, tests in by_marker.items():
        covering = [r for r in runs if not r.markers or marker in r.markers]
        markers[marker] = {
            "tests": len(tests),
            "runs": len(covering),
            "runs_with_failure": sum(1 for r in covering if any(t in tests or t == RUN_ID for t in r.failed)),
        }
    return {
        "command": " ".join(sys.argv),
        "hog": args.hog,
        "runs": [asdict(r) for r in runs],
        "failed_tests": rows,
        "markers": markers,
        "total_runs": len(runs),
        "runs_with_failure": sum(1 for r in runs if r.failed),
        "runs_with_machine_pause": sum(1 for r in runs if r.paused),
        "median_run_s": sorted(r.seconds for r in runs)[len(runs) // 2] if runs else None,
    }


def _ran(tid: str, run: RunResult, by_marker: dict[str, set[str]]) -> bool:
    """Whether ``run`` ran test ``tid`` (every run has a whole-run row)."""
    if tid == RUN_ID or not run.markers:
        return True
    return any(tid in by_marker.get(marker, ()) for marker in run.markers)


def print_report(rep: dict) -> None:
    print()
    hog = f" (CPU hog: {rep['hog']} busy processes)" if rep["hog"] else ""
    median = rep["median_run_s"] or 0
    paused = f", {rep['runs_with_machine_pause']} during which the machine stopped" * bool(
        rep["runs_with_machine_pause"]
    )
    print(
        f"{rep['total_runs']} runs, {rep['runs_with_failure']} with a failure{paused}{hog}; "
        f"median run {median:.0f} s"
    )
    if not rep["failed_tests"]:
        print("no test failed")
    else:
        width = max(len(r["test"]) for r in rep["failed_tests"])
        print(f"{'test':{width}}  {'runs':>4}  {'fail':>4}  first line of each distinct failure (times seen)")
        for row in rep["failed_tests"]:
            for i, d in enumerate(row["distinct"]):
                head = (
                    f"{row['test']:{width}}  {row['runs']:>4}  {row['failures']:>4}"
                    if i == 0
                    else " " * (width + 12)
                )
                print(f"{head}  {d['first_line']} (x{d['count']})")
    print()
    print(f"{'marker':12} {'tests':>5} {'runs':>4} {'runs with a failure':>20}")
    for marker, m in rep["markers"].items():
        print(f"{marker:12} {m['tests']:>5} {m['runs']:>4} {m['runs_with_failure']:>20}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_hog(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin a core each, as other jobs on a shared CI machine would."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--markers", nargs="+", default=list(DEFAULT_MARKERS), help="pytest markers")
    parser.add_argument("--full", action="store_true", help="run the whole suite, as .ci/run does")
    parser.add_argument("--runs", type=int, default=10, help="consecutive runs (default 10)")
    parser.add_argument("--separately", action="store_true", help="one pytest process per marker per run")
    parser.add_argument(
        "--hog", type=int, default=0, metavar="K", help="keep K busy processes beside the runs"
    )
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    parser.add_argument("--keep", type=Path, help="keep each run's JUnit XML and output under this folder")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)

    markers = list(args.markers)
    if args.full:
        plans = [([], "all", [])]
    elif args.separately:
        plans = [(["-m", m], m, [m]) for m in markers]
    else:
        expr = " or ".join(markers)
        plans = [(["-m", expr], expr, markers)]
    signal.signal(signal.SIGTERM, _interrupt)  # a killed soak stops its run and reports, as on Ctrl-C
    by_marker = collect(markers)
    hogs = start_hog(args.hog)
    runs: list[RunResult] = []
    try:
        for i in range(1, args.runs + 1):
            for selection, label, covered in plans:
                run = run_pytest(
                    len(runs) + 1, selection, label, covered, args.run_timeout, args.keep, args.pytest_args
                )
                runs.append(run)
                bad = ", ".join(sorted(run.failed)) or "-"
                stopped = f"; MACHINE STOPPED: {'; '.join(run.paused)}" if run.paused else ""
                print(
                    f"run {i}/{args.runs} [{label}]: {run.passed} passed, {len(run.failed)} failed, "
                    f"{run.skipped} skipped in {run.seconds:.0f} s; failed: {bad}{stopped}",
                    file=sys.stderr,
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted: reporting the runs that ended", file=sys.stderr)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    rep = report(runs, by_marker, args)
    if args.keep:
        (args.keep / "report.json").write_text(json.dumps(rep, indent=2))
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 1 if rep["runs_with_failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
