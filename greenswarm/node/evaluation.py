"""Held-out evaluation and the best checkpoints by held-out loss.

A crash, a bad averaging round or a diverging run can leave a site's *latest* checkpoint worse than an
earlier one. With ``eval.batches`` set, the node measures the global model's loss on a fixed held-out
set after each outer step (every ``eval.every_rounds``), and with ``eval.keep_best`` it keeps the
checkpoints of the k lowest losses in ``run_dir/best``, next to an index ``best/best.json``.

The held-out set is a shard of the *same corpus* the swarm trains on (``data.source``), chosen with the
same rule as training shards: document ``i`` is in shard ``i % eval.num_shards``. Defaults pick the
last shard of the training layout (``eval.num_shards = data.num_shards``, ``eval.shard_index =
eval.num_shards - 1``): a swarm that wants evaluation leaves that shard to no site, e.g. three sites
with ``data.num_shards: 4`` on shards 0-2, as ``benchmarks/loss_parity.py`` does. A site can only
check its *own* training shard against the held-out one; the config refuses that overlap.

Kept files are hard links to the ``checkpoint.pt`` just written (no extra disk until it rotates out),
or copies where the file system has no hard links; each one verifies with
:meth:`~greenswarm.node.checkpoint.Checkpointer.read` and loads like any checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from math import gcd
from pathlib import Path
from typing import Any

import torch

from greenswarm.errors import ConfigError
from greenswarm.node.checkpoint import Checkpointer, fsync_directory
from greenswarm.node.data import DataConfig, TokenBatches

log = logging.getLogger(__name__)

BEST_DIR = "best"
INDEX = "best.json"
# step-000012-loss-2.3456-<lineage>.pt: sorted by outer step, readable without the index, and enough
# to rebuild it when best.json is lost (the loss to 4 decimals).
_NAME_RE = re.compile(r"^step-(\d{6,})-loss-(\d+\.\d+)-([A-Za-z0-9_]+)\.pt$")


@dataclass
class EvalConfig:
    """Held-out evaluation after outer steps, and how many of the best checkpoints to keep.

    ``batches`` held-out batches of ``batch_size`` sequences (``data.seq_len`` tokens) are read once
    and reused, so losses of different outer steps are comparable; 0 turns evaluation off.
    ``shard_index`` of ``num_shards`` names the held-out shard of ``data.source``; ``num_shards = 0``
    means ``data.num_shards`` and ``shard_index = -1`` the last shard (``num_shards - 1``), so by
    default the shard the swarm leaves untrained is the last one. ``every_rounds``: evaluate the outer
    steps that are multiples of it (and the first). ``keep_best``: keep the checkpoints
    of the k lowest losses in ``run_dir/best`` (needs ``batches > 0``; 0 keeps none).

    ``max_share``: the most of the wall time measuring may take. When measurements grow slow against
    the outer steps (a loaded machine; rounds faster than a forward pass over the held-out set), the
    node measures every ``every_rounds`` x 2, 4, 8 ... outer steps instead, the least power of two
    that keeps it under that share (:class:`MeasurePace`), on outer steps that are multiples of it: a
    site measuring every 4th step measures the same global models as one measuring every 2nd, so
    sites holding one digest still report one loss. Measuring shares rank 0's cores or GPU with
    training; the last global model is measured at the end whatever the pace.

    What is measured is the *global* model (:mod:`~greenswarm.node.global_eval`), on a copy of its own
    on rank 0: ``device`` ``auto`` puts it where rank 0 trains, ``cpu`` on the CPU (a GPU short of
    memory for one more unsharded copy). ``background``: measure beside training, on a thread of its
    own (with ``keep_best`` the loop waits for each loss: the checkpoint it keeps must be the one
    measured). The last global model is measured when the node stops, too.
    """

    batches: int = 0
    shard_index: int = -1
    num_shards: int = 0
    batch_size: int = 8
    every_rounds: int = 1
    keep_best: int = 0
    background: bool = True
    device: str = "auto"
    max_share: float = 0.25

    @property
    def enabled(self) -> bool:
        return self.batches > 0

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming this dataclass's field (the loader adds ``eval.``)."""
        for name in ("batches", "keep_best", "num_shards"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)
        for name in ("batch_size", "every_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if not 0 < self.max_share <= 1:
            raise ConfigError(
                f"must be in (0, 1] (a share of the wall time), got {self.max_share}", field="max_share"
            )
        if self.shard_index < -1:
            raise ConfigError(
                f"must be >= 0 (or -1: the last shard), got {self.shard_index}", field="shard_index"
            )
        if self.num_shards and self.shard_index >= self.num_shards:
            raise ConfigError(
                f"must be in [0, num_shards={self.num_shards}), got {self.shard_index}", field="shard_index"
            )
        if self.device not in ("auto", "cpu"):
            raise ConfigError(
                f"must be 'auto' (where rank 0 trains) or 'cpu', got {self.device!r}", field="device"
            )
        if self.keep_best and not self.enabled:
            raise ConfigError(
                f"keeping the {self.keep_best} best checkpoints needs held-out losses: set batches > 0",
                field="keep_best",
            )

    def held_out(self, data: DataConfig) -> DataConfig:
        """The data config of the held-out shard: ``data`` with this config's (resolved) shard.

        A shard of ``data``'s run, so it keys documents as the run's training stream does -- by index
        when that resumed a position saved before keys by file (:meth:`DataConfig.with_shard`).
        """
        num_shards = self.num_shards or data.num_shards
        shard_index = num_shards - 1 if self.shard_index < 0 else self.shard_index
        return data.with_shard(shard_index, num_shards)

    def check_against(self, data: DataConfig) -> None:
        """Refuse a held-out shard that does not exist or shares documents with the training shard ``data``.

        Shard ``h`` of ``m`` and shard ``s`` of ``n`` share a document ``i`` (``i % m == h`` and ``i % n
        == s``) exactly when ``h == s`` modulo ``gcd(m, n)`` (Chinese remainder theorem): with equal
        counts, when the indices are equal; with coprime counts such as ``n`` and ``n + 1``, always.
        """
        held = self.held_out(data)
        if held.shard_index >= held.num_shards:  # num_shards taken from data.num_shards
            raise ConfigError(
                f"must be in [0, data.num_shards={held.num_shards}), got {held.shard_index}",
                field="shard_index",
            )
        if not shards_overlap(held.shard_index, held.num_shards, data.shard_index, data.num_shards):
            return
        culprit = "num_shards" if held.num_shards != data.num_shards else "shard_index"
        hint = "data.num_shards is 1, so this site trains on every document; " if data.num_shards == 1 else ""
        raise ConfigError(
            f"{hint}held-out shard {held.shard_index} of {held.num_shards} shares documents with this "
            f"site's training shard {data.shard_index} of {data.num_shards}; hold out a shard no site "
            f"trains on (e.g. data.num_shards = sites + 1 and the last shard for evaluation)",
            field=culprit,
        )


def shards_overlap(index_a: int, count_a: int, index_b: int, count_b: int) -> bool:
    """Whether shard ``index_a`` of ``count_a`` and shard ``index_b`` of ``count_b`` share a document."""
    return (index_a - index_b) % gcd(count_a, count_b) == 0


class HeldOut:
    """The fixed held-out batches of a site: read on first use, then the same tensors every time
    (the node's :class:`~greenswarm.node.global_eval.GlobalEvaluator` reads them on rank 0)."""

    def __init__(self, cfg: EvalConfig, data: DataConfig, tokenizer: Any):
        self.cfg = cfg
        self.data = cfg.held_out(data)
        self.tokenizer = tokenizer
        self._batches: list[torch.Tensor] | None = None
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """A short digest of the held-out tokens: two sites measure one model alike only on one set
        (it depends on the corpus, ``data.seed``, ``seq_len``, ``batches`` and ``batch_size``)."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for batch in self.batches():
                digest.update(batch.to(torch.int64).contiguous().numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:12]
        return self._fingerprint

    def batches(self) -> list[torch.Tensor]:
        """``cfg.batches`` windows of ``(batch_size, seq_len + 1)`` tokens (empty when evaluation is off)."""
        if self._batches is None:
            stream = TokenBatches(self.data, self.tokenizer, self.cfg.batch_size)
            self._batches = list(islice(stream, self.cfg.batches))
        return self._batches


@dataclass
class BestEntry:
    """One kept checkpoint: its file name in ``best/``, held-out loss and which global model it holds."""

    file: str
    loss: float
    outer_round: int
    lineage: str
    wall_time: float

    @classmethod
    def from_json(cls, item: Any) -> BestEntry:
        """Parse one index item; ValueError/TypeError/KeyError for anything malformed."""
        entry = cls(
            file=str(item["file"]),
            loss=float(item["loss"]),
            outer_round=int(item["outer_round"]),
            lineage=str(item["lineage"]),
            wall_time=float(item["wall_time"]),
        )
        if not math.isfinite(entry.loss) or Path(entry.file).name != entry.file:
            raise ValueError(f"bad entry {item!r}")
        return entry

    @classmethod
    def from_name(cls, path: Path) -> BestEntry | None:
        """Recover an entry from a kept file's name (and its mtime), or None when it is not one."""
        match = _NAME_RE.match(path.name)
        if match is None:
            return None
        return cls(path.name, float(match[2]), int(match[1]), match[3], path.stat().st_mtime)

    def key(self) -> tuple[float, int]:
        """Order of preference: lower loss first; on a tie, the later outer step."""
        return (self.loss, -self.outer_round)


class MeasurePace:
    """How many outer steps apart the node measures: ``every_rounds`` times a power of two, the least at
    which measuring takes at most ``max_share`` of the wall time (``eval.max_share``).

    Fed on the loop's thread: :meth:`landed` at each outer step the node measures or skips,
    :meth:`measured` with each finished measurement's seconds. The wall time per outer step is that
    of the last few, divided by the steps they advanced (a catch-up jumps several). The factor rises
    at once to what the newest measurement needs, and falls one halving per measurement, so one fast
    measurement (an idle machine for a moment, a long pause between windows) does not undo it.
    Powers of two on multiples (:meth:`BestCheckpoints.due`): every 4th step is also every 2nd, so
    sites at different paces share the multiples of the larger stride. That is all they share: two
    sites that hold the same models for fewer steps than that stride may measure none in common.
    """

    def __init__(self, every_rounds: int, max_share: float, clock: Callable[[], float] = time.monotonic):
        self.every_rounds, self.max_share, self.clock = every_rounds, max_share, clock
        self.factor = 1
        self._landed: deque[tuple[float, int]] = deque(maxlen=9)  # (when, outer step) of the last ones

    @property
    def stride(self) -> int:
        return self.every_rounds * self.factor

    def landed(self, outer_round: int) -> None:
        if self._landed and outer_round < self._landed[-1][1]:  # a resync went back: time anew
            self._landed.clear()
        self._landed.append((self.clock(), outer_round))

    def measured(self, seconds: float) -> None:
        """A measurement took ``seconds``: the factor that keeps the next ones within the share."""
        if len(self._landed) < 2 or not math.isfinite(seconds):
            return
        (first, first_round), (last, last_round) = self._landed[0], self._landed[-1]
        if last_round <= first_round:
            return
        per_step = (last - first) / (last_round - first_round)
        need = seconds / (self.max_share * self.every_rounds * max(per_step, 1e-6))
        wanted = 1 << max(0, math.ceil(math.log2(need))) if need > 1 else 1
        self.factor = wanted if wanted >= self.factor else self.factor // 2


class BestCheckpoints:
    """Decides when to evaluate, and keeps the checkpoints of the ``keep_best`` lowest held-out losses.

    Runs on rank 0 only (where the checkpoint is written). Call :meth:`after_step` right after each
    :meth:`Checkpointer.save` of a new global model. Problems with ``best/`` (a lost or garbled
    index, a full disk) are logged and never stop training.
    """

    def __init__(self, cfg: EvalConfig, checkpointer: Checkpointer):
        self.cfg = cfg
        self.checkpointer = checkpointer
        self.directory = checkpointer.directory / BEST_DIR
        self.index = self.directory / INDEX
        self.entries: list[BestEntry] = self._load_or_forget() if cfg.keep_best else []
        self.last_round: int | None = max((e.outer_round for e in self.entries), default=None)
        self.pace = MeasurePace(cfg.every_rounds, cfg.max_share)

    # ---- the node's entry point

    def due(self, outer_round: int) -> bool:
        """Whether ``outer_round`` should be evaluated: the first step, a step *behind* the last one
        measured (a resync), and multiples of the stride -- ``every_rounds``, times :attr:`pace`'s
        factor when measuring is slow (``eval.max_share``).

        Multiples, not "``every_rounds`` since the last one": sites that measure the same multiples
        measure the same global models (every 4th step is also every 2nd), so sites holding one digest
        report one loss. A catch-up that jumps over a multiple waits for the next one, less than a
        stride away.
        """
        if not self.cfg.enabled:
            return False
        last = self.last_round
        if last is None or outer_round < last:
            return True
        return outer_round > last and outer_round % self.pace.stride == 0

    def after_step(
        self, outer_round: int, lineage: str, evaluate: Callable[[], float | None]
    ) -> float | None:
        """Evaluate when due and keep the current checkpoint if it is among the best; the loss or None.

        ``evaluate`` computes the held-out loss of the global model just checkpointed, or returns None
        when it is measured later, beside training (the node's :class:`GlobalEvaluator`).
        """
        loss = self.measure(outer_round, evaluate)
        self.keep_if_best(outer_round, lineage, loss)
        return loss

    def measure(self, outer_round: int, evaluate: Callable[[], float | None]) -> float | None:
        """The held-out loss of outer step ``outer_round`` when an evaluation is due, else None (the
        loop's part: it needs the model as it is). ``evaluate`` returns None for a loss measured
        later, beside training (nothing to keep then: ``keep_best`` waits for its losses)."""
        self.pace.landed(outer_round)
        if not self.due(outer_round):
            return None
        value = evaluate()
        self.last_round = outer_round
        if value is None:
            return None
        loss = float(value)
        if not math.isfinite(loss):
            log.warning("held-out loss of outer step %d is %s; its checkpoint is not kept", outer_round, loss)
        return loss

    def keep_if_best(self, outer_round: int, lineage: str, loss: float | None) -> None:
        """Keep ``checkpoint.pt`` (outer step ``outer_round``'s, written by now) when ``loss`` is among
        the best (the part that needs the file, which a background writer runs after writing it)."""
        if loss is None or not math.isfinite(loss) or not self.cfg.keep_best:
            return
        try:
            self.keep(outer_round, lineage, loss)
        except OSError as e:  # a full or read-only disk must not stop training
            log.warning("could not keep outer step %d in %s: %s", outer_round, self.directory, e)

    def would_keep(self, outer_round: int, lineage: str, loss: float | None) -> bool:
        """Whether :meth:`keep_if_best` would keep this loss (a site that checkpoints only every so
        often writes a checkpoint for a step that will be kept, and for no other)."""
        if loss is None or not math.isfinite(loss) or not self.cfg.keep_best:
            return False
        entry = BestEntry(_file_name(outer_round, loss, lineage), loss, outer_round, lineage, 0.0)
        return entry in self._ranked(entry)

    def _ranked(self, entry: BestEntry) -> list[BestEntry]:
        """The k best entries with ``entry`` among the candidates (the same global model evaluated
        again, e.g. after a restart, replaces its older entry)."""
        others = [e for e in self.entries if (e.outer_round, e.lineage) != (entry.outer_round, entry.lineage)]
        return sorted([*others, entry], key=BestEntry.key)[: self.cfg.keep_best]

    # ---- keeping files

    def keep(self, outer_round: int, lineage: str, loss: float) -> Path | None:
        """Keep ``checkpoint.pt`` as outer step ``outer_round``'s if its ``loss`` is among the k lowest.

        Returns the kept file, or None when the loss did not make it. Order matters for crashes: the
        new file is linked first, then the index is replaced, then dropped files are deleted; a file
        the index does not list is picked up again on restart, an index entry without a file dropped.
        """
        if not self.checkpointer.path.exists():
            log.warning("no checkpoint to keep at %s", self.checkpointer.path)
            return None
        entry = BestEntry(_file_name(outer_round, loss, lineage), loss, outer_round, lineage, time.time())
        kept = self._ranked(entry)
        if entry not in kept and kept == self.entries:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / entry.file
        if entry in kept:
            _link_or_copy(self.checkpointer.path, target)
        before, self.entries = self.entries, kept
        self._write_index()
        names = {e.file for e in kept}
        for old in before:
            if old.file not in names:
                (self.directory / old.file).unlink(missing_ok=True)
        if entry not in kept:
            return None
        log.info("kept outer step %d (held-out loss %.4f) in %s", outer_round, loss, target)
        return target

    def _write_index(self) -> None:
        """Replace ``best.json`` atomically: a crash leaves the old index or the new, never half of one."""
        tmp = self.index.with_name(self.index.name + ".tmp")
        data = [dataclasses.asdict(e) for e in sorted(self.entries, key=BestEntry.key)]
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index)
        fsync_directory(self.directory)

    # ---- reading the index back

    def _load_or_forget(self) -> list[BestEntry]:
        try:
            return self._load()
        except OSError as e:  # an unreadable best/ costs its history, never the node
            log.warning("cannot read %s (%s); starting a new list of best checkpoints", self.directory, e)
            return []

    def _load(self) -> list[BestEntry]:
        """The kept entries after a restart: the index, reconciled with the files actually in ``best/``."""
        if not self.directory.is_dir():
            return []
        for tmp in self.directory.glob("*.tmp"):  # half-made by a crash; rebuilt or redone when needed
            tmp.unlink(missing_ok=True)
        entries = list({e.file: e for e in self._read_index()}.values())
        listed = {e.file for e in entries}
        entries = [e for e in entries if (self.directory / e.file).is_file()]
        if len(entries) < len(listed):
            gone = len(listed) - len(entries)
            log.warning("%s lists %d file(s) that are gone; forgetting them", self.index, gone)
        for path in sorted(self.directory.glob("step-*.pt")):
            if path.name not in listed and (found := BestEntry.from_name(path)) is not None:
                entries.append(found)  # linked, but the crash came before the index was written
        return sorted(entries, key=BestEntry.key)

    def _read_index(self) -> list[BestEntry]:
        if not self.index.exists():
            if any(self.directory.glob("step-*.pt")):
                log.warning("%s is missing; rebuilding it from the file names", self.index)
            return []
        try:
            items = json.loads(self.index.read_text())
            if not isinstance(items, list):
                raise ValueError(f"expected a list, got {type(items).__name__}")
            return [BestEntry.from_json(item) for item in items]
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("%s is unreadable (%s); rebuilding it from the file names", self.index, e)
            return []


def _file_name(outer_round: int, loss: float, lineage: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_]", "_", lineage) or "none"
    return f"step-{outer_round:06d}-loss-{loss:.4f}-{safe}.pt"


def _link_or_copy(source: Path, target: Path) -> None:
    """Put ``source`` at ``target`` (replacing it): a hard link, else a durable copy; atomic either way."""
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (some network and FUSE file systems, another device)
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_directory(target.parent)
