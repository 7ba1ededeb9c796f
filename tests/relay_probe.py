"""Run inside a network namespace by ``tests/test_relay_members.py``: ask the bootstrap for a relay
pass (with a membership certificate, or without one), then try to push a 1 MiB stream between two
throw-away peers through the relay; print one JSON line with what happened.

    python tests/relay_probe.py --initial-peers BOOT --relay RELAY --identity KEY [--certificate CERT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from greenswarm.bootstrap.relay_check import relay_carries
from greenswarm.errors import SwarmError
from greenswarm.node.relay_pass import relays_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--relay", required=True)
    parser.add_argument("--identity", required=True)
    parser.add_argument("--certificate")
    args = parser.parse_args()
    certificate = Path(args.certificate).read_bytes() if args.certificate else b""
    try:
        granted: object = relays_for(args.initial_peers, args.identity, certificate)
    except SwarmError as e:
        granted = f"refused: {e}"
    carried, why = relay_carries(args.relay, timeout=8.0)
    print(json.dumps({"pass": granted, "carried": carried, "why": why}), flush=True)


if __name__ == "__main__":
    main()
