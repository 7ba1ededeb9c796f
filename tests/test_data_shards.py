"""Sharding by files: whole files when the readers divide them, the document fallback otherwise.

Every test is in-process and offline: the corpora are small local parquet/txt/jsonl directories, and
the ``hf:`` path is exercised by loading such a directory through the Hub code path with the Hub
switched off (``HF_HUB_OFFLINE``) and its HTTP session replaced by one that records any call.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from greenswarm.errors import ConfigError
from greenswarm.node.config import TrainConfig
from greenswarm.node.data import (
    DataConfig,
    Sharding,
    TokenBatches,
    iter_documents,
    open_source,
    run_keys,
    sub_shard,
)
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import EvalConfig, HeldOut
from greenswarm.node.model import ModelConfig
from greenswarm.node.tokenizer import ByteTokenizer
from greenswarm.node.trainer import InnerTrainer

TOK = ByteTokenizer()
FILES = 8


def _rows(file: int) -> int:
    return 3 + file  # files of different lengths: whole-file shards are not equal-sized


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight parquet files; row ``r`` of file ``f`` reads ``"file f row r"``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("parquet8")
    for f in range(FILES):
        rows = [f"file {f} row {r}" for r in range(_rows(f))]
        pq.write_table(pa.table({"text": rows}), root / f"part-{f:02d}.parquet")
    return root


ALL_DOCS = {f"file {f} row {r}" for f in range(FILES) for r in range(_rows(f))}


def _docs(cfg: DataConfig) -> list[tuple[int, str]]:
    return list(iter_documents(cfg))


def _file_of(text: str) -> int:
    return int(text.split()[1])


def _take(batches: TokenBatches, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(iter(batches), n))


# ------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("files", [1, 2, 3, 6, 8, 12])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 16])
def test_keys_partition_rows_and_files_read_hold_them(files: int, count: int) -> None:
    """Every row of every file belongs to exactly one reader, always inside a file that reader opens;
    readers own whole, distinct files exactly when ``count`` divides ``files``."""
    readers = [Sharding(files, k, count) for k in range(count)]
    for file in range(files):
        for row in range(2 * count + 1):
            owners = [s.index for s in readers if s.owns(file, row)]
            assert len(owners) == 1
            assert file in readers[owners[0]].files_read()
    divisible = files % count == 0
    assert all(s.split == ("files" if divisible else "documents") for s in readers)
    if divisible:
        read = [set(s.files_read()) for s in readers]
        assert sum(map(len, read)) == files and set().union(*read) == set(range(files))
        assert all(s.keep_every == 1 and len(r) == files // count for s, r in zip(readers, read, strict=True))
    else:
        assert all(len(s.files_read()) == files // (count // s.keep_every) for s in readers)


# ---------------------------------------------------------------------------------- whole files


def test_whole_distinct_files_when_divisible(parquet_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Four readers of eight files: each reads two whole files, no two the same, all rows once."""
    counts: Counter[str] = Counter()
    per_reader: list[set[int]] = []
    with caplog.at_level(logging.INFO, logger="greenswarm.node.data"):
        for k in range(4):
            cfg = DataConfig(source=str(parquet_dir), shard_index=k, num_shards=4)
            docs = _docs(cfg)
            files = {_file_of(text) for _, text in docs}
            assert files == {k, k + 4}
            assert len(docs) == _rows(k) + _rows(k + 4)  # whole files
            assert all(key % 4 == k for key, _ in docs)
            per_reader.append(files)
            counts.update(text for _, text in docs)
    assert set(counts) == ALL_DOCS and set(counts.values()) == {1}
    lines = [r.getMessage() for r in caplog.records if "split by" in r.getMessage()]
    assert len(lines) == 4 and all("split by files: reads 2 files whole" in line for line in lines)
    assert "(1, 5)" in lines[1]


