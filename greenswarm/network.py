"""Joining the swarm's DHT: multiaddr checks, the swarm config, and a DHT that fails with one clear line.

Every command that talks to the swarm (bootstrap, node, progress) goes through :func:`start_dht`, so
they agree on validators (signed, schema-checked records) and report an unreachable swarm the same way.

It also decides how a peer is reached (see ``docs/nat.md``). A site that others can dial joins
*directly*. A site behind NAT joins *through a relay*: it reserves a libp2p circuit-relay slot on
its bootstrap peer, announces ``<bootstrap>/p2p-circuit`` as its only address, and every
connection to it is carried by the bootstrap. The bootstrap runs the relay service. Two p2pd flags
that recipe needs have no hivemind argument, so they travel as named reachability modes that
:func:`_register_p2pd_modes` adds to hivemind's table of p2pd flags.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, get_args

from greenswarm.configuration import check_number
from greenswarm.errors import ConfigError, SwarmError
from greenswarm.hivemind_internals import add_p2pd_mode, p2pd_mode
from greenswarm.procs import exit_with_parent, reap_children, start_shared_memory_manager, stopped_for

if TYPE_CHECKING:
    from hivemind import DHT

#: tasks of coroutines running in this (DHT) process for :func:`run_in_dht`, held until they end
_HELD_TASKS: set[asyncio.Task] = set()

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MADDR_HINT = "expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


def check_maddr(text: str, what: str, need_peer_id: bool) -> str:
    """Validate one multiaddr; ``what`` names the flag or field in the error."""
    from hivemind.utils.multiaddr import Multiaddr

    text = text.strip()
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # the multiaddr library raises several unrelated exception types
        raise ConfigError(f"{text!r} is not a multiaddr ({e}); {MADDR_HINT}", field=what) from None
    names = [p.name for p in maddr.protocols()]
    if not any(n in names for n in ("ip4", "ip6", "dns", "dns4", "dns6")):
        raise ConfigError(f"{text!r} has no /ip4, /ip6 or /dns part; {MADDR_HINT}", field=what)
    if "tcp" not in names and "udp" not in names:
        raise ConfigError(f"{text!r} has no /tcp/PORT part; {MADDR_HINT}", field=what)
    if need_peer_id and "p2p" not in names:
        raise ConfigError(f"{text!r} has no /p2p/PEER_ID part; {MADDR_HINT}", field=what)
    return text


def check_peers(peers: list[str], what: str) -> list[str]:
    """Validate a list of peer multiaddrs (each must name its peer id)."""
    return [check_maddr(p, what, need_peer_id=True) for p in peers]


Reachability = Literal["auto", "direct", "relay"]
REACHABILITY: tuple[str, ...] = get_args(Reachability)

#: Named p2pd flag sets, registered into hivemind's reachability table (see _register_p2pd_modes).
RELAY_SERVICE_MODE = "greenswarm-relay-service"
BEHIND_NAT_MODE = "greenswarm-behind-nat"
#: a public peer that relays for nobody (a certified swarm's bootstrap DHT daemon: its relay is gated)
PUBLIC_NO_RELAY_MODE = "greenswarm-public-no-relay"
#: A relayed connection carries at most this many bytes each way and lasts at most this long before
#: the relay resets it (p2pd's defaults: 4 GiB, 30 min, far too little for a site that keeps its
#: averaging connection for days). Bounded all the same, so an open swarm's bootstrap is no unlimited
#: relay for anyone: a site whose connection is reset redials it, and the round then in flight fails
#: and is retried (docs/deploy.md). ``greenswarm bootstrap --relay-data-gib/--relay-hours`` set them.
RELAY_DATA_GIB = 64.0
RELAY_HOURS = 24.0
#: relayed connections a peer may have open at once, and reservations (each site holds one)
RELAY_MAX_CIRCUITS = 16
RELAY_MAX_RESERVATIONS = 128


def _register_p2pd_modes() -> None:
    """Teach hivemind's P2P two extra sets of p2pd flags, selected by ``force_reachability``.

    hivemind 1.1.12 passes ``P2P.FORCE_REACHABILITY_MAPPING[force_reachability]`` to p2pd as flags
    and has no other way to add one. Two are needed and measured (docs/nat.md): a site behind NAT
    must turn relay *discovery* off (``-relayDiscovery=false``; with it on, the reservation on the
    trusted relay waits ~180 s), and the bootstrap must raise the relay's per-connection data and
    time limits. Registering new names leaves hivemind's own modes untouched.
    """
    add_p2pd_mode(RELAY_SERVICE_MODE, relay_flags(RELAY_DATA_GIB, RELAY_HOURS))
    add_p2pd_mode(BEHIND_NAT_MODE, {"forceReachabilityPrivate": 1, "relayDiscovery": 0})
    add_p2pd_mode(PUBLIC_NO_RELAY_MODE, {"forceReachabilityPublic": 1, "relayService": 0})


def relay_flags(data_gib: float, hours: float) -> dict[str, Any]:
    """p2pd's flags for a relay whose circuits carry at most ``data_gib`` GiB each way and last at most
    ``hours`` hours (see :data:`RELAY_DATA_GIB`)."""
    return {
        "forceReachabilityPublic": 1,
        "relayDataLimit": max(1, int(data_gib * (1 << 30))),
        # whole seconds: Go's duration parser takes "86400s", not "1e+06h"
        "relayTimeLimit": f"{max(1, round(hours * 3600))}s",
        "relayMaxCircuits": RELAY_MAX_CIRCUITS,
        "relayMaxReservations": RELAY_MAX_RESERVATIONS,
    }


@dataclass
class SwarmConfig:
    """How a process joins the swarm.

    ``name`` separates swarms that share a DHT: it prefixes every key and averaging group, so two
    experiments on one bootstrap peer never average with each other.

    ``reachability`` says how other sites reach this one: ``direct`` (they dial its addresses),
    ``relay`` (through its initial peers' circuit relay; for sites behind NAT or a firewall that
    allows outbound connections only) or ``auto``: direct when the site announces an address, has a
    public IP to listen on, or the whole swarm is on this machine; relay otherwise.

    ``certificate`` and ``authority``: the site's membership certificate and the swarm authority's
    public key. The node checks at start that the certificate is valid for this swarm, this site's
    name and region, and the peer id of ``identity`` (so both need a fixed identity file).

    ``revocations``: a revocation list file from the operator (``greenswarm swarm revoke``): members
    it names are refused from the start; newer lists reach a running site through the DHT.

    ``join_retry_s``: seconds to wait before each new try when no initial peer answers
    (:data:`JOIN_RETRY_DELAYS_S`, 15 s in all); a site whose bootstrap restarts slowly can wait longer,
    a script that wants to know at once shorter (``[]``: one try).
    """

    name: str = "greenswarm"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None
    reachability: Reachability = "auto"
    certificate: str | None = None  # this site's membership certificate (greenswarm swarm admit)
    authority: str | None = None  # the swarm authority's public key (.pub) that signed it
    revocations: str | None = None  # the authority's revocation list (greenswarm swarm revoke), if given
    join_retry_s: list[float] = field(default_factory=lambda: list(JOIN_RETRY_DELAYS_S))

    def validate(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"{self.name!r}: use 1-64 letters, digits, '-' or '_'", field="name")
        if (self.certificate is None) != (self.authority is None):
            missing = "authority" if self.authority is None else "certificate"
            raise ConfigError("certificate and authority go together: set both or neither", field=missing)
        if self.revocations and not self.authority:
            raise ConfigError(
                "a revocation list is the authority's: it needs swarm.authority to be checked",
                field="revocations",
            )
        if self.certificate and not self.identity:
            raise ConfigError(
                "a certificate binds one peer id, so the site needs a fixed identity file (swarm.identity)",
                field="identity",
            )
        check_peers(self.initial_peers, "initial_peers")
        for m in self.host_maddrs:
            check_maddr(m, "host_maddrs", need_peer_id=False)
        for m in self.announce_maddrs:
            check_maddr(m, "announce_maddrs", need_peer_id=False)
        if self.reachability not in REACHABILITY:
            raise ConfigError(
                f"must be one of {', '.join(REACHABILITY)}, got {self.reachability!r}", field="reachability"
            )
        for delay in self.join_retry_s:
            check_number(delay, "join_retry_s", minimum=0.0, inclusive=True)


def _ips(maddrs: list[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for m in maddrs:
        parts = m.split("/")
        for proto, value in zip(parts[1::2], parts[2::2], strict=False):
            if proto in ("ip4", "ip6"):
                try:
                    out.append(ipaddress.ip_address(value))
                except ValueError:
                    pass
    return out


def _local_public_ips() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This machine's globally routable interface addresses (what 0.0.0.0 would listen on)."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_global:
                found.append(ip)
    return found


def resolve_reachability(cfg: SwarmConfig) -> tuple[str, str]:
    """``(direct|relay, why)`` for ``cfg``: the choice ``auto`` makes, and the reason, for the log.

    The safe default is the relay: it works from behind any NAT that allows outbound TCP, and a
    direct address that others cannot dial makes every averaging group fail. So ``auto`` goes
    direct only on evidence that others can dial this site.
    """
    if cfg.reachability == "relay" and not cfg.initial_peers:
        # checked here, not in validate(): --initial-peers may still supply them after the file loads
        raise ConfigError(
            "a site reached through a relay needs initial peers to relay through "
            "(swarm.initial_peers or --initial-peers)",
            field="swarm.reachability",
        )
    if cfg.reachability != "auto":
        return cfg.reachability, f"swarm.reachability is {cfg.reachability}"
    if not cfg.initial_peers:
        return "direct", "no initial peers: this peer starts the swarm"
    if cfg.announce_maddrs:
        return "direct", "the site announces its own addresses"
    peer_ips = _ips(cfg.initial_peers)
    if peer_ips and all(ip.is_loopback for ip in peer_ips):
        return "direct", "the whole swarm is on this machine"
    listen = _ips(cfg.host_maddrs)
    if any(ip.is_global for ip in listen):
        return "direct", "it listens on a public address"
    if any(ip.is_unspecified for ip in listen) and _local_public_ips():
        return "direct", "it listens on all interfaces and has a public address"
    return "relay", "no public address: others reach it through its initial peers' relay"


def relay_options(initial_peers: list[str]) -> dict[str, Any]:
    """The DHT options of a site reached through its initial peers' relay (docs/nat.md)."""
    return {
        "force_reachability": BEHIND_NAT_MODE,
        "use_auto_relay": True,
        "trusted_relays": list(initial_peers),
        # p2pd builds circuit addresses only from a relay's *public* IPs; announcing them ourselves
        # also covers relays on private addresses (a campus, a test's network namespaces)
        "announce_maddrs": [f"{peer}/p2p-circuit" for peer in initial_peers],
    }


