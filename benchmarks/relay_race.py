"""How often p2pd's default relay (128 KiB per connection) beats the configured one at start-up.

Starts ``greenswarm bootstrap`` ``--starts`` times in a hub network namespace (tests/netns.py; needs
root) for each ``GOMAXPROCS`` value given, and tallies on which attempt its start-up relay check
(a 1 MiB stream through the relay; greenswarm/bootstrap/relay_check.py) passed, or whether it gave
up. See docs/nat.md.

    sudo python benchmarks/relay_race.py [--gomaxprocs 1 2] [--starts 10] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_start(prefix: list[str], key: Path, gomaxprocs: str) -> str:
    """``attempt N`` on which the relay check passed, or ``gave up``."""
    env = dict(os.environ, GOMAXPROCS=gomaxprocs)
    cmd = [*prefix, sys.executable, "-m", "greenswarm", "bootstrap", "--listen", "/ip4/0.0.0.0/tcp/31337",
           "--announce", "/ip4/10.77.0.1/tcp/31337", "--identity", str(key), "--json"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if line.startswith("{"):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    if not line.startswith("{"):
        return "gave up"
    check = json.loads(line)["relay_check"]
    return "attempt " + check.split("(attempt ")[1].split(")")[0] if "attempt" in check else check


def main() -> None:
    from tests import netns

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gomaxprocs", nargs="+", default=["1", "2"])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    netns.sweep()
    topo = netns.make_topology(1)
    key = Path(tempfile.mkdtemp(prefix="relay-race-")) / "boot.key"
    out: dict[str, dict[str, int]] = {}
    try:
        for g in args.gomaxprocs:
            tally = collections.Counter(
                one_start(topo.exec_prefix(topo.hub), key, g) for _ in range(args.starts)
            )
            out[g] = dict(sorted(tally.items()))
    finally:
        topo.close()
    if args.json:
        print(json.dumps(out))
    else:
        for g, tally in out.items():
            print(f"GOMAXPROCS={g}: {args.starts} starts, relay check {tally}")


if __name__ == "__main__":
    main()
