"""Token batches: shapes, disjoint shards, determinism, resume, local files via datasets (offline)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch

from greenswarm.errors import ConfigError
from greenswarm.node.data import DataConfig, TokenBatches, iter_documents, stdlib_files, sub_shard
from greenswarm.node.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _take(batches: TokenBatches, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(iter(batches), n))


@pytest.fixture
def corpus(tmp_path):
    """A directory with .txt, .jsonl and .parquet files; 20 documents, each one recognisable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("".join(f"txt document {i}\n" for i in range(6)))
    lines = [json.dumps({"text": f"jsonl document {i}"}) + "\n" for i in range(7)]
    (tmp_path / "b.jsonl").write_text("".join(lines))
    pq.write_table(pa.table({"text": [f"parquet document {i}" for i in range(7)]}), tmp_path / "c.parquet")
    return tmp_path


def test_import_is_cheap():
    code = "import sys, greenswarm.node.data; print('datasets' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_stdlib_batches_shape_dtype_values():
    batches = TokenBatches(DataConfig(seq_len=64), TOK, batch_size=4)
    assert batches.tokens_per_batch == 4 * 64
    got = _take(batches, 3)
    for b in got:
        assert b.shape == (4, 65) and b.dtype == torch.long
        assert int(b.min()) >= 0 and int(b.max()) < TOK.vocab_size
    # Consecutive windows of one stream: Python source text, documents separated by EOS.
    text = TOK.decode(torch.cat(got).flatten().tolist())
    assert "def " in text or "import " in text


def test_stdlib_shards_disjoint_and_cover():
    everything = {i for i, _ in iter_documents(DataConfig())}
    assert len(everything) == len(stdlib_files()) > 100
    s0 = {i for i, _ in iter_documents(DataConfig(shard_index=0, num_shards=2))}
    s1 = {i for i, _ in iter_documents(DataConfig(shard_index=1, num_shards=2))}
    assert s0 and s1 and not s0 & s1
    assert s0 | s1 == everything
    assert all(i % 2 == 0 for i in s0)


def test_epoch_order_reshuffled_and_deterministic():
    first = [i for i, _ in iter_documents(DataConfig(num_shards=4), epoch=0)]
    again = [i for i, _ in iter_documents(DataConfig(num_shards=4), epoch=0)]
    second = [i for i, _ in iter_documents(DataConfig(num_shards=4), epoch=1)]
    assert first == again
    assert first != second and sorted(first) == sorted(second)


def test_batches_deterministic_and_seed_dependent():
    a = _take(TokenBatches(DataConfig(seed=1), TOK, 2), 2)
    b = _take(TokenBatches(DataConfig(seed=1), TOK, 2), 2)
    c = _take(TokenBatches(DataConfig(seed=2), TOK, 2), 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_state_dict_resume_same_next_batch():
    cfg = DataConfig(seq_len=32)
    first = TokenBatches(cfg, TOK, 4)
    it = iter(first)
    for _ in range(37):
        next(it)
    state = first.state_dict()
    assert state["batches"] == 37
    expected = [next(it) for _ in range(3)]

    resumed = TokenBatches(cfg, TOK, 4)
    resumed.load_state_dict(state)
    got = _take(resumed, 3)
    assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))
    assert resumed.state_dict()["batches"] == 40


def test_resume_across_epochs(corpus):
    # 20 short documents: a few batches span several epochs.
    cfg = DataConfig(source=str(corpus), seq_len=16)
    ref = _take(TokenBatches(cfg, TOK, 3), 30)
    for k in (1, 7, 19):
        b = TokenBatches(cfg, TOK, 3)
        _take(b, k)
        state = b.state_dict()
        r = TokenBatches(cfg, TOK, 3)
        r.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(ref[k : k + 5], _take(r, 5), strict=True))
    assert TokenBatches(cfg, TOK, 3).epoch == 0
    b = TokenBatches(cfg, TOK, 3)
    _take(b, 30)
    assert b.epoch >= 2


def test_resume_refuses_other_shard():
    b = TokenBatches(DataConfig(num_shards=2), TOK, 2)
    _take(b, 1)
    other = TokenBatches(DataConfig(num_shards=2, shard_index=1), TOK, 2)
    with pytest.raises(ConfigError):
        other.load_state_dict(b.state_dict())