def relay_service_options(data_gib: float = RELAY_DATA_GIB, hours: float = RELAY_HOURS) -> dict[str, Any]:
    """The p2p options of a bootstrap peer (or its relay daemon) that relays for sites behind NAT."""
    _register_p2pd_modes()
    if (data_gib, hours) == (RELAY_DATA_GIB, RELAY_HOURS):
        return {"force_reachability": RELAY_SERVICE_MODE}
    name = f"{RELAY_SERVICE_MODE}:{data_gib:g}GiB:{hours:g}h"
    add_p2pd_mode(name, relay_flags(data_gib, hours))
    return {"force_reachability": name}


def no_relay_options() -> dict[str, Any]:
    """The DHT options of a public bootstrap peer that relays for nobody itself (its relay is gated)."""
    _register_p2pd_modes()
    return {"force_reachability": PUBLIC_NO_RELAY_MODE}


def with_p2pd_metrics(options: dict[str, Any], addr: str) -> dict[str, Any]:
    """:func:`start_dht`'s ``options`` with the p2p daemon also serving libp2p's own Prometheus metrics
    on ``addr`` (``host:port``): the relay service counts its circuits and the bytes it carried there,
    which the daemon's control API does not report. A p2pd flag travels only in a named mode (see
    :func:`_register_p2pd_modes`), so this registers the options' mode plus ``-metricsAddr``."""
    _register_p2pd_modes()
    base = options.get("force_reachability")
    name = f"{base or 'greenswarm'}+metrics@{addr}"
    add_p2pd_mode(name, {**p2pd_mode(base), "metricsAddr": addr})
    return {**options, "force_reachability": name}


