"""Bytes each reader of a sharded corpus reads: split by files against reading everything.

Writes a local parquet directory split into ``--files`` files (tinyshakespeare from ../shared, one
document per paragraph, ``--copies`` times over so the data dwarfs the reader's own overhead; else a
seeded synthetic text), then reads it through the node's own data pipeline
(:func:`greenswarm.node.data.open_source`, the document source behind ``TokenBatches``): for each
world size in ``--worlds``, each rank ``r`` of each of ``--sites`` sites reads one full epoch of its
shard ``sub_shard(site, r, world)``, exactly as the trainer builds it under torchrun.

Measured for each reader, around opening its source and streaming the epoch:

* ``read_bytes``: the kernel's count of bytes this process read (``rchar`` in ``/proc/self/io``:
  every ``read``/``pread`` syscall, whether the page cache or the disk served it), so it includes
  everything the reader's ``datasets``/``pyarrow`` stack read -- parquet footers, schemas, any file
  it opened -- and not just what the sharding rule says it should. A warm-up pass over a separate
  one-file directory first loads every lazily imported module, so imports do not count;
* ``opened``: the corpus files it opened (``open()`` calls seen by a wrapper on ``builtins.open``,
  through which ``datasets``' streaming reader opens local files);
* ``file_bytes``: the on-disk size of the files its :class:`~greenswarm.node.data.Sharding` says it
  reads, for comparison.

``ratio`` is ``read_bytes`` over what the one reader of world size 1 read (the whole corpus). With
8 files, world sizes 1, 2, 4 split by whole files; 3 falls back to splitting by documents and
reads every file (shown when ``--worlds`` includes it).

    python benchmarks/data_shards.py [--files 8] [--worlds 1 2 3 4] [--sites 1] [--copies 4] [--json]
"""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CORPUS = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"


def documents(copies: int, seed: int = 0) -> tuple[list[str], str]:
    """The corpus's documents (paragraphs of tinyshakespeare, or synthetic ones) and where they come from."""
    if CORPUS.exists():
        paragraphs = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        return paragraphs * copies, f"tinyshakespeare paragraphs x{copies}"
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(2000)]
    docs = [" ".join(rng.choices(words, k=rng.randint(20, 200))) for _ in range(1500 * copies)]
    return docs, f"synthetic text ({len(docs)} documents)"


