"""The members-only relay of a certified swarm: a relay daemon of its own, behind a TCP gate that
lets in only hosts whose sites proved their membership.

p2pd (go-libp2p's relay v2) can bound what a reservation may carry, but it cannot ask who is
reserving: it has no filter a program can set. So in a certified swarm the bootstrap does not relay
on its DHT daemon at all (``relayService`` off there). It starts a second p2p daemon, with a
stable identity of its own (``<identity>.relay``), that only relays, and listens on loopback; the
public relay port is a gate in this process that forwards a TCP connection to it only from an IP
address that holds a **pass**. A site asks for a pass before it starts its daemon: over an
authenticated libp2p stream to the bootstrap's DHT daemon (the handler sees the caller's peer id,
which the transport proved), it shows its membership certificate; the bootstrap checks it (swarm,
authority, binding to that peer id, expiry, the revocation list), and lets in the address that
connection came from until the certificate expires. Passes are kept in ``<identity>.passes.json``,
so a restarted bootstrap lets its sites back in at once (a relay client whose reservation fails
waits long before it tries again).

What an outsider gets: the DHT (public, as before) and a closed relay port. It cannot reserve a
slot, so nobody can reach it through the relay, and it cannot open a circuit to anyone. What the
gate cannot tell apart: an outsider behind the same public IP as a member (one NAT, one campus), who
reaches the relay daemon; its limits (``-relayMaxCircuits``, data and time per circuit) still bound
what it can carry. A revoked member's pass is withdrawn the moment the bootstrap applies the list
(its connections through the gate are cut).

Refused connections are counted (``greenswarm_bootstrap_relay_refused_total``) and said once a
minute per address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greenswarm.errors import ConfigError
from greenswarm.security.admission import Admission, RefusalLog
from greenswarm.security.certificates import CertificateError

log = logging.getLogger("greenswarm.bootstrap")

#: the libp2p protocol a site asks for its pass on (a unary call to the bootstrap's DHT daemon)
PASS_PROTOCOL = "greenswarm-relay-pass/1"
#: bytes one read of a forwarded connection takes at most
CHUNK = 256 * 1024


class RelayGate:
    """Forwards TCP connections from pass holders to the relay daemon at ``target`` (host, port).

    ``own``: addresses that are always let in (the bootstrap host's own: its relay check runs from
    there). Runs its own event loop on a daemon thread; :meth:`start` binds and returns the port."""

    def __init__(
        self, host: str, port: int, target: tuple[str, int], own: set[str], passes: Path | None = None
    ):
        self.host, self.port, self.target = host, port, target
        self.own = set(own) | {"127.0.0.1", "::1"}
        self.passes_path = passes
        self.passes: dict[str, dict[str, float]] = {}  # ip -> {peer id -> until (unix seconds)}
        self.refused = 0  # connections refused at the gate
        self.forwarded = 0  # connections let through
        self._open: dict[str, set[asyncio.StreamWriter]] = {}  # ip -> its connections through the gate
        self._refusals = RefusalLog(log)
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="relay-gate", daemon=True)
        self._load()

    # ------------------------------------------------------------------ passes

    def allow(self, ip: str, peer: str, until: float, still: Callable[[], bool] | None = None) -> bool:
        """Let ``ip`` in for ``peer`` until ``until`` -- if ``still()`` holds then, under the lock
        :meth:`withdraw` takes (a revocation applied between the check and this call wins). Whether
        the pass was given."""
        with self._lock:
            if still is not None and not still():
                return False
            self.passes.setdefault(_canonical(ip), {})[peer] = until
        self._save()
        return True

    def withdraw(self, revoked: Callable[[str], bool]) -> list[str]:
        """Take back every pass of a peer ``revoked`` says is revoked; cut the connections of an
        address left without one. Returns the peers it withdrew."""
        gone: list[str] = []
        closed: list[str] = []
        now = time.time()
        with self._lock:
            for ip, peers in list(self.passes.items()):
                for peer in [p for p in peers if revoked(p)]:
                    del peers[peer]
                    gone.append(peer)
                for peer in [p for p, until in peers.items() if until <= now]:
                    del peers[peer]  # (an expired pass lets nobody in, and keeps no connection open)
                if not peers:
                    del self.passes[ip]
                    closed.append(ip)
        for ip in closed:
            self._loop.call_soon_threadsafe(self._close_all, ip)
        if gone:
            self._save()
        return gone

    def admitted(self, ip: str) -> bool:
        ip = _canonical(ip)
        if ip in self.own:
            return True
        now = time.time()
        with self._lock:
            return any(until > now for until in self.passes.get(ip, {}).values())

    def held(self) -> int:
        """How many peers hold a pass that is valid now."""
        now = time.time()
        with self._lock:
            return sum(1 for peers in self.passes.values() for until in peers.values() if until > now)

    def _load(self) -> None:
        if self.passes_path is None or not self.passes_path.is_file():
            return
        try:
            data = json.loads(self.passes_path.read_text())
            now = time.time()
            self.passes = {
                str(ip): {str(p): float(t) for p, t in peers.items() if float(t) > now}
                for ip, peers in data.items()
            }
        except (OSError, ValueError, AttributeError, TypeError) as e:  # a damaged file: sites ask again
            log.warning(
                "ignoring the relay passes in %s (%s): sites will ask for new ones", self.passes_path, e
            )
            self.passes = {}

    def _save(self) -> None:
        if self.passes_path is None:
            return
        # one writer at a time, each writing the passes as they are then: an older snapshot written
        # last would bring a withdrawn pass back at the next start
        with self._save_lock:
            with self._lock:
                text = json.dumps(self.passes, indent=1, sort_keys=True)
            tmp = self.passes_path.with_name(self.passes_path.name + ".tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, self.passes_path)
            except OSError as e:  # the passes still hold in memory: a restart makes sites ask again
                log.warning("cannot write %s: %s", self.passes_path, e)

    # ------------------------------------------------------------------ forwarding

    def start(self) -> int:
        """Start the gate's loop, bind the gate and start forwarding; the bound port."""
        self.start_loop()
        return self.bind()

    def start_loop(self) -> None:
        self._thread.start()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run ``coro`` on the gate's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def bind(self) -> int:
        """Listen on the gate's address; the bound port. :class:`ConfigError` naming ``--relay-port``
        when the address cannot be bound (in use, not this host's)."""
        try:
            self._server = self.run(
                asyncio.start_server(self._handle, self.host, self.port, reuse_address=True), 10
            )
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {self.host}:{self.port} for the members-only relay: {e.strerror or e}",
                field="--relay-port",
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        if not peername:  # the client is gone already
            writer.close()
            return
        ip = _canonical(str(peername[0]))
        if not self.admitted(ip):
            self.refused += 1
            self._refusals.warn(
                f"relay: refused a connection from {ip}: it holds no relay pass (not a member)"
            )
            writer.close()
            return
        opened = self._open.setdefault(ip, set())
        opened.add(writer)  # (before the wait below: a withdrawal meanwhile closes it)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as e:
            log.warning("relay: the relay daemon does not answer (%s)", e)
            opened.discard(writer)
            writer.close()
            return
        if not self.admitted(ip) or writer.is_closing():  # withdrawn while the daemon answered
            opened.discard(writer)
            for w in (writer, up_writer):
                w.close()
            return
        self.forwarded += 1
        self._open.setdefault(ip, set()).update((writer, up_writer))
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            self._open.get(ip, set()).difference_update((writer, up_writer))
            for w in (writer, up_writer):
                w.close()

    def _close_all(self, ip: str) -> None:
        for w in self._open.pop(ip, set()):
            w.close()

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        for ip in list(self._open):
            self._loop.call_soon_threadsafe(self._close_all, ip)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either end closes."""
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while True:
            chunk = await reader.read(CHUNK)
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


def _canonical(ip: str) -> str:
    """An address as one spelling (an IPv4-mapped IPv6 address as its IPv4 one)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


