"""Progress records: one signed, schema-checked DHT entry per live site.

Each site node writes its record under one DHT key (``<swarm>_progress``), subkey = its own RSA public
key, so only that node can overwrite it (hivemind's ``RSASignatureValidator``) and every field has a
fixed type (``SchemaValidator``). Records expire a few refreshes after the last write, so a dead site
drops out of ``greenswarm progress`` by itself. Readers must register the same validators, or
hivemind refuses the signed values.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivemind import DHT

    from greenswarm.security.admission import Admission

RECORD_VERSION = 1


@dataclass(frozen=True)
class ProgressRecord:
    """What a site tells the swarm about itself (fields from DESIGN.md, plus what peers need to sync)."""

    site: str
    region: str
    state: str  # IDLE | SOLO | FEDERATED
    peer_id: str
    outer_round: int  # outer steps applied to this site's view of the global model
    lineage: str  # digest of the history of that view; equal lineage = same global parameters
    round_index: int  # clock-aligned round slot of the last outer step (-1: none yet)
    local_steps: int
    tokens: int
    loss: float | None
    window_end: float | None  # clock time the current window ends (None outside a window)
    energy_kwh: float
    emissions_g: float
    clock_time: float  # the site's clock (trace time in replays)
    wall_time: float
    world_size: int = 1
    version: int = RECORD_VERSION
    wire: str | None = None  # wire format of the last averaged round (auto picks one per round)
    refused: int = 0  # groupmates' updates this site refused so far (NaN/Inf, norm far outside the group's)
    next_start: float | None = None  # policy: deadline: clock time the plan next trains (None: no plan)
    # a shared deadline {deadline, target, values, work_tokens, at}: what it can still train, how clean
    plan: dict[str, Any] | None = None
    model: str | None = None  # ModelIdentity.to_wire(): architecture, parameters, tokenizer, digest
    # digest of the global state this site serves at (outer_round, lineage): parameters and momentum
    state_digest: str | None = None
    # the held-out loss of the global model last measured here (eval.batches), of outer step eval_round,
    # whose digest (GlobalState.digest) is eval_digest: sites holding one digest report one number
    eval_loss: float | None = None
    eval_round: int | None = None
    eval_digest: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> ProgressRecord:
        return cls(**value)

    @property
    def in_window(self) -> bool:
        """Training now (a restarting site trains once it has caught up; it is no partner yet)."""
        return self.state in ("SOLO", "FEDERATED")


def record_validators(swarm: str, admission: Admission | None = None, seed: bytes | None = None) -> list[Any]:
    """The validators every process of swarm ``swarm`` registers: records are signed and typed; in a
    certified swarm (``admission``) they are also signed by a member and bound to its certificate
    (:mod:`greenswarm.security.records`; ``seed`` is this peer's identity key, None to only check)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from greenswarm.node.progress_schema import ProgressSchema

    validators = [
        SchemaValidator(ProgressSchema, allow_extra_keys=True, prefix=swarm),
        # a key of its own, not hivemind's process-wide one: two peers in one process (a test, a
        # benchmark) must not write their records under one subkey
        RSASignatureValidator(RSAPrivateKey()),
    ]
    if admission is not None:
        from greenswarm.security.records import MemberRecordValidator

        validators.append(MemberRecordValidator(admission, seed))
    return validators


def progress_key(swarm: str) -> str:
    return f"{swarm}_progress"


def _owner_subkey(validators: list[Any]) -> bytes:
    from hivemind.dht.crypto import RSASignatureValidator

    signer = next(v for v in validators if isinstance(v, RSASignatureValidator))
    return signer.local_public_key


def _clean_floats(record: ProgressRecord) -> ProgressRecord:
    """Strict schema types: make sure every float field really is a float (not an int or numpy scalar)."""
    changes = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.type in ("float", "float | None") and value is not None:
            changes[f.name] = float(value)
        elif f.type == "int":
            changes[f.name] = int(value)
    return dataclasses.replace(record, **changes)


class ProgressPublisher:
    """Writes this site's record every ``refresh_s`` wall seconds and whenever asked to (state changes).

    Writes are fire-and-forget futures so a slow DHT never stalls training; the record lives for
    ``ttl_s`` so a killed site disappears from the table within that time.

    With ``keepalive_s``, a background thread writes the last record again every ``refresh_s`` while
    the node's loop is busy elsewhere -- an averaging round that waits out a timeout, a checkpoint,
    an evaluation -- for at most ``keepalive_s`` after the loop last made one. A site blocked in a
    round is alive and in its window; without this its record expired mid-round, its groupmates saw
    it gone and fell back to SOLO, and the swarm split into lineages. A frozen or dead process writes
    nothing, and a loop stuck for longer than ``keepalive_s`` lets its record expire.
    """

    def __init__(
        self,
        dht: DHT,
        swarm: str,
        validators: list[Any],
        refresh_s: float,
        ttl_s: float,
        keepalive_s: float = 0.0,
    ):
        self.dht, self.key = dht, progress_key(swarm)
        self.subkey = _owner_subkey(validators)
        self.refresh_s, self.ttl_s, self.keepalive_s = refresh_s, ttl_s, keepalive_s
        self._made = float("-inf")  # when the loop last made a record (monotonic)
        self._stored = float("-inf")  # when a record was last written, by the loop or the keep-alive
        self._wire: dict[str, Any] | None = None  # the last record, as written
        self._pending = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def maybe_publish(self, make_record: Any, force: bool = False) -> bool:
        """Publish ``make_record()`` if forced or due; returns whether a write was started."""
        if not force and time.monotonic() - self._made < self.refresh_s:
            return False
        record = _clean_floats(make_record())
        with self._lock:
            self._made = time.monotonic()
            self._wire = record.to_wire()
            self._write()
        if self.keepalive_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._keep_alive, name="progress-keepalive", daemon=True)
            self._thread.start()
        return True

    @property
    def last_record(self) -> ProgressRecord | None:
        """The record last written (None before the first): what the swarm now reads of this site."""
        wire = self._wire
        return None if wire is None else ProgressRecord.from_wire(wire)

    def _write(self) -> None:
        from hivemind.utils import get_dht_time

        self._stored = time.monotonic()
        self._pending = self.dht.store(
            self.key,
            subkey=self.subkey,
            value=self._wire,
            expiration_time=get_dht_time() + self.ttl_s,
            return_future=True,
        )

    def keepalive_due(self, now: float) -> bool:
        """Whether the keep-alive writes the last record again at (monotonic) ``now``: a refresh is
        due and the loop made a record within ``keepalive_s``."""
        return (
            self._wire is not None
            and now - self._stored >= self.refresh_s
            and now - self._made <= self.keepalive_s
        )

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.refresh_s / 2):
            with self._lock:
                if self.keepalive_due(time.monotonic()):
                    try:
                        self._write()
                    except Exception:  # the DHT is shutting down: the record expires, as it should
                        return

    def close(self) -> None:
        """Stop the keep-alive (the record then lives out its ``ttl_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def publish_final(self, record: ProgressRecord, lives_s: float, timeout: float = 5.0) -> None:
        """Write ``record`` once to live ``lives_s`` seconds (at least ``ttl_s``: a site's last record,
        held by the peers that store it after the site's process is gone) and wait for it. The
        keep-alive stops first, so it never writes the record again."""
        from hivemind.utils import get_dht_time

        self.close()
        with self._lock:
            self._made = time.monotonic()
            self._wire = _clean_floats(record).to_wire()
            self._stored = time.monotonic()
            self._pending = self.dht.store(
                self.key,
                subkey=self.subkey,
                value=self._wire,
                expiration_time=get_dht_time() + max(lives_s, self.ttl_s),
                return_future=True,
            )
        self.flush(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait for the last write (used before exit, so the final state reaches the swarm) -- unless
        the p2p daemon is gone (a Ctrl-C, or a SIGTERM to the process group, reaches it too): the write
        cannot arrive then, and waiting for it held every such stop ``timeout`` seconds longer."""
        from greenswarm.network import daemon_gone

        if self._pending is not None and not daemon_gone(getattr(self.dht, "pid", None)):
            try:
                self._pending.result(timeout=timeout)
            except Exception:  # best effort at shutdown; the record expires anyway
                pass


def open_reader(
    initial_peers: list[str],
    swarm: str,
    host_maddrs: list[str] | None = None,
    admission: Admission | None = None,
) -> DHT:
    """A client-mode DHT that can read swarm ``swarm``'s records (with the validators hivemind needs);
    with ``admission`` it reads only records of certified members."""
    from greenswarm.network import READER_RETRY_DELAYS_S, start_dht

    return start_dht(
        initial_peers,
        host_maddrs=host_maddrs or ["/ip4/0.0.0.0/tcp/0"],
        client_mode=True,
        record_validators=record_validators(swarm, admission),
        retry_delays_s=READER_RETRY_DELAYS_S,
    )


async def live_members(dht: DHT, swarm: str) -> dict[str, float]:
    """``peer id -> until when`` for every site with a live progress record (from any process that
    holds ``dht``). In a certified swarm the DHT accepts records from members only and none that
    outlives its writer's certificate, so this is the list of members to trust now."""
    found = await dht.get(progress_key(swarm), latest=True, return_future=True)
    members: dict[str, float] = {}
    if found is not None and isinstance(found.value, dict):
        for item in found.value.values():
            value = getattr(item, "value", None)
            if isinstance(value, dict) and isinstance(value.get("peer_id"), str):
                members[value["peer_id"]] = float(item.expiration_time)
    return members


def fetch_records(dht: DHT, swarm: str, timeout_s: float | None = None) -> list[ProgressRecord]:
    """All live, valid progress records of swarm ``swarm``, sorted by site name (``timeout_s``: give
    up after this long, with TimeoutError; None: the DHT's own timeouts)."""
    if timeout_s is None:
        result = dht.get(progress_key(swarm), latest=True)
    else:
        future = dht.get(progress_key(swarm), latest=True, return_future=True)
        try:
            result = future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise
    if result is None or not isinstance(result.value, dict):
        return []
    records = []
    for item in result.value.values():
        value = getattr(item, "value", None)
        if not isinstance(value, dict):
            continue
        try:
            records.append(ProgressRecord.from_wire(value))
        except TypeError:  # a record of another version; skip rather than crash the reader
            continue
    return sorted(records, key=lambda r: (r.site, r.peer_id))
