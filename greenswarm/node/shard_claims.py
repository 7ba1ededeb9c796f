"""Shards claimed through the DHT, without a coordinator (``data.sharding: claim``): rank 0's side.

:class:`ShardClaims` keeps this site's readers (its ranks) supplied with shards of the swarm's corpus
and tells the swarm what it holds and how far it read, by the rules of
:mod:`greenswarm.node.shard_records`:

* **claim** -- read every site's record, pick free shards (lowest next epoch first), write a lease
  for each, wait ``data.claim_settle_s`` for rival claims to show, read again, and keep only the
  shards whose earliest live claim is this site's; each reader gets its shard from the furthest
  position any record gives. Each rank holds the shard it reads and, claimed in the background, the
  one it reads next.
* **renew** -- every third of ``data.lease_s`` on a thread of its own: leases extended, the record
  written again, and any shard an earlier rival claim holds is left (the reader is told before its
  next step, and the site logs what it will have read twice).
* **commit** -- once a checkpoint is on disk, the positions it saved are published (a crash loses
  what the site read after its last checkpoint, and whoever continues the shard reads that again,
  so nothing is skipped), each interval read goes to ``run_dir/shards.jsonl``, and shards read to
  the end of their epoch are released.
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

#: how long a site's shard record lives after its last write (its positions outlive its leases; every
#: live site carries every position it has read, so they outlive the record too)
RECORD_TTL_S = 6 * 3600.0
#: the shards a reader is kept supplied with: the one it reads and the one it reads next
QUEUE_DEPTH = 2
#: how long a DHT read or write of the records may take before this round of claims gives up
DHT_TIMEOUT_S = 10.0

#: a plan for the ranks: rank -> [("assign", shard, position) | ("withdraw", shard, None)]
Plan = dict[int, list[tuple[str, int, Position | None]]]


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


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
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._renewed = float("-inf")  # monotonic time of the last renewal
        self._said_none = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the loop's side

    def start(
        self, statuses: list[dict[str, Any]], saved: dict[str, Any] | None = None, background: bool = True
    ) -> None:
        """Take back what the checkpoint's readers held (``statuses``: each rank's queue and positions;
        ``saved``: :meth:`state_dict` of that checkpoint) where no other site took it over meanwhile,
        then start renewing on a thread of its own (``background``; a test may renew by hand)."""
        tokens = {int(k): (str(t), float(c)) for k, (t, c) in ((saved or {}).get("tokens") or {}).items()}
        self._learn(saved or {})
        wanted: dict[int, int] = {}
        for rank, status in enumerate(statuses):
            for shard in status.get("queue", []):
                position = tuple(status["positions"][shard])
                self.known[shard] = max(self.known.get(shard, START), position)  # type: ignore[arg-type]
                self.read_from[shard] = position  # type: ignore[assignment]
                wanted[shard] = rank
        if wanted:
            self._resume(wanted, tokens)
        if background:
            self._thread = threading.Thread(target=self._run, name="shard-claims", daemon=True)
            self._thread.start()

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
        """Claim a shard now for each rank that has none (blocking: a claim settles for
        ``data.claim_settle_s``), ask the background for the ones they read next, and hand it all to
        the ranks. Whether every rank has a shard now."""
        for rank in range(self.readers):
            with self._lock:
                empty = not self._queue_after_plan(rank)
            if empty:
                self._claim_for(rank, 1)
        self._wake.set()
        self.before_step()
        ready = self.ready()
        if not ready and not self._said_none:
            with self._lock:
                held = sorted({h.site for h in self._view().holders.values()})
            self.log.warning(
                "no free shard of the %d claimable: all are held by live sites (%s); waiting for one "
                "(data.num_shards should be at least twice the swarm's ranks)",
                len(self.claimable),
                ", ".join(held) or "none",
            )
        self._said_none = not ready
        return ready

    def before_step(self) -> None:
        """Hand the ranks what was claimed, released or lost since their last step (loop thread)."""
        with self._lock:
            plan, self._plan = self._plan, {}
            for rank, actions in plan.items():
                for action, shard, _ in actions:
                    if action == "assign" and shard not in self.queues[rank]:
                        self.queues[rank].append(shard)
                    elif action == "withdraw" and shard in self.queues[rank]:
                        self.queues[rank].remove(shard)
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
        positions, journal what was read, release the shards read to their epoch's end. May run on
        the checkpoint writer's thread."""
        if not reader_states:
            return
        lines = []
        with self._lock:
            finished = []
            for rank, state in enumerate(reader_states):
                if not isinstance(state, dict) or not state.get("claimed"):
                    continue
                for shard, size in state.get("sizes", {}).items():
                    self.sizes[int(shard)] = max(int(size), self.sizes.get(int(shard), 0))
                queue = {int(k) for k in state.get("queue", [])}
                for shard, position in state.get("positions", {}).items():
                    shard, position = int(shard), tuple(int(x) for x in position)
                    if position > self.known.get(shard, START):
                        self.known[shard] = position  # type: ignore[assignment]
                    start = self.read_from.get(shard)
                    if start is None or not position > start:  # not this site's, or nothing new read
                        continue
                    lines.append(self._interval(shard, start, position))  # type: ignore[arg-type]
                    self.read_from[shard] = position  # type: ignore[assignment]
                    lease = self.held.get(shard)
                    if lease is not None and lease.rank == rank and shard not in queue:
                        finished.append(shard)  # its reader moved on before this checkpoint
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
                ", ".join(
                    f"shard {k} (next: epoch {self.known[k][0]}, document {self.known[k][1]})"
                    for k in finished
                ),
            )

    def release_all(self, why: str) -> None:
        """Withdraw every shard from the ranks and every lease (after a checkpoint: the site leaves its
        window or stops). Loop thread."""
        with self._claiming, self._lock:
            shards = sorted(self.held)
            plan: Plan = {}
            for rank in range(self.readers):
                queued = set(self.queues[rank]) | {s for a, s, _ in self._plan.get(rank, []) if a == "assign"}
                if queued:
                    plan[rank] = [("withdraw", shard, None) for shard in sorted(queued)]
                self.queues[rank] = []
            self._plan = {}
            self.held.clear()
            self.read_from.clear()
        if plan:
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
        """Stop renewing (leases were released by :meth:`release_all`, or run out after a crash)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=DHT_TIMEOUT_S + self.settle_s + 5)

    # ------------------------------------------------------------------ claims

    def _claim_for(self, rank: int, n: int, wanted: list[int] | None = None) -> list[int]:
        """Claim up to ``n`` free shards (or exactly the ``wanted`` ones, where free) for ``rank``; plan
        the won ones for it. Returns them."""
        with self._claiming:
            if self._stop.is_set():
                return []
            records = self._fetch()
            now = self.now()
            with self._lock:
                self.others = records
                view = self._view(now)
                self._learn_view(view)
                mine = {lease.token for lease in self.held.values()}
                if wanted is None:
                    picks = choose(view, self.claimable, mine, set(self.held), n, self.peer_id)
                else:
                    picks = [k for k in wanted if k not in self.held and view.free(k, mine)]
                for shard in picks:
                    self.held[shard] = Lease(shard, now, now + self.lease_s, secrets.token_hex(8), rank)
            if not picks:
                return []
            self._publish(wait=True)
            if self._stop.wait(self.settle_s):
                return []
            records = self._fetch()
            now = self.now()
            won, lost = [], []
            with self._lock:
                self.others = records
                view = self._view(now)
                self._learn_view(view)
                for shard in picks:
                    holder = view.holders.get(shard)
                    lease = self.held.get(shard)
                    if lease is None:  # released meanwhile
                        continue
                    if holder is not None and holder.lease.token != lease.token:
                        del self.held[shard]
                        lost.append((shard, holder.site))
                        continue
                    position = max(self.known.get(shard, START), view.position(shard))
                    self.read_from[shard] = position
                    self._plan.setdefault(rank, []).append(("assign", shard, position))
                    won.append(shard)
            if lost:
                self.log.info(
                    "claim crossed with another: %s", "; ".join(f"shard {k} is {site}'s" for k, site in lost)
                )
                self._publish()
            if won:
                self.log.info(
                    "claimed shard%s %s for rank %d (%s)",
                    "" if len(won) == 1 else "s",
                    ", ".join(map(str, won)),
                    rank,
                    ", ".join(_describe(self.read_from[k], self.sizes.get(k)) for k in won),
                )
            return won

    def _resume(self, wanted: dict[int, int], tokens: dict[int, tuple[str, float]]) -> None:
        """Re-take the shards a restarted site's readers held (see :meth:`start`)."""
        records = self._fetch()
        now = self.now()
        reclaim: dict[int, list[int]] = {}
        gone = []
        with self._lock:
            self.others = records
            view = self._view(now)
            self._learn_view(view)
            for shard, rank in sorted(wanted.items()):
                holder = view.holders.get(shard)
                token = tokens.get(shard)
                if holder is not None and (token is None or holder.lease.token != token[0]):
                    gone.append((shard, holder.site))
                    self._plan.setdefault(rank, []).append(("withdraw", shard, None))
                    self.read_from.pop(shard, None)
                elif holder is not None and token is not None:  # its own lease, still live
                    self.held[shard] = Lease(shard, token[1], now + self.lease_s, token[0], rank)
                    position = max(self.known.get(shard, START), view.position(shard))
                    self._plan.setdefault(rank, []).append(("assign", shard, position))
                else:
                    reclaim.setdefault(rank, []).append(shard)
                    self._plan.setdefault(rank, []).append(("withdraw", shard, None))  # until won again
        for shard, site in gone:
            self.log.warning(
                "shard %d was taken over by %s while this site was away: leaving it", shard, site
            )
        if self.held:
            self._publish(wait=True)
        for rank, shards in reclaim.items():
            self._claim_for(rank, len(shards), wanted=shards)

    def _renew(self) -> None:
        """Extend this site's leases, read the others' records, leave any shard a rival claimed first."""
        records = self._fetch()
        now = self.now()
        lost = []
        with self._lock:
            self.others = records
            for shard, lease in list(self.held.items()):
                self.held[shard] = Lease(shard, lease.claimed_at, now + self.lease_s, lease.token, lease.rank)
            view = self._view(now)
            self._learn_view(view)
            for shard, lease in list(self.held.items()):
                holder = view.holders.get(shard)
                if holder is not None and holder.lease.token != lease.token:
                    del self.held[shard]
                    self.read_from.pop(shard, None)
                    self._plan.setdefault(lease.rank, []).append(("withdraw", shard, None))
                    lost.append((shard, holder.site))
        for shard, site in lost:
            self.log.warning(
                "shard %d is held by %s, which claimed it first: leaving it (what this site read of it "
                "since its last checkpoint will be read again)",
                shard,
                site,
            )
        self._publish()
        self._renewed = time.monotonic()

    def _run(self) -> None:
        """Renew every third of the lease; claim the shards ranks read next when asked."""
        period = self.lease_s / 3
        while not self._stop.is_set():
            self._wake.wait(timeout=max(0.05, period - (time.monotonic() - self._renewed)))
            if self._stop.is_set():
                return
            try:
                if time.monotonic() - self._renewed >= period:
                    self._renew()
                if self._wake.is_set():
                    self._wake.clear()
                    self._top_up()
            except Exception as e:  # a DHT hiccup: the next renewal tries again, well within the lease
                self.log.warning("shard claims: %s: %s (trying again)", type(e).__name__, e)
                self._stop.wait(1.0)

    def _top_up(self) -> None:
        """Claim the next shard for each rank that has only the one it reads."""
        for rank in range(self.readers):
            with self._lock:
                queued = len(self._queue_after_plan(rank))
            if 0 < queued < QUEUE_DEPTH:
                self._claim_for(rank, QUEUE_DEPTH - queued)

    # ------------------------------------------------------------------ records

    def _record(self, now: float | None = None) -> ShardRecord:
        return ShardRecord(
            site=self.site,
            peer_id=self.peer_id,
            dataset=self.dataset,
            count=self.count,
            leases=list(self.held.values()),
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
        for action, shard, _ in self._plan.get(rank, []):
            if action == "assign" and shard not in queue:
                queue.append(shard)
            elif action == "withdraw" and shard in queue:
                queue.remove(shard)
        return queue

    def _fetch(self) -> list[ShardRecord]:
        """The other sites' records of this dataset (this site's own, under any subkey, left out: its
        memory is newer). Records of another dataset are said once each."""
        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=DHT_TIMEOUT_S)
        records = []
        if found is not None and isinstance(found.value, dict):
            for item in found.value.values():
                record = record_of(getattr(item, "value", None))
                if record is None or record.peer_id == self.peer_id:
                    continue
                if record.dataset != self.dataset:
                    self._other_dataset(record)
                    continue
                records.append(record)
        return records

    _said_datasets: set[str] | None = None

    def _other_dataset(self, record: ShardRecord) -> None:
        said = self._said_datasets = self._said_datasets or set()
        if record.peer_id not in said:
            said.add(record.peer_id)
            self.log.warning(
                "site %s claims shards of another corpus (dataset %s, not %s: another data.source, "
                "seed, num_shards, tokenizer or held-out shard); its claims do not bind this site",
                record.site,
                record.dataset,
                self.dataset,
            )

    def _publish(self, wait: bool = False) -> bool:
        """Write this site's record (``wait``: until the DHT holds it, or it failed: said, never
        raised -- the next renewal writes it again). Whether it is known to be stored."""
        from hivemind.utils import get_dht_time

        with self._lock:
            value = self._record().to_wire()
        try:
            future = self.dht.store(
                self.key,
                subkey=self.subkey,
                value=value,
                expiration_time=get_dht_time() + RECORD_TTL_S,
                return_future=True,
            )
            if not wait:
                return False
            if future.result(timeout=DHT_TIMEOUT_S):
                return True
            why = "the DHT did not store it"
        except Exception as e:  # the DHT is busy or shutting down
            why = f"{type(e).__name__}: {e}"
        self.log.warning("shard claims: this site's shard record was not written (%s); renewal retries", why)
        return False

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
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.journal, "a", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


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
