"""Re-dial the swarm's entry points when none is connected, so a restarted bootstrap learns about a
site again (issue #6, bootstrap loss).

hivemind pings its initial peers once, at start. When the bootstrap peer dies and comes back (same
identity, same address), it starts with an empty routing table and nobody dials it: sites that reach
each other keep averaging, but the bootstrap -- and anyone who joins through it, like
``greenswarm progress`` -- no longer finds them. :class:`EntryWatch` pings the initial peers' DHT every
``period_s`` (dialling them first when the site's daemon is not connected to them), which puts the
site back in their routing tables. The check runs in the DHT's process and the
node only looks at its result, so a dead bootstrap never stalls training.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from greenswarm.hivemind_internals import dial
from greenswarm.network import run_in_dht

log = logging.getLogger(__name__)


class EntryWatch:
    """Keeps a site connected to at least one of its initial peers."""

    #: the longest one check may take: a dial to an address that never answers is cut off here, so
    #: a bootstrap that came back is dialled again within a period of this
    CHECK_TIMEOUT_S = 30.0
    #: a check with no answer at all after this long (its DHT process is stuck) is given up
    ABANDON_S = CHECK_TIMEOUT_S + 30.0

    def __init__(self, dht: Any, initial_peers: list[str], period_s: float = 10.0):
        self.dht, self.initial_peers, self.period_s = dht, list(initial_peers), period_s
        self._probe: Any = None
        self._started = 0.0
        self._next = time.monotonic() + period_s
        self.rejoins = 0
        self.checks = 0  # checks that answered (with a result or an error)
        self._was_connected = True

    def poll(self) -> None:
        """Called from the node's loop: collect the last check's result, start the next one when due."""
        if self._probe is not None and self._probe.done():
            self.checks += 1
            try:
                connected, answered = self._probe.result()
            except Exception as e:  # the DHT process is busy or gone: try again next period
                log.warning("entry-point check failed: %r", e)
                connected, answered = self._was_connected, 0
            if not connected and answered:
                self.rejoins += 1
                log.info("re-joined the swarm through %d initial peer(s) (the bootstrap came back)", answered)
            elif not connected and self._was_connected:
                log.warning("no initial peer is reachable; training and averaging go on with known peers")
            self._was_connected = connected or bool(answered)
            self._probe = None
        elif self._probe is not None and time.monotonic() - self._started > self.ABANDON_S:
            log.warning("entry-point check unanswered for %.0f s; starting another", self.ABANDON_S)
            self._probe = None
        if self._probe is None and self.initial_peers and time.monotonic() >= self._next:
            self._started = time.monotonic()
            self._next = self._started + self.period_s
            self._probe = run_in_dht(
                self.dht, partial(_check_and_redial, self.initial_peers), self.CHECK_TIMEOUT_S
            )


async def _check_and_redial(maddrs: list[str], _dht: Any, node: Any) -> tuple[bool, int]:
    """Runs in the DHT process: (already connected to an initial peer?, how many answered a ping)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    wanted = {}
    for text in maddrs:
        addr = Multiaddr(text)
        wanted[PeerID.from_base58(addr["p2p"])] = addr.decapsulate(Multiaddr(f"/p2p/{addr['p2p']}"))
    connected = {info.peer_id for info in await node.p2p.list_peers()}
    was_connected = bool(connected & set(wanted))
    answered = 0
    for peer, addr in wanted.items():
        # ping even when connected: a connection can come back by itself (the bootstrap's address is in
        # the daemon's peerstore) while the restarted bootstrap's routing table still lacks this site;
        # a ping is what puts it back there
        try:
            if peer not in connected:
                await dial(node.p2p, peer, addr)
            if await node.protocol.call_ping(peer) is not None:
                answered += 1
        except Exception as e:
            log.debug("re-dialling %s failed: %r", peer, e)
    return was_connected, answered