# ---------------------------------------------------------------------------- the pass, both ends


def grant(
    admission: Admission, gate: RelayGate, certificate: bytes, peer: str, ips: list[str]
) -> dict[str, Any]:
    """The bootstrap's answer to a pass request from ``peer`` (its certificate, the addresses its
    connections came from): a pass for those addresses until the certificate expires, or why not."""
    try:
        membership = admission.check(certificate, peer)
    except CertificateError as e:
        return {"error": f"no relay pass: {e}"}
    if not ips:
        return {"error": "no relay pass: the bootstrap cannot see which address this connection came from"}
    ip = ", ".join(ips)

    def still_member() -> bool:
        return admission.revoked(peer, certificate) is None

    if not all(gate.allow(one, peer, membership.expires, still=still_member) for one in ips):
        gate.withdraw(lambda p: p == peer)
        return {"error": "no relay pass: this peer was revoked meanwhile"}
    log.info("relay: a pass for %s (site %s, %s) until %s", ip, membership.site, peer, membership.expires)
    return {"until": membership.expires}


class GatedRelay:
    """A certified swarm's relay: the relay daemon, the gate in front of it, and the pass service on
    the bootstrap's DHT daemon (see the module doc). Its coroutines run on the gate's loop."""

    def __init__(
        self,
        admission: Admission,
        identity: str,
        listen_host: str,
        port: int,
        own: set[str],
        mode: str,
    ):
        from greenswarm.bootstrap.identity import load_or_create_identity

        self.admission, self.mode = admission, mode
        self.relay_identity = f"{identity}.relay"
        self.peer_id = load_or_create_identity(self.relay_identity)
        self.listen_host, self.own = listen_host, own
        self.gate = RelayGate(listen_host, port, ("127.0.0.1", 0), own, Path(f"{identity}.passes.json"))
        self._daemon: Any = None  # the relay daemon
        self._replica: Any = None  # the DHT daemon, for the pass service
        self.relays: list[str] = []  # what sites reach the relay at (the gate, with the relay's peer id)

    def start(self, dht: Any, bootstrap_maddrs: list[str]) -> list[str]:
        """Start the relay daemon, the gate and the pass service; the relay's addresses for sites."""
        self.gate.start_loop()
        self.gate.run(self._start_daemon())
        port = self.gate.bind()
        self.relays = _relay_maddrs(bootstrap_maddrs, port, self.peer_id, self.listen_host)
        self.gate.run(self._serve_passes(dht))  # (last: a pass always comes with where the relay is)
        return self.relays

    async def _start_daemon(self) -> None:
        from hivemind.p2p import P2P

        self._daemon = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=self.relay_identity,
            check_if_identity_free=False,  # (hivemind's check reads RSA keys only; ours are Ed25519)
            force_reachability=self.mode,
            dht_mode="server",  # (libp2p's peer routing: a peer finds a site's circuit address through it)
            auto_nat=False,
            nat_port_map=False,
        )
        addrs = [str(a) for a in await self._daemon.get_visible_maddrs()]
        tcp = next(a for a in addrs if a.startswith("/ip4/127.0.0.1/tcp/"))
        self.gate.target = ("127.0.0.1", int(tcp.split("/")[4]))

    def restart_daemon(self) -> None:
        """A new relay daemon behind the same gate (the relay race lost: see relay_check)."""

        async def restart() -> None:
            await self._daemon.shutdown()
            await self._start_daemon()

        self.gate.run(restart())

    async def _serve_passes(self, dht: Any) -> None:
        from greenswarm import hivemind_internals as seam

        self._replica = await dht.replicate_p2p()

        async def answer(request: bytes, remote_id: Any) -> bytes:
            peer = remote_id.to_base58()
            ips = await _remote_ips(self._replica, remote_id)
            ip = ", ".join(ips) or "no direct address"
            reply = grant(self.admission, self.gate, bytes(request), peer, ips)
            if "error" not in reply:
                reply["relays"] = self.relays
            else:
                self.gate._refusals.warn(f"relay: refused a pass to {peer} ({ip}): {reply['error']}")
            return json.dumps(reply).encode()

        await seam.add_unary_handler(self._replica, PASS_PROTOCOL, answer)

    def withdraw_revoked(self, _blob: bytes | None = None) -> None:
        """Take back the passes of members the admission's revocation list names."""
        gone = self.gate.withdraw(lambda peer: self.admission.revoked(peer) is not None)
        for peer in gone:
            log.warning("relay: withdrew the pass of revoked member %s", peer)

    def close(self) -> None:
        async def stop() -> None:
            # the pass service's replica too, here on its loop: left to the interpreter's exit, its
            # client's tasks were collected after the loop had stopped, and each printed a traceback
            # into the bootstrap's log
            try:
                if self._replica is not None:
                    await self._replica.shutdown()
            finally:
                if self._daemon is not None:
                    await self._daemon.shutdown()

        with contextlib.suppress(Exception):
            self.gate.run(stop(), timeout=15)
        self.gate.close()


async def _remote_ips(p2p: Any, peer: Any) -> list[str]:
    """The IP addresses the bootstrap's daemon sees ``peer``'s direct connections come from (not its
    relayed ones: a circuit's address is the relay's)."""
    ips: list[str] = []
    for info in await p2p.list_peers():
        if info.peer_id == peer:
            for addr in info.addrs:
                parts = str(addr).split("/")
                if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts:
                    ips.append(parts[2])
    return list(dict.fromkeys(ips))


def _relay_maddrs(
    bootstrap_maddrs: list[str], port: int, relay_id: str, gate_host: str = "0.0.0.0"
) -> list[str]:
    """The relay's addresses: each of the bootstrap's TCP addresses of the family the gate listens
    on, at the gate's port, with the relay daemon's peer id."""
    family = "ip6" if ":" in gate_host else "ip4"
    out = []
    for m in bootstrap_maddrs:
        parts = m.split("/")
        if len(parts) >= 5 and parts[1] == family and parts[3] == "tcp":
            out.append(f"/{parts[1]}/{parts[2]}/tcp/{port}/p2p/{relay_id}")
    return list(dict.fromkeys(out))