#: Seconds to wait before each retry when no initial peer answered: a bootstrap that is restarting,
#: or one flooded by many sites starting at once (or starved of CPU on a busy machine), answers a
#: moment later. A site waits 15 s in all: a refused dial fails at once, so a shorter schedule gave
#: up on a bootstrap that was merely slow (seen on a loaded 2-core machine, five peers starting at
#: once). A one-off reader (``greenswarm progress``) answers its user sooner.
JOIN_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
READER_RETRY_DELAYS_S = (1.0, 3.0)


#: how long a DHT process may take to come up (p2pd started, initial peers dialled) before the
#: command gives up with an error instead of waiting forever, as hivemind would
DHT_START_TIMEOUT_S = 60.0


def start_dht(
    initial_peers: list[str],
    *,
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    identity_path: str | None = None,
    client_mode: bool = False,
    record_validators: list[Any] | None = None,
    retry_delays_s: tuple[float, ...] = JOIN_RETRY_DELAYS_S,
    **kwargs: Any,
) -> DHT:
    """Start a hivemind DHT; an unreachable swarm or a taken port becomes a one-line :class:`SwarmError`.

    When none of the initial peers answers, it tries again after each of :data:`JOIN_RETRY_DELAYS_S`
    (logged) before giving up: a dial can fail transiently, and a site that gives up at once would
    sit out its whole window.
    """
    from hivemind import DHT
    from hivemind.p2p import P2PDaemonError

    class OwnedDHT(DHT):
        """hivemind's DHT process, which ends itself and its p2pd daemon when its parent dies."""

        def run(self) -> None:
            exit_with_parent()
            super().run()

        def shutdown(self) -> None:
            """hivemind's shutdown, bounded (:func:`end_helper`) -- or none when the p2p daemon is
            gone already, as after a Ctrl-C or a SIGTERM to the process group (p2pd gets it too):
            nothing is left to close cleanly then."""
            if self.is_alive():
                end_helper(self, self.pid, super().shutdown)

    _register_p2pd_modes()
    start_shared_memory_manager()  # before hivemind's first shared tensor, where a stop could hang us
    delays = list(retry_delays_s) if initial_peers else []
    while True:
        try:
            dht = OwnedDHT(
                initial_peers=initial_peers or None,
                start=False,
                host_maddrs=host_maddrs,
                announce_maddrs=announce_maddrs or None,
                identity_path=identity_path,
                client_mode=client_mode,
                record_validators=record_validators or [],
                check_if_identity_free=False,  # hivemind's check reads RSA keys only; ours are Ed25519
                **kwargs,
            )
            try:
                dht.run_in_background(await_ready=True, timeout=DHT_START_TIMEOUT_S)  # hivemind: forever
            except TimeoutError:
                if dht.is_alive():
                    reap_children(timeout=1.0, pid=dht.pid)  # its p2pd
                    dht.kill()
                raise SwarmError(
                    f"the DHT process did not start within {DHT_START_TIMEOUT_S:.0f} s; see the log above"
                ) from None
            return dht
        except P2PDaemonError as e:
            text = str(e)
            if "bootstrap" in text and delays:
                delay = delays.pop(0)
                logging.getLogger("greenswarm.network").warning(
                    "no initial peer answered; trying again in %g s", delay
                )
                time.sleep(delay)
                continue
            if "bootstrap" in text:
                peers = ", ".join(initial_peers)
                raise SwarmError(
                    f"cannot reach the swarm: none of the initial peers answered ({peers}) in "
                    f"{1 + len(retry_delays_s)} tries over {sum(retry_delays_s):g} s"
                ) from None
            if "address already in use" in text:
                raise SwarmError(
                    f"cannot listen on {', '.join(host_maddrs)}: address already in use"
                ) from None
            raise SwarmError(f"cannot start the p2p daemon: {text}") from None


