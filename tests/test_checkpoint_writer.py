"""Checkpoints written beside training: what the loop hands over is what lands on disk, in order, and a
failed write is never swallowed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.checkpoint_writer import BackgroundWriter, snapshot
from greenswarm.node.config import TrainConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig
from greenswarm.node.trainer import InnerTrainer


class GatedCheckpointer(Checkpointer):
    """Writes only when the test opens the gate: a slow disk, under the test's control."""

    def __init__(self, directory: Path, fail_on: int | None = None):
        super().__init__(directory)
        self.gate = threading.Event()
        self.saved: list[int] = []
        self.fail_on = fail_on

    def save(self, payload: dict[str, Any]) -> Path:
        assert self.gate.wait(10), "the test never opened the gate"
        if payload["n"] == self.fail_on:
            raise OSError(28, "No space left on device")
        path = super().save(payload)
        self.saved.append(payload["n"])
        return path


def test_snapshots_are_written_in_order_and_what_follows_sees_each_file(tmp_path: Path) -> None:
    checkpointer = GatedCheckpointer(tmp_path)
    writer = BackgroundWriter(checkpointer)
    seen: list[int] = []
    for n in range(3):
        if n == 2:
            checkpointer.gate.set()
        writer.submit(
            {"n": n, "t": torch.full((4,), float(n))}, lambda: seen.append(checkpointer.load()["n"])
        )
    writer.flush()
    assert checkpointer.saved == [0, 1, 2] and seen == [0, 1, 2]
    assert torch.equal(Checkpointer(tmp_path).load()["t"], torch.full((4,), 2.0))
    writer.close()


def test_a_third_snapshot_waits_while_one_is_written_and_another_waits(tmp_path: Path) -> None:
    checkpointer = GatedCheckpointer(tmp_path)
    writer = BackgroundWriter(checkpointer)
    writer.submit({"n": 0})  # taken up by the writer, which waits at the gate
    writer.submit({"n": 1})  # waits
    third = threading.Thread(target=writer.submit, args=({"n": 2},))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # no third copy of the state while two are held
    checkpointer.gate.set()
    third.join(10)
    writer.close()
    assert checkpointer.saved == [0, 1, 2]


def test_a_failed_write_is_raised_on_the_loops_thread_and_the_writer_goes_on(tmp_path: Path) -> None:
    checkpointer = GatedCheckpointer(tmp_path, fail_on=1)
    checkpointer.gate.set()
    writer = BackgroundWriter(checkpointer)
    writer.submit({"n": 0})
    writer.submit({"n": 1})
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    writer.submit({"n": 2})  # raised once; the next write goes through
    writer.close()
    assert checkpointer.saved == [0, 2]


def test_snapshot_copies_every_tensor_and_keeps_plain_values() -> None:
    live = torch.zeros(3)
    payload = {"a": [live, (live, 1)], "b": "x"}
    copy = snapshot(payload)
    live += 1
    assert torch.equal(copy["a"][0], torch.zeros(3)) and torch.equal(copy["a"][1][0], torch.zeros(3))
    assert copy["a"][1][1] == 1 and copy["b"] == "x" and isinstance(copy["a"][1], tuple)


