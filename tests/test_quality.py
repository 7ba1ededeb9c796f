"""The global model's held-out loss (issue #23): measured on its own bits, beside training, the same
number wherever the same model is held, and published in the record, the table, the summary and the
demo's report. The real-process check (sites of one digest report one loss) is in test_demo.py."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch

from greenswarm.demo import DemoOptions, plan_sites, swarm_quality
from greenswarm.demo_view import quality_line
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.node.config import TrainConfig, load_site_config
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.evaluation import EvalConfig, HeldOut
from greenswarm.node.global_eval import EVALS_FILE, GlobalEvaluator, Snapshot
from greenswarm.node.model import ModelConfig
from greenswarm.node.progress import ProgressRecord
from greenswarm.node.progress_view import progress_table
from greenswarm.node.trainer import InnerTrainer

pytestmark = pytest.mark.quality

EVAL = EvalConfig(batches=2, batch_size=2)


@pytest.fixture(scope="module")
def trainer() -> InnerTrainer:
    data = DataConfig(seq_len=32, shard_index=0, num_shards=2)
    return InnerTrainer(
        ModelConfig(), data, TrainConfig(batch_size=2, micro_batch_size=2, threads=1), World()
    )


def _evaluator(trainer: InnerTrainer, run_dir: Path | None = None, **cfg: object) -> GlobalEvaluator:
    eval_cfg = EvalConfig(batches=2, batch_size=2, **cfg)  # type: ignore[arg-type]
    return GlobalEvaluator(
        eval_cfg,
        ModelConfig(),
        HeldOut(eval_cfg, trainer.batches.cfg, trainer.tokenizer),
        trainer.tokenizer.vocab_size,
        numel=sum(s.numel() for s in trainer.shapes),
        device="cpu",
        run_dir=run_dir,
    )


def _snapshot(flat: torch.Tensor, outer_round: int = 1, digest: str = "d") -> Snapshot:
    return Snapshot(flat.clone(), outer_round, "L", digest, tokens=100, clock_time=0.0)


def test_one_model_gives_one_loss_wherever_it_is_measured(trainer: InnerTrainer, tmp_path: Path) -> None:
    """Two evaluators (two sites), one in the background and one in the loop, measure the same bits to the
    same float; the training model is untouched, and another model gives another loss."""
    flat = trainer.full_parameters()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    here = _evaluator(trainer, tmp_path, background=False)
    there = _evaluator(trainer, background=True)
    try:
        measured = here.submit(_snapshot(flat), here=True)
        assert there.submit(_snapshot(flat)) is None  # beside training: nothing yet
        assert there.drain(timeout=60)
        (beside,) = there.finished()
        assert measured is not None and beside.loss == measured.loss  # bit for bit
        assert here.finished() == [measured]
        assert math.isfinite(measured.loss) and measured.held_out_tokens == 2 * 2 * 32
        assert measured.perplexity == pytest.approx(math.exp(measured.loss))
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
        trainer.step()
        moved = here.submit(_snapshot(trainer.full_parameters(), outer_round=2, digest="e"), here=True)
        assert moved is not None and moved.loss != measured.loss
        lines = (tmp_path / EVALS_FILE).read_text().splitlines()
        assert len(lines) == 2 and '"digest": "e"' in lines[1]
    finally:
        here.close()
        there.close()


def test_only_the_model_part_of_a_schedule_free_state_is_measured(trainer: InnerTrainer) -> None:
    """An ``x+z`` global vector: the model is x, its first part; whatever z holds changes nothing."""
    flat = trainer.full_parameters()
    evaluator = _evaluator(trainer, background=False)
    plain = evaluator.loss_of(flat)
    assert evaluator.loss_of(torch.cat([flat, torch.randn_like(flat)])) == plain
    with pytest.raises(ValueError, match="fewer than the model"):
        evaluator.loss_of(flat[:-1])


def test_a_slow_evaluation_measures_the_newest_state_and_a_failure_is_said(
    trainer: InnerTrainer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one measurement runs, newer states replace each other: only the newest is measured next.
    A measurement that fails is logged, and the next state is measured all the same."""
    evaluator = _evaluator(trainer, background=True)
    flat = trainer.full_parameters()
    entered, gate, real = threading.Event(), threading.Event(), evaluator.loss_of

    def slow(values: torch.Tensor) -> tuple[float, int]:
        entered.set()
        gate.wait(30)
        if values[0].item() == 123.0:
            raise RuntimeError("out of memory")
        return real(values)

    monkeypatch.setattr(evaluator, "loss_of", slow)
    try:
        evaluator.submit(_snapshot(flat, outer_round=1))
        assert entered.wait(30)
        for step in (2, 3, 4):  # while step 1 waits at the gate
            evaluator.submit(_snapshot(flat, outer_round=step))
        gate.set()
        assert evaluator.drain(timeout=60)
        assert [e.outer_round for e in evaluator.finished()] == [1, 4]
        broken = flat.clone()
        broken[0] = 123.0
        with caplog.at_level(logging.WARNING):
            evaluator.submit(_snapshot(broken, outer_round=5))
            assert evaluator.drain(timeout=60)
        assert "held-out evaluation of outer step 5 failed: out of memory" in caplog.text
        assert not evaluator.measured((5, "L", "d"))  # a failed one is not measured: the end tries again
        evaluator.submit(_snapshot(flat, outer_round=6))
        assert evaluator.drain(timeout=60)
        assert [e.outer_round for e in evaluator.finished()] == [6]
    finally:
        evaluator.close()


