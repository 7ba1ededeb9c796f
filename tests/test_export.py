"""Models in and out in Hugging Face format: ``model.config`` (any causal-LM config.json),
``model.init_from`` (a local model directory), the swarm refusing a site that trains another model, and
``greenswarm export`` (a real site's checkpoint to safetensors that transformers loads, same logits)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from greenswarm.configuration import config_from_dict
from greenswarm.errors import ConfigError
from greenswarm.node.config import SiteConfig, TrainConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import EvalConfig, HeldOut
from greenswarm.node.export import MODEL_FILE, PROVENANCE_FILE, export_run
from greenswarm.node.model import ModelConfig, ModelIdentity, build_model, model_identity
from greenswarm.node.trainer import InnerTrainer
from tests.conftest import Swarm, site_config, wait_until, write_trace

pytestmark = pytest.mark.export

TOKENS = torch.arange(0, 250, 7).reshape(2, -1) % 259  # two rows of byte tokens


def _gpt2_config(directory: Path, vocab: int = 300) -> Path:
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=vocab).save_pretrained(directory)
    return directory


def test_a_config_json_builds_its_architecture_at_the_tokenizers_side_and_the_same_at_every_site(
    tmp_path: Path,
) -> None:
    directory = _gpt2_config(tmp_path / "gpt2-small-test")
    a = build_model(ModelConfig(config=str(directory)), 259)
    b = build_model(ModelConfig(config=str(directory / "config.json")), 259)  # the file itself works too
    assert a.config.model_type == "gpt2" and a.config.vocab_size == 300 and not a.config.use_cache
    assert next(a.parameters()).dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    cfg = ModelConfig(config=str(directory))
    ia = model_identity(a, "bytes/259", cfg)
    preset = model_identity(build_model(ModelConfig(), 259), "bytes/259", ModelConfig())
    assert ia == model_identity(b, "bytes/259", cfg) and ia != preset
    assert ModelIdentity.from_wire(ia.to_wire()) == ia
    assert model_identity(a, "other/259", cfg).differences(ia) == ["tokenizer"]
    seed1 = ModelConfig(config=str(directory), seed=1)
    reseeded = model_identity(build_model(seed1, 259), "bytes/259", seed1)
    assert reseeded.differences(ia) == ["starting weights (model.seed, model.init_from)"]
    # another transformers version with the same model and start is the same model
    assert ia.same_model(dataclasses.replace(ia, transformers="4.99.0")) and not ia.same_model(reseeded)
    assert reseeded.key != ia.key  # and they never meet in an averaging group


def test_model_sources_are_checked_at_load_time_with_the_field_named(tmp_path: Path) -> None:
    config = _gpt2_config(tmp_path / "cfg")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((config / "config.json").read_text())
    base = {"name": "a", "region": "R"}
    cases = {
        "model.config": {"config": str(tmp_path / "missing")},
        "model.init_from": {"init_from": str(tmp_path / "noweights")},
    }
    for where, model in cases.items():
        with pytest.raises(ConfigError) as err:
            config_from_dict(SiteConfig, {**base, "model": model}, source="site.yaml")
        assert where in str(err.value), err.value
    with_tokenizer = tmp_path / "hf-model"
    build_model(ModelConfig(config=str(config)), 259).save_pretrained(with_tokenizer)
    (with_tokenizer / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as err:  # byte ids into a model that reads its own tokenizer's
        config_from_dict(SiteConfig, {**base, "model": {"init_from": str(with_tokenizer)}})
    assert "model.tokenizer" in str(err.value) and "has its own tokenizer" in str(err.value)
    with pytest.raises(ConfigError, match="not both"):
        config_from_dict(SiteConfig, {**base, "model": {"config": str(config), "init_from": str(config)}})
    with pytest.raises(ConfigError, match="does not cover the tokenizer's 400 tokens"):
        build_model(ModelConfig(config=str(config)), 400)
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ConfigError, match="not a config transformers can read"):
        build_model(ModelConfig(config=str(config)), 259)


DATA = DataConfig(shard_index=0, num_shards=2, seq_len=64)  # as site_config(shard=0, shards=2) reads


def _trainer(model: ModelConfig) -> InnerTrainer:
    return InnerTrainer(model, DATA, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World())


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    return model(input_ids=TOKENS).logits


@pytest.mark.swarm
def test_a_real_sites_model_goes_out_and_back_in(swarm: Swarm, tmp_path: Path) -> None:
    """A real site trains (held-out loss, best checkpoints kept); a site with another model is refused
    at join, naming both; the site's global model is exported, loads in transformers with the node's
    logits, and a site started from it (``init_from``) has the held-out loss the export was kept at."""
    hours, speedup = 1, 300.0
    trace = write_trace(tmp_path / "green.csv", {"GREEN": [10.0] * hours}, step_s=3600)
    peers = swarm.bootstrap()
    start_file = tmp_path / "start"
    common = dict(speedup=speedup, start_file=start_file, sync_s=600.0, shard=0, shards=2)
    site_a = site_config("site-a", "GREEN", trace, peers, tmp_path / "site-a", **common,
                         eval={"batches": 2, "batch_size": 2, "keep_best": 2})  # fmt: skip
    swarm.node("site-a", swarm.write_config("site-a", site_a))
    wait_until(lambda: "joined swarm" in swarm.log("site-a"), 90, "site-a to join")

    other = _gpt2_config(tmp_path / "gpt2-test")
    site_b = site_config("site-b", "GREEN", trace, peers, tmp_path / "site-b", **common,
                         model={"config": str(other)}, node={"restart": "never"})  # fmt: skip
    swarm.node("site-b", swarm.write_config("site-b", site_b))
    assert swarm.wait("site-b", timeout=90) == 2, swarm.log("site-b")[-3000:]
    errors = [line for line in swarm.log("site-b").splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in swarm.log("site-b"), swarm.log("site-b")[-3000:]
    assert "site-b" in errors[0] and "site site-a" in errors[0], errors[0]
    assert (
        "gpt2" in errors[0]
        and "llama" in errors[0]
        # (both draw their starting weights from one recipe, model.seed 0: only these two differ)
        and "they differ in architecture and parameter count;" in errors[0]
    )

    end_wall = swarm.start_replay(["site-a"], start_file) + hours * 3600 / speedup
    assert swarm.wait("site-a", timeout=end_wall + 120 - time.time()) == 0, swarm.log("site-a")[-4000:]
    run_dir = tmp_path / "site-a"
    assert json.loads((run_dir / MODEL_FILE).read_text())["identity"].startswith("llama|")

    # out: the newest global model, through the CLI, as transformers loads it
    out = tmp_path / "exported"
    command = ["export", "--run-dir", str(run_dir), "--out", str(out), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "greenswarm", *command], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert {"model.safetensors", "config.json", PROVENANCE_FILE} <= set(report["files"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert report["outer_round"] == summary["outer_round"] >= 2

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    node = _trainer(ModelConfig())  # the node's own model, holding the checkpoint's global vector
    from greenswarm.node.checkpoint import Checkpointer

    node.load_full_parameters(Checkpointer(run_dir).load()["outer"][0])
    expected, got = _logits(node.model), _logits(loaded)
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-5

    # the best kept one, and back in: a site starting from it evaluates to the loss it was kept at
    best = export_run(run_dir, tmp_path / "best", best=True)
    assert best["held_out_loss"] is not None and best["checkpoint"].startswith(str(run_dir / "best"))
    resumed = _trainer(ModelConfig(init_from=str(tmp_path / "best")))
    held_out = HeldOut(EvalConfig(batches=2, batch_size=2), DATA, resumed.tokenizer)
    assert resumed.evaluate(held_out.batches()) == pytest.approx(best["held_out_loss"], abs=1e-4)
    with pytest.raises(ConfigError, match="--force"):
        export_run(run_dir, out)

    # and a real site started from it says so, at that loss, and joins the swarm it came from
    site_c = site_config("site-c", "GREEN", trace, peers, tmp_path / "site-c", **common,
                         model={"init_from": str(tmp_path / "best")}, node={"restart": "never"},
                         eval={"batches": 2, "batch_size": 2})  # fmt: skip
    swarm.node("site-c", swarm.write_config("site-c", site_c))
    said = "held-out loss of the starting model (weights of "
    wait_until(lambda: "joined swarm" in swarm.log("site-c"), 90, "site-c to start from the export")
    line = next(x for x in swarm.log("site-c").splitlines() if said in x)
    print(f"kept at {best['held_out_loss']:.6f}; {line}")  # (for the record: pytest -rP shows it)
    assert float(line.rsplit(":", 1)[1]) == pytest.approx(best["held_out_loss"], abs=1e-4), line
    swarm.kill("site-c", signal.SIGTERM)
    assert swarm.wait("site-c", timeout=60) == 0, swarm.log("site-c")[-3000:]


def test_an_export_carries_the_sites_own_tokenizer_and_its_fingerprint_tells_vocabularies_apart(
    tmp_path: Path,
) -> None:
    """In-process, from a run directory as a node leaves it (model.json and a verified checkpoint)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from greenswarm.node.checkpoint import Checkpointer
    from greenswarm.node.export import describe_model
    from greenswarm.node.tokenizer import load_tokenizer

    def tokenizer(directory: Path, words: list[str]) -> str:
        raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>")
        fast.save_pretrained(directory)
        return str(directory)

    words = ["[UNK]", "<eos>", *(f"w{i}" for i in range(40))]
    tok = tokenizer(tmp_path / "tok", words)
    other = tokenizer(tmp_path / "b" / "tok", [*words[:-1], "different"])  # same size and folder name
    same = tokenizer(tmp_path / "elsewhere", words)
    assert load_tokenizer(tok).fingerprint != load_tokenizer(other).fingerprint
    assert load_tokenizer(tok).fingerprint == load_tokenizer(same).fingerprint  # where it lies is no part
    cfg = ModelConfig(tokenizer=tok)
    model = build_model(cfg, 42)
    names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()], strict=True)
    run_dir = tmp_path / "run"
    identity = model_identity(model, load_tokenizer(tok).fingerprint, cfg)
    describe_model(run_dir, model, list(names), list(shapes), cfg, identity)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    Checkpointer(run_dir).save({"outer": [flat, torch.zeros_like(flat)], "site": {"outer_round": 3}})

    for out in (run_dir, run_dir / "sub", tmp_path):  # never over (or around) the run itself
        with pytest.raises(ConfigError, match="the run directory"):
            export_run(run_dir, out, force=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no earlier export"):
        export_run(run_dir, tmp_path / "taken", force=True)
    report = export_run(run_dir, tmp_path / "out")
    assert report["outer_round"] == 3 and report["tokenizer_saved"].startswith("saved from")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).encode("w3 w7") == [5, 9]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ids = torch.tensor([[2, 5, 9, 1]])
    with torch.no_grad():
        model.eval()
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


