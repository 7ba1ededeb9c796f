"""Shards claimed through the DHT, without a coordinator (``data.sharding: claim``): rank 0's side.

:class:`ShardClaims` keeps this site's readers (its ranks) supplied with shards of the swarm's corpus
and tells the swarm what it holds and how far it read, by the rules of
:mod:`greenswarm.node.shard_records`:

* **claim** -- read every site's record, pick free shards (lowest next epoch first), write a lease
  for each, wait ``data.claim_settle_s`` for rival claims to show, read again, and keep only the
  shards whose earliest live claim is this site's; each reader gets its shard from the furthest
  position any record gives. Each rank holds the shard it reads and, claimed in the background, the
  one it reads next.
* **renew** -- every third of ``data.lease_s`` (from the last renewal's start), and again a moment
  after one the DHT did not take, on a thread of its own (claims never hold it up):
  leases extended once the DHT holds the new record, and any shard an earlier rival claim holds is
  left (the reader is told before its next step, and the site logs what it will have read twice). A
  lease the site could not renew for a whole lease (the DHT failed it) is left too: another site may
  hold that shard by now; it is claimed again, with a new date, if it is still free.
* **commit** -- once a checkpoint is on disk, the positions it saved are published (a crash loses
  what the site read after its last checkpoint, and whoever continues the shard reads that again,
  so nothing is skipped), each interval read goes to ``run_dir/shards.jsonl``, and the shards its
  readers had left by then (read to the end of their epoch, or left for a new one) are released.
  Readers name each shard they left with the token of the claim it was given under, so a checkpoint
  taken before a shard was claimed again never releases the new claim.
* **release** -- when the site leaves its window, and when it stops, after a checkpoint: every
  lease is withdrawn, positions stay published. A crashed site's leases simply run out.

The readers only read (:mod:`greenswarm.node.shard_reader`); what they are given or lose reaches
them before the next step, from the loop's thread (:meth:`ShardClaims.before_step`).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greenswarm.network import daemon_gone
from greenswarm.node.data import DataConfig
from greenswarm.node.evaluation import EvalConfig, shards_overlap
from greenswarm.node.shard_reader import START, Position
from greenswarm.node.shard_records import (
    Lease,
    ShardRecord,
    SwarmShards,
    choose,
    merge,
    record_of,
    shards_key,
)
from greenswarm.procs import stopping

#: how long a site's shard record lives after its last write (its positions outlive its leases; every
#: live site carries every position it has read, so they outlive the record too)
RECORD_TTL_S = 6 * 3600.0
#: the shards a reader is kept supplied with: the one it reads and the one it reads next
QUEUE_DEPTH = 2
#: how long a DHT read or write of the records may take (at most a third of the lease)
DHT_TIMEOUT_S = 10.0
#: why a record was not written when this site's p2p daemon had gone (a stop to the process group)
DAEMON_GONE = "this site's p2p daemon is gone"
#: a site that could not give every rank a shard gives back what it got and tries again this much later
RETRY_S = 2.0

#: a plan for the ranks: rank -> [(action, shard, position, token)]: ("assign", shard, position,
#: token), ("withdraw", shard, None, None) or ("clear", -1, None, None) (withdraw every shard)
Action = tuple[str, int, Position | None, str | None]
Plan = dict[int, list[Action]]


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


class _ClaimAbandoned(Exception):
    """A claim could not be settled (its store failed, or the site is stopping); said by its caller."""


class ShardClaims:
    """Claims, renews, commits and releases this site's shards (rank 0; see the module's docstring).

    ``subkey``: this site's record subkey (its RSA public key); ``claimable``: the shards any site may
    claim (the held-out shard is not one); ``readers``: the site's ranks; ``apply``: hands a plan to
    the ranks (a collective under torchrun, so it is only called from the loop's thread).
    """

    def __init__(
        self,
        dht: Any,
        swarm: str,
        subkey: bytes,
        site: str,
        peer_id: str,
        dataset: str,
        count: int,
        claimable: list[int],
        readers: int,
        lease_s: float,
        settle_s: float,
        apply: Callable[[Plan], None],
        run_dir: str | Path,
        log: logging.Logger | None = None,
        now: Callable[[], float] = _dht_time,
    ):
        self.dht, self.key, self.subkey = dht, shards_key(swarm), subkey
        self.site, self.peer_id, self.dataset, self.count = site, peer_id, dataset, count
        self.claimable = list(claimable)
        self._claimable = set(claimable)
        self.readers, self.lease_s, self.settle_s = readers, lease_s, settle_s
        self.dht_timeout_s = min(DHT_TIMEOUT_S, lease_s / 3)
        self.apply, self.now = apply, now
        self.log = log or logging.getLogger(__name__)
        self.journal = Path(run_dir) / "shards.jsonl"
        self.held: dict[int, Lease] = {}
        self.known: dict[int, Position] = {}  # the furthest committed position of every shard heard of
        self.sizes: dict[int, int] = {}
        self.read_from: dict[int, Position] = {}  # where this site's committed reading of a shard stands
        self.queues: list[list[int]] = [[] for _ in range(readers)]  # as the ranks last reported them
        self.others: list[ShardRecord] = []  # the other sites' records, as last read
        self._plan: Plan = {}  # for the ranks, before their next step
        self._lock = threading.RLock()  # the state above
        self._claiming = threading.Lock()  # one claim (or release) at a time: a claim spans its settle
        self._publishing = threading.Lock()  # one record write at a time, each expiring after the last
        self._expires = 0.0  # the expiration time of the last record written
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._retry_at = 0.0  # (monotonic) when a site that could not serve every rank tries again
        self._said: set[str] = set()  # warnings said once
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ the loop's side

    def start(
        self, statuses: list[dict[str, Any]], saved: dict[str, Any] | None = None, background: bool = True
    ) -> None:
        """Take back what the checkpoint's readers held (``statuses``: each rank's queue and positions;
        ``saved``: :meth:`state_dict` of that checkpoint) where no other site took it over meanwhile,
        then renew, and claim what ranks read next, on threads of their own (``background``; a test may
        do both by hand)."""
        tokens = {int(k): (str(t), float(c)) for k, (t, c) in ((saved or {}).get("tokens") or {}).items()}
        self._learn(saved or {})
        wanted: dict[int, int] = {}
        for rank, status in enumerate(statuses):
            self.queues[rank] = list(status.get("queue", []))
            for shard in self.queues[rank]:
                position = tuple(status["positions"][shard])
                self.known[shard] = max(self.known.get(shard, START), position)  # type: ignore[arg-type]
                self.read_from[shard] = position  # type: ignore[assignment]
                wanted[shard] = rank
        if wanted:
            self._resume(wanted, tokens)
        if background:
            for name, target in (("shard-leases", self._renew_loop), ("shard-claims", self._claims_loop)):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    def prepare(self) -> bool:
        """Before a step: hand the ranks what changed, and claim at once for a rank with no shard.
        Whether every rank has one to read."""
        self.before_step()
        return self.ready() or self.ensure()

    def ready(self) -> bool:
        """Whether every rank has a shard to read (after :meth:`before_step` hands over what is planned)."""
        with self._lock:
            return all(self._queue_after_plan(rank) for rank in range(self.readers))

    def ensure(self) -> bool:
        """Claim now, in one settle, a shard for each rank that has none (blocking: a claim settles for
        ``data.claim_settle_s``); hand them to the ranks and ask the background for the ones they read
        next. A site that cannot serve every rank cannot train: it gives back what this call got and
        tries again ``RETRY_S`` later. Whether every rank has a shard now."""
        if time.monotonic() < self._retry_at:
            return False
        with self._lock:
            wants = {rank: 1 for rank in range(self.readers) if not self._queue_after_plan(rank)}
        won = self._claim(wants) if wants else []
        with self._lock:
            ready = all(self._queue_after_plan(rank) for rank in range(self.readers))
            if not ready and won:  # never read: given back at once
                for shard in won:
                    lease = self.held.pop(shard)
                    self.read_from.pop(shard, None)
                    actions = [
                        a for a in self._plan.pop(lease.rank, []) if not (a[0] == "assign" and a[1] == shard)
                    ]
                    if actions:
                        self._plan[lease.rank] = actions
        if not ready:
            self._retry_at = time.monotonic() + RETRY_S
            if won:
                self._publish()
            self._say_once(
                "no-free-shard",
                f"not every rank of this site has a shard: of the {len(self.claimable)} claimable, none is "
                f"free for {len(wants)} rank(s) (held by {', '.join(self._holders()) or 'nobody seen'}); "
                "waiting for one (data.num_shards should be at least twice the swarm's ranks)",
            )
            return False
        self._said.discard("no-free-shard")
        self._wake.set()
        self.before_step()
        return True

    def before_step(self) -> None:
        """Hand the ranks what was claimed, released or lost since their last step (loop thread)."""
        with self._lock:
            plan, self._plan = self._plan, {}
            for rank, actions in plan.items():
                for action, shard, _, _ in actions:
                    if action == "assign" and shard not in self.queues[rank]:
                        self.queues[rank].append(shard)
                    elif action == "withdraw" and shard in self.queues[rank]:
                        self.queues[rank].remove(shard)
                    elif action == "clear":
                        self.queues[rank] = []
        if plan:
            self.apply(plan)

    def after_step(self, statuses: list[dict[str, Any]] | None) -> None:
        """What the ranks read in the step (each one's queue): a rank short of its next shard gets one
        claimed in the background."""
        if not statuses:
            return
        with self._lock:
            for rank, status in enumerate(statuses):
                self.queues[rank] = list(status.get("queue", []))
            short = any(len(self._queue_after_plan(r)) < QUEUE_DEPTH for r in range(self.readers))
        if short:
            self._wake.set()

    def commit(self, reader_states: list[dict[str, Any]] | None) -> None:
        """A checkpoint holding ``reader_states`` (each rank's saved reader) is on disk: publish its
        positions, journal what was read, release the shards its readers had left by then, under the
        claim they left (not one made since). May run on the checkpoint writer's thread."""
        if not reader_states:
            return
        lines = []
        with self._lock:
            finished = []
            for state in reader_states:
                if not isinstance(state, dict) or not state.get("claimed"):
                    continue
                for shard, size in state.get("sizes", {}).items():
                    self.sizes[int(shard)] = max(int(size), self.sizes.get(int(shard), 0))
                for shard, position in state.get("positions", {}).items():
                    shard, position = int(shard), tuple(int(x) for x in position)
                    if position > self.known.get(shard, START):
                        self.known[shard] = position  # type: ignore[assignment]
                    start = self.read_from.get(shard)
                    if start is not None and position > start:  # this site's reading, and some new
                        lines.append(self._interval(shard, start, position))  # type: ignore[arg-type]
                        self.read_from[shard] = position  # type: ignore[assignment]
                for shard, token in state.get("left", {}).items():
                    lease = self.held.get(int(shard))
                    if lease is not None and token and lease.token == token:
                        finished.append(int(shard))  # its reader left it before this checkpoint
            for shard in finished:
                del self.held[shard]
                self.read_from.pop(shard, None)
        # published first, then journaled: a crash between the two leaves the journal a line short,
        # never another site reading again what this checkpoint holds
        self._publish(wait=True)
        self._write_journal(lines)
        if finished:
            self.log.info(
                "released %s: its reader moved on",
                ", ".join(f"shard {k} (next: {_describe(self.known.get(k, START), None)})" for k in finished),
            )

    def release_all(self, why: str) -> None:
        """Withdraw every shard from the ranks and every lease (after a checkpoint: the site leaves its
        window or stops). Loop thread."""
        with self._claiming, self._lock:
            shards = sorted(self.held)
            plan: Plan = {rank: [("clear", -1, None, None)] for rank in range(self.readers)}
            self.queues = [[] for _ in range(self.readers)]
            self._plan = {}
            self.held.clear()
            self.read_from.clear()
        self.apply(plan)
        if shards:
            self.log.info("released shards %s (%s)", ", ".join(map(str, shards)), why)
        self._publish(wait=True)

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps beside the readers: the claims' tokens (a restart within the
        lease knows its own), and what this site knew of the swarm's positions."""
        with self._lock:
            return {
                "tokens": {k: (lease.token, lease.claimed_at) for k, lease in self.held.items()},
                "known": dict(self.known),
                "sizes": dict(self.sizes),
            }

    def view(self) -> SwarmShards:
        """The swarm's shards as this site last read them (its own state included)."""
        with self._lock:
            return self._view()

    def summary(self) -> dict[str, Any]:
        """For the site's summary: what it holds and what the swarm has read."""
        with self._lock:
            view = self._view()
            read = [k for k in self.claimable if view.position(k) != START]
            return {
                "sharding": "claim",
                "dataset": self.dataset,
                "shards": self.count,
                "claimable": len(self.claimable),
                "held": sorted(self.held),
                "started": len(read),
                "epoch": min((view.next_epoch(k) for k in self.claimable), default=0),
            }

    def close(self) -> None:
        """Stop renewing and claiming (leases were released by :meth:`release_all`, or run out)."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=3 * self.dht_timeout_s + self.settle_s + 5)

    # ------------------------------------------------------------------ claims

    def _claim(self, wants: dict[int, int] | None = None, wanted: dict[int, int] | None = None) -> list[int]:
        """Claim, in one settle, ``wants[rank]`` free shards for each rank (or the ``wanted`` shards,
        shard -> rank, where free); plan the won ones for their ranks and return them. A claim that
        cannot be settled -- a DHT read or write that fails, a stop -- leaves no lease behind."""
        won: list[int] = []
        picks: dict[int, Lease] = {}
        with self._claiming:
            try:
                if self._stop.is_set():
                    raise _ClaimAbandoned("stopping")
                records = self._fetch()
                now = self.now()
                with self._lock:
                    self.others = records
                    view = self._view(now)
                    self._learn_view(view)
                    mine = {lease.token for lease in self.held.values()}
                    if wanted is None:
                        ranks = [rank for rank, n in sorted((wants or {}).items()) for _ in range(n)]
                        shards = choose(view, self.claimable, mine, set(self.held), len(ranks), self.peer_id)
                        order = list(zip(shards, ranks, strict=False))
                    else:
                        order = [
                            (k, r)
                            for k, r in sorted(wanted.items())
                            if k not in self.held and view.free(k, mine)
                        ]
                    for shard, rank in order:
                        picks[shard] = Lease(shard, now, now + self.lease_s, secrets.token_hex(8), rank)
                    self.held.update(picks)
                if not picks:
                    return []
                if not self._publish(wait=True):
                    raise _ClaimAbandoned("its lease could not be written")
                if self._stop.wait(self.settle_s):
                    raise _ClaimAbandoned("stopping")
                records = self._fetch()
                now = self.now()
                lost = []
                with self._lock:
                    self.others = records
                    view = self._view(now)
                    self._learn_view(view)
                    for shard, lease in picks.items():
                        holder = view.holders.get(shard)
                        if not self._holds(lease):  # released meanwhile (a renewal replaces the object)
                            continue
                        if holder is not None and holder.lease.token != lease.token:
                            del self.held[shard]
                            lost.append((shard, holder.site))
                            continue
                        position = max(self.known.get(shard, START), view.position(shard))
                        self.read_from[shard] = position
                        self._plan.setdefault(lease.rank, []).append(("assign", shard, position, lease.token))
                        won.append(shard)
                if lost:
                    self.log.info(
                        "claim crossed with another: %s",
                        "; ".join(f"shard {k} is {site}'s" for k, site in lost),
                    )
                    self._publish()
            except Exception as e:  # nothing half-claimed stays: a lease not settled is withdrawn
                with self._lock:
                    for shard, lease in picks.items():
                        if shard not in won and self._holds(lease):
                            del self.held[shard]
                if picks:
                    self._publish()
                if not isinstance(e, _ClaimAbandoned) or str(e) != "stopping":
                    self.log.warning(
                        "shard claims: a claim was given up (%s: %s); trying again", type(e).__name__, e
                    )
                return won
        if won:
            self.log.info(
                "claimed %s",
                ", ".join(
                    f"shard {k} for rank {picks[k].rank} ({_describe(self.read_from[k], self.sizes.get(k))})"
                    for k in won
                ),
            )
        return won

    def _resume(self, wanted: dict[int, int], tokens: dict[int, tuple[str, float]]) -> None:
        """Re-take the shards a restarted site's readers held (see :meth:`start`). When the swarm's
        records cannot be read, the readers give them up: another site may hold them now."""
        try:
            records = self._fetch()
        except Exception as e:
            self.log.warning(
                "cannot read the swarm's shard records (%s: %s): leaving the shards the checkpoint's "
                "readers held (%s); claiming afresh",
                type(e).__name__,
                e,
                ", ".join(map(str, sorted(wanted))),
            )
            with self._lock:
                for rank in range(self.readers):
                    self._plan.setdefault(rank, []).append(("clear", -1, None, None))
                self.read_from.clear()
            return
        now = self.now()
        reclaim: dict[int, int] = {}
        gone = []
        with self._lock:
            self.others = records
            view = self._view(now)
            self._learn_view(view)
            for shard, rank in sorted(wanted.items()):
                holder = view.holders.get(shard)
                token = tokens.get(shard)
                self._plan.setdefault(rank, []).append(("withdraw", shard, None, None))  # until taken back
                if holder is not None and (token is None or holder.lease.token != token[0]):
                    gone.append((shard, holder.site))
                    self.read_from.pop(shard, None)
                elif holder is not None and token is not None:  # its own lease, still live
                    self.held[shard] = Lease(shard, token[1], now + self.lease_s, token[0], rank)
                    position = max(self.known.get(shard, START), view.position(shard))
                    self._plan[rank].append(("assign", shard, position, token[0]))
                else:
                    reclaim[shard] = rank
        for shard, site in gone:
            self.log.warning(
                "shard %d was taken over by %s while this site was away: leaving it", shard, site
            )
        if self.held:
            self._publish(wait=True)
        if reclaim:
            self._claim(wanted=reclaim)
        with self._lock:  # what was not taken back is this site's no more
            for shard in reclaim:
                if shard not in self.held:
                    self.read_from.pop(shard, None)

    def _renew(self, read: bool = True) -> bool:
        """Extend this site's leases (once the DHT holds them), leave any shard a rival claimed first,
        and any whose lease ran out before it could be renewed; whether the DHT took the renewal.
        ``read``: read the others' records first (a retry right after a renewal the DHT did not take
        goes straight to the write: the records were read a moment ago)."""
        records = None
        try:
            records = self._fetch() if read else None
        except Exception as e:  # renew what it holds anyway: the others' records are the last ones read
            self._say_once("fetch", f"cannot read the swarm's shard records ({type(e).__name__}: {e})")
        now = self.now()
        lost, lapsed = [], []
        with self._lock:
            if records is not None:
                self.others = records
                self._said.discard("fetch")
            for shard, lease in list(self.held.items()):
                if not lease.live(now):  # not renewed for a whole lease: another site may hold it by now
                    lapsed.append(shard)
                    self._leave(shard, lease)
            view = self._view(now)
            self._learn_view(view)
            for shard, lease in list(self.held.items()):
                holder = view.holders.get(shard)
                if holder is not None and holder.lease.token != lease.token:
                    lost.append((shard, holder.site))
                    self._leave(shard, lease)
        for shard, site in lost:
            self.log.warning(
                "shard %d is held by %s, which claimed it first: leaving it (what this site read of it "
                "since its last checkpoint will be read again)",
                shard,
                site,
            )
        if lapsed:
            self.log.warning(
                "could not renew the lease on shard%s %s in time (the DHT did not take this site's record "
                "for %g s): leaving %s, to be claimed again if still free",
                "" if len(lapsed) == 1 else "s",
                ", ".join(map(str, lapsed)),
                self.lease_s,
                "it" if len(lapsed) == 1 else "them",
            )
        return self._publish(wait=True, renew=True)

    def _holds(self, lease: Lease) -> bool:
        """(under the lock) Whether this site still holds ``lease``'s claim (renewed or not: a renewal
        replaces the lease object, so claims are compared by token)."""
        current = self.held.get(lease.shard)
        return current is not None and current.token == lease.token

    def _leave(self, shard: int, lease: Lease) -> None:
        """(under the lock) Give up ``shard``: its reader is told before its next step."""
        del self.held[shard]
        self.read_from.pop(shard, None)
        self._plan.setdefault(lease.rank, []).append(("withdraw", shard, None, None))

    def _renew_loop(self) -> None:
        """Renew every third of the lease, whatever the claims are doing (:meth:`_next_renewal`)."""
        at, stored = time.monotonic() + self.lease_s / 3, True
        while not self._stop.wait(max(0.0, at - time.monotonic())):
            began = time.monotonic()
            try:
                stored = self._renew(read=stored)
            except Exception as e:  # a bug or a dying DHT: the next renewal tries again
                self.log.warning("shard leases: %s: %s (trying again)", type(e).__name__, e)
                stored = False
            at = self._next_renewal(began, stored)

    def _next_renewal(self, began: float, stored: bool) -> float:
        """When the renewal after one that began at ``began`` (monotonic) is due: a third of the lease
        after that one began, not after it ended, so a slow DHT does not stretch the period; and, if
        the DHT did not take it, a moment after it failed. Each renewal waits up to a third of the
        lease on the read and again on the write: timed from its end, with the next try a whole
        period later, one store that timed out cost the lease (a soak beside two busy processes: "the
        DHT did not take this site's record for 6 s" 2 s after the one store that failed)."""
        if stored:
            return began + self.lease_s / 3
        return time.monotonic() + min(self.lease_s / 12, 1.0)

    def _claims_loop(self) -> None:
        """Claim the shards ranks read next when asked."""
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._top_up()
            except Exception as e:
                self.log.warning("shard claims: %s: %s (trying again)", type(e).__name__, e)
                self._stop.wait(1.0)

    def _top_up(self) -> None:
        """Claim the next shard for each rank that has only the one it reads (never while a rank has
        none: then the site cannot train, and it would only keep shards from others)."""
        with self._lock:
            queued = [len(self._queue_after_plan(rank)) for rank in range(self.readers)]
        if 0 in queued:
            return
        wants = {rank: QUEUE_DEPTH - n for rank, n in enumerate(queued) if n < QUEUE_DEPTH}
        if wants:
            self._claim(wants)

    # ------------------------------------------------------------------ records

    def _record(self, leases: list[Lease] | None = None) -> ShardRecord:
        return ShardRecord(
            site=self.site,
            peer_id=self.peer_id,
            dataset=self.dataset,
            count=self.count,
            leases=list(self.held.values()) if leases is None else leases,
            positions=dict(self.known),
            sizes=dict(self.sizes),
            excluded=[k for k in range(self.count) if k not in self._claimable],
            wall_time=time.time(),
        )

    def _view(self, now: float | None = None) -> SwarmShards:
        now = self.now() if now is None else now
        view = merge([*self.others, self._record()], self.dataset, now)
        view.count = self.count
        return view

    def _holders(self) -> list[str]:
        with self._lock:
            return sorted({h.site for h in self._view().holders.values()})

    def _learn_view(self, view: SwarmShards) -> None:
        for shard, position in view.positions.items():
            if position > self.known.get(shard, START):
                self.known[shard] = position
        for shard, size in view.sizes.items():
            self.sizes[shard] = max(size, self.sizes.get(shard, 0))

    def _learn(self, saved: dict[str, Any]) -> None:
        for shard, position in (saved.get("known") or {}).items():
            position = tuple(int(x) for x in position)
            if position > self.known.get(int(shard), START):
                self.known[int(shard)] = position  # type: ignore[assignment]
        for shard, size in (saved.get("sizes") or {}).items():
            self.sizes[int(shard)] = max(int(size), self.sizes.get(int(shard), 0))

    def _queue_after_plan(self, rank: int) -> list[int]:
        queue = list(self.queues[rank])
        for action, shard, _, _ in self._plan.get(rank, []):
            if action == "assign" and shard not in queue:
                queue.append(shard)
            elif action == "withdraw" and shard in queue:
                queue.remove(shard)
            elif action == "clear":
                queue = []
        return queue

    def _fetch(self) -> list[ShardRecord]:
        """The other sites' records of this dataset (this site's own, under any subkey, left out: its
        memory is newer). Records of another dataset are said once each."""
        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self.dht_timeout_s)
        records = []
        if found is not None and isinstance(found.value, dict):
            for item in found.value.values():
                record = record_of(getattr(item, "value", None))
                if record is None or record.peer_id == self.peer_id:
                    continue
                if record.dataset != self.dataset:
                    self._say_once(
                        f"dataset/{record.peer_id}",
                        f"site {record.site} claims shards of another corpus (dataset {record.dataset}, not "
                        f"{self.dataset}: another data.source, seed, num_shards, tokenizer or held-out "
                        "shard); its claims do not bind this site",
                    )
                    continue
                records.append(record)
        return records

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.warning("%s", message)

    def _publish(self, wait: bool = False, renew: bool = False) -> bool:
        """Write this site's record (``wait``: until the DHT holds it, or it failed: said, never raised
        -- the next renewal writes it again; ``renew``: with every lease extended by ``lease_s``, which
        this site counts on only once the DHT holds them). Records are written one at a time, each
        expiring after the last, so a record built earlier never replaces a later one. Whether it is
        known to be stored."""
        from hivemind.utils import get_dht_time

        with self._publishing:
            with self._lock:
                leases = list(self.held.values())
                if renew:
                    until = self.now() + self.lease_s
                    leases = [Lease(x.shard, x.claimed_at, until, x.token, x.rank) for x in leases]
                value = self._record(leases).to_wire()
            self._expires = max(get_dht_time() + RECORD_TTL_S, self._expires + 1e-3)
            try:
                future = self.dht.store(
                    self.key,
                    subkey=self.subkey,
                    value=value,
                    expiration_time=self._expires,
                    return_future=True,
                )
                if not wait:
                    return False
                if daemon_gone(getattr(self.dht, "pid", None)):  # it cannot arrive: not waited for
                    stored, why = False, DAEMON_GONE
                else:
                    stored = bool(future.result(timeout=self.dht_timeout_s))
                    why = "the DHT did not store it"
            except Exception as e:  # the DHT is busy or shutting down
                stored, why = False, f"{type(e).__name__}: {e}"
            if stored and renew:
                with self._lock:  # the leases it still holds, as renewed
                    for lease in leases:
                        if self._holds(lease):
                            self.held[lease.shard] = lease
        if not stored and not (stopping() and why == DAEMON_GONE):  # (a group's stop ends it too)
            self.log.warning(
                "shard claims: this site's shard record was not written (%s); renewal retries", why
            )
        return stored

    def _interval(self, shard: int, start: Position, end: Position) -> dict[str, Any]:
        return {
            "shard": shard,
            "from": list(start),
            "to": list(end),
            "documents": documents_between(start, end, self.sizes.get(shard)),
            "site": self.site,
            "wall_time": time.time(),
        }

    def _write_journal(self, lines: list[dict[str, Any]]) -> None:
        if not lines:
            return
        try:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, open(self.journal, "a", encoding="utf-8") as f:
                for line in lines:
                    f.write(json.dumps(line) + "\n")
        except OSError as e:  # the journal is a report: a full disk must not fail the checkpoint
            self._say_once("journal", f"cannot write {self.journal}: {e}")


def claimable_shards(data: DataConfig, held_out: EvalConfig) -> tuple[list[int], list[int]]:
    """``(claimable, excluded)``: the shards of ``data.num_shards`` any site may claim, and those none
    may, the held-out shard of evaluation (``eval.shard_index``, by default the last), whether or not
    this site evaluates: every site of a swarm must leave out the same ones."""
    count = data.num_shards
    held = held_out.held_out(data)
    excluded = [k for k in range(count) if shards_overlap(k, count, held.shard_index, held.num_shards)]
    return [k for k in range(count) if k not in excluded], excluded


def documents_between(start: Position, end: Position, size: int | None) -> int | None:
    """Documents begun between two positions of one shard (None when they span an epoch of unknown size)."""
    if start[0] == end[0]:
        return end[1] - start[1]
    if size is None:
        return None
    return (size - start[1]) + (end[0] - start[0] - 1) * size + end[1]


def _describe(position: Position, size: int | None) -> str:
    epoch, document, _ = position
    return f"epoch {epoch} from document {document}" + (f" of {size}" if size else "")
