"""How a site decides to be reached: directly, or through its initial peers' relay."""

from __future__ import annotations

import pytest

from greenswarm.errors import ConfigError
from greenswarm.network import (
    BEHIND_NAT_MODE,
    RELAY_SERVICE_MODE,
    SwarmConfig,
    _register_p2pd_modes,
    relay_options,
    resolve_reachability,
)

PEER = "/ip4/10.77.0.1/tcp/31337/p2p/12D3KooWFAQhjmFvk2zYxbfDbRb23EauPFxhm66Nkbzu5ng3zDf3"
LOCAL = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWFAQhjmFvk2zYxbfDbRb23EauPFxhm66Nkbzu5ng3zDf3"


def _cfg(**kw) -> SwarmConfig:
    cfg = SwarmConfig(**kw)
    cfg.validate()
    return cfg


def test_explicit_choice_wins() -> None:
    assert resolve_reachability(_cfg(initial_peers=[LOCAL], reachability="relay"))[0] == "relay"
    assert resolve_reachability(_cfg(initial_peers=[PEER], reachability="direct"))[0] == "direct"


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, "direct"),  # no initial peers: this peer starts the swarm
        ({"initial_peers": [LOCAL]}, "direct"),  # everything on this machine
        ({"initial_peers": [PEER], "announce_maddrs": ["/ip4/198.51.100.20/tcp/31400"]}, "direct"),
        ({"initial_peers": [PEER], "host_maddrs": ["/ip4/93.184.216.34/tcp/31400"]}, "direct"),  # a global IP
        ({"initial_peers": [PEER], "host_maddrs": ["/ip4/10.1.2.3/tcp/0"]}, "relay"),
    ],
)
def test_auto_goes_direct_only_on_evidence(kw: dict, expected: str) -> None:
    choice, why = resolve_reachability(_cfg(**kw))
    assert choice == expected, why
    assert why


def test_relay_needs_initial_peers_and_unknown_values_are_refused() -> None:
    with pytest.raises(ConfigError) as err:  # at start: --initial-peers may supply them after loading
        resolve_reachability(_cfg(reachability="relay"))
    assert err.value.field == "swarm.reachability"
    with pytest.raises(ConfigError) as err:
        _cfg(reachability="sometimes")
    assert err.value.field == "reachability" and "auto" in str(err.value)


def test_relay_options_announce_circuit_addresses_through_every_initial_peer() -> None:
    other = PEER.replace("10.77.0.1", "10.88.0.1")
    opts = relay_options([PEER, other])
    assert opts["announce_maddrs"] == [f"{PEER}/p2p-circuit", f"{other}/p2p-circuit"]
    assert opts["trusted_relays"] == [PEER, other]
    assert opts["use_auto_relay"] is True
    assert opts["force_reachability"] == BEHIND_NAT_MODE


def test_p2pd_modes_add_flags_without_touching_hivemind_modes() -> None:
    from hivemind.p2p import P2P

    before = {k: dict(v) for k, v in P2P.FORCE_REACHABILITY_MAPPING.items() if not k.startswith("greenswarm")}
    _register_p2pd_modes()
    _register_p2pd_modes()  # idempotent
    table = P2P.FORCE_REACHABILITY_MAPPING
    assert table[BEHIND_NAT_MODE] == {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
    assert table[RELAY_SERVICE_MODE]["forceReachabilityPublic"] == 1
    assert table[RELAY_SERVICE_MODE]["relayDataLimit"] > 4 << 30
    assert {k: v for k, v in table.items() if not k.startswith("greenswarm")} == before
    args = P2P._make_process_args("p2pd", **table[BEHIND_NAT_MODE])
    assert "-relayDiscovery=0" in args


def test_relay_check_dials_the_bootstrap_locally_when_it_can() -> None:
    from greenswarm.bootstrap.relay_check import check_address

    pid = "12D3KooWFAQhjmFvk2zYxbfDbRb23EauPFxhm66Nkbzu5ng3zDf3"
    public = f"/ip4/203.0.113.7/tcp/31337/p2p/{pid}"
    assert check_address(["/ip4/0.0.0.0/tcp/31337"], [public], pid) == f"/ip4/127.0.0.1/tcp/31337/p2p/{pid}"
    local = f"/ip4/127.0.0.1/tcp/40000/p2p/{pid}"
    assert check_address(["/ip4/0.0.0.0/tcp/0"], [public, local], pid) == local
    assert check_address(["/ip4/10.0.0.5/tcp/31337"], [public], pid) == public