class _View:
    """The part of a SwarmView that the join check reads: successive polls of the unlike records."""

    def __init__(self, *polls: list):
        self.polls, self.current = list(polls), []

    def poll_now(self) -> None:
        self.current = self.polls.pop(0) if self.polls else self.current

    def unlike(self) -> list:
        return self.current


def test_the_join_refuses_only_a_live_other_model_and_never_the_sites_own_old_record() -> None:
    from types import SimpleNamespace

    from greenswarm.node.joining import refuse_other_models

    mine = model_identity(build_model(ModelConfig(), 259), "bytes/259", ModelConfig())
    other = dataclasses.replace(mine, architecture="gpt2", digest="000000000000")

    def record(site: str, peer: str, model: str | None) -> SimpleNamespace:
        return SimpleNamespace(site=site, peer_id=peer, model=model)

    stale = record("b", "peer-b", other.to_wire())
    own_old = record("a", "peer-old", None)  # this site's record from before it restarted
    refuse_other_models(_View([own_old]), mine, "a", "test", ttl_s=0)  # its own: never
    refuse_other_models(_View([stale], []), mine, "a", "test", ttl_s=0)  # gone within a lifetime
    with pytest.raises(ConfigError) as err:
        refuse_other_models(_View([stale], [stale]), mine, "a", "test", ttl_s=0)
    assert "site b (peer-b)" in str(err.value) and "they differ in architecture" in str(err.value)
    with pytest.raises(ConfigError, match="greenswarm version"):  # a record naming no model: older
        old = record("c", "peer-c", None)
        refuse_other_models(_View([old], [old]), mine, "a", "test", ttl_s=0)