def test_a_reader_never_opens_other_readers_files(parquet_dir: Path, tmp_path: Path) -> None:
    """With other readers' files deleted after the source is opened, a reader streams its epoch unchanged."""
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(parquet_dir, copy)
    cfg = DataConfig(source=str(copy), shard_index=1, num_shards=4)
    expected = _docs(DataConfig(source=str(parquet_dir), shard_index=1, num_shards=4))
    source = open_source(cfg)
    assert source.sharding.files_read() == [1, 5]
    for f in range(FILES):
        if f not in (1, 5):
            (copy / f"part-{f:02d}.parquet").unlink()
    assert list(source.documents(0)) == expected
    assert list(source.documents(1)) != expected and sorted(source.documents(1)) == sorted(expected)


def test_files_of_several_kinds_are_numbered_across_kinds(tmp_path: Path) -> None:
    """Two .txt and two .jsonl files are four files: two readers get one of each kind, whole."""
    for i in range(2):
        (tmp_path / f"t{i}.txt").write_text("".join(f"t{i} line {r}\n" for r in range(3)))
        (tmp_path / f"j{i}.jsonl").write_text(
            "".join(json.dumps({"text": f"j{i} doc {r}"}) + "\n" for r in range(4))
        )
    shards = [
        [t for _, t in _docs(DataConfig(source=str(tmp_path), shard_index=k, num_shards=2))] for k in range(2)
    ]
    # Builders in order of first appearance in the sorted listing: j0.jsonl, j1.jsonl, t0.txt, t1.txt.
    assert sorted(shards[0]) == sorted([f"j0 doc {r}" for r in range(4)] + [f"t0 line {r}" for r in range(3)])
    assert sorted(shards[1]) == sorted([f"j1 doc {r}" for r in range(4)] + [f"t1 line {r}" for r in range(3)])


# ------------------------------------------------------------------------------------- fallback


@pytest.mark.parametrize("count, opened, keep", [(3, 8, 3), (6, 4, 3), (16, 1, 2)])
def test_documents_fallback_when_not_divisible(
    parquet_dir: Path, caplog: pytest.LogCaptureFixture, count: int, opened: int, keep: int
) -> None:
    """Readers that do not divide the files split by document: each opens ``opened`` files (the ones
    ``gcd(count, files)`` assigns it), and together they still read every row exactly once."""
    counts: Counter[str] = Counter()
    with caplog.at_level(logging.INFO, logger="greenswarm.node.data"):
        for k in range(count):
            source = open_source(DataConfig(source=str(parquet_dir), shard_index=k, num_shards=count))
            assert source.sharding.split == "documents" and source.sharding.keep_every == keep
            assert len(source.sharding.files_read()) == opened
            docs = list(source.documents(0))
            assert {_file_of(t) for _, t in docs} <= set(source.sharding.files_read())
            counts.update(t for _, t in docs)
    assert set(counts) == ALL_DOCS and set(counts.values()) == {1}
    line = next(r.getMessage() for r in caplog.records if "split by" in r.getMessage())
    assert f"split by documents ({count} does not divide 8)" in line
    assert f"keeps 1 document in {keep} of each" in line
    assert ("reads every file" in line) == (opened == FILES)


def test_one_file_is_split_by_documents_as_before(parquet_dir: Path) -> None:
    """One file: the key is the row number, so shard ``k`` keeps rows ``k, k + n, ...`` as it always did."""
    one = str(parquet_dir / "part-07.parquet")
    for k in range(3):
        rows = [t for _, t in _docs(DataConfig(source=one, shard_index=k, num_shards=3))]
        assert sorted(rows) == sorted(f"file 7 row {r}" for r in range(k, _rows(7), 3))


# ------------------------------------------------------------------------ sites, ranks, held out


