"""How often a p2p stream loses its handler's last reply, for hivemind's close and for greenswarm's.

A reducer in an all-reduce answers each part a sender streams to it. hivemind's reducer returns
(closing its end) right after its last reply; greenswarm's (greenswarm/averaging/exact.py) holds
the stream open until the sender, holding every part it expects, closes it. This script runs both
patterns over two real p2p daemons on loopback, with hivemind's own stream handlers and the
all-reduce's message type, and counts *short* streams: the sender got fewer replies than it sent
parts. A short stream is a failed round on one member of a group that reduced correctly.

The loss is rare and needs a busy machine to show: ``--hog K`` keeps K busy processes beside the
run (as other jobs on a shared CI machine). Printed per protocol: short streams out of
``--streams`` per repeat, the median over repeats, and how long a lingering reducer held on
(median, from its last reply to the sender's close).

    python benchmarks/stream_tail.py [--streams 1500] [--repeats 3] [--hog 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import start_hog  # noqa: E402  (a sibling script)

PARTS = 2  # parts per stream: the last one is the reply at risk
REPLY_BYTES = 200_000  # one averaged part of a few hundred thousand values, coded to bytes
PART_BYTES = 1_000
LINGER_LIMIT_S = 5.0


async def one_protocol(streams: int, linger: bool) -> tuple[int, list[float]]:
    """Short streams out of ``streams``, and how long each lingering handler waited for the close."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(
        initial_peers=[str(a) for a in await server.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    held: list[float] = []
    reply = averaging_pb2.AveragingData(
        code=averaging_pb2.AVERAGED_PART, tensor_part=runtime_pb2.Tensor(buffer=b"x" * REPLY_BYTES)
    )

    async def reducer(stream, context: P2PContext):
        async for _ in stream:
            yield reply
        if linger:  # greenswarm: the sender's close cancels this
            since = time.monotonic()
            try:
                await asyncio.sleep(LINGER_LIMIT_S)
            finally:
                held.append(time.monotonic() - since)

    await server.add_protobuf_handler(
        "tail", reducer, averaging_pb2.AveragingData, stream_input=True, stream_output=True
    )

    async def parts():
        for _ in range(PARTS):
            yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=b"y" * PART_BYTES))

    short = 0
    try:
        for _ in range(streams):
            got = 0
            replies = await client.iterate_protobuf_handler(
                server.peer_id, "tail", parts(), averaging_pb2.AveragingData
            )
            try:
                async for _ in replies:
                    got += 1
                    if linger and got == PARTS:  # greenswarm: stop at what is expected, then close
                        break
            finally:
                await replies.aclose()
            short += got != PARTS
        await asyncio.sleep(0.5)  # let the last handlers see their close
    finally:
        await client.shutdown()
        await server.shutdown()
    return short, held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1500, help="streams per protocol per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--hog", type=int, default=0, metavar="K", help="keep K busy processes beside the run"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    hogs = start_hog(args.hog)
    results: dict[str, dict] = {}
    try:
        for name, linger in (
            ("hivemind (reducer closes first)", False),
            ("greenswarm (sender closes)", True),
        ):
            shorts, held = [], []
            for _ in range(args.repeats):
                short, waits = asyncio.run(one_protocol(args.streams, linger))
                shorts.append(short)
                held.extend(waits)
            results[name] = {
                "short_per_repeat": shorts,
                "median_short": statistics.median(shorts),
                "held_median_ms": round(statistics.median(held) * 1000, 1) if held else None,
            }
    finally:
        for hog in hogs:
            hog.kill()
    if args.json:
        print(
            json.dumps(
                {"streams": args.streams, "repeats": args.repeats, "hog": args.hog, **results}, indent=2
            )
        )
        return 0
    print(f"{args.streams} streams x {args.repeats} repeats, {args.hog} busy processes beside")
    for name, r in results.items():
        held = (
            f"; reducer held on {r['held_median_ms']} ms (median)" if r["held_median_ms"] is not None else ""
        )
        print(f"{name:32} short streams {r['short_per_repeat']} (median {r['median_short']}){held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
