"""Held-out evaluation and the best-k checkpoints: the best states of a run survive crashes and bad rounds."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from greenswarm.errors import ConfigError
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import TrainConfig, load_site_config
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import BestCheckpoints, EvalConfig, HeldOut, MeasurePace, shards_overlap
from greenswarm.node.model import ModelConfig
from greenswarm.node.trainer import InnerTrainer

# ------------------------------------------------------------------------------------------ evaluator


@pytest.fixture(scope="module")
def trainer() -> InnerTrainer:
    data = DataConfig(seq_len=32, shard_index=0, num_shards=2)
    return InnerTrainer(
        ModelConfig(), data, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World()
    )


@pytest.fixture(scope="module")
def held_out(trainer: InnerTrainer) -> HeldOut:
    return HeldOut(EvalConfig(batches=3, batch_size=2), trainer.batches.cfg, trainer.tokenizer)


def test_held_out_batches_are_read_once_from_the_held_out_shard(held_out: HeldOut) -> None:
    """The same tensors every call (comparable losses, no re-reading), from the shard nobody trains on."""
    batches = held_out.batches()
    assert len(batches) == 3 and all(b.shape == (2, 33) for b in batches)
    assert held_out.batches() is batches
    assert (held_out.data.shard_index, held_out.data.num_shards) == (1, 2)  # the last of data's 2 shards


def test_evaluate_is_repeatable_and_leaves_the_model_alone(trainer: InnerTrainer, held_out: HeldOut) -> None:
    """Evaluating changes no parameter, creates no gradient and restores the train/eval mode it found."""
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert trainer.model.training
    first = trainer.evaluate(held_out.batches())
    second = trainer.evaluate(held_out.batches())
    assert math.isfinite(first) and first == second
    assert 0 < first < 2 * math.log(trainer.tokenizer.vocab_size)  # an untrained model: ~ln(vocab)
    assert trainer.model.training
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    trainer.model.eval()
    try:
        assert trainer.evaluate(held_out.batches()) == first
        assert not trainer.model.training
    finally:
        trainer.model.train()


def test_evaluate_follows_training(trainer: InnerTrainer, held_out: HeldOut) -> None:
    """A step moves the held-out loss: the evaluator sees the current model, not a cached one."""
    before = trainer.evaluate(held_out.batches())
    trainer.step()
    assert trainer.evaluate(held_out.batches()) != before


# ------------------------------------------------------------------------------------------ best k


def save(ckpt: Checkpointer, step: int) -> None:
    ckpt.save({"site": {"outer_round": step}, "weights": torch.full((4,), float(step))})


def run(best: BestCheckpoints, ckpt: Checkpointer, losses: dict[int, float]) -> None:
    """Outer steps in order: checkpoint, then evaluate (as the node does) with the given loss."""
    for step, loss in losses.items():
        save(ckpt, step)
        got = best.after_step(step, f"lin{step}", lambda loss=loss: loss)
        # the evaluated loss comes back as it was, NaN included (NaN != NaN, so compare by kind)
        assert (math.isnan(got) and math.isnan(loss)) if math.isnan(loss) else got == loss, (step, got, loss)


def kept(run_dir: Path) -> dict[int, float]:
    """Outer step -> loss of every file in best/, checked against the index and the digest."""
    index = json.loads((run_dir / "best" / "best.json").read_text())
    files = sorted(p.name for p in (run_dir / "best").glob("*.pt"))
    assert sorted(e["file"] for e in index) == files  # nothing unlisted, nothing missing
    out = {}
    for entry in index:
        payload = Checkpointer.read(run_dir / "best" / entry["file"])
        assert payload is not None, entry
        assert payload["site"]["outer_round"] == entry["outer_round"]  # the file holds its own step
        assert entry["lineage"] == f"lin{entry['outer_round']}" and entry["wall_time"] > 0
        out[entry["outer_round"]] = entry["loss"]
    return out


def test_keeps_exactly_the_k_lowest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=3), ckpt)
    losses = {1: 5.0, 2: 4.0, 3: 4.5, 4: 3.0, 5: 6.0, 6: 3.5, 7: 4.2, 8: 2.0}
    for step, loss in losses.items():
        run(best, ckpt, {step: loss})
        seen = {s: v for s, v in losses.items() if s <= step}
        assert kept(tmp_path) == dict(sorted(seen.items(), key=lambda kv: kv[1])[:3]), step
    assert kept(tmp_path) == {8: 2.0, 4: 3.0, 6: 3.5}
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == [
        "best.json",
        "step-000004-loss-3.0000-lin4.pt",
        "step-000006-loss-3.5000-lin6.pt",
        "step-000008-loss-2.0000-lin8.pt",
    ]


def test_a_kept_file_survives_checkpoint_rotation(tmp_path: Path) -> None:
    """The hard link keeps the old contents after checkpoint.pt and .prev.pt move on."""
    ckpt = Checkpointer(tmp_path)
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=1), ckpt)
    run(best, ckpt, {1: 1.0, 2: 9.0, 3: 9.0, 4: 9.0})
    (only,) = (tmp_path / "best").glob("*.pt")
    payload = Checkpointer.read(only)
    assert payload is not None and torch.equal(payload["weights"], torch.full((4,), 1.0))
    assert Checkpointer(tmp_path).load()["site"]["outer_round"] == 4  # the node's own checkpoint is untouched


def test_nan_and_inf_are_never_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = Checkpointer(tmp_path)
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=2), ckpt)
    with caplog.at_level(logging.WARNING, logger="greenswarm.node.evaluation"):
        run(best, ckpt, {1: 3.0, 2: float("nan"), 3: float("inf"), 4: float("-inf"), 5: 4.0})
    assert kept(tmp_path) == {1: 3.0, 5: 4.0}
    assert (
        sum("is nan" in r.message or "is inf" in r.message or "is -inf" in r.message for r in caplog.records)
        == 3
    )


def test_evaluates_every_n_rounds(tmp_path: Path) -> None:
    """Due at the first step and the multiples of ``every_rounds`` (sites measure the same global
    models); a catch-up that jumps over one waits for the next, and a resync back is measured."""
    best = BestCheckpoints(EvalConfig(batches=1, every_rounds=3), Checkpointer(tmp_path))
    calls: list[int] = []
    for step in (1, 2, 3, 4, 5, 7, 8, 10, 11, 12, 5, 6):
        best.after_step(step, "x", lambda step=step: calls.append(step) or 1.0)
    assert calls == [1, 3, 12, 5, 6]
    assert not (tmp_path / "best").exists()  # keep_best = 0: evaluation only


def test_slow_measurements_go_further_apart_within_their_share() -> None:
    """``eval.max_share``: the least power of two of ``every_rounds`` at which a measurement of the newest
    length takes at most that share of the outer steps' wall time; at once up, one halving at a time
    down; the wall time per step is per step advanced (a catch-up jumps several)."""
    now = [0.0]
    pace = MeasurePace(every_rounds=1, max_share=0.25, clock=lambda: now[0])
    pace.measured(100.0)  # (no outer steps timed yet: nothing to compare with)
    assert pace.factor == 1
    for t, step in ((0.0, 1), (3.0, 2), (9.0, 4)):  # 3 s per outer step, 4 reached by a catch-up
        now[0] = t
        pace.landed(step)
    # seconds measured -> factor (the share of 3 s is 0.75 s)
    expected = [(0.5, 1), (0.75, 1), (0.76, 2), (5.0, 8), (2.0, 4), (0.1, 2), (0.1, 1), (0.1, 1)]
    for seconds, factor in expected:
        pace.measured(seconds)
        assert pace.factor == factor, (seconds, factor)
    now[0] = 10.0
    pace.landed(2)  # a resync back: the steps are timed anew, and one is too few to time
    pace.measured(100.0)
    assert pace.factor == 1
    slow = MeasurePace(every_rounds=3, max_share=0.5, clock=lambda: now[0])
    for t, step in ((0.0, 3), (3.0, 6)):
        now[0] = t
        slow.landed(step)
    slow.measured(3.0)  # 3 s a measurement, 1.5 s of share per every_rounds (3) steps: twice as far
    assert (slow.factor, slow.stride) == (2, 6)


@pytest.mark.parametrize("every_rounds", [1, 3])
def test_sites_at_different_paces_measure_the_same_global_models(tmp_path: Path, every_rounds: int) -> None:
    """Paced, a site measures the multiples of its stride, also when its factor changes between two,
    so a site measuring every 4th outer step measures models that one measuring every 2nd does too."""
    measured: dict[int, list[int]] = {}
    steps = [*range(1, 10), *range(13, 30)]  # (a catch-up jumps over 10-12)
    for factor in (1, 2, 4):
        best = BestCheckpoints(
            EvalConfig(batches=1, every_rounds=every_rounds), Checkpointer(tmp_path / str(factor))
        )
        calls = measured.setdefault(factor, [])
        for step in steps:
            best.pace.factor = factor if step < 20 else 2  # (from step 20 on, all at every 2nd)
            best.after_step(step, "x", lambda step=step, calls=calls: calls.append(step) or 1.0)
    strides = {factor: every_rounds * factor for factor in measured}
    for factor, calls in measured.items():
        expected = [1] + [
            s for s in steps if s > 1 and s % (strides[factor] if s < 20 else 2 * every_rounds) == 0
        ]
        assert calls == expected, factor
    assert set(measured[4]) <= set(measured[2]) <= set(measured[1])


def test_off_by_default(tmp_path: Path) -> None:
    best = BestCheckpoints(EvalConfig(), Checkpointer(tmp_path))
    assert best.after_step(1, "x", lambda: pytest.fail("evaluated with batches = 0")) is None


def test_a_restart_respects_the_kept_entries(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    run(BestCheckpoints(EvalConfig(batches=1, keep_best=2), ckpt), ckpt, {1: 2.0, 2: 3.0})
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=2), Checkpointer(tmp_path))
    assert [(e.outer_round, e.loss) for e in best.entries] == [(1, 2.0), (2, 3.0)]
    run(best, ckpt, {3: 4.0})  # worse than both: not kept
    assert kept(tmp_path) == {1: 2.0, 2: 3.0}
    run(best, ckpt, {4: 1.0})
    assert kept(tmp_path) == {4: 1.0, 1: 2.0}


@pytest.mark.parametrize(
    "damage",
    [
        b"{ not json",
        b'{"file": "a dict, not a list"}',
        b'[{"file": "step-000001-loss-2.0000-lin1.pt"}]',  # fields missing
        b'[{"file": "../../etc/passwd", "loss": 1, "outer_round": 1, "lineage": "x", "wall_time": 0}]',
        b"",
        None,  # deleted
    ],
)
def test_a_garbled_index_is_rebuilt_from_the_files(
    tmp_path: Path, damage: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(tmp_path)
    run(BestCheckpoints(EvalConfig(batches=1, keep_best=2), ckpt), ckpt, {1: 2.0, 2: 3.0, 3: 5.0})
    index = tmp_path / "best" / "best.json"
    if damage is None:
        index.unlink()
    else:
        index.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="greenswarm.node.evaluation"):
        best = BestCheckpoints(EvalConfig(batches=1, keep_best=2), Checkpointer(tmp_path))
    assert "rebuilding it from the file names" in caplog.text
    assert [(e.outer_round, e.loss, e.lineage) for e in best.entries] == [(1, 2.0, "lin1"), (2, 3.0, "lin2")]
    run(best, ckpt, {4: 2.5})
    assert kept(tmp_path) == {1: 2.0, 4: 2.5}


def test_unlisted_and_missing_files_are_reconciled(tmp_path: Path) -> None:
    """A crash between linking and writing the index, or a file deleted by hand, heals on restart."""
    ckpt = Checkpointer(tmp_path)
    run(BestCheckpoints(EvalConfig(batches=1, keep_best=3), ckpt), ckpt, {1: 2.0, 2: 3.0})
    os.link(
        tmp_path / "best" / "step-000001-loss-2.0000-lin1.pt",
        tmp_path / "best" / "step-000007-loss-1.5000-lin7.pt",
    )
    (tmp_path / "best" / "step-000002-loss-3.0000-lin2.pt").unlink()
    for stale in ("step-000009-loss-1.0000-lin9.pt.tmp", "best.json.tmp"):  # half-made by a crash
        (tmp_path / "best" / stale).write_bytes(b"half")
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=3), Checkpointer(tmp_path))
    assert [(e.outer_round, e.loss) for e in best.entries] == [(7, 1.5), (1, 2.0)]
    assert best.last_round == 7
    assert not list((tmp_path / "best").glob("*.tmp"))


def test_copies_when_hard_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*_args: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    ckpt = Checkpointer(tmp_path)
    run(BestCheckpoints(EvalConfig(batches=1, keep_best=2), ckpt), ckpt, {1: 2.0, 2: 1.0, 3: 3.0})
    assert kept(tmp_path) == {2: 1.0, 1: 2.0}
    assert all(p.stat().st_nlink == 1 for p in (tmp_path / "best").glob("*.pt"))


def test_a_disk_error_while_keeping_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "link", full)
    monkeypatch.setattr("shutil.copyfile", full)
    ckpt = Checkpointer(tmp_path)
    best = BestCheckpoints(EvalConfig(batches=1, keep_best=2), ckpt)
    save(ckpt, 1)
    with caplog.at_level(logging.WARNING, logger="greenswarm.node.evaluation"):
        assert best.after_step(1, "lin1", lambda: 2.0) == 2.0
    assert "No space left on device" in caplog.text


def test_damaged_best_file_fails_verification(tmp_path: Path) -> None:
    """A kept file is checked like any checkpoint: damage is caught, not loaded."""
    ckpt = Checkpointer(tmp_path)
    run(BestCheckpoints(EvalConfig(batches=1, keep_best=1), ckpt), ckpt, {1: 2.0, 2: 3.0})
    (path,) = (tmp_path / "best").glob("*.pt")
    path.unlink()  # break the hard link first: damaging the shared inode would damage checkpoint.prev.pt too
    data = (tmp_path / "checkpoint.prev.pt").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert Checkpointer.read(path) is None


# ------------------------------------------------------------------------------------------ config


def site(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text("name: s\nregion: DE\n" + text)
    return path


def test_eval_defaults(tmp_path: Path) -> None:
    cfg = load_site_config(site(tmp_path, ""))
    assert cfg.eval == EvalConfig(
        batches=0, shard_index=-1, num_shards=0, batch_size=8, every_rounds=1, keep_best=0
    )


def test_keep_best_needs_batches(tmp_path: Path) -> None:
    path = site(tmp_path, "eval:\n  keep_best: 3\n")
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert str(info.value).startswith(f"{path}:4: eval.keep_best: ")
    assert "batches > 0" in str(info.value)


def test_held_out_shard_must_not_be_the_training_shard(tmp_path: Path) -> None:
    text = "data:\n  num_shards: 4\n  shard_index: 1\neval:\n  batches: 2\n  shard_index: 1\n"
    path = site(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert str(info.value).startswith(f"{path}:8: eval.shard_index: held-out shard 1 of 4 shares documents")


@pytest.mark.parametrize(
    ("snippet", "field", "expected"),
    [
        ("eval:\n  batches: 2\n", "eval.shard_index", "data.num_shards is 1"),  # trains on everything
        (
            "data:\n  num_shards: 3\n  shard_index: 2\neval:\n  batches: 2\n",
            "eval.shard_index",
            "shard 2 of 3",
        ),
        ("data:\n  num_shards: 3\neval:\n  batches: 2\n  num_shards: 4\n", "eval.num_shards", "shard 3 of 4"),
        (
            "data:\n  num_shards: 3\neval:\n  batches: 2\n  shard_index: 3\n",
            "eval.shard_index",
            "[0, data.num",
        ),
        ("eval:\n  num_shards: 2\n  shard_index: 2\n", "eval.shard_index", "must be in [0, num_shards=2)"),
        ("eval:\n  shard_index: -2\n", "eval.shard_index", "must be >= 0 (or -1: the last shard)"),
        ("eval:\n  every_rounds: 0\n", "eval.every_rounds", "must be >= 1"),
        ("eval:\n  batches: -1\n", "eval.batches", "must be >= 0"),
    ],
)
def test_eval_config_errors_name_the_field(tmp_path: Path, snippet: str, field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_site_config(site(tmp_path, snippet))
    assert f": {field}: " in str(info.value) and expected in str(info.value), str(info.value)


def test_a_spare_shard_is_a_valid_held_out_set(tmp_path: Path) -> None:
    """Three sites on shards 0-2 of 4: the default held-out shard is 3, which nobody trains on."""
    cfg = load_site_config(site(tmp_path, "data:\n  num_shards: 4\neval:\n  batches: 4\n  keep_best: 2\n"))
    held = cfg.eval.held_out(cfg.data)
    assert (held.shard_index, held.num_shards, held.source, held.seq_len) == (3, 4, "stdlib", 128)
    # finer held-out layouts are fine when they miss this site's documents: odd documents vs shard 0 of 4
    load_site_config(
        site(tmp_path, "data:\n  num_shards: 4\neval:\n  batches: 4\n  shard_index: 1\n  num_shards: 2\n")
    )


def test_shards_overlap_matches_brute_force() -> None:
    for m in range(1, 7):
        for n in range(1, 7):
            for h in range(m):
                for s in range(n):
                    brute = any(i % m == h and i % n == s for i in range(m * n))
                    assert shards_overlap(h, m, s, n) == brute, (h, m, s, n)