@pytest.mark.parametrize("worlds", [(2, 4), (3,), (2, 1, 4)])
def test_sites_with_different_world_sizes_stay_disjoint(parquet_dir: Path, worlds: tuple[int, ...]) -> None:
    """Sites whose ranks split by files and sites whose ranks fall back to documents never overlap:
    one key for all. ``len(worlds) + 1`` site shards, the last held out for evaluation. With eight
    files: (2, 4) splits every reader by documents; (3,) has 6 ranks by documents beside a held-out
    half by files; (2, 1, 4) has 8 and 4 readers by files beside 16 by documents."""
    sites = len(worlds) + 1
    counts: Counter[str] = Counter()
    for s, world in enumerate(worlds):
        site = DataConfig(source=str(parquet_dir), shard_index=s, num_shards=sites)
        for r in range(world):
            counts.update(t for _, t in _docs(sub_shard(site, r, world)))
    data = DataConfig(source=str(parquet_dir), shard_index=0, num_shards=sites)
    held = EvalConfig(batches=1).held_out(data)
    held_docs = Counter(t for _, t in _docs(held))
    assert set(counts.values()) == {1} and set(held_docs.values()) == {1}
    assert not set(counts) & set(held_docs)
    assert set(counts) | set(held_docs) == ALL_DOCS


def test_held_out_with_its_own_count_is_disjoint(parquet_dir: Path) -> None:
    """``eval.num_shards`` unlike ``data.num_shards`` (8 vs 4: files vs files; 6 vs 4: documents vs
    files) is still disjoint whenever the config's modular check accepts it."""
    for eval_count, eval_index in ((8, 7), (6, 5), (12, 11)):
        cfg = EvalConfig(batches=1, num_shards=eval_count, shard_index=eval_index)
        held = {t for _, t in _docs(cfg.held_out(DataConfig(source=str(parquet_dir))))}
        assert held
        checked = 0
        for s in range(4):
            data = DataConfig(source=str(parquet_dir), shard_index=s, num_shards=4)
            try:
                cfg.check_against(data)
            except ConfigError:
                continue  # the config refuses this pair
            assert not held & {t for _, t in _docs(data)}
            checked += 1
        assert checked >= 2


# --------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("count", [4, 3])  # whole files; the document fallback
def test_resume_is_exact_under_file_sharding(parquet_dir: Path, count: int) -> None:
    cfg = DataConfig(source=str(parquet_dir), shard_index=count - 1, num_shards=count, seq_len=16)
    ref = _take(TokenBatches(cfg, TOK, 2), 40)
    for k in (1, 9, 23):
        b = TokenBatches(cfg, TOK, 2)
        _take(b, k)
        r = TokenBatches(cfg, TOK, 2)
        r.load_state_dict(b.state_dict())
        assert all(torch.equal(x, y) for x, y in zip(ref[k : k + 6], _take(r, 6), strict=True))
    b = TokenBatches(cfg, TOK, 2)
    _take(b, 40)
    assert b.epoch >= 1  # resumption was checked across an epoch boundary too
    assert b.state_dict()["data"]["files"] == FILES


# ------------------------------------------------------------- runs from before keys by file


def _index_shard(index: int, count: int) -> list[str]:
    """Shard ``index`` of ``count`` as greenswarm assigned it before keys by file (independently of
    the code under test): document ``i`` of the whole corpus -- files in order, rows in order -- when
    ``i % count == index``."""
    corpus = [f"file {f} row {r}" for f in range(FILES) for r in range(_rows(f))]
    return [text for i, text in enumerate(corpus) if i % count == index]


def _epochs(docs: list[str], seed: int = 0) -> Iterator[tuple[int, int, list[int]]]:
    """``(epoch, position, tokens + [EOS])`` in each epoch's order: a shard smaller than the shuffle
    buffer is shuffled completely with ``Random(seed + epoch)``."""
    for epoch in itertools.count():
        order = list(docs)
        random.Random(seed + epoch).shuffle(order)
        for pos, text in enumerate(order):
            yield epoch, pos, [*TOK.encode(text), TOK.eos_id]


