"""Does every command stop on SIGTERM wherever its start-up is? Stop them at random moments and count.

``kill PID`` during a command's start-up -- importing, building its model, starting its DHT and p2p
daemon, joining -- must end it with a clean status (0 or 130), promptly, with nothing it started left
running. This starts each long-running command (``bootstrap``, ``node``, ``progress --watch``, ``demo``)
again and again in a session of its own, sends it SIGTERM after a random delay within its start-up,
and times the stop. A command still running ``--timeout`` seconds after its SIGTERM is a hang: the
Python stacks of it and its children are printed (py-spy, when installed) and it is killed. Whatever is
left in its session once it has exited is a leak, listed and killed.

Found this way, and fixed (docs/testing.md): a SIGTERM that landed while torch started its
shared-memory manager left the process spinning, deaf to every signal.

    python benchmarks/stop_soak.py [--trials 10] [--commands bootstrap node progress demo] [--hog 2] [--json]

Prints one line per stop, then per command: trials, clean stops, hangs, leaks, and the median, 95th
percentile and slowest stop (seconds from SIGTERM to exit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

#: the span of each command's start-up on a quiet 2-core machine (to its ready line), in seconds:
#: the SIGTERM lands uniformly within it
STARTUP_S = {"bootstrap": 3.0, "node": 7.0, "progress": 5.0, "demo": 20.0}
CLEAN = (0, 130)
TRACE_ROWS = ["time,GREEN"] + [f"2026-01-01T{h:02d}:00:00Z,10.0" for h in range(24)]


def session_procs(sid: int) -> list[psutil.Process]:
    """Live processes in session ``sid`` (a command started in a session of its own, and what it started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return found


def stacks(pid: int) -> str:
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return "(install py-spy to see where it waits)"
    out = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            if proc.name() in ("p2pd", "torch_shm_manager"):
                continue
        except psutil.NoSuchProcess:
            continue
        dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True)
        out.append(dump.stdout or dump.stderr)
    return "\n".join(out)