def test_local_txt_jsonl_parquet(corpus):
    docs = [text for _, text in iter_documents(DataConfig(source=str(corpus)))]
    expected = (
        [f"txt document {i}" for i in range(6)]
        + [f"jsonl document {i}" for i in range(7)]
        + [f"parquet document {i}" for i in range(7)]
    )
    assert sorted(docs) == sorted(expected)
    for name, kind in (("a.txt", "txt"), ("b.jsonl", "jsonl"), ("c.parquet", "parquet")):
        batches = TokenBatches(DataConfig(source=str(corpus / name), seq_len=16), TOK, 2)
        b = next(iter(batches))
        assert b.shape == (2, 17)
        assert f"{kind} document" in TOK.decode(b.flatten().tolist())
        assert TOK.eos_id in b.tolist()[0] + b.tolist()[1]


def test_local_glob_and_shards(corpus):
    source = str(corpus / "*.jsonl")
    shards = [dict(iter_documents(DataConfig(source=source, shard_index=k, num_shards=3))) for k in range(3)]
    indices = [set(s) for s in shards]
    assert set().union(*indices) == set(range(7))
    assert sum(len(s) for s in indices) == 7
    assert all(i % 3 == k for k, s in enumerate(indices) for i in s)
    assert shards[1][4] == "jsonl document 4"


def test_text_field_for_json(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello there", "id": 1}) + "\n")
    docs = list(iter_documents(DataConfig(source=str(tmp_path / "d.jsonl"), text_field="body")))
    assert docs == [(0, "hello there")]
    with pytest.raises(ConfigError) as e:
        list(iter_documents(DataConfig(source=str(tmp_path / "d.jsonl"))))
    assert e.value.field == "text_field" and "body" in str(e.value)


def test_missing_or_empty_source_names_it(tmp_path):
    missing = tmp_path / "no" / "such.txt"
    with pytest.raises(ConfigError) as e:
        TokenBatches(DataConfig(source=str(missing)), TOK, 2)
    assert e.value.field == "source" and str(missing) in str(e.value)

    (tmp_path / "notes.md").write_text("not a supported file")
    with pytest.raises(ConfigError) as e:
        TokenBatches(DataConfig(source=str(tmp_path)), TOK, 2)
    assert e.value.field == "source" and str(tmp_path) in str(e.value)

    with pytest.raises(ConfigError) as e:
        TokenBatches(DataConfig(source=str(tmp_path / "*.jsonl")), TOK, 2)
    assert e.value.field == "source"

    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ConfigError) as e:
        next(iter(TokenBatches(DataConfig(source=str(tmp_path / "empty.txt")), TOK, 2)))
    assert e.value.field == "source" and "empty.txt" in str(e.value)


def test_hub_source_offline_is_a_config_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        TokenBatches(DataConfig(source="hf:greenswarm-test/no-such-dataset:cfg"), TOK, 2)
    assert e.value.field == "source" and "greenswarm-test/no-such-dataset" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_len": 4}, "seq_len"),
        ({"shard_index": 2, "num_shards": 2}, "shard_index"),
        ({"shard_index": -1}, "shard_index"),
        ({"num_shards": 0}, "num_shards"),
        ({"source": ""}, "source"),
        ({"source": "hf:"}, "source"),
        ({"text_field": ""}, "text_field"),
    ],
)
def test_validate(kwargs, field):
    with pytest.raises(ConfigError) as e:
        DataConfig(**kwargs).validate()
    assert e.value.field == field


def test_sub_shard_arithmetic():
    site = DataConfig(shard_index=1, num_shards=3)
    ranks = [sub_shard(site, r, 4) for r in range(4)]
    assert [(c.shard_index, c.num_shards) for c in ranks] == [(1, 12), (4, 12), (7, 12), (10, 12)]
    # The ranks of a site read exactly the site's documents, whatever its world size.
    for world in (1, 2, 4):
        indices = {sub_shard(site, r, world).shard_index for r in range(world)}
        owned = {i for i in range(240) if i % (3 * world) in indices}
        assert owned == {i for i in range(240) if i % 3 == 1}
    with pytest.raises(ValueError):
        sub_shard(site, 4, 4)


def test_local_files_never_touch_the_hub(corpus, monkeypatch):
    import datasets.load

    calls = []
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.load, "get_session", lambda *a, **k: calls.append(a))
    assert len(list(iter_documents(DataConfig(source=str(corpus))))) == 20
    assert calls == []