def _index_batches(docs: list[str], n: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """The first ``n`` batches of a reader of ``docs`` (one stream cut into windows)."""
    need = n * batch * (seq_len + 1)
    stream: list[int] = []
    for _, _, tokens in _epochs(docs):
        stream += tokens
        if len(stream) >= need:
            break
    return list(torch.tensor(stream[:need]).view(n, batch, seq_len + 1))


def _old_position(cfg: DataConfig, docs: list[str], batches: int, batch: int) -> dict:
    """The data position a checkpoint written before keys by file holds after ``batches`` batches:
    no ``files``, no ``keys``."""
    consumed, done = batches * batch * (cfg.seq_len + 1), 0
    for epoch, pos, tokens in _epochs(docs):
        if consumed < done + len(tokens):
            fingerprint = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seq_len"}
            fingerprint["tokenizer"] = repr(TOK)
            where = {"epoch": epoch, "document": pos, "offset": consumed - done}
            return {"batches": batches, **where, "data": fingerprint}
        done += len(tokens)
    raise AssertionError("unreachable")


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("index, count", [(1, 4), (2, 3)])
def test_position_saved_before_file_keys_resumes_exactly_by_index(
    parquet_dir: Path, caplog: pytest.LogCaptureFixture, index: int, count: int
) -> None:
    """A checkpoint's position from before keys by file resumes at the very next token of the shard
    the run had (not an epoch over, not other documents), and the run's later positions stay by index."""
    cfg = DataConfig(source=str(parquet_dir), shard_index=index, num_shards=count, seq_len=16)
    docs = _index_shard(index, count)
    assert {t for _, t in _docs(cfg)} != set(docs)  # keys by file give this shard other documents
    ref = _index_batches(docs, 44, 2, 16)
    for k in (0, 7, 23, 34):  # across epoch boundaries (about 10 batches an epoch)
        r = TokenBatches(cfg, TOK, 2)
        with caplog.at_level(logging.INFO, logger="greenswarm.node.data"):
            r.load_state_dict(_old_position(cfg, docs, k, 2))
        assert _same(_take(r, 6), ref[k : k + 6])
        assert r.sharding.keys == "index" and r.sharding.files_read() == list(range(FILES))
        later = r.state_dict()  # the run's next checkpoint: by index, and says so
        assert (later["data"]["keys"], later["data"]["files"], later["batches"]) == ("index", FILES, k + 6)
        again = TokenBatches(cfg, TOK, 2)
        again.load_state_dict(later)
        assert _same(_take(again, 4), ref[k + 6 : k + 10])
    assert "predates keys by file" in caplog.text and "starts over" not in caplog.text
    assert "keys by corpus index" in caplog.text


def test_held_out_keeps_its_documents_after_the_upgrade(parquet_dir: Path) -> None:
    """Wired as a site wires them (the trainer's stream a sub-shard of ``cfg.data``, the held-out set
    built from ``cfg.data`` and read on first use): resuming an old position keys the held-out shard
    by index too, so it holds the documents it held before -- none the site trained on. Keyed by file
    instead, it would hold documents the site already trained on."""
    site = DataConfig(source=str(parquet_dir), shard_index=0, num_shards=4, seq_len=16)  # 3 held out
    trainer = InnerTrainer(
        ModelConfig(), site, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World()
    )
    held = HeldOut(EvalConfig(batches=3, batch_size=2), site, trainer.tokenizer)
    state = trainer.state_dict()
    state["data"] = [_old_position(site, _index_shard(0, 4), 5, 2)]
    trainer.load_state_dict(state)
    assert run_keys(site) == "index" and trainer.batches.sharding.keys == "index"
    assert _same(held.batches(), _index_batches(_index_shard(3, 4), 3, 2, 16))
    assert held.data.shard_index == 3 and run_keys(held.data) == "index"
    trained = set(_index_shard(0, 4))
    assert not trained & set(_index_shard(3, 4))
    by_file = {t for _, t in _docs(dataclasses.replace(held.data))}  # ``replace``: a new run's config
    assert trained & by_file  # what the held-out set would have held, keyed by file


def test_a_new_run_keys_by_file(parquet_dir: Path) -> None:
    """No position, or one saved since keys by file (with ``files``, whether or not it names its
    keys): keys by file, whole files, for the training stream and the held-out shard alike."""
    site = DataConfig(source=str(parquet_dir), shard_index=0, num_shards=4, seq_len=16)
    stream = TokenBatches(sub_shard(site, 0, 1), TOK, 2)
    held = HeldOut(EvalConfig(batches=2, batch_size=2), site, TOK)
    assert run_keys(site) == "file" and stream.sharding.keys == "file"
    assert stream.sharding.files_read() == [0, 4]
    position = stream.state_dict()
    assert (position["data"]["keys"], position["data"]["files"]) == ("file", FILES)
    assert {_file_of(t) for _, t in _docs(held.data)} == {3, 7}
    ref = _take(TokenBatches(site, TOK, 2), 14)
    _take(stream, 5)
    for saved in (stream.state_dict(), _without(stream.state_dict(), "keys")):  # now; as of 2f9c791
        r = TokenBatches(site, TOK, 2)
        r.load_state_dict(saved)
        assert r.sharding.keys == "file" and _same(_take(r, 9), ref[5:])
    assert run_keys(site) == "file"
    assert _same(held.batches(), _take(TokenBatches(held.data, TOK, 2), 2))


def _without(state: dict, key: str) -> dict:
    return {**state, "data": {k: v for k, v in state["data"].items() if k != key}}


def test_position_refused_for_other_settings_but_not_for_more_files(
    parquet_dir: Path, tmp_path: Path
) -> None:
    """Another seed is the operator's change, unknown keys a later version's: refused. A grown corpus
    moves every key: the epoch restarts."""
    import shutil

    copy = tmp_path / "grows"
    shutil.copytree(parquet_dir, copy)
    cfg = DataConfig(source=str(copy), shard_index=0, num_shards=2, seq_len=16)
    a = TokenBatches(cfg, TOK, 2)
    _take(a, 3)
    with pytest.raises(ConfigError):
        TokenBatches(
            DataConfig(source=str(copy), shard_index=0, num_shards=2, seed=5), TOK, 2
        ).load_state_dict(a.state_dict())
    unknown = a.state_dict()
    unknown["data"]["keys"] = "hash"  # a later version's keys
    with pytest.raises(ConfigError, match="keys 'hash'"):
        TokenBatches(cfg, TOK, 2).load_state_dict(unknown)
    shutil.copy(copy / "part-00.parquet", copy / "part-08.parquet")  # the corpus grew: keys moved
    grown = TokenBatches(cfg, TOK, 2)
    grown.load_state_dict(a.state_dict())
    assert grown.sharding.files == 9 and grown.state_dict()["document"] == 0
    assert grown.state_dict()["batches"] == 3


# ---------------------------------------------------------------------------------------- hf:


def test_hf_source_shards_by_files_offline(parquet_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf:`` with a local dataset directory goes through ``load_dataset(NAME, streaming=True)`` --
    the Hub path -- and shards by its files exactly as the local source does, without any HTTP call."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls: list[object] = []
    monkeypatch.setattr(datasets.load, "get_session", lambda *a, **k: calls.append(a))
    for count in (4, 3):
        for k in range(count):
            hub = open_source(DataConfig(source=f"hf:{parquet_dir}", shard_index=k, num_shards=count))
            assert hub.sharding.files == FILES
            local = _docs(DataConfig(source=str(parquet_dir), shard_index=k, num_shards=count))
            assert list(hub.documents(0)) == local
    assert calls == []


# ------------------------------------------------------------------------------------- benchmark


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bytes read come from /proc/self/io")
def test_benchmark_reports_fewer_bytes_per_reader_with_file_shards() -> None:
    """``benchmarks/data_shards.py`` on four files: two readers read about half each, three (the
    fallback) read everything each; every documented key is there."""
    script = Path(__file__).parents[1] / "benchmarks" / "data_shards.py"
    out = subprocess.run(
        [sys.executable, str(script), "--files", "4", "--worlds", "1", "2", "3", "--copies", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    result = json.loads(out)
    summary = {s["world"]: s for s in result["summary"]}
    assert summary[1]["max_ratio"] == 1.0 and summary[1]["files_opened_per_reader"] == 4
    assert summary[2]["split"] == "files" and summary[2]["max_ratio"] < 0.65
    assert summary[3]["split"] == "documents" and summary[3]["max_ratio"] > 0.95
    assert {s["documents"] for s in result["summary"]} == {result["documents"]}
    for row in result["readers"]:
        assert {"world", "site", "rank", "split", "opened", "file_bytes", "read_bytes", "ratio"} <= set(row)
