"""How reliably a supervised node comes back after a crash: SIGKILL it again and again, time each restart.

Starts a bootstrap peer and two sites on 127.0.0.1 (tests/conftest.py's ``Swarm``, which reaps every
process at the end), then ``--restarts`` times: waits a little (the kills land at different points of
the node's work), SIGKILLs the node process under ``node-crash``'s supervisor, and times until the
new node logs its first training step. A restart that takes longer than ``--timeout`` is a hang: the
stacks of the supervisor and every process under it are printed (with py-spy, when it is installed)
and the run stops there. Prints the count, the hangs, and the median and slowest restart.

    python benchmarks/restart_soak.py [--restarts 100] [--timeout 45] [--hog 2] [--json]

This is how the hang behind ``test_shutdown``'s "timed out waiting for the node's restart" was found
(docs/testing.md, the tenth soak): before the fix, 2 restarts in 79 hung on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST_STEP = "first training step"


def node_process(supervisor_pid: int) -> object:
    """The node under a supervisor: its one live child that is not torch's shared-memory manager."""
    import psutil

    kids = [
        k
        for k in psutil.Process(supervisor_pid).children()
        if k.status() != psutil.STATUS_ZOMBIE and not k.name().startswith("torch_shm")
    ]
    if len(kids) != 1:
        raise RuntimeError(
            f"expected one node under the supervisor, found {[(k.pid, k.name()) for k in kids]}"
        )
    return kids[0]


def dump_stacks(supervisor_pid: int) -> str:
    """Every Python stack under the supervisor (py-spy), or a line saying how to get them."""
    import psutil

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return "(install py-spy to see where each process waits)"
    out = []
    sup = psutil.Process(supervisor_pid)
    for proc in [sup, *sup.children(recursive=True)]:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or proc.name().startswith(("torch_shm", "p2pd")):
                continue
        except psutil.NoSuchProcess:
            continue
        dumped = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True)
        out.append(dumped.stdout + dumped.stderr)
    return "\n".join(out)


def soak(workdir: Path, restarts: int, timeout: float) -> dict:
    from tests.conftest import Swarm, site_config, write_trace

    swarm = Swarm(workdir)
    times: list[float] = []
    hang = None
    try:
        peers = swarm.bootstrap("entry")
        trace = write_trace(workdir / "green.csv", {"GREEN": [10.0] * 24 * 30}, step_s=3600)
        start = time.time() + 4
        for i, name in enumerate(("node-stay", "node-crash")):
            node = {"restart": "on-crash", "max_restarts": restarts + 1}
            cfg = site_config(name, "GREEN", trace, peers, workdir / name, speedup=30.0, start_wall=start,
                              sync_s=600.0, shard=i, shards=2, node=node)  # fmt: skip
            swarm.node(name, swarm.write_config(name, cfg))

        def steps() -> int:
            return swarm.log("node-crash").count(FIRST_STEP)

        deadline = time.monotonic() + 120
        while steps() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not start:\n{swarm.log('node-crash')[-2000:]}")
            time.sleep(0.2)
        supervisor = swarm.procs["node-crash"].pid
        for n in range(restarts):
            before = steps()
            time.sleep(1.0 + (n % 5) * 0.7)  # kill at different points of the node's work
            node_process(supervisor).kill()
            killed = time.monotonic()
            while steps() == before and time.monotonic() - killed < timeout:
                time.sleep(0.1)
            if steps() == before:
                hang = {"restart": n + 1, "stacks": dump_stacks(supervisor)}
                break
            times.append(time.monotonic() - killed)
            print(f"restart {n + 1}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    finally:
        swarm.close()
    return {
        "restarts": len(times) + (hang is not None),
        "hangs": int(hang is not None),
        "timeout_s": timeout,
        "median_s": statistics.median(times) if times else None,
        "slowest_s": max(times) if times else None,
        "hang": hang,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=100, help="how many times to kill the node")
    parser.add_argument("--timeout", type=float, default=45.0, help="seconds after which a restart is a hang")
    parser.add_argument("--hog", type=int, default=0, metavar="K", help="keep K busy processes beside it")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    from benchmarks.soak import start_hog

    hogs = start_hog(args.hog)
    try:
        with tempfile.TemporaryDirectory(prefix="greenswarm-restarts-") as tmp:
            result = soak(Path(tmp), args.restarts, args.timeout)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    result["hog"] = args.hog
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        hog = f", CPU hog {args.hog}" if args.hog else ""
        within = f"no first step within {args.timeout:.0f} s"
        print(f"{result['restarts']} restarts{hog}: {result['hangs']} hung ({within})")
        if result["median_s"] is not None:
            median, slowest = result["median_s"], result["slowest_s"]
            print(f"restart to first training step: median {median:.1f} s, slowest {slowest:.1f} s")
        if result["hang"]:
            print(f"restart {result['hang']['restart']} hung; the stacks:\n{result['hang']['stacks']}")
    return 1 if result["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