#: how long a p2p daemon that got the same stop as its owner (Ctrl-C, or SIGTERM to the process group)
#: may take to exit before it counts as alive: 20-70 ms measured on a quiet 2-core machine. Waited only
#: once a stop signal arrived (:func:`greenswarm.procs.stopping`), so a clean stop pays nothing for it
DAEMON_EXIT_GRACE_S = 0.25


def _running_daemon(proc: Any) -> bool:
    """Whether ``proc`` is a p2p daemon that has not exited (one that ended meanwhile has not)."""
    import psutil

    try:
        return proc.name() == "p2pd" and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _daemon_alive(dht_pid: int, grace_s: float) -> bool:
    """Whether a p2p daemon under the DHT process ``dht_pid`` is still running after ``grace_s``."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        try:
            children = psutil.Process(dht_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        alive = any(_running_daemon(p) for p in children)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def daemon_gone(dht_pid: int | None) -> bool:
    """Whether the p2p daemon under the DHT process ``dht_pid`` is gone, or goes within
    :data:`DAEMON_EXIT_GRACE_S` of a stop signal (a Ctrl-C or a SIGTERM to the process group reaches
    it too). Nothing sent through it can arrive then: a wait for a DHT write would only run out its
    timeout. ``None`` (a DHT of no process of its own): not gone. The grace counts from the signal, so
    a stop that reached this process alone (``kill PID``) waits for it once, not at every call."""
    since = stopped_for()
    grace_s = 0.0 if since is None else max(0.0, DAEMON_EXIT_GRACE_S - since)
    return dht_pid is not None and not _daemon_alive(dht_pid, grace_s)


def kill_if_daemon_gone(helper: Any, dht_pid: int) -> bool:
    """Kill a hivemind helper process (a DHT or an averager) when the p2p daemon under the DHT
    process ``dht_pid`` is gone, or goes within :data:`DAEMON_EXIT_GRACE_S`, as after a Ctrl-C or a
    SIGTERM to the process group (p2pd gets it too): nothing is left to close cleanly then, and
    hivemind's shutdown would spend seconds of timeouts on the dead daemon. Returns whether it did;
    if not, shut the helper down as usual.

    The grace matters: the stop reaches the daemon and its owner at once, and an owner that looked
    at once saw a daemon still exiting, took the clean path and waited 6-7 s on it (a bootstrap
    stopped by SIGTERM to its group, right after it started)."""
    if not helper.is_alive() or not daemon_gone(dht_pid):  # (no stop signal: no grace to wait)
        return False
    helper.kill()  # it ignores SIGTERM: its owner stops it (procs.on_termination)
    helper.join(2.0)
    return True


def end_helper(helper: Any, dht_pid: int, shutdown: Callable[[], None]) -> None:
    """Stop a hivemind helper process (a DHT or an averager), within a bound.

    ``shutdown`` is hivemind's own: a message, a join of its ``shutdown_timeout``, then a SIGTERM --
    which the helper ignores, as it inherited its owner's handler (:func:`procs.on_termination`). A
    helper still alive after that would keep its owner waiting at exit, in multiprocessing's join of
    its children, for as long as it lives: it is killed instead, with its p2p daemon first (once the
    helper is gone the daemon is no longer this process's descendant to reap)."""
    if kill_if_daemon_gone(helper, dht_pid):
        return
    shutdown()
    if helper.is_alive():
        logging.getLogger("greenswarm.network").warning(
            "a hivemind helper (pid %d) did not stop within its grace period: killing it", helper.pid
        )
        reap_children(timeout=1.0, pid=helper.pid)
        helper.kill()
        helper.join(2.0)


def visible_peer_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs (with /p2p/ID) others should use to reach this peer, loopback last."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    return sorted(addrs, key=lambda a: ("/127.0.0.1/" in a or "/::1/" in a, a))


def run_in_dht(dht: DHT, coro_fn: Callable[[Any, Any], Awaitable[Any]], timeout_s: float) -> Future:
    """Run ``coro_fn(dht, node)`` in the DHT's process; the returned future resolves within ``timeout_s``.

    hivemind's DHT process starts each ``run_coroutine`` as a task and keeps no reference to it.
    asyncio holds tasks only weakly, and a connection opened to the p2p daemon holds its reader only
    weakly too, so a task awaiting the daemon's answer (``list_peers``, ``connect``) is a cycle no one
    references: the garbage collector destroys it ("Task was destroyed but it is pending!") and its
    future never resolves. That stopped a site's bootstrap re-join for good (issue #22). Here the
    task is held until it ends, and bounded, so the caller always gets a result or an error.
    ``coro_fn`` must pickle (a module-level function, or a ``partial`` of one): it crosses a pipe.
    """
    return dht.run_coroutine(partial(_held_and_bounded, coro_fn, timeout_s), return_future=True)


def connections(dht: DHT, timeout_s: float = 2.0) -> dict[str, list[str]]:
    """The peers ``dht``'s p2p daemon is connected to now, with the addresses it uses for each (a
    ``/p2p-circuit`` one: carried by a relay). Raises when the daemon does not answer in time."""
    return run_in_dht(dht, _list_connections, timeout_s).result(timeout=timeout_s + 1.0)


async def _list_connections(_dht: Any, node: Any) -> dict[str, list[str]]:
    """Runs in the DHT process (see :func:`connections`)."""
    return {str(peer.peer_id): [str(a) for a in peer.addrs] for peer in await node.p2p.list_peers()}


async def _held_and_bounded(
    coro_fn: Callable[[Any, Any], Awaitable[Any]], timeout_s: float, dht: Any, node: Any
) -> Any:
    """Runs in the DHT process (see :func:`run_in_dht`)."""
    task = asyncio.current_task()
    assert task is not None
    _HELD_TASKS.add(task)
    try:
        return await asyncio.wait_for(coro_fn(dht, node), timeout_s)
    finally:
        _HELD_TASKS.discard(task)
