"""Joining the swarm: check the membership certificate, decide how to be reached, start the DHT and
the parts that talk through it (averager, swarm view, digest board, entry watch, progress records).

Rank 0 only. :func:`join_swarm` returns every part in one :class:`SwarmParts`, and
:meth:`SwarmParts.close` stops them in the right order (records, view, averager, then the DHT
they all talk through), so the node holds no half-started swarm when something fails on the way.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from greenswarm.averaging.agreement import DigestBoard
from greenswarm.averaging.averager import StateProvider, SwarmAverager
from greenswarm.bootstrap.identity import identity_seed, load_or_create_identity
from greenswarm.errors import ConfigError, SwarmError
from greenswarm.faults import FaultPlan
from greenswarm.network import connections, relay_options, resolve_reachability, start_dht
from greenswarm.node import listen_port
from greenswarm.node.config import SiteConfig
from greenswarm.node.model import ModelIdentity
from greenswarm.node.progress import ProgressPublisher, live_members, record_validators
from greenswarm.node.rejoin import EntryWatch
from greenswarm.node.relay_pass import relays_for
from greenswarm.node.revocations import RevocationWatch
from greenswarm.node.swarm_view import SwarmView, describe_model
from greenswarm.security.admission import Admission
from greenswarm.security.certificates import CertificateError
from greenswarm.timefmt import utc_minute

#: wall seconds beyond a round's timeouts that its checkpoint and evaluation may take while the site's
#: record is kept alive (past that, a loop that does not come back lets the record expire)
KEEPALIVE_SLACK_S = 60.0


@dataclass
class SwarmParts:
    """What a site runs to take part in the swarm (rank 0)."""

    dht: Any
    peer_id: str
    averager: SwarmAverager
    view: SwarmView
    digests: DigestBoard
    entry: EntryWatch
    publisher: ProgressPublisher
    reachability: str  # "direct" or "relay"
    admission: Admission | None = None  # who may train with this site (None: anyone)
    revocations: RevocationWatch | None = None  # the swarm's revocation lists (None: an open swarm)

    def connections(self, timeout_s: float = 2.0) -> dict[str, list[str]]:
        """The peers this site's p2p daemon is connected to now, with the addresses it uses for each:
        a site behind NAT shows ``/p2p-circuit`` addresses for every other site (it never dialled
        one directly). Raises when the daemon does not answer in time."""
        return connections(self.dht, timeout_s)

    def connections_or(self, previous: dict[str, list[str]], log: logging.Logger) -> dict[str, list[str]]:
        """:meth:`connections`, or ``previous`` when the daemon does not answer: a diagnostic must
        never stall a round or a stop."""
        try:
            return self.connections()
        except Exception as err:
            log.debug("cannot list connections: %r", err)
            return previous

    def close(self, log: logging.Logger) -> None:
        """Stop every part, records first and the DHT last; report failures and go on."""
        for part in (self.publisher, self.view, self.revocations):
            if part is not None:
                _quietly(part.close, part, log)
        for part in (self.averager, self.dht):
            _quietly(part.shutdown, part, log)


def join_swarm(
    cfg: SiteConfig,
    numel: int,
    served: StateProvider,
    faults: FaultPlan,
    log: logging.Logger,
    model: ModelIdentity | None = None,
) -> tuple[SwarmParts, Any]:
    """Join the swarm of ``cfg`` with a global model of ``numel`` values; ``served`` is what this site
    serves to newcomers. Returns the parts and the site's checked membership certificate (or None).

    ``model``: what this site trains. Its digest is part of the averaging groups' key, so sites that
    train another model never meet this one in a group; a live site that does is refused here, with
    one line naming both (:func:`refuse_other_models`)."""
    swarm = cfg.swarm
    if swarm.identity:
        load_or_create_identity(swarm.identity)
    admission = membership = seed = None
    if swarm.certificate:
        membership = check_membership(cfg, log)
        admission = Admission.from_files(swarm.name, swarm.authority, swarm.certificate)
        admission.load_revocations(swarm.revocations)
        if (why := admission.revoked(membership.peer_id, admission.certificate)) is not None:
            raise CertificateError(f"{swarm.certificate}: this site is no longer a member: {why}")
        seed = identity_seed(swarm.identity)
    validators = record_validators(swarm.name, admission, seed)
    reachability, why = resolve_reachability(swarm)
    log.info("joining the swarm %s: %s", "through a relay" if reachability == "relay" else "directly", why)
    reach: dict[str, Any] = {"announce_maddrs": swarm.announce_maddrs}
    # a certified swarm's relay lets in members only: the pass comes before the daemon
    # (node/relay_pass.py), for a site reached directly too, which dials NAT'ed sites through it
    relays = swarm.initial_peers
    if admission is not None and swarm.initial_peers:
        relays = relays_for(
            swarm.initial_peers,
            swarm.identity,
            admission.certificate,
            retry_delays_s=tuple(swarm.join_retry_s),
        )
    if reachability == "relay":
        # behind NAT: reached through the bootstrap's relay, and a DHT client (others cannot dial
        # it for DHT queries cheaply, so it does not serve them)
        reach = {**relay_options(relays), "client_mode": True}

    def start(host_maddrs: list[str]) -> Any:
        return start_dht(
            swarm.initial_peers,
            host_maddrs=host_maddrs,
            identity_path=swarm.identity,
            record_validators=validators,
            retry_delays_s=tuple(swarm.join_retry_s),
            **reach,
        )

    run_dir = cfg.node.run_dir
    sticky = listen_port.remembered(run_dir, swarm.host_maddrs)  # the port of this site's last start
    try:
        dht = start(sticky)
    except SwarmError as e:
        if sticky == swarm.host_maddrs or "address already in use" not in str(e):
            raise
        listen_port.forget(run_dir, log, "taken by another process")
        dht = start(swarm.host_maddrs)
    started: list[tuple[Any, str]] = [(dht, "shutdown")]  # stopped in reverse if a later part fails
    try:
        _remember_port(run_dir, swarm.host_maddrs, dht, log)
        peer_id = dht.peer_id.to_base58()
        averager = SwarmAverager(
            dht,
            f"{swarm.name}-avg" + (f"-{model.key}" if model else ""),
            numel,
            cfg.averaging,
            served,
            faults=faults,
            admission=admission,
            members=functools.partial(live_members, dht, swarm.name),
        )
        started.append((averager, "shutdown"))
        revoked = (lambda peer: admission.revoked(peer) is not None) if admission is not None else None
        view = SwarmView(
            dht, swarm.name, peer_id, cfg.node.swarm_poll_s, model.to_wire() if model else None, revoked
        )
        started.append((view, "close"))
        revocations = None
        if admission is not None:  # newer revocation lists, to every process of this site
            revocations = RevocationWatch(dht, admission, peer_id, averager.apply_revocations)
            started.append((revocations, "close"))
        publisher = ProgressPublisher(
            dht,
            swarm.name,
            validators,
            cfg.node.progress_refresh_s,
            cfg.node.progress_ttl_s,
            # a round (or the checkpoint and evaluation after it) may hold the loop this long
            keepalive_s=cfg.averaging.longest_round_s() + KEEPALIVE_SLACK_S,
        )
        started.append((publisher, "close"))
        parts = SwarmParts(
            dht=dht,
            peer_id=peer_id,
            averager=averager,
            view=view,
            digests=DigestBoard(dht, swarm.name, peer_id),
            entry=EntryWatch(dht, swarm.initial_peers, cfg.node.rejoin_s),
            publisher=publisher,
            reachability=reachability,
            admission=admission,
            revocations=revocations,
        )
    except BaseException:  # a half-joined site must not leave a DHT, daemon or averager process behind
        for part, stop in reversed(started):
            _quietly(getattr(part, stop), part, log)
        raise
    return parts, membership


def check_membership(cfg: SiteConfig, log: logging.Logger) -> Any:
    """Refuse to start with a certificate that is not this site's, this swarm's, or valid now; return
    the checked membership."""
    from greenswarm.bootstrap.identity import read_identity
    from greenswarm.security.certificates import CertificateError, load_authority_public, verify

    swarm = cfg.swarm
    membership = verify(
        swarm.certificate,
        load_authority_public(swarm.authority),
        swarm=swarm.name,
        peer_id=read_identity(swarm.identity),
    )
    if (membership.site, membership.region) != (cfg.name, cfg.region):
        raise CertificateError(
            f"{swarm.certificate}: issued to site {membership.site!r} in {membership.region!r}, "
            f"but this config is {cfg.name!r} in {cfg.region!r}"
        )
    log.info(
        "admitted to swarm '%s' until %s (certificate %s)",
        swarm.name,
        utc_minute(membership.expires),
        swarm.certificate,
    )
    return membership


def _remember_port(run_dir: str, host_maddrs: list[str], dht: Any, log: logging.Logger) -> None:
    """Keep the port the daemon listens on for the site's next start (:mod:`listen_port`); a daemon
    that cannot say costs the next start its port, never this join."""
    try:
        listen_port.remember(run_dir, host_maddrs, [str(m) for m in dht.get_visible_maddrs()])
    except Exception as err:
        log.debug("could not keep the listen port: %r", err)


def _quietly(stop: Any, part: Any, log: logging.Logger) -> None:
    try:
        stop()
    except Exception as e:  # shutting down: report and go on with the rest
        log.debug("shutdown of %s failed: %r", type(part).__name__, e)


def refuse_other_models(view: SwarmView, model: ModelIdentity, site: str, swarm: str, ttl_s: float) -> None:
    """Refuse to train in a swarm whose live sites train another model: one line naming both sides
    and what differs (architecture, parameter count, tokenizer, starting weights). Averaging them could
    not work (the vectors differ in length or meaning, or start from different places), and neither
    could adopting their state.

    Only records that outlive one record lifetime (``ttl_s``) count, and never this site's own (under
    an earlier peer id, from before a restart or an upgrade): a record lives on for a while after its
    process ends, and a refusal ends the node."""
    view.poll_now()
    seen = {r.peer_id for r in view.unlike() if r.site != site}
    if not seen:
        return
    time.sleep(ttl_s)
    view.poll_now()
    unlike = [r for r in view.unlike() if r.site != site and r.peer_id in seen]
    if not unlike:
        return
    other = unlike[0]
    theirs = ModelIdentity.from_wire(other.model or "")
    differs = model.differences(theirs) if theirs else ["greenswarm version"]
    raise ConfigError(
        f"this site ({site}) trains {model}, but site {other.site} ({other.peer_id}) of swarm '{swarm}' "
        f"trains {describe_model(other.model)}: they differ in {_in_words(differs)}; every site of a "
        "swarm must train the same model from the same start (model.preset / model.config / model.init_from, "
        "model.tokenizer, model.seed) with the same greenswarm",
        field="model",
    )


def _in_words(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if not items:
        return "configuration"
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
