"""What admission costs: signed DHT records, and averaging rounds in a certified swarm.

Two measurements, each against a baseline run in the same process:

* ``records``: signing and checking one DHT record with the membership validator (Ed25519 signature
  over the record, certificate check, claims) against serializing and deserializing the same record
  (msgpack, what every DHT record costs anyway). Microseconds per record, median of ``--repeats``.
* ``rounds``: the median wall time of an averaging round of ``--sites`` real averagers on loopback
  (their own processes and p2pd daemons) in a certified swarm (certificates checked at join and
  before the all-reduce, claims and parts screened, records signed) against the same round in an
  open swarm. Rounds alternate between the two swarms so a noisy machine hurts both alike.

    python benchmarks/admission_overhead.py [--records 2000] [--rounds 5] [--sites 3] [--numel 1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _members(tmp: Path, names: list[str]) -> tuple[list[Path], list]:
    from greenswarm.bootstrap.identity import load_or_create_identity
    from greenswarm.security.admission import Admission
    from greenswarm.security.certificates import create_authority, issue

    if not (tmp / "authority.key").exists():
        create_authority(tmp / "authority.key")
    identities, admissions = [], []
    for name in names:
        identity = tmp / f"{name}.key"
        peer_id = load_or_create_identity(identity)
        issue(tmp / "authority.key", swarm="bench", site=name, region="R", peer_id=peer_id, valid_s=3600,
              out=tmp / f"{name}.cert")  # fmt: skip
        identities.append(identity)
        admissions.append(Admission.from_files("bench", tmp / "authority.key.pub", tmp / f"{name}.cert"))
    return identities, admissions


def records(n: int, repeats: int) -> dict[str, float]:
    """Microseconds per record: sign + check with the membership validator vs msgpack round trip."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from greenswarm.bootstrap.identity import identity_seed
    from greenswarm.security.admission import Admission
    from greenswarm.security.records import MemberRecordValidator

    with tempfile.TemporaryDirectory() as tmp:
        (identity,), (admission,) = _members(Path(tmp), ["a"])
        writer = MemberRecordValidator(admission, identity_seed(identity))
        reader = MemberRecordValidator(Admission.from_files("bench", Path(tmp) / "authority.key.pub"))
    value = {"site": "a", "region": "R", "outer_round": 12, "loss": 2.5, "tokens": 123456, "wire": "int8"}

    def plain() -> None:
        for i in range(n):
            MSGPackSerializer.loads(MSGPackSerializer.dumps({**value, "outer_round": i}))

    def signed() -> None:
        for i in range(n):
            blob = MSGPackSerializer.dumps({**value, "outer_round": i})
            record = DHTRecord(b"k" * 20, b"", blob, time.time() + 60)
            stored = DHTRecord(record.key, record.subkey, writer.sign_value(record), record.expiration_time)
            assert reader.validate(stored)
            MSGPackSerializer.loads(reader.strip_value(stored))

    out = {}
    for name, fn in (("plain_us", plain), ("signed_us", signed)):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) / n * 1e6)
        out[name] = statistics.median(times)
    out["ratio"] = out["signed_us"] / out["plain_us"]
    return out


def rounds(n_rounds: int, sites: int, numel: int) -> dict[str, float]:
    """Median seconds of a loopback averaging round: certified swarm vs open swarm."""
    import torch

    from greenswarm.averaging.averager import SwarmAverager
    from greenswarm.averaging.config import LOOPBACK_TIMEOUTS, AveragingConfig
    from greenswarm.bootstrap.identity import identity_seed
    from greenswarm.network import start_dht
    from greenswarm.node.progress import record_validators
    from greenswarm.security.admission import Admission

    cfg = AveragingConfig(wire="int8", **LOOPBACK_TIMEOUTS)
    made = []

    def swarm(certified: bool, tmp: Path) -> list:
        names = [f"{'c' if certified else 'o'}{i}" for i in range(sites)]
        identities, admissions = _members(tmp, names)
        reader = Admission.from_files("bench", tmp / "authority.key.pub") if certified else None
        boot = start_dht(
            [], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=record_validators("bench", reader)
        )
        entry = [str(a) for a in boot.get_visible_maddrs()]
        made.append(boot)
        peers = []
        for identity, admission in zip(identities, admissions, strict=True):
            validators = record_validators("bench", admission if certified else None, identity_seed(identity))
            dht = start_dht(entry, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(identity),
                            record_validators=validators)  # fmt: skip
            averager = SwarmAverager(dht, f"bench-{names[0]}", numel, cfg, lambda: ({}, []),
                                     admission=admission if certified else None)  # fmt: skip
            made.extend([averager, dht])
            peers.append(averager)
        return peers

    def one_round(peers: list, index: int) -> float:
        gen = torch.Generator().manual_seed(index)
        deltas = [torch.randn(numel, generator=gen) for _ in peers]
        results: list = [None] * len(peers)

        def run(i: int) -> None:
            results[i] = peers[i].average(deltas[i], 1.0, index, f"l{index}", len(peers), gather={})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(peers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(r.ok for r in results):
            raise RuntimeError(f"a round failed: {[r.reason for r in results if not r.ok]}")
        return max(r.seconds for r in results)

    seconds: dict[str, list[float]] = {"open": [], "certified": []}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            open_peers, certified_peers = swarm(False, Path(tmp)), swarm(True, Path(tmp))
            for index in range(n_rounds + 1):  # the first round of each warms up (connections)
                for name, peers in (("open", open_peers), ("certified", certified_peers)):
                    took = one_round(peers, index)
                    if index:
                        seconds[name].append(took)
        finally:
            for part in reversed(made):
                part.shutdown()
    out = {f"{k}_s": statistics.median(v) for k, v in seconds.items()}
    out["ratio"] = out["certified_s"] / out["open_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=2000, help="records per timing (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="timings of the record loop (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per swarm after a warm-up (default 5)")
    parser.add_argument("--sites", type=int, default=3, help="averagers per swarm (default 3)")
    parser.add_argument("--numel", type=int, default=1_000_000, help="values averaged per round")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = {
        "records": records(args.records, args.repeats),
        "rounds": rounds(args.rounds, args.sites, args.numel),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    rec, rnd = result["records"], result["rounds"]
    print(
        f"records: {rec['signed_us']:.0f} us signed+checked vs {rec['plain_us']:.1f} us msgpack "
        f"(ratio {rec['ratio']:.1f}, median of {args.repeats} x {args.records})"
    )
    print(
        f"rounds:  {rnd['certified_s']:.3f} s certified vs {rnd['open_s']:.3f} s open "
        f"(ratio {rnd['ratio']:.2f}, median of {args.rounds}; {args.sites} sites, "
        f"{args.numel:,} values, int8)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
