"""Sites behind NAT train together through the bootstrap peer, in real network namespaces.

The topology (tests/netns.py): a hub namespace holding the bootstrap peer at 10.77.0.1 and three
site namespaces linked only to the hub, with forwarding off there, so sites reach the hub and never
each other. Each site joins with ``reachability: auto``, finds no public address, and is reached
through the bootstrap's circuit relay. The swarm is certified, so that relay is the members-only one
(its own daemon behind a gate that lets in the sites that showed their certificate:
docs/security.md); ``tests/test_relay_members.py`` shows an outsider kept out of it. Needs root and
``ip netns``; skipped with the reason elsewhere, required where ``GREENSWARM_REQUIRE_NAT=1``
(``.ci/run``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.security.certificates import create_authority, issue
from tests import netns
from tests.conftest import Swarm, federated_rounds, shared_globals, site_config, wait_until, write_trace

# hardening: members average through the members-only relay (issue #19)
pytestmark = [pytest.mark.nat, pytest.mark.swarm, pytest.mark.security, pytest.mark.hardening]

HUB_PORT = 31337
SPEEDUP, SYNC_S, TRACE_MIN = 60.0, 600.0, 64


@pytest.fixture
def topology() -> Iterator[netns.Topology]:
    with netns.topology_for_test(3) as topo:
        yield topo


def _bootstrap(swarm: Swarm, topo: netns.Topology, authority: Path) -> list[str]:
    """The bootstrap peer in the hub, announcing the hub's public address, certified by ``authority``."""
    prefix = [*topo.exec_prefix(topo.hub), sys.executable, "-m", "greenswarm"]
    swarm.command(
        "bootstrap",
        "bootstrap",
        "--listen",
        f"/ip4/0.0.0.0/tcp/{HUB_PORT}",
        "--announce",
        f"/ip4/{netns.HUB_ADDR}/tcp/{HUB_PORT}",
        "--identity",
        str(swarm.tmp / "bootstrap.key"),
        "--swarm",
        "test",
        "--authority",
        f"{authority}.pub",
        "--json",
        prefix=prefix,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in swarm.log("bootstrap").splitlines():
            if line.startswith("{"):
                started = json.loads(line)
                # the bootstrap pushed a 1 MiB stream through its own relay before announcing itself
                assert started["relay_check"].startswith("passed"), started
                return [a for a in started["initial_peers"] if netns.HUB_ADDR in a]
        assert swarm.procs["bootstrap"].poll() is None, swarm.log("bootstrap")
        time.sleep(0.2)
    raise TimeoutError(swarm.log("bootstrap"))


def _member(tmp: Path, name: str, authority: Path) -> dict:
    """The swarm section of an admitted site: its identity, certificate and the authority's key."""
    identity = tmp / f"{name}.key"
    issue(authority, swarm="test", site=name, region="R", peer_id=load_or_create_identity(identity),
          valid_s=3600, out=tmp / f"{name}.cert")  # fmt: skip
    return {
        "identity": str(identity),
        "certificate": str(tmp / f"{name}.cert"),
        "authority": f"{authority}.pub",
    }


def test_three_sites_behind_nat_average_through_the_bootstrap(
    swarm: Swarm, topology: netns.Topology, tmp_path: Path
) -> None:
    """Three NAT'ed sites complete federated rounds through the hub and agree after each round;
    `greenswarm progress` inside a site namespace lists all three; no site reaches another."""
    sites = topology.sites
    for a in sites:  # the premise: sites cannot open connections to each other
        for b in sites:
            if a is not b:
                assert not topology.reachable(a.ns, b.addr, 22), (a.ns, b.addr)
    authority = tmp_path / "authority.key"
    create_authority(authority)
    peers = _bootstrap(swarm, topology, authority)
    trace = write_trace(tmp_path / "trace.csv", {"R": [20.0] * (TRACE_MIN // 5)})
    start_file = tmp_path / "start"
    before = topology.hub_bytes()
    for i, site in enumerate(sites):
        name = f"site{i}"
        cfg = site_config(
            name, "R", trace, peers, tmp_path / name,
            speedup=SPEEDUP, start_file=start_file, sync_s=SYNC_S, shard=i, shards=3,
            node={"keep_globals": 100},
            averaging={"wire": "fp16"},  # a fixed format, so the hub's byte count below is known
            swarm=_member(tmp_path, name, authority),
        )  # fmt: skip
        cfg["swarm"]["host_maddrs"] = ["/ip4/0.0.0.0/tcp/0"]
        swarm.node(
            name, swarm.write_config(name, cfg), prefix=[*topology.exec_prefix(site.ns), sys.executable]
        )
    end_wall = swarm.start_replay([f"site{i}" for i in range(3)], start_file) + TRACE_MIN * 60 / SPEEDUP

    # mid-run, `greenswarm progress` from inside a NAT'ed site lists every site
    def every_site_listed() -> bool:
        listed = swarm.run_in(
            topology.exec_prefix(sites[0].ns),
            "progress",
            "--initial-peers",
            *peers,
            "--swarm",
            "test",
            "--authority",
            f"{authority}.pub",
            "--json",
        )
        if listed.returncode != 0:  # e.g. the bootstrap, on a busy machine, answered too late: ask again
            return False
        return sorted(r["site"] for r in json.loads(listed.stdout)) == ["site0", "site1", "site2"]

    wait_until(every_site_listed, end_wall - time.time(), "every site in greenswarm progress")

    # once each has averaged three rounds and all three hold three global models in common, the
    # question is answered: the operator stops them (the rest of the trace would repeat those rounds)
    names = [f"site{i}" for i in range(3)]

    def three_rounds_together() -> bool:
        if all(swarm.procs[n].poll() is not None for n in names):
            return True
        averaged = all(federated_rounds(tmp_path / n) >= 3 for n in names)
        return averaged and len(shared_globals(tmp_path, names)) >= 3

    wait_until(three_rounds_together, end_wall + 60 - time.time(), "three rounds applied by all three sites")
    codes = swarm.stop(*names, timeout=120)
    assert all(code == 0 for code in codes.values()), {n: swarm.log(n)[-3000:] for n in names}
    after = topology.hub_bytes()

    summaries = [json.loads((tmp_path / f"site{i}" / "summary.json").read_text()) for i in range(3)]
    ids = {s["peer_id"] for s in summaries}
    for i, summary in enumerate(summaries):
        assert "joining the swarm through a relay" in swarm.log(f"site{i}")
        assert "relay pass granted by" in swarm.log(f"site{i}")  # the members-only relay let it in
        assert summary["reachability"] == "relay"
        assert summary["federated_rounds"] >= 3, summary
        assert summary["first_round_s"] is not None
        # every other site this one is connected to is reached through a /p2p-circuit address
        for peer, addrs in summary["connections"].items():
            if peer in ids:
                assert addrs and all("/p2p-circuit" in a for a in addrs), (peer, addrs)
    # the averaging traffic went through the hub: each site moved at least its share of every round
    numel = torch.load(next((tmp_path / "site0" / "globals").glob("outer-*.pt"))).numel()
    for site in sites:
        moved = after[site.ns]["rx"] - before[site.ns]["rx"]
        assert moved > 3 * numel * 2 * (2 / 3), (site.ns, moved)  # fp16: 2 bytes a value
    figures = {  # shown with pytest -s; quoted in docs/nat.md
        s["site"]: {
            "first_step_s": s["first_step_s"],
            "first_round_s": s["first_round_s"],
            "federated_rounds": s["federated_rounds"],
            "median_round_s": s["median_round_s"],
            "hub_rx_mb": (after[site.ns]["rx"] - before[site.ns]["rx"]) / 1e6,
            "connections": s["connections"],
        }
        for s, site in zip(summaries, sites, strict=True)
    }
    print(json.dumps({"numel": numel, "sites": figures}, indent=1))
    # after every round the three sites hold the same global parameters, bit for bit (the all-reduce
    # is exact and a round is applied only after the group's digests agree)
    shared = shared_globals(tmp_path, names)
    assert len(shared) >= 3, shared
    for step, paths in sorted(shared.items()):
        first, *rest = (torch.load(path) for path in paths)
        assert all(torch.equal(first, other) for other in rest), step
