"""Averaging rounds through the bootstrap's relay (NAT'ed sites in network namespaces) vs loopback.

For each configuration, N probe processes join a swarm and run ``--rounds`` all-reduce rounds of a
``--numel``-value vector, one round per ``--slot`` seconds, through greenswarm's averager (the exact
all-reduce a site node runs) in each of ``--wires`` (fp32, fp16, bf16, int8, int7-zstd, ...;
``hivemind-fp16`` is hivemind's plain ``DecentralizedAverager``, which the ``aux`` mechanism uses):

* ``loopback``: a bootstrap and N probes on 127.0.0.1, every probe dialled directly;
* ``hub``: the NAT topology of tests/netns.py (needs root): the bootstrap in the hub namespace, each
  probe in its own site namespace, joined with ``reachability: relay``, every link shaped to
  ``--mbit`` with tbf. Each site's link carries its own upload and download.

Printed per configuration: time from process start to having joined the swarm (for a NAT'ed site:
its relay reservation included); the median
all-reduce time (from the group being formed to the result) and median round time (matchmaking
included); and for the hub, bytes through the hub per site per round from the hub's link
counters, against the all-reduce's wire bytes (each site sends (N-1)/N of its vector to the others
and receives as much back, twice: reduce-scatter and all-gather), and the ratio of the measured
all-reduce time to wire bytes / link rate. Medians over rounds; run several times on a shared
machine. Requires root for the hub configurations.

    sudo python benchmarks/nat_rounds.py [--sites 2 3 4] [--rounds 6] [--numel 1000000] [--mbit 100] [--json]
    sudo python benchmarks/nat_rounds.py --sites 3 --mbits 50 200 --wires fp32 bf16 int8 int7-zstd
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HUB_PORT = 31337


def probe(args: argparse.Namespace) -> None:
    """One site: join, wait for the common start, run the rounds, print one JSON line."""
    import torch
    from hivemind import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression

    from greenswarm.network import relay_options, start_dht

    t0 = time.monotonic()
    extra = {**relay_options([args.peer]), "client_mode": True} if args.relay else {}
    if args.role == "client":  # behind NAT, no relay: never accepts connections
        extra = {"client_mode": True}
    host = "/ip4/127.0.0.1/tcp/0" if args.role == "direct" and not args.relay else "/ip4/0.0.0.0/tcp/0"
    dht = start_dht([args.peer], host_maddrs=[host], **extra)
    joined = time.monotonic() - t0
    if args.role == "direct" and args.wire != "hivemind-fp16":
        swarm_probe(args, dht, t0, joined)
        return
    avg = DecentralizedAverager(
        [torch.full((args.numel,), float(args.index))],
        dht,
        prefix="natbench",
        target_group_size=args.n + (args.role != "direct"),
        min_group_size=args.n + (args.role != "direct"),
        min_matchmaking_time=1.0,
        request_timeout=0.5,
        allreduce_timeout=120,
        compression=Float16Compression(),
        client_mode=args.role == "client",
        auxiliary=args.role == "aux",
        start=True,
    )
    if args.role == "aux":  # the helper on the hub: joins every round, contributes nothing
        for r in range(args.rounds):
            time.sleep(max(0.0, args.start_at + r * args.slot - time.time()))
            try:
                avg.step(timeout=args.slot * 0.9)
            except Exception:
                pass
        print(json.dumps({"aux": True}), flush=True)
        avg.shutdown()
        dht.shutdown()
        return
    rounds, first_done = [], None
    for r in range(args.rounds):
        time.sleep(max(0.0, args.start_at + r * args.slot - time.time()))
        began = time.monotonic()
        ctl = avg.step(wait=False, timeout=args.slot * 0.9)
        formed = None
        while not ctl.done():
            if formed is None and ctl.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED):
                formed = time.monotonic()
            time.sleep(0.002)
        ended = time.monotonic()
        try:
            ctl.result()
            ok = True
        except Exception:
            ok = False
        if ok and first_done is None:
            first_done = ended - t0
        rounds.append({"ok": ok, "round_s": ended - began, "allreduce_s": ended - (formed or began)})
    with avg.get_tensors() as (tensor,):
        value = float(tensor[0])
    print(
        json.dumps({"joined_s": joined, "first_round_s": first_done, "rounds": rounds, "value": value}),
        flush=True,
    )
    avg.shutdown()
    dht.shutdown()


def swarm_probe(args: argparse.Namespace, dht, t0: float, joined: float) -> None:
    """The rounds through greenswarm's averager (exact all-reduce, ``--wire`` format, pre-coding for
    error feedback): what a site node runs. The vector is Gaussian (seeded per site), so entropy-coded
    formats see realistic codes; the bytes a value really took are reported."""
    import torch

    from greenswarm.averaging.agreement import state_digest
    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.codecs import wire_format
    from greenswarm.averaging.config import AveragingConfig

    cfg = AveragingConfig(
        wire=args.wire, matchmaking_s=2.0, request_timeout_s=1.0, allreduce_timeout_s=120.0,
        chunk_timeout_s=30.0, max_group_size=args.n,
    )  # fmt: skip
    avg = SwarmAverager(dht, "natbench", args.numel, cfg, lambda: ({}, []))
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.index))
    rounds, first_done = [], None
    for r in range(args.rounds):
        time.sleep(max(0.0, args.start_at + r * args.slot - time.time()))
        began = time.monotonic()
        outcome = avg.average(x, 1.0, r, "natbench", args.n, {})
        ended = time.monotonic()
        if outcome.ok and first_done is None:
            first_done = ended - t0
        allreduce_s = outcome.report.seconds if outcome.ok else None  # coding + all-reduce
        rounds.append(
            {
                "ok": outcome.ok,
                "round_s": ended - began,
                "allreduce_s": allreduce_s,
                "digest": state_digest([outcome.averaged]) if outcome.ok else None,
                "reason": outcome.reason[:200],
            }
        )
    bytes_per_value = wire_format(args.wire).encoded_bytes(x) / args.numel
    print(
        json.dumps({"joined_s": joined, "first_round_s": first_done, "rounds": rounds, "value": 0.0,
                    "bytes_per_value": bytes_per_value}),
        flush=True,
    )  # fmt: skip
    avg.shutdown()
    dht.shutdown()


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )  # noqa: SIM115


def _bootstrap(
    prefix: list[str], listen: str, announce: list[str], tmp: Path, env: dict
) -> tuple[subprocess.Popen, str]:
    log = tmp / "bootstrap.log"
    cmd = [*prefix, sys.executable, "-m", "greenswarm", "bootstrap", "--listen", listen, "--identity",
           str(tmp / "boot.key"), "--json", *(["--announce", *announce] if announce else [])]  # fmt: skip
    proc = _start(cmd, log, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                peers = json.loads(line)["initial_peers"]
                want = announce[0].split("/tcp/")[0] if announce else "/ip4/127.0.0.1"
                return proc, next(p for p in peers if p.startswith(want))
        time.sleep(0.2)
    raise TimeoutError(log.read_text())


def run_config(kind: str, n: int, args: argparse.Namespace) -> dict:
    """``kind``: loopback, hub (sites reached through the relay) or aux (client-mode sites and an
    auxiliary averager on the hub)."""
    import signal

    from tests import netns

    tmp = Path(tempfile.mkdtemp(prefix=f"natbench-{kind}-{n}-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    topo = netns.make_topology(n) if kind in ("hub", "aux") else None
    try:
        if topo is not None:
            if args.mbit:
                topo.shape(args.mbit)
            boot, peer = _bootstrap(topo.exec_prefix(topo.hub), f"/ip4/0.0.0.0/tcp/{HUB_PORT}",
                                    [f"/ip4/{netns.HUB_ADDR}/tcp/{HUB_PORT}"], tmp, env)  # fmt: skip
        else:
            boot, peer = _bootstrap([], "/ip4/127.0.0.1/tcp/0", [], tmp, env)
        procs.append(boot)
        start_at = time.time() + args.warmup
        helper = None
        if kind == "aux":
            cmd = [*topo.exec_prefix(topo.hub), sys.executable, __file__, "--probe", "--peer", peer,
                   "--n", str(n), "--role", "aux", "--rounds", str(args.rounds), "--numel", str(args.numel),
                   "--slot", str(args.slot), "--start-at", str(start_at)]  # fmt: skip
            helper = _start(cmd, tmp / "aux.log", env)
        role = {"loopback": "direct", "hub": "direct", "aux": "client"}[kind]
        for i in range(n):
            prefix = topo.exec_prefix(topo.sites[i].ns) if topo else []
            cmd = [*prefix, sys.executable, __file__, "--probe", "--peer", peer, "--n", str(n),
                   "--index", str(i), "--rounds", str(args.rounds), "--numel", str(args.numel),
                   "--slot", str(args.slot), "--start-at", str(start_at), "--role", role,
                   "--wire", args.wire, *(["--relay"] if kind == "hub" else [])]  # fmt: skip
            procs.append(_start(cmd, tmp / f"probe{i}.log", env))
        before = topo.hub_bytes() if topo else None
        results = []
        for i, proc in enumerate(procs[1:]):
            proc.wait(timeout=args.warmup + args.rounds * args.slot + 120)
            lines = [
                x for x in (tmp / f"probe{i}.log").read_text().splitlines() if x.startswith('{"joined_s"')
            ]
            if not lines:
                raise RuntimeError((tmp / f"probe{i}.log").read_text()[-3000:])
            results.append(json.loads(lines[-1]))
        after = topo.hub_bytes() if topo else None
        if helper is not None:
            procs.append(helper)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if topo is not None:
            topo.close()
    ok_rounds = [r for res in results for r in res["rounds"] if r["ok"]]
    # bytes a site sends per round, and receives: its parts to the others, then the averaged parts
    # back; with the auxiliary helper every part goes to (and comes back from) the helper
    per_value = statistics.median(res.get("bytes_per_value", 2.0) for res in results)
    wire_one_way = (1.0 if kind == "aux" else 2 * (n - 1) / n) * args.numel * per_value
    # every round that all sites completed must have given them the same bits
    by_round = zip(*[res["rounds"] for res in results], strict=True)
    digests = [{r.get("digest") for r in rs} for rs in by_round if all(r["ok"] for r in rs)]
    values = {round(res["value"], 4) for res in results}  # hivemind-fp16 probes: the averaged value
    out = {
        "kind": kind,
        "wire": args.wire,
        "sites": n,
        "rounds_ok": f"{len(ok_rounds)}/{n * args.rounds}",
        "identical_results": all(len(d) == 1 for d in digests) and len(values) == 1,
        "failures": sorted({r["reason"] for res in results for r in res["rounds"] if not r["ok"]}),
        "bytes_per_value": per_value,
        "joined_s": statistics.median([res["joined_s"] for res in results]),
        "median_allreduce_s": statistics.median([r["allreduce_s"] for r in ok_rounds]) if ok_rounds else None,
        "mbit": args.mbit,
        "median_round_s": statistics.median([r["round_s"] for r in ok_rounds]) if ok_rounds else None,
        "wire_bytes_per_site_per_round": wire_one_way,
    }
    if topo is not None and before and after:
        per_site = [
            (
                (after[s]["rx"] - before[s]["rx"]) / args.rounds,
                (after[s]["tx"] - before[s]["tx"]) / args.rounds,
            )
            for s in after
        ]
        out["hub_bytes_per_site_per_round"] = {
            "from_site": statistics.median(p[0] for p in per_site),
            "to_site": statistics.median(p[1] for p in per_site),
        }
        out["hub_bytes_per_round_total"] = sum(a + b for a, b in per_site)
        if args.mbit and out["median_allreduce_s"]:
            link_s = wire_one_way / (args.mbit * 1e6 / 8)
            out["wire_time_s"] = link_s
            out["allreduce_over_wire_time"] = out["median_allreduce_s"] / link_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", default="direct", help=argparse.SUPPRESS)
    parser.add_argument("--mechanisms", nargs="+", default=["hub"], help="hub (relay) and/or aux (helper)")
    parser.add_argument("--sites", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--slot", type=float, default=6.0, help="seconds between round starts")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds for every probe to join")
    parser.add_argument("--mbit", type=float, default=100.0, help="hub link rate (0: unshaped)")
    parser.add_argument(
        "--wires", nargs="+", default=["fp16"],
        help="greenswarm wire formats to compare (hivemind-fp16: hivemind's own averager, as before)",
    )  # fmt: skip
    parser.add_argument("--mbits", type=float, nargs="+", help="several hub link rates (overrides --mbit)")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback reference")
    parser.add_argument("--wire", default="fp16", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.probe:
        probe(args)
        return
    results = []
    for mbit in args.mbits or [args.mbit]:
        args.mbit = mbit
        for wire in args.wires:
            args.wire = wire
            if not args.no_loopback:
                results.append(run_config("loopback", 3, args))
            for kind in args.mechanisms:
                for n in args.sites:
                    results.append(run_config(kind, n, args))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
        return
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