def test_an_owned_trainer_state_does_not_move_with_later_steps() -> None:
    """``own=True`` is what a background checkpoint takes: later steps change neither the model's nor
    the optimizer's tensors in it, while a plain state dict of a single-process site is its live state."""
    data = DataConfig(seq_len=16, shard_index=0, num_shards=1)
    trainer = InnerTrainer(
        ModelConfig(), data, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World()
    )
    trainer.step()
    owned, live = trainer.state_dict(own=True), trainer.state_dict()
    frozen = snapshot(owned)
    trainer.step()
    name = next(iter(owned["model"]))
    assert torch.equal(owned["model"][name], frozen["model"][name])
    assert not torch.equal(live["model"][name], frozen["model"][name])
    for key, state in owned["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, frozen["optimizer"]["state"][key][field]), (key, field)


def test_a_site_takes_no_third_snapshot_while_two_are_held(tmp_path: Path) -> None:
    """SiteCheckpoints waits for the writer's slot *before* it copies the state: with one snapshot
    being written and one waiting, the next outer step's checkpoint takes no copy until one is gone."""
    from greenswarm.faults import FaultPlan
    from greenswarm.node.config import load_site_config
    from greenswarm.node.site_checkpoints import SiteCheckpoints
    from greenswarm.node.site_stats import SiteStats
    from greenswarm.node.state_sync import StateSync
    from tests.test_rounds import N, _Ledger, _SavingRanks, global_state

    class CountingRanks(_SavingRanks):
        taken = 0

        def save(self, own: bool = False) -> dict[str, Any]:
            CountingRanks.taken += 1
            return super().save(own)

    cfg = load_site_config(None, ["name=me", "region=CAISO_NORTH", f"node.run_dir={tmp_path}"])
    state, ranks = global_state(1.0), CountingRanks(torch.zeros(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 0.3)
    site = SiteCheckpoints(cfg, FaultPlan(), ranks, state, sync, SiteStats(), _Ledger(), background=True)
    gate = threading.Event()
    save = site.checkpointer.save
    site.checkpointer.save = lambda payload: gate.wait(10) and save(payload)  # a slow disk
    site.after_step(lambda: 0.0)  # being written
    site.after_step(lambda: 0.0)  # waiting
    third = threading.Thread(target=site.after_step, args=(lambda: 0.0,))
    third.start()
    third.join(0.5)
    assert third.is_alive() and CountingRanks.taken == 2
    gate.set()
    third.join(10)
    site.close()
    assert CountingRanks.taken == 3 and Checkpointer(tmp_path).load() is not None


def _counting_ranks(local: torch.Tensor) -> Any:
    """test_rounds.py's saving ranks, counting the states taken (each one a model-sized copy)."""
    from tests.test_rounds import _SavingRanks

    class CountingRanks(_SavingRanks):
        taken = 0

        def save(self, own: bool = False) -> dict[str, Any]:
            self.taken += 1
            return super().save(own)

    return CountingRanks(local)


def _cadenced_site(tmp_path: Path, background: bool, *sets: str) -> tuple[Any, Any, Any]:
    """A SiteCheckpoints writing at most once an hour, its ranks and its global state."""
    from greenswarm.faults import FaultPlan
    from greenswarm.node.config import load_site_config
    from greenswarm.node.site_checkpoints import SiteCheckpoints
    from greenswarm.node.site_stats import SiteStats
    from greenswarm.node.state_sync import StateSync
    from tests.test_rounds import N, _Ledger, global_state

    base = ["name=me", "region=CAISO_NORTH", f"node.run_dir={tmp_path}", "node.checkpoint_every_s=3600"]
    cfg = load_site_config(None, [*base, *sets])
    state, ranks = global_state(1.0), _counting_ranks(torch.zeros(N))
    sync = StateSync(state, ranks, lambda peers: None, threading.Event(), 0.3)
    site = SiteCheckpoints(cfg, FaultPlan(), ranks, state, sync, SiteStats(), _Ledger(), background)
    return site, ranks, state


def _step(site: Any, state: Any, slot: int, loss: float = 0.0) -> None:
    from tests.test_rounds import ME, N

    state.apply(torch.full((N,), 0.1), slot, [ME])
    site.after_step(lambda: loss)
    if site.writer is not None:
        site.writer.flush()


def _written_step(tmp_path: Path) -> int:
    return Checkpointer(tmp_path).load()["site"]["outer_round"]


@pytest.mark.parametrize("background", [False, True])
def test_checkpoint_every_s_skips_outer_steps_but_not_a_stop_or_a_kept_global(
    tmp_path: Path, background: bool
) -> None:
    """``node.checkpoint_every_s``: the first outer step's checkpoint is written, the next ones within
    the interval are not (the state is not even copied), ``keep_globals`` still keeps every global
    model, going IDLE writes the skipped state, and so does a stop."""
    site, ranks, state = _cadenced_site(tmp_path, background, "node.keep_globals=10")
    for slot in range(3):
        _step(site, state, slot)
    assert ranks.taken == 1 and _written_step(tmp_path) == 1
    assert len(list((tmp_path / "globals").glob("outer-*.pt"))) == 3
    site.save_if_behind()  # the node goes IDLE
    assert ranks.taken == 2 and _written_step(tmp_path) == 3
    site.save_if_behind()  # nothing new since
    assert ranks.taken == 2
    _step(site, state, 3)
    site.save()  # a stop
    site.close()
    assert ranks.taken == 3 and _written_step(tmp_path) == 4


@pytest.mark.parametrize("background", [False, True])
def test_checkpoint_every_s_writes_a_step_kept_among_the_best_and_no_other(
    tmp_path: Path, background: bool
) -> None:
    """A step whose held-out loss makes the best k is written (its kept file is that step's), one that
    does not make it is skipped like any other within the interval."""
    sets = ("eval.batches=1", "eval.keep_best=2", "data.num_shards=2")
    site, ranks, state = _cadenced_site(tmp_path, background, *sets)
    for slot, loss in enumerate((3.0, 2.0, 2.5, 4.0)):  # kept, kept, kept (drops 3.0), not kept
        _step(site, state, slot, loss)
    site.close()
    assert ranks.taken == 3 and _written_step(tmp_path) == 3
    kept = sorted(Checkpointer.read(f)["site"]["outer_round"] for f in (tmp_path / "best").glob("*.pt"))
    assert kept == [2, 3]


def test_a_restarted_site_writes_its_first_outer_step_whatever_the_cadence(tmp_path: Path) -> None:
    """The checkpoint a site resumed from may be nearly an interval old: the first step after a restart
    is written (a crash loop must not retrain the same data again and again)."""
    site, ranks, state = _cadenced_site(tmp_path, False)
    _step(site, state, 0)
    _step(site, state, 1)
    assert ranks.taken == 1
    again, ranks2, state2 = _cadenced_site(tmp_path, False)
    assert again.resume() and state2.outer_round == 1
    _step(again, state2, 5)
    assert ranks2.taken == 1 and _written_step(tmp_path) == 2


@pytest.mark.parametrize(("schedule", "warmup"), [("constant", 20), ("cosine", 2)], ids=["warm-up", "decay"])
def test_a_trainer_restored_mid_warm_up_is_the_trainer_saved(
    tmp_path: Path, schedule: str, warmup: int
) -> None:
    """A release while the learning rate still warms up (or decays): the restored trainer's state is
    the saved one, its digest included, and its next step is the step the saved trainer takes. (Its
    groups held the configured peak instead of the rate the last step used, so a `small` site's
    restarts, released 11-18 steps into a 20-step warm-up, all said "not the state released".)"""
    from greenswarm.digests import content_digest

    data = DataConfig(seq_len=16, shard_index=0, num_shards=1)
    cfg = TrainConfig(batch_size=2, micro_batch_size=2, threads=1, warmup_steps=warmup,
                      schedule=schedule, total_steps=40)  # fmt: skip

    def trainer() -> InnerTrainer:
        return InnerTrainer(ModelConfig(), data, cfg, World())

    saved = trainer()
    for _ in range(3):
        saved.step()
    path = tmp_path / "state.pt"
    torch.save(saved.state_dict(), path)
    restored = trainer()
    restored.load_state_dict(torch.load(path, weights_only=False))
    assert content_digest(restored.state_dict()) == content_digest(saved.state_dict())
    assert restored.step().loss == saved.step().loss
    assert content_digest(restored.state_dict()) == content_digest(saved.state_dict())
