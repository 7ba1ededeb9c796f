"""Token batches from the shards a site claimed through the swarm (``data.sharding: claim``).

With claimed shards every rank of a site is a reader of whole shards: shard ``k`` of the swarm's
``data.num_shards`` holds the documents whose key is ``k`` modulo that count (the same keys as a
fixed shard, :mod:`greenswarm.node.data`), in the same per-epoch order. A shard is read by one
reader at a time, and its place is one exact position, ``(epoch, document, offset)``: the next
unread token. Any reader of any site can continue a shard from a position another one published,
whatever their world sizes or micro-batches, because the position names a token, not a batch.

Rank 0 claims the shards and hands them to its ranks (:mod:`greenswarm.node.shard_claims`); a
reader only reads what it is given: its ``queue`` holds the shard it reads first and the shards it
reads next. When a shard's epoch ends the reader moves on to the next one in its queue. With no next
shard yet it reads the same shard's next epoch rather than stop mid-step: it still holds that
shard's lease, so no other reader can be in it, and each shard is still read once per epoch, in
order. When it is then given another shard it leaves the wrapped one at its exact position.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from greenswarm.errors import ConfigError
from greenswarm.node.data import CLAIM_FIELDS, DataConfig, open_source

log = logging.getLogger(__name__)

#: ``(epoch, document, offset)``: where a shard's next unread token is (document: its place in the
#: epoch's order; offset: tokens of it already read). Ordered as tuples: later is further.
Position = tuple[int, int, int]
START: Position = (0, 0, 0)


class ShardsRunOut(RuntimeError):
    """The reader was asked for a batch with no shard to read (rank 0 gives each one before it trains)."""


class _Reading:
    """The shard being read: its documents from the reader's position, and the document in hand."""

    def __init__(self, shard: int, docs: Iterator[tuple[Position, torch.Tensor]]):
        self.shard, self.docs = shard, docs
        self.tokens: torch.Tensor | None = None  # the document in hand, its EOS included
        self.used = 0  # of its tokens, read
        self.epoch = self.document = 0
        self.produced = False  # a document with tokens came out of this epoch


