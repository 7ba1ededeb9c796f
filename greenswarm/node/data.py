"""Token batches for pretraining, from disjoint per-site shards of a text corpus.

Every site of a swarm reads the same corpus in the same deterministic order, and each document has a
*key*: ``file + files * row`` for row ``row`` of file ``file`` (the corpus's files sorted, or a Hub
dataset's shards in the dataset's order; ``files`` of them). Document ``key`` belongs to shard
``key % num_shards``: sites never train on each other's documents, without any coordination beyond
their shard index, and the ranks of a site split the site's shard the same way (:func:`sub_shard`).

Because ``files`` is a term of the key, a reader never opens a file it owns no document of:

* when ``num_shards`` divides ``files``, ``key % num_shards == file % num_shards``, so a reader owns
  whole files (split ``"files"``) and opens only its ``files / num_shards`` of them -- the same
  assignment as ``datasets``' ``split_dataset_by_node`` with its ``"shards"`` strategy;
* otherwise it falls back to splitting by document (split ``"documents"``): it opens the files ``file
  == shard_index`` modulo ``g = gcd(num_shards, files)`` (every file when ``g`` is 1, e.g. one big
  file) and keeps one document in ``num_shards / g`` of each.

One key for every reader, whatever its ``num_shards``, is what keeps readers of different layouts
disjoint: a site's ranks (``num_shards * world``), sites with different world sizes, and the held-out
shard of evaluation (``node/evaluation.py``), which may use another ``num_shards`` and is checked
against the training shard with the same modular arithmetic as before. (``split_dataset_by_node``
numbers examples globally in its fallback, so two readers with different world sizes, one splitting
by files and one by examples, would overlap.)

Keys by file came in after greenswarm had keyed a document by its place in the whole corpus (its
*index*: all rows of every earlier file, then its row). A data position records its keys
(:data:`KEYS_BY_FILE` or :data:`KEYS_BY_INDEX`); a run resumed from a position saved before that
(without them) keeps keys by index, the shards it had, and so does every reader of the run opened
afterwards -- its held-out shard above all (:meth:`DataConfig.with_shard`). New runs key by file.
Sources:

* ``"stdlib"`` -- the installed Python standard library's ``.py`` files, one document each: always
  present and offline, so demos and tests need no download (sites must run the same Python version);
* a local file, directory or glob of ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files, streamed
  through ``datasets`` (a ``.txt`` line is one document, as in ``datasets``' ``text`` builder);
* ``"hf:NAME"`` or ``"hf:NAME:CONFIG"`` -- a Hub dataset, streamed (for real runs with a network); its
  files are the streamed dataset's shards (``IterableDataset.num_shards``).

Documents are tokenized lazily, joined with the tokenizer's EOS and cut into fixed windows, so the
first batch is ready at once however large the corpus. ``datasets`` is imported only for the
sources that need it, which keeps ``import greenswarm.node.data`` cheap.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from math import gcd
from typing import Any, Protocol

import torch

from greenswarm.errors import ConfigError

log = logging.getLogger(__name__)

# File suffix -> the ``datasets`` packaged builder that reads it.
BUILDERS: dict[str, str] = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# Directories of the standard library that are not representative source code (or not stdlib).
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

# Documents of a streamed dataset are shuffled within a buffer of this many (a full shuffle would
# need the whole shard in memory); smaller shards are shuffled completely.
SHUFFLE_BUFFER = 10_000

# Document keys, as a data position records them. By file: ``file + files * row``. By index: the
# document's place in the whole corpus, the only keys before keys by file -- kept for the runs that
# resume a position saved then, so that they read the documents they read before.
KEYS_BY_FILE = "file"
KEYS_BY_INDEX = "index"

#: ``data.sharding``: a shard set in the config, or shards claimed through the DHT
SHARDINGS = ("fixed", "claim")
#: the fields of :class:`DataConfig` that say how shards are handed out, not which documents a shard holds
CLAIM_FIELDS = ("sharding", "lease_s", "claim_settle_s")
#: the most shards a claimed corpus may be cut into: every site's shard record lists what it knows of
#: each (about 22 KB at 1024), and one DHT read returns every site's record (p2pd carries at most 4 MB)
MAX_CLAIMED_SHARDS = 1024


@dataclass
class DataConfig:
    """Where a site's training tokens come from and which disjoint shard of them it reads."""

    source: str = "stdlib"  # "stdlib", a local file/dir/glob, or "hf:NAME[:CONFIG]"
    text_field: str = "text"  # column holding the text in .jsonl/.json/.parquet and Hub datasets
    split: str = "train"  # Hub datasets only; local files form a single split
    seq_len: int = 128
    shard_index: int = 0
    num_shards: int = 1
    seed: int = 0  # document order: epoch e is shuffled with seed + e
    # "fixed": this site reads shard ``shard_index`` of ``num_shards`` (private per-site data, or shards
    # set by hand); "claim": the swarm's ``num_shards`` shards are claimed through the DHT with expiring
    # leases (node/shard_claims.py, docs/data.md), each read once per epoch by whichever site holds it
    sharding: str = "fixed"
    lease_s: float = 60.0  # "claim": a claimed shard is free this long after its holder last renewed it
    claim_settle_s: float = 1.0  # "claim": wait this long after a claim for rival claims before reading

    def validate(self) -> None:
        """Raise :class:`ConfigError` (field = this dataclass's field name) for a bad value."""
        if self.sharding not in SHARDINGS:
            raise ConfigError(
                f"must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}", field="sharding"
            )
        for name in ("lease_s", "claim_settle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"must be a number of seconds > 0, got {value!r}", field=name)
        if self.claim_settle_s * 3 > self.lease_s:
            raise ConfigError(
                f"must be at most a third of lease_s ({self.lease_s:g} s), or claims outlive their lease "
                f"before they settle, got {self.claim_settle_s:g}",
                field="claim_settle_s",
            )
        for name in ("source", "text_field", "split"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"must be a non-empty string, got {value!r}", field=name)
        for name in ("seq_len", "shard_index", "num_shards", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"must be an integer, got {value!r}", field=name)
        if self.seq_len < 8:
            raise ConfigError(f"must be at least 8, got {self.seq_len}", field="seq_len")
        if self.num_shards < 1:
            raise ConfigError(f"must be at least 1, got {self.num_shards}", field="num_shards")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(
                f"must be in [0, num_shards={self.num_shards}), got {self.shard_index}", field="shard_index"
            )
        if self.seed < 0:
            raise ConfigError(f"must be non-negative, got {self.seed}", field="seed")
        if self.claimed and self.num_shards > MAX_CLAIMED_SHARDS:
            raise ConfigError(
                f"claimed shards are at most {MAX_CLAIMED_SHARDS}, got {self.num_shards}", field="num_shards"
            )
        if self.source.startswith("hf:") and not self.source[3:].split(":")[0].strip():
            raise ConfigError("'hf:' must be followed by a dataset name: 'hf:NAME[:CONFIG]'", field="source")

    @property
    def claimed(self) -> bool:
        """Whether the site reads shards it claimed through the swarm (``sharding: claim``)."""
        return self.sharding == "claim"

    def with_shard(self, shard_index: int, num_shards: int) -> DataConfig:
        """This config for shard ``shard_index`` of ``num_shards`` of the same *run*.

        The readers of a run -- a site's ranks (:func:`sub_shard`) and its held-out shard
        (``EvalConfig.held_out``) -- share the run's document keys: once the training stream resumes a
        position saved before keys by file, every reader opened afterwards from a config of the run
        keys by index too (:func:`run_keys`). ``dataclasses.replace`` makes the config of a new run.
        """
        other = replace(self, shard_index=shard_index, num_shards=num_shards)
        other._run = self._shared_run()
        return other

    def _shared_run(self) -> _Run:
        # An attribute, not a field: no part of the config the operator writes, compares or dumps.
        run = self.__dict__.get("_run")
        if run is None:
            run = self._run = _Run()
        return run


@dataclass
class _Run:
    """What the readers of one run share beyond their settings: its document keys, once decided."""

    keys: str | None = None  # None: no position has said; a new run keys by file


def run_keys(cfg: DataConfig) -> str:
    """The document keys readers opened from ``cfg`` use: those of the last position a reader of its run
    resumed (:meth:`TokenBatches.load_state_dict`), else :data:`KEYS_BY_FILE`."""
    return cfg._shared_run().keys or KEYS_BY_FILE


def sub_shard(cfg: DataConfig, rank: int, world: int) -> DataConfig:
    """The shard of process ``rank`` of ``world`` (torchrun) within its site's shard ``cfg``.

    Returns ``shard_index = cfg.shard_index + cfg.num_shards * rank`` and ``num_shards =
    cfg.num_shards * world``. Since ``i % (S * W) == s + S * r`` implies ``i % S == s``, the ranks of
    a site read exactly the site's documents, split disjointly, *whatever the site's world size* --
    so sites with different numbers of GPUs never overlap. (The layout ``s * W + r`` is disjoint only
    while every site has the same ``W``, and changes a site's documents when its ``W`` changes.)
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    return cfg.with_shard(cfg.shard_index + cfg.num_shards * rank, cfg.num_shards * world)


@dataclass(frozen=True)
class Sharding:
    """Which documents, and so which files, one reader (shard ``index`` of ``count``) of a corpus reads.

    Row ``row`` of file ``file`` has the key ``file + files * row`` and belongs to shard ``key %
    count`` (see the module docstring for why one key serves every layout). With ``single_documents``
    every file is one document (the standard library's sources), so the key is the file's index and
    a reader opens exactly its own files whatever ``count`` is. With ``keys`` :data:`KEYS_BY_INDEX` (a
    run resumed from before keys by file) the key is the document's place in the whole corpus, which
    only counting every earlier row tells: the reader opens every file.
    """

    files: int  # files in the corpus (a Hub dataset's shards)
    index: int
    count: int
    single_documents: bool = False
    keys: str = KEYS_BY_FILE

    @property
    def by_index(self) -> bool:
        """Whether keys are places in the whole corpus (for single documents, both keys are the file)."""
        return self.keys == KEYS_BY_INDEX and not self.single_documents

    @property
    def split(self) -> str:
        """``"files"`` when the reader owns whole files, ``"documents"`` when it keeps some of each."""
        whole = self.count == 1 if self.by_index else self.files % self.count == 0
        return "files" if self.single_documents or whole else "documents"

    @property
    def keep_every(self) -> int:
        """The reader keeps one document in this many of each file it opens (1: whole files)."""
        if self.single_documents:
            return 1
        return self.count if self.by_index else self.count // gcd(self.count, self.files)

    def key(self, file: int, row: int) -> int:
        """The document key of row ``row`` of file ``file`` (keys by file only)."""
        if self.by_index:
            raise ValueError("a key by index counts the rows of every earlier file; see _DatasetSource")
        return file + self.files * row

    def owns(self, file: int, row: int) -> bool:
        """Whether row ``row`` of file ``file`` is this reader's (keys by file only)."""
        return self.key(file, row) % self.count == self.index

    def files_read(self) -> list[int]:
        """The files holding a document of this reader, in corpus order; no other file is opened.

        ``key % g == file % g`` for ``g = gcd(count, files)`` (``g`` divides ``files``), so only files
        with ``file % g == index % g`` can hold a key ``== index`` modulo ``count``. Keys by index
        can be anywhere: every file.
        """
        if self.single_documents:
            return [f for f in range(self.files) if f % self.count == self.index]
        if self.by_index:
            return list(range(self.files))
        g = gcd(self.count, self.files)
        return [f for f in range(self.files) if f % g == self.index % g]

    def describe(self, source: str) -> str:
        """One line for the log: the split, and how much of the corpus this reader opens."""
        read = self.files_read()
        shown = ", ".join(map(str, read[:8])) + (", ..." if len(read) > 8 else "")
        files = f"{len(read)} file{'' if len(read) == 1 else 's'}"
        head = f"data {source!r}: shard {self.index} of {self.count} of {self.files} files"
        if self.by_index:
            head += ", keys by corpus index (a run resumed from a data position saved before keys by file)"
        if self.split == "files":
            return f"{head}, split by files: reads {files} whole ({shown})"
        opened = "every file" if len(read) == self.files else f"{files} ({shown})"
        if self.by_index:
            return f"{head}, split by documents: reads {opened} and keeps 1 document in {self.count}"
        return (
            f"{head}, split by documents ({self.count} does not divide {self.files}): reads {opened} "
            f"and keeps 1 document in {self.keep_every} of each"
        )

    def as_dict(self) -> dict[str, Any]:
        """For summaries: the keys, the split, the corpus's files and how many of them this reader opens."""
        return {
            "keys": self.keys,
            "split": self.split,
            "files": self.files,
            "files_read": len(self.files_read()),
            "keep_every": self.keep_every,
            "shard_index": self.index,
            "num_shards": self.count,
        }


# ----------------------------------------------------------------------------------------- sources


class _Source(Protocol):
    sharding: Sharding  # a reader resuming a position may replace it with other ``keys``

    def documents(self, epoch: int, start: int = 0) -> Iterator[tuple[int, str]]:
        """``(document key, text)`` of this shard's documents in epoch ``epoch``'s order, from ``start``."""
        ...


class _StdlibSource:
    """The standard library's ``.py`` files, sorted by relative path; read only when reached."""

    def __init__(self, cfg: DataConfig, keys: str = KEYS_BY_FILE):
        self.cfg = cfg
        self.root = sysconfig.get_paths()["stdlib"]
        self.files = stdlib_files(self.root)
        self.sharding = Sharding(
            len(self.files), cfg.shard_index, cfg.num_shards, single_documents=True, keys=keys
        )

    def documents(self, epoch: int, start: int = 0) -> Iterator[tuple[int, str]]:
        order = self.sharding.files_read()  # the same files under either keys
        random.Random(self.cfg.seed + epoch).shuffle(order)
        for index in order[start:]:
            path = os.path.join(self.root, self.files[index])
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:  # vanished or unreadable: an empty document keeps positions stable
                text = ""
            yield index, text


class _DatasetSource:
    """Local files or a Hub dataset, streamed through ``datasets`` one file (shard) at a time.

    Each file this reader owns a document of is streamed on its own (``IterableDataset.shard`` down
    to one of the dataset's shards), in corpus order, so the reader knows every row's file and row
    number -- its key -- and never opens another reader's files.
    """

    def __init__(self, cfg: DataConfig, keys: str = KEYS_BY_FILE):
        self.cfg = cfg
        # (description, IterableDataset, column) in corpus order; their shards are the corpus's files.
        self.parts: list[tuple[str, Any, str]] = []
        if cfg.source.startswith("hf:"):
            self._open_hub()
        else:
            self._open_local()
        # File f of the corpus: (part, the file's index among that part's shards).
        self.files: list[tuple[int, int]] = [
            (p, j) for p, (_, ds, _) in enumerate(self.parts) for j in range(ds.num_shards)
        ]
        self.sharding = Sharding(len(self.files), cfg.shard_index, cfg.num_shards, keys=keys)

    def _open_hub(self) -> None:
        spec = self.cfg.source[3:]
        name, _, config = spec.partition(":")
        import datasets  # heavy; only for this source

        try:
            ds = datasets.load_dataset(name, config or None, split=self.cfg.split, streaming=True)
        except Exception as e:  # ConnectionError offline, DatasetNotFoundError, ValueError for a split, ...
            offline = " (HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
            raise ConfigError(
                f"cannot open Hub dataset {spec!r} split {self.cfg.split!r}{offline}: "
                f"{type(e).__name__}: {e}. Hub datasets need network access; offline, pass a local "
                "file or directory (or 'stdlib')",
                field="source",
            ) from e
        self.parts.append((self.cfg.source, ds, self.cfg.text_field))

    def _open_local(self) -> None:
        files = local_files(self.cfg.source)
        groups: dict[str, list[str]] = {}
        for path in files:  # builders in order of first appearance; files sorted within each
            groups.setdefault(_builder(path), []).append(path)
        import datasets  # heavy; only for this source

        for builder, paths in groups.items():
            try:
                with _no_download_count(datasets):
                    ds = datasets.load_dataset(builder, data_files=paths, split="train", streaming=True)
            except Exception as e:
                raise ConfigError(
                    f"cannot read {self.cfg.source!r} as {builder}: {type(e).__name__}: {e}", field="source"
                ) from e
            column = "text" if builder == "text" else self.cfg.text_field
            self.parts.append((f"{self.cfg.source} ({builder})", ds, column))

    def _shard_stream(self) -> Iterator[tuple[int, str]]:
        """This shard's documents in corpus order: of the files it reads, the rows whose key it owns."""
        sharding = self.sharding
        if sharding.by_index:
            yield from self._index_stream()
            return
        for file in sharding.files_read():
            part, index = self.files[file]
            where, ds, column = self.parts[part]
            # One shard of the part: only this file is opened (the part itself when it is one file).
            stream = ds if ds.num_shards == 1 else ds.shard(num_shards=ds.num_shards, index=index)
            for row_number, row in enumerate(stream):
                if sharding.owns(file, row_number):
                    yield sharding.key(file, row_number), _row_text(row, column, where)

    def _index_stream(self) -> Iterator[tuple[int, str]]:
        """Keys by index, exactly as before keys by file: every file streamed, document ``i`` of the
        whole corpus kept when ``i % count == index``."""
        n, k = self.sharding.count, self.sharding.index
        i = 0
        for where, ds, column in self.parts:
            for row in ds:
                if i % n == k:
                    yield i, _row_text(row, column, where)
                i += 1

    def documents(self, epoch: int, start: int = 0) -> Iterator[tuple[int, str]]:
        # Shuffle *after* sharding and in Python: ``IterableDataset.shuffle`` also reorders the source
        # files, which would move documents between shards from one epoch to the next.
        docs = _buffer_shuffle(self._shard_stream(), SHUFFLE_BUFFER, random.Random(self.cfg.seed + epoch))
        for pos, doc in enumerate(docs):
            if pos >= start:
                yield doc


def open_source(cfg: DataConfig, quiet: bool = False) -> _Source:
    """The document source of ``cfg``; missing paths and unreachable datasets fail here, eagerly.

    Logs one INFO line saying how the shard is split (by files or by documents) and how many files
    it opens: with fewer files than readers, the fallback still opens every file. The keys are the
    run's (:func:`run_keys`): by file unless a reader of the run resumed a position saved before them.
    """
    cfg.validate()
    keys = run_keys(cfg)
    source: _Source = _StdlibSource(cfg, keys) if cfg.source == "stdlib" else _DatasetSource(cfg, keys)
    if not quiet:  # (claimed shards are opened one after another: node/shard_reader.py says which)
        log.info("%s", source.sharding.describe(cfg.source))
    return source


def iter_documents(cfg: DataConfig, epoch: int = 0) -> Iterator[tuple[int, str]]:
    """``(document key, text)`` of the documents of ``cfg``'s shard, in epoch ``epoch``'s order."""
    return open_source(cfg).documents(epoch)


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                files.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(files)


def local_files(source: str) -> list[str]:
    """The supported files named by ``source`` (a file, a directory searched recursively, a glob), sorted."""
    path = os.path.expanduser(source)
    supported = ", ".join(BUILDERS)
    if glob.has_magic(path):
        matches = sorted(glob.glob(path, recursive=True))
        files = [m for m in matches if os.path.isfile(m) and _builder(m)]
        if not matches:
            raise ConfigError(f"no file matches {source!r}", field="source")
        if not files:
            raise ConfigError(f"no {supported} file matches {source!r}", field="source")
        return files
    if os.path.isdir(path):
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".") and _builder(f)]
        if not files:
            raise ConfigError(f"directory {source!r} has no {supported} files", field="source")
        return sorted(files)
    if os.path.isfile(path):
        if not _builder(path):
            raise ConfigError(f"{source!r} is not a {supported} file", field="source")
        return [path]
    raise ConfigError(
        f"{source!r} does not exist (expected 'stdlib', 'hf:NAME[:CONFIG]' or a local file, directory, glob)",
        field="source",
    )