def write_parquet(docs: list[str], root: Path, files: int) -> list[Path]:
    """``docs`` in ``files`` parquet files of consecutive documents, as a sharded dataset is laid out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    paths = []
    per = -(-len(docs) // files)
    for f in range(files):
        path = root / f"train-{f:05d}-of-{files:05d}.parquet"
        pq.write_table(pa.table({"text": docs[f * per : (f + 1) * per]}), path)
        paths.append(path)
    return paths


def rchar() -> int:
    """Bytes this process has read through read syscalls so far (Linux ``/proc/self/io``)."""
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


@contextmanager
def opens_under(root: Path) -> Iterator[list[str]]:
    """Record the names of files under ``root`` opened through ``builtins.open`` meanwhile."""
    seen: list[str] = []
    real = builtins.open
    prefix = str(root)

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str | os.PathLike) and os.fspath(file).startswith(prefix):
            seen.append(Path(file).name)
        return real(file, *args, **kwargs)

    builtins.open = spy
    try:
        yield seen
    finally:
        builtins.open = real


def read_shard(cfg: Any, root: Path) -> dict[str, Any]:
    """Open ``cfg``'s source and stream one epoch; what it read."""
    from greenswarm.node.data import open_source

    with opens_under(root) as opened:
        before = rchar()
        t0 = time.perf_counter()
        source = open_source(cfg)
        after_open = rchar()
        docs = chars = 0
        for _, text in source.documents(0):
            docs += 1
            chars += len(text)
        read = rchar() - before
        seconds = time.perf_counter() - t0
    sharding = source.sharding
    names = sorted(p.name for p in root.glob("*.parquet"))
    return {
        "split": sharding.split,
        "files_read": sharding.files_read(),
        "file_bytes": sum((root / names[f]).stat().st_size for f in sharding.files_read()),
        "opened": sorted(set(opened)),
        "read_bytes": read,
        "open_bytes": after_open - before,
        "documents": docs,
        "chars": chars,
        "seconds": round(seconds, 3),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from greenswarm.node.data import DataConfig, open_source, sub_shard

    docs, what = documents(args.copies)
    root = work / "corpus"
    paths = write_parquet(docs, root, args.files)
    warm = work / "warmup"
    write_parquet(docs[:50], warm, 1)
    for _ in open_source(DataConfig(source=str(warm))).documents(0):  # imports, not measured
        pass

    corpus_bytes = sum(p.stat().st_size for p in paths)
    rows: list[dict[str, Any]] = []
    everything: int | None = None
    for world in args.worlds:
        for site in range(args.sites):
            site_cfg = DataConfig(source=str(root), shard_index=site, num_shards=args.sites)
            for rank in range(world):
                cfg = sub_shard(site_cfg, rank, world)
                row = {"world": world, "site": site, "rank": rank, "readers": args.sites * world}
                row.update(read_shard(cfg, root))
                rows.append(row)
        if everything is None and world == 1 and args.sites == 1:
            everything = rows[-1]["read_bytes"]
    if everything is None:  # no world-1 single reader asked for: measure it as the baseline
        everything = read_shard(DataConfig(source=str(root)), root)["read_bytes"]
    for row in rows:
        row["ratio"] = round(row["read_bytes"] / everything, 4)
    summary = []
    for world in args.worlds:
        mine = [r for r in rows if r["world"] == world]
        summary.append(
            {
                "world": world,
                "readers": mine[0]["readers"],
                "split": mine[0]["split"],
                "files_opened_per_reader": max(len(r["opened"]) for r in mine),
                "mean_read_bytes": round(sum(r["read_bytes"] for r in mine) / len(mine)),
                "max_read_bytes": max(r["read_bytes"] for r in mine),
                "max_ratio": max(r["ratio"] for r in mine),
                "ideal_ratio": round(1 / mine[0]["readers"], 4),
                "documents": sum(r["documents"] for r in mine),
            }
        )
    return {
        "corpus": what,
        "files": args.files,
        "corpus_bytes": corpus_bytes,
        "documents": len(docs),
        "sites": args.sites,
        "everything_read_bytes": everything,
        "measured": "rchar from /proc/self/io around open_source + one epoch; opened = builtins.open spy",
        "readers": rows,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=8, help="parquet files in the corpus (default 8)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4], help="ranks per site")
    parser.add_argument("--sites", type=int, default=1, help="sites (data.num_shards; default 1)")
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus's documents (default 4)")
    parser.add_argument("--workdir", type=Path, help="keep the parquet directory here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("needs Linux: bytes read are taken from /proc/self/io")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local corpus: nothing to ask the Hub

    if args.workdir:
        result = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="greenswarm-shards-") as tmp:
            result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['corpus']}: {result['documents']} documents in {result['files']} parquet files, "
        f"{result['corpus_bytes']:,} bytes; {result['sites']} site(s)"
    )
    print(f"one reader reading everything: {result['everything_read_bytes']:,} bytes read")
    print(
        f"{'world':>5} {'site':>4} {'rank':>4} {'split':>9} {'opened':>6} {'file bytes':>11} "
        f"{'read bytes':>11} {'ratio':>6} {'docs':>6}"
    )
    for r in result["readers"]:
        print(
            f"{r['world']:>5} {r['site']:>4} {r['rank']:>4} {r['split']:>9} {len(r['opened']):>6} "
            f"{r['file_bytes']:>11,} {r['read_bytes']:>11,} {r['ratio']:>6.3f} {r['documents']:>6}"
        )
    print()
    for s in result["summary"]:
        print(
            f"world {s['world']} ({s['readers']} readers, split by {s['split']}): at most "
            f"{s['max_read_bytes']:,} bytes and {s['files_opened_per_reader']} files per reader, "
            f"ratio {s['max_ratio']:.3f} (1/readers = {s['ideal_ratio']:.3f}); "
            f"{s['documents']} documents in all"
        )


if __name__ == "__main__":
    main()
