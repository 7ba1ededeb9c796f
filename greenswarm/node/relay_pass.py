"""A site behind NAT asks its bootstrap for a pass to the swarm's members-only relay.

In a certified swarm the bootstrap's relay is a daemon of its own behind a gate that lets in only
the addresses of proven members (:mod:`greenswarm.bootstrap.relay_gate`). So before a site reached
through the relay starts its own daemon -- which reserves its relay slot at once, and waits a long
time before it tries again when that fails -- it shows its membership certificate to the bootstrap
over an authenticated stream, from a short-lived daemon with the site's own identity: the bootstrap
lets the address the stream came from through the gate, and answers with the relay's addresses.

A bootstrap that offers no such relay (an open swarm's, or an older greenswarm's) relays on its DHT
daemon: the site then uses its initial peers as relays, as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from greenswarm.errors import SwarmError

log = logging.getLogger(__name__)

#: (greenswarm.bootstrap.relay_gate.PASS_PROTOCOL: the node does not import the bootstrap)
PASS_PROTOCOL = "greenswarm-relay-pass/1"


async def _ask(
    initial_peers: list[str], identity: str, certificate: bytes, timeout_s: float
) -> dict[str, Any]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from greenswarm import hivemind_internals as seam

    p2p = await P2P.create(
        host_maddrs=["/ip4/0.0.0.0/tcp/0"],
        identity_path=identity,
        check_if_identity_free=False,  # (hivemind's check reads RSA keys only; ours are Ed25519)
        dht_mode="client",
        auto_nat=False,
        nat_port_map=False,
    )
    answers: dict[str, Any] = {}
    try:
        for maddr in initial_peers:
            peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
            try:
                await asyncio.wait_for(
                    seam.dial(p2p, peer, Multiaddr(maddr.rsplit("/p2p/", 1)[0])), timeout_s
                )
            except Exception as e:  # this bootstrap does not answer (yet): tried again
                answers[maddr] = {"unreachable": f"{type(e).__name__}: {e}"}
                continue
            try:
                reply = await asyncio.wait_for(
                    seam.call_unary(p2p, peer, PASS_PROTOCOL, certificate), timeout_s
                )
            except Exception as e:  # this bootstrap offers no gated relay (an open swarm's, an older one)
                answers[maddr] = {"unavailable": f"{type(e).__name__}: {e}"}
                continue
            try:
                answer = json.loads(reply)
            except ValueError:
                answer = {"error": "the bootstrap's answer was not a relay pass"}
            if "relays" in answer or "error" in answer:
                return {maddr: answer}
            answers[maddr] = answer
        return answers
    finally:
        await p2p.shutdown()


def relays_for(
    initial_peers: list[str],
    identity: str,
    certificate: bytes,
    timeout_s: float = 15.0,
    retry_delays_s: tuple[float, ...] = (),
) -> list[str]:
    """The relay addresses this member is let through to; its initial peers when no bootstrap offers a
    members-only relay; :class:`SwarmError` when one refuses this site's pass (saying why). While no
    initial peer answers at all it tries again after each of ``retry_delays_s`` (``swarm.join_retry_s``,
    as the join does)."""
    answers = asyncio.run(_ask(initial_peers, identity, certificate, timeout_s))
    for delay in retry_delays_s:
        if not answers or not all("unreachable" in a for a in answers.values()):
            break
        log.info("no bootstrap answered the relay pass request; trying again in %g s", delay)
        time.sleep(delay)
        answers = asyncio.run(_ask(initial_peers, identity, certificate, timeout_s))
    for maddr, answer in answers.items():
        if "error" in answer:
            raise SwarmError(f"the bootstrap {maddr} refused this site its relay pass: {answer['error']}")
        if answer.get("relays"):
            log.info("relay pass granted by %s: reached through %s", maddr, ", ".join(answer["relays"]))
            return list(answer["relays"])
    said = "; ".join(f"{m}: {a.get('unreachable') or a.get('unavailable', a)}" for m, a in answers.items())
    if answers and all("unreachable" in a for a in answers.values()):
        log.warning(
            "no bootstrap answered this site's relay pass request (%s): relaying through the initial "
            "peers, which in a certified swarm relay for nobody (behind NAT, restart the site once the "
            "bootstrap is up)",
            said,
        )
    else:
        log.info(
            "no bootstrap offers a members-only relay (%s): relaying through the initial peers",
            said or "none answered",
        )
    return list(initial_peers)