@contextlib.contextmanager
def _no_download_count(datasets: Any) -> Iterator[None]:
    """Stop ``load_dataset`` from pinging the Hub to count a *local* load.

    Unless HF_HUB_OFFLINE is set, each packaged-builder load sends a HEAD request to the Hub; without
    a network that stalls for seconds (DNS) per load, for a purely local read.
    """
    config = datasets.config
    old = getattr(config, "HF_UPDATE_DOWNLOAD_COUNTS", None)
    config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        if old is None:
            del config.HF_UPDATE_DOWNLOAD_COUNTS
        else:
            config.HF_UPDATE_DOWNLOAD_COUNTS = old


def _builder(path: str) -> str:
    return BUILDERS.get(os.path.splitext(path)[1].lower(), "")


def _row_text(row: dict[str, Any], column: str, where: str) -> str:
    if column not in row:
        columns = ", ".join(map(repr, row))
        raise ConfigError(f"{where} has no column {column!r}; its columns are {columns}", field="text_field")
    value = row[column]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(
            f"column {column!r} of {where} holds {type(value).__name__}, not text", field="text_field"
        )
    return value


def _settings(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A data position's fingerprint without the corpus's file count and keys (see ``load_state_dict``)."""
    return {k: v for k, v in fingerprint.items() if k not in ("files", "keys", *CLAIM_FIELDS)}


def _saved_keys(saved: dict[str, Any]) -> str:
    """The keys a data position was saved under: recorded since they are; before, positions with the
    file count (which came with keys by file) keyed by file, and older ones by index."""
    return str(saved.get("keys", KEYS_BY_FILE if "files" in saved else KEYS_BY_INDEX))


def _buffer_shuffle(items: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Approximately shuffle a stream, holding at most ``size`` items; exact when it is shorter."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


# ----------------------------------------------------------------------------------------- batches


class TokenBatches:
    """An endless iterable of ``(batch_size, seq_len + 1)`` LongTensor windows of one shard.

    Inputs are ``batch[:, :-1]`` and labels ``batch[:, 1:]``. Documents are tokenized, each followed
    by the tokenizer's EOS, concatenated, and cut into consecutive windows of ``seq_len + 1`` tokens;
    after the shard's last document the next epoch begins, in a new order (seed ``cfg.seed + epoch``).

    The position (epoch, document, token offset) is exact, so :meth:`state_dict` /
    :meth:`load_state_dict` resume at the next unseen token by skipping whole documents without
    tokenizing them (skipped documents are still streamed, but only from the shard's own files). A
    new ``iter()`` continues from the current position.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, batch_size: int):
        cfg.validate()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {batch_size!r}", field="batch_size")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_id = int(tokenizer.eos_id)
        self._source = open_source(cfg)
        self._batches = 0
        self._epoch = 0
        self._doc = 0  # position in the epoch's document order of the next unconsumed token
        self._offset = 0  # tokens of that document already consumed

    @property
    def tokens_per_batch(self) -> int:
        """Tokens trained on per batch (predicted positions): ``batch_size * seq_len``."""
        return self.batch_size * self.cfg.seq_len

    @property
    def epoch(self) -> int:
        """The epoch being read (after a batch that ends an epoch, the next one starts on the next read)."""
        return self._epoch

    @property
    def sharding(self) -> Sharding:
        """How this shard splits the corpus: by files or by documents, and how many files it opens."""
        return self._source.sharding

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts, plus the data settings the position is only valid for."""
        return {
            "batches": self._batches,
            "epoch": self._epoch,
            "document": self._doc,
            "offset": self._offset,
            "data": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken; iterators created afterwards start there.

        A position saved for other data settings (source, shard, seed, tokenizer) is refused. The
        position's document keys become this reader's and its run's (:func:`run_keys`): a position
        saved before keys by file (it records neither keys nor the corpus's file count) resumes by
        index, exactly where it was, and so does the run's held-out shard, which keeps its documents.
        A position saved when the corpus had another number of files (files were added) names other
        documents, since keys depend on that number: that is not the operator's setting, so rather than
        stop the site it is logged and the saved epoch starts over (documents already read this epoch
        come again; none is skipped).
        """
        if state.get("claimed"):  # saved by a run that claimed its shards (data.sharding was "claim")
            log.warning(
                "the data position was saved for shards claimed through the swarm; data.sharding is "
                "'fixed' now, so shard %d of %d starts at its beginning",
                self.cfg.shard_index,
                self.cfg.num_shards,
            )
            return
        saved = state.get("data")
        now = self._fingerprint()
        if saved is not None and _settings(saved) != _settings(now):
            raise ConfigError(
                f"the data position was saved for {saved}, but the data is now {now}; "
                "the shard or order changed, so the position cannot be resumed"
            )
        keys = None if saved is None else _saved_keys(saved)
        if keys not in (None, KEYS_BY_FILE, KEYS_BY_INDEX):
            raise ConfigError(
                f"the data position was saved with document keys {keys!r}, which this version does not "
                f"know (it knows {KEYS_BY_FILE!r} and {KEYS_BY_INDEX!r}), so it cannot be resumed"
            )
        self._batches = int(state["batches"])
        self._epoch = int(state["epoch"])
        self._doc = int(state["document"])
        self._offset = int(state["offset"])
        if saved is None or keys is None:
            return
        self.cfg._shared_run().keys = keys  # for the run's readers opened from now on: its held-out shard
        if keys != self.sharding.keys:
            self._source.sharding = replace(self.sharding, keys=keys)
            if keys == KEYS_BY_INDEX:
                log.info(
                    "the data position predates keys by file: this run keeps keys by corpus index, and "
                    "with them its training and held-out documents (new runs key by file); %s",
                    self.sharding.describe(self.cfg.source),
                )
        if "files" in saved and saved["files"] != now["files"]:
            log.warning(
                "the data position was saved when %r had %s files; it has %d now, so the position names "
                "other documents: epoch %d of shard %d of %d starts over",
                self.cfg.source,
                saved["files"],
                now["files"],
                self._epoch,
                self.cfg.shard_index,
                self.cfg.num_shards,
            )
            self._doc, self._offset = 0, 0

    def _fingerprint(self) -> dict[str, Any]:
        d = asdict(self.cfg)
        d.pop("seq_len")  # the position is in tokens, so a new window length can resume it
        for name in CLAIM_FIELDS:  # how shards are claimed moves no document (and older positions lack them)
            d.pop(name)
        d["tokenizer"] = repr(self.tokenizer)
        d["files"] = self.sharding.files  # every document's key depends on it
        d["keys"] = self.sharding.keys
        return d

    def __iter__(self) -> Iterator[torch.Tensor]:
        window = self.cfg.seq_len + 1
        need = self.batch_size * window
        docs = self._tokenized(self._epoch, self._doc, self._offset)
        # The first document comes with its resume offset; start from an exhausted empty one.
        epoch, doc, offset, tokens = self._epoch, self._doc, 0, torch.empty(0, dtype=torch.long)
        while True:
            pieces: list[torch.Tensor] = []
            missing = need
            while missing:
                if len(tokens) == offset:
                    epoch, doc, offset, tokens = next(docs)
                take = min(missing, len(tokens) - offset)
                pieces.append(tokens[offset : offset + take])
                offset += take
                missing -= take
            if offset == len(tokens):  # the next token is the start of the following document
                self._epoch, self._doc, self._offset = epoch, doc + 1, 0
            else:
                self._epoch, self._doc, self._offset = epoch, doc, offset
            self._batches += 1
            yield torch.cat(pieces).view(self.batch_size, window)

    def _tokenized(self, epoch: int, start: int, offset: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(epoch, position, offset, tokens + [EOS])`` of each non-empty document, forever."""
        while True:
            produced = False
            for pos, (_, text) in enumerate(self._source.documents(epoch, start), start=start):
                ids = self.tokenizer.encode(text) if text else []
                if not ids:
                    continue
                produced = True
                tokens = torch.tensor([*ids, self.eos_id], dtype=torch.long)
                yield epoch, pos, (offset if pos == start else 0), tokens
            if not produced and start == 0:
                raise ConfigError(
                    f"{self.cfg.source!r} has no readable text in shard {self.cfg.shard_index} of "
                    f"{self.cfg.num_shards}",
                    field="source",
                )
            epoch, start, offset = epoch + 1, 0, 0