def test_the_record_and_the_table_carry_the_held_out_loss() -> None:
    """The signed record's schema takes the new fields; ``greenswarm progress`` shows a column for them
    (only when some site measures one)."""
    from greenswarm.node.progress_schema import RecordModel

    base = dict(
        site="a", region="R", state="FEDERATED", peer_id="p", outer_round=12, lineage="L", round_index=3,
        local_steps=5, tokens=640, loss=2.5, window_end=None, energy_kwh=1.0, emissions_g=2.0,
        clock_time=0.0, wall_time=0.0,
    )  # fmt: skip
    measured = ProgressRecord(**base, eval_loss=2.3141, eval_round=12, eval_digest="abc")
    RecordModel.parse_obj(measured.to_wire())
    with pytest.raises(Exception, match="eval_round"):
        RecordModel.parse_obj({**measured.to_wire(), "eval_round": -1})
    assert ProgressRecord.from_wire(measured.to_wire()) == measured
    from rich.console import Console

    def shown(records: list[ProgressRecord]) -> str:
        console = Console(width=250, record=True)
        console.print(progress_table(records))
        return console.export_text()

    assert "held-out" in shown([measured, ProgressRecord(**base)]) and "2.314 @12" in shown([measured])
    assert "held-out" not in shown([ProgressRecord(**base)])


def test_the_demo_report_names_the_swarm_model_its_loss_and_its_tokens() -> None:
    def site(name: str, outer: int, digest: str, loss: float, pending: int = 0) -> dict:
        return {
            "site": name, "eval_loss": loss, "eval_round": outer, "eval_digest": digest,
            "eval_perplexity": math.exp(loss), "eval_tokens": 8192, "tokens_since_sync": pending,
        }  # fmt: skip

    totals = {"tokens": 300_000, "emissions_g": 1234.0}
    sites = [site("a", 7, "old", 3.0), site("b", 9, "new", 2.5, 1024), site("c", 9, "new", 2.5)]
    quality = swarm_quality(sites, totals)
    assert quality is not None
    assert (quality["outer_round"], quality["digest"], quality["sites"]) == (9, "new", ["b", "c"])
    assert quality["identical"] and quality["tokens_not_averaged"] == 1024
    line = quality_line(quality)
    for text in (
        "held-out loss 2.5000", "perplexity 12.18", "8,192 held-out tokens", "300,000 training tokens",
        "1,024 of them", "1,234 g CO2", "held by b, c: the same loss at each",
    ):  # fmt: skip
        assert text in line, (text, line)
    assert swarm_quality([{"site": "a", "eval_loss": None}], totals) is None
    assert "not evaluated" in quality_line(None)
    # the demo's --set is for what every site shares; what it sets per site is refused before anything starts
    for override in ("name=x", "node.run_dir=/tmp/x", "swarm.name=other", "scheduler.clock.speedup=2"):
        with pytest.raises(GreenswarmError, match="the demo sets"):
            plan_sites(DemoOptions(overrides=[override]))


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("eval:\n  device: cuda\n", "eval.device: must be 'auto' (where rank 0 trains) or 'cpu'"),
        ("eval:\n  background: maybe\n", "eval.background"),
        ("eval:\n  max_share: 0\n", "eval.max_share: must be in (0, 1]"),
        ("eval:\n  max_share: 1.5\n", "eval.max_share: must be in (0, 1]"),
    ],
)
def test_eval_settings_are_checked_at_load(tmp_path: Path, snippet: str, expected: str) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("name: s\nregion: R\n" + snippet)
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    assert expected in str(info.value) and str(path) in str(info.value), str(info.value)
