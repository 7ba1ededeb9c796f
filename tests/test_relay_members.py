"""A certified swarm's relay carries members only (issue #19), in real network namespaces.

The bootstrap (with ``--authority``) runs in the hub; one site namespace holds a member, another an
outsider (an identity, no certificate). Each asks the bootstrap for a relay pass and then tries to
push a 1 MiB stream between two peers through the relay, as two sites behind NAT would. The member
is granted its pass and its stream goes through; the outsider is refused its pass, cannot reserve a
slot or reach anyone through the relay, and the bootstrap counts and logs the refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from greenswarm.bootstrap.identity import load_or_create_identity
from greenswarm.security.certificates import create_authority, issue
from tests import netns
from tests.conftest import Swarm

pytestmark = [pytest.mark.nat, pytest.mark.swarm, pytest.mark.security, pytest.mark.hardening]

HUB_PORT = 31337
PROBE = Path(__file__).with_name("relay_probe.py")


@pytest.fixture
def two_sites() -> Iterator[netns.Topology]:
    with netns.topology_for_test(2) as topo:
        yield topo


def test_only_members_reserve_and_relay_through_the_bootstrap(
    swarm: Swarm, two_sites: netns.Topology
) -> None:
    topo, tmp = two_sites, swarm.tmp
    authority = tmp / "authority.key"
    create_authority(authority)
    member_key, outsider_key = tmp / "member.key", tmp / "outsider.key"
    issue(authority, swarm="test", site="member", region="R", peer_id=load_or_create_identity(member_key),
          valid_s=3600, out=tmp / "member.cert")  # fmt: skip
    load_or_create_identity(outsider_key)
    swarm.command(
        "bootstrap", "bootstrap", "--listen", f"/ip4/0.0.0.0/tcp/{HUB_PORT}",
        "--announce", f"/ip4/{netns.HUB_ADDR}/tcp/{HUB_PORT}", "--identity", str(tmp / "bootstrap.key"),
        "--swarm", "test", "--authority", f"{authority}.pub", "--json",
        prefix=[*topo.exec_prefix(topo.hub), sys.executable, "-m", "greenswarm"],
    )  # fmt: skip
    started = None
    deadline = time.monotonic() + 60
    while started is None and time.monotonic() < deadline:
        started = next(
            (json.loads(x) for x in swarm.log("bootstrap").splitlines() if x.startswith("{")), None
        )
        assert swarm.procs["bootstrap"].poll() is None, swarm.log("bootstrap")
        time.sleep(0.2)
    assert started is not None, swarm.log("bootstrap")
    assert started["relay_check"].startswith("passed"), started  # through the gate, from the hub itself
    peers = [a for a in started["initial_peers"] if netns.HUB_ADDR in a]
    relay = next(r for r in started["relays"] if netns.HUB_ADDR in r)
    assert relay.split("/p2p/")[1] != peers[0].split("/p2p/")[1]  # a relay daemon of its own

    def probe(site: netns.Site, identity: Path, certificate: Path | None = None) -> dict:
        extra = ["--certificate", str(certificate)] if certificate else []
        out = subprocess.run(
            [*topo.exec_prefix(site.ns), sys.executable, str(PROBE), "--initial-peers", *peers,
             "--relay", relay, "--identity", str(identity), *extra],
            capture_output=True, text=True, timeout=120, cwd=tmp, start_new_session=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    member_site, outsider_site = topo.sites
    outsider = probe(outsider_site, outsider_key)
    assert (
        str(outsider["pass"]).startswith("refused:")
        and "showed no membership certificate" in outsider["pass"]
    )
    # its peers cannot even hold a connection to the relay: no reservation, no circuit to anyone
    assert outsider["carried"] is False, outsider
    assert "failed to connect to bootstrap peers" in outsider["why"] or "cannot reach" in outsider["why"]
    member = probe(member_site, member_key, tmp / "member.cert")
    assert member["pass"] == [relay], member
    assert member["carried"] is True, member

    log = swarm.log("bootstrap")
    assert f"relay: refused a connection from {outsider_site.addr}" in log
    assert f"relay: refused a pass to {load_or_create_identity(outsider_key)}" in log
    assert f"relay: a pass for {member_site.addr} (site member" in log

    # a clean stop takes the relay's daemon and the pass service along, and leaves nothing in the log
    # (the pass service's client was left to the interpreter's exit, whose collection of it printed
    # tracebacks: docs/testing.md row 65)
    assert swarm.stop("bootstrap") == {"bootstrap": 0}, swarm.log("bootstrap")[-3000:]
    said = swarm.log("bootstrap")
    noise = ("Traceback", "Exception ignored", "Task was destroyed")
    assert not [w for w in noise if w in said], said[-3000:]