class ClaimedBatches:
    """An endless iterable of ``(batch_size, seq_len + 1)`` windows, like
    :class:`~greenswarm.node.data.TokenBatches`, over the shards rank 0 assigned to this reader.

    ``queue[0]`` is the shard being read; the rest are claimed and wait their turn. ``positions``
    holds every shard this reader has touched, ``sizes`` the documents in an epoch of each shard it
    read to the end. :meth:`state_dict` is what the checkpoint keeps, and what rank 0 publishes once
    that checkpoint is on disk (the documents before a published position are in the saved model).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, batch_size: int):
        cfg.validate()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {batch_size!r}", field="batch_size")
        self.cfg, self.tokenizer, self.batch_size = cfg, tokenizer, batch_size
        self.eos_id = int(tokenizer.eos_id)
        self.queue: list[int] = []
        self.positions: dict[int, Position] = {}
        self.sizes: dict[int, int] = {}
        # the claim each queued shard was assigned under, and the claim each shard that left the queue
        # (read to its end, withdrawn, or a wrapped one left for a new one) was assigned under: what a
        # checkpoint tells rank 0 of which leases it may release (a shard claimed again since has
        # another token, so an older checkpoint never releases the new claim)
        self.tokens: dict[int, str] = {}
        self.left: dict[int, str] = {}
        self._batches = 0
        self._reading: _Reading | None = None
        self._wrapped: set[int] = set()  # shards read past their epoch for want of a next one
        self._files: int | None = None
        self._moved = True  # the queue changed since rank 0 last heard (see take_moved)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.cfg.seq_len

    # ---- what rank 0 decides

    def assign(self, shard: int, position: Position, token: str = "") -> None:
        """Read ``shard`` from ``position`` (or from where this reader already is in it, if further),
        after the shards already queued, under the claim ``token``. A shard read past its epoch for want
        of this one is left."""
        position = tuple(int(x) for x in position)  # type: ignore[assignment]
        if not 0 <= shard < self.cfg.num_shards:
            raise ValueError(f"shard {shard} is not one of {self.cfg.num_shards}")
        for wrapped in self._wrapped & set(self.queue):
            if wrapped != shard:
                self.withdraw(wrapped)
        self._wrapped.discard(shard)
        self.tokens[shard] = token
        self.left.pop(shard, None)
        self._moved = True
        here = self.positions.get(shard, START)
        if position > here:
            self.positions[shard] = position
            if self._reading is not None and self._reading.shard == shard:
                self._reading = None  # reopened at the new position
        else:
            self.positions.setdefault(shard, here)
        if shard not in self.queue:
            self.queue.append(shard)

    def withdraw(self, shard: int) -> None:
        """Stop reading ``shard`` (released or lost): its position stays where reading left it."""
        if shard in self.queue:
            self.queue.remove(shard)
            self.left[shard] = self.tokens.pop(shard, "")
            self._moved = True
        self._wrapped.discard(shard)
        if self._reading is not None and self._reading.shard == shard:
            self._reading = None

    def clear(self) -> None:
        """Stop reading every shard (the site released them all)."""
        for shard in list(self.queue):
            self.withdraw(shard)

    def take_moved(self) -> bool:
        """Whether the queue changed (or a shard's epoch ended) since the last call: rank 0 then needs
        the readers' :meth:`status` after the step."""
        moved, self._moved = self._moved, False
        return moved

    def status(self) -> dict[str, Any]:
        """What rank 0 needs after each step: the queue, and where each queued shard is."""
        return {"queue": list(self.queue), "positions": {k: self.positions[k] for k in self.queue}}

    # ---- reading

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        window = self.cfg.seq_len + 1
        pieces: list[torch.Tensor] = []
        missing = self.batch_size * window
        empty_epochs = 0
        while missing:
            if not self.queue:
                raise ShardsRunOut("no claimed shard to read: rank 0 assigns one before every step")
            shard = self.queue[0]
            if self._reading is None or self._reading.shard != shard:
                self._reading = _Reading(shard, self._documents(shard))
            reading = self._reading
            if reading.tokens is None or reading.used == len(reading.tokens):
                item = next(reading.docs, None)
                if item is None:
                    empty_epochs = 0 if reading.produced else empty_epochs + 1
                    if empty_epochs > len(self.queue) + 1:
                        raise ConfigError(
                            f"{self.cfg.source!r} has no readable text in claimed shards "
                            f"{', '.join(map(str, self.queue))} of {self.cfg.num_shards}",
                            field="source",
                        )
                    self._end_of_epoch(shard)
                    continue
                (reading.epoch, reading.document, reading.used), reading.tokens = item
                reading.produced = True
            take = min(missing, len(reading.tokens) - reading.used)
            pieces.append(reading.tokens[reading.used : reading.used + take])
            reading.used += take
            missing -= take
            if reading.used == len(reading.tokens):
                self.positions[shard] = (reading.epoch, reading.document + 1, 0)
            else:
                self.positions[shard] = (reading.epoch, reading.document, reading.used)
        self._batches += 1
        return torch.cat(pieces).view(self.batch_size, window)

    def _end_of_epoch(self, shard: int) -> None:
        """``shard``'s epoch is read: on to the next claimed shard, or (none yet) this one's next epoch."""
        epoch = self.positions[shard][0]
        self.positions[shard] = (epoch + 1, 0, 0)
        self._reading = None
        self._moved = True
        if len(self.queue) > 1:
            self.withdraw(shard)
        else:
            self._wrapped.add(shard)
            log.debug(
                "claimed shard %d: epoch %d read and no next shard yet: reading epoch %d",
                shard,
                epoch,
                epoch + 1,
            )

    def _documents(self, shard: int) -> Iterator[tuple[Position, torch.Tensor]]:
        """``(position of the document's first unread token, its tokens + EOS)`` from ``shard``'s
        position to the end of its epoch; records the epoch's size when it gets there."""
        epoch, start, offset = self.positions.get(shard, START)
        source = open_source(self.cfg.with_shard(shard, self.cfg.num_shards), quiet=True)
        count = start
        for document, (_, text) in enumerate(source.documents(epoch, start), start=start):
            count = document + 1
            ids = self.tokenizer.encode(text) if text else []
            first = offset if document == start else 0
            if not ids or first > len(ids):
                continue
            yield (epoch, document, first), torch.tensor([*ids, self.eos_id], dtype=torch.long)
        self.sizes[shard] = count

    # ---- checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "claimed": True,
            "queue": list(self.queue),
            "positions": dict(self.positions),
            "sizes": dict(self.sizes),
            "tokens": dict(self.tokens),
            "left": dict(self.left),
            "batches": self._batches,
            "data": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved queue and positions (rank 0 then checks them against the swarm's
        leases: a shard another site took over meanwhile is withdrawn). A position saved for a fixed
        shard (``data.sharding`` was ``fixed``) means nothing here: the reader starts with none."""
        if not state.get("claimed"):
            log.warning(
                "the data position was saved for fixed shard %s; data.sharding is 'claim' now, so this "
                "reader starts from the swarm's claimed shards",
                (state.get("data") or {}).get("shard_index", "?"),
            )
            return
        saved, now = state.get("data") or {}, self.fingerprint()
        other = {k: v for k, v in saved.items() if k != "files"}
        if other != {k: v for k, v in now.items() if k != "files"}:
            raise ConfigError(
                f"the claimed shards' positions were saved for {saved}, but the data is now {now}; "
                "the shards or their order changed, so the positions cannot be resumed"
            )
        if saved.get("files") != now["files"]:  # files were added: positions name other documents
            log.warning(
                "the claimed shards' positions were saved when %r had %s files; it has %d now, so they "
                "name other documents (and the swarm's records another corpus): this reader starts with "
                "no shard",
                self.cfg.source,
                saved.get("files"),
                now["files"],
            )
            return
        self.queue = [int(k) for k in state["queue"]]
        self.positions = {int(k): tuple(int(x) for x in v) for k, v in state["positions"].items()}  # type: ignore[misc]
        self.sizes = {int(k): int(v) for k, v in state.get("sizes", {}).items()}
        self.tokens = {int(k): str(v) for k, v in state.get("tokens", {}).items()}
        self.left = {int(k): str(v) for k, v in state.get("left", {}).items()}
        self._batches = int(state.get("batches", 0))
        self._reading, self._wrapped = None, set()

    def fingerprint(self) -> dict[str, Any]:
        """The settings a shard position is valid for: every site of a swarm must read alike."""
        return dataset_settings(self.cfg, self.tokenizer, self.files())

    def files(self) -> int:
        """The corpus's files (every document's key depends on their number)."""
        if self._files is None:
            self._files = open_source(self.cfg.with_shard(0, self.cfg.num_shards), quiet=True).sharding.files
        return self._files


def apply_plan(reader: ClaimedBatches, actions: list[tuple[str, int, Any, Any]]) -> None:
    """What rank 0 planned for this reader (node/shard_claims.py): ``(action, shard, position, token)``
    with action "assign", "withdraw" or "clear" (every shard), in order."""
    for action, shard, position, token in actions:
        if action == "assign":
            reader.assign(shard, position, token or "")
        elif action == "withdraw":
            reader.withdraw(shard)
        elif action == "clear":
            reader.clear()
        else:
            raise ValueError(f"unknown shard action {action!r}")


def dataset_settings(cfg: DataConfig, tokenizer: Any, files: int) -> dict[str, Any]:
    """What makes one claimed corpus: its source and order, its cut into shards, its tokens -- what a
    position in a shard means. Sites that differ in any of it cannot continue each other's shards."""
    d = asdict(cfg)
    for name in ("seq_len", "shard_index", *CLAIM_FIELDS):
        d.pop(name)
    d["tokenizer"] = getattr(tokenizer, "fingerprint", repr(tokenizer))
    d["files"] = files
    return d