class Bench:
    def __init__(self, work: Path, timeout_s: float):
        self.work, self.timeout_s = work, timeout_s
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.peers: list[str] = []
        self.boot: subprocess.Popen | None = None

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        return subprocess.Popen(
            [sys.executable, "-m", "greenswarm", *args],
            stdout=open(log, "w"),  # noqa: SIM115  (closed with the process)
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
            cwd=self.work,
        )

    def entry_point(self) -> None:
        """The bootstrap that the nodes and readers under test join."""
        self.boot = self.start("entry", *self.bootstrap_args("entry"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in (self.work / "entry.log").read_text().splitlines():
                if line.startswith("{"):
                    self.peers = json.loads(line)["initial_peers"]
                    return
            time.sleep(0.2)
        raise RuntimeError("the entry bootstrap did not start")

    def bootstrap_args(self, name: str) -> list[str]:
        key = self.work / f"{name}.key"
        return [
            "bootstrap",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--identity",
            str(key),
            "--swarm",
            "test",
            "--json",
        ]

    def args(self, command: str, trial: int) -> list[str]:
        run = self.work / f"{command}-{trial}"
        if command == "bootstrap":
            return self.bootstrap_args(f"boot-{trial}")
        if command == "progress":
            return ["progress", "--initial-peers", *self.peers, "--swarm", "test", "--watch", "1"]
        if command == "demo":
            return ["demo", "--no-live", "--minutes", "3", "--workdir", str(run)]
        trace = self.work / "green.csv"
        trace.write_text("\n".join(TRACE_ROWS) + "\n")
        cfg = {
            "name": f"stop-{trial}",
            "region": "GREEN",
            "swarm": {"name": "test", "initial_peers": self.peers, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},
            "data": {"seq_len": 64},
            "train": {"threads": 1, "batch_size": 4, "micro_batch_size": 4},
            "scheduler": {"trace": str(trace), "clock": {"kind": "replay", "speedup": 300.0}},
            "averaging": {"sync_interval_s": 600.0},
            "node": {"run_dir": str(run)},
        }
        path = self.work / f"stop-{trial}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return ["node", "--config", str(path)]

    def trial(self, command: str, trial: int, rng: random.Random) -> dict:
        delay = rng.uniform(0.0, STARTUP_S[command])
        proc = self.start(f"{command}-{trial}", *self.args(command, trial))
        time.sleep(delay)
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        result = {"command": command, "trial": trial, "delay_s": round(delay, 2)}
        try:
            code = proc.wait(timeout=self.timeout_s)
            result |= {"code": code, "stop_s": round(time.monotonic() - sent, 2), "hang": None}
        except subprocess.TimeoutExpired:
            result |= {"code": None, "stop_s": None, "hang": stacks(proc.pid)}
        # what it started must be gone soon after it exited: its daemons get their stop from it
        deadline = time.monotonic() + 5
        left = session_procs(proc.pid)
        while left and result["hang"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
            left = session_procs(proc.pid)
        result["left"] = [f"{p.pid} {p.name()}" for p in left]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        # the demo's sites live in sessions of their own: whatever of them is left counts too
        if command == "demo":
            for sid_proc in psutil.process_iter(["cmdline"]):
                try:
                    if str(self.work / f"demo-{trial}") in " ".join(sid_proc.info["cmdline"] or []):
                        result["left"].append(f"{sid_proc.pid} {sid_proc.name()}")
                        os.killpg(os.getsid(sid_proc.pid), signal.SIGKILL)
                except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                    continue
        return result

    def close(self) -> None:
        if self.boot is not None and self.boot.poll() is None:
            os.killpg(self.boot.pid, signal.SIGTERM)
            try:
                self.boot.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.boot.pid, signal.SIGKILL)
                self.boot.wait()


def summarize(results: list[dict]) -> dict[str, dict]:
    table = {}
    for command in dict.fromkeys(r["command"] for r in results):
        rows = [r for r in results if r["command"] == command]
        stops = sorted(r["stop_s"] for r in rows if r["stop_s"] is not None)
        table[command] = {
            "trials": len(rows),
            "clean": sum(r["code"] in CLEAN and not r["left"] for r in rows),
            "hangs": sum(r["hang"] is not None for r in rows),
            "leaks": sum(bool(r["left"]) for r in rows),
            "median_s": statistics.median(stops) if stops else None,
            "p95_s": stops[min(len(stops) - 1, round(0.95 * (len(stops) - 1)))] if stops else None,
            "max_s": stops[-1] if stops else None,
        }
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="stops per command (default 10)")
    parser.add_argument("--commands", nargs="+", default=list(STARTUP_S), choices=list(STARTUP_S))
    parser.add_argument("--timeout", type=float, default=30.0, help="a stop slower than this is a hang")
    parser.add_argument("--hog", type=int, default=0, help="busy processes beside the commands")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(opts.hog)]
    work = Path(tempfile.mkdtemp(prefix="greenswarm-stop-soak-"))
    bench = Bench(work, opts.timeout)
    results = []
    try:
        bench.entry_point()
        for trial in range(opts.trials):
            for command in opts.commands:
                result = bench.trial(command, trial, rng)
                results.append(result)
                if not opts.json:
                    status = "HANG" if result["hang"] else f"exit {result['code']} in {result['stop_s']} s"
                    left = f", left {result['left']}" if result["left"] else ""
                    print(f"{command:9s} #{trial}: SIGTERM {result['delay_s']:5.2f} s in: {status}{left}")
                    if result["hang"]:
                        print(result["hang"])
    finally:
        bench.close()
        for hog in hogs:
            hog.kill()
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(results)
    if opts.json:
        print(json.dumps({"hog": opts.hog, "commands": table, "stops": results}, indent=2))
    else:
        print(f"\n{'command':10s} trials clean hangs leaks median_s p95_s max_s")
        for command, row in table.items():
            print(
                f"{command:10s} {row['trials']:6d} {row['clean']:5d} {row['hangs']:5d} {row['leaks']:5d} "
                f"{row['median_s']!s:>8s} {row['p95_s']!s:>5s} {row['max_s']!s:>5s}"
            )
    return 0 if all(r["hang"] is None and not r["left"] and r["code"] in CLEAN for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
