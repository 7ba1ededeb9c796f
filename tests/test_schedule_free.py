"""Schedule-free inner optimization (``train.optimizer: adamw-schedulefree``): the optimizer against the
reference package, the flat vector a swarm averages (``x``, and ``z`` by ``train.sf_z``), evaluation
and checkpoints at the right sequence, an exact resume, the cosine schedule it is compared with, and
the config and identity checks. In-process; ``tests/test_schedule_free_swarm.py`` runs it sharded
under torchrun and in a swarm of real processes.
"""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import pytest
import torch

from greenswarm.errors import ConfigError
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.config import TrainConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.distributed import World
from greenswarm.node.model import ModelConfig, ModelIdentity, causal_lm_loss
from greenswarm.node.schedule_free import ScheduleFreeAdamW
from greenswarm.node.trainer import InnerTrainer

pytestmark = pytest.mark.schedulefree


def trainer(**train: object) -> InnerTrainer:
    cfg = TrainConfig(
        batch_size=4, micro_batch_size=4, threads=1, optimizer="adamw-schedulefree", warmup_steps=3
    )
    for key, value in train.items():
        setattr(cfg, key, value)
    cfg.validate()
    return InnerTrainer(
        ModelConfig(preset="tiny"), DataConfig(source="stdlib"), cfg, World.from_environment("cpu")
    )


def digest(t: InnerTrainer) -> str:
    """Every bit of a schedule-free trainer's state: y (the parameters), x, z, both Adam moments, the
    step count and the average's weights."""
    h = hashlib.sha256()
    opt = t.schedule_free
    assert opt is not None
    for p in t.model.parameters():
        h.update(p.detach().numpy().tobytes())
        for key in sorted(opt.state[p]):
            h.update(opt.state[p][key].numpy().tobytes())
    group = opt.param_groups[0]
    h.update(repr((group["k"], group["weight_sum"], group["lr_max"], t.steps)).encode())
    return h.hexdigest()


def test_it_takes_the_reference_packages_steps() -> None:
    """The same steps as ``schedulefree.AdamWScheduleFree`` 1.4.1 (float rounding apart), at y in
    training and at x after ``eval()``: the three sequences are only stored differently."""
    schedulefree = pytest.importorskip("schedulefree")
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    theirs = copy.deepcopy(ours)
    reference = schedulefree.AdamWScheduleFree(
        theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=5, foreach=False
    )
    optimizer = ScheduleFreeAdamW(
        ours.parameters(), lr=1e-2, beta=0.9, beta2=0.95, weight_decay=0.1, warmup_steps=5
    )
    reference.train()
    for _ in range(60):
        inputs = torch.randn(32, 8)
        target = inputs.sum(1, keepdim=True)
        for model, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), target).backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # y
    reference.eval()
    for x, b in zip(optimizer.sequences("x"), theirs.parameters(), strict=True):
        torch.testing.assert_close(x, b, rtol=1e-5, atol=1e-6)  # x


def test_inner_momentum_is_schedule_free_plus_first_moment() -> None:
    """``momentum`` > 0 (ScheduleFree+): the z step follows a bias-corrected first moment; at the
    first step it equals the plain step (the corrected moment is the gradient)."""
    torch.manual_seed(1)
    base = torch.nn.Linear(4, 1)
    plain, with_momentum = copy.deepcopy(base), copy.deepcopy(base)
    opts = [
        ScheduleFreeAdamW(plain.parameters(), lr=1e-2),
        ScheduleFreeAdamW(with_momentum.parameters(), lr=1e-2, momentum=0.9),
    ]
    inputs = [torch.randn(8, 4) for _ in range(3)]
    for step, batch in enumerate(inputs):
        for model, opt in zip((plain, with_momentum), opts, strict=True):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
        same = all(
            torch.equal(a, b) for a, b in zip(plain.parameters(), with_momentum.parameters(), strict=True)
        )
        assert same == (step == 0), step
    assert "exp_avg" in opts[1].state[next(with_momentum.parameters())]


def test_evaluation_sees_x_and_changes_no_bit() -> None:
    """The held-out loss is the model's at x (the average, what is exported), not at y where gradients
    are taken; evaluating leaves every bit of the state as it was, so training goes on exactly."""
    t = trainer()
    for _ in range(6):
        t.step()
    batches = [next(t._iterator) for _ in range(2)]
    before = digest(t)
    loss = t.evaluate(batches)
    assert digest(t) == before
    # the same loss from a plain copy of the model holding x, summed as evaluate sums it
    at_x = copy.deepcopy(t.model).eval()
    torch.nn.utils.vector_to_parameters(
        torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")]), at_x.parameters()
    )
    with torch.no_grad():
        total = torch.zeros(())
        for batch in batches:
            total += causal_lm_loss(at_x, batch)
    assert float(total) / len(batches) == loss
    y = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    x = torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")])
    assert not torch.equal(x, y)  # (the two really differ after a few steps)


@pytest.mark.parametrize("sf_z", ["average", "shift", "reset"])
def test_the_flat_vector_moves_x_and_z_as_sf_z_says(sf_z: str) -> None:
    """What a round gathers and loads: ``average`` -- x then z (twice the model), each set from the
    vector; ``shift`` -- x, and z keeps its lead over x; ``reset`` -- x, and z set to it. Adding (an
    overlapped round's rebase) moves both alike. The parameters are y = lerp(z, x, beta) after each."""
    t = trainer(sf_z=sf_z)
    for _ in range(4):
        t.step()
    n = t.num_parameters
    x0 = torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")])
    z0 = torch.cat([z.reshape(-1) for z in t.schedule_free.sequences("z")])
    flat = t.full_parameters()
    assert flat.numel() == (2 * n if sf_z == "average" else n)
    assert torch.equal(flat[:n], x0)
    target = flat + 0.01

    t.load_full_parameters(target)
    x1 = torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")])
    z1 = torch.cat([z.reshape(-1) for z in t.schedule_free.sequences("z")])
    assert torch.equal(x1, target[:n])
    expected_z = {"average": target[n:], "shift": z0 - x0 + target[:n], "reset": target[:n]}[sf_z]
    torch.testing.assert_close(z1, expected_z, rtol=0, atol=1e-6)
    if sf_z != "shift":
        assert torch.equal(z1, expected_z)
    y = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    assert torch.equal(y, torch.lerp(z1, x1, 0.9))
    assert torch.equal(t.full_parameters(), target)  # what was loaded is what a round gathers again

    shift = torch.full_like(target, 0.5)
    shift[n:] = 0.25  # (average: z's half of the vector moves z)
    t.load_full_parameters(shift, add=True)
    x2 = torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")])
    z2 = torch.cat([z.reshape(-1) for z in t.schedule_free.sequences("z")])
    assert torch.equal(x2, x1 + 0.5) and torch.equal(z2, z1 + (0.25 if sf_z == "average" else 0.5))
    y = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    assert torch.equal(y, torch.lerp(z2, x2, 0.9))


def test_a_restarted_site_resumes_the_schedule_free_state_exactly(tmp_path: Path) -> None:
    """Killed after a checkpoint and restarted, a site holds the very state it saved (x, z, y, the
    second moment, the step count and the average's weights: digest-equal), and its next steps are the
    ones it would have taken: the checkpoint's model is x, and y is recomputed from x and z."""
    t = trainer()
    for _ in range(7):
        t.step()
    saved = digest(t)
    checkpointer = Checkpointer(tmp_path)
    state = t.state_dict(own=True)
    checkpointer.save({"trainer": state})
    x = torch.cat([x.reshape(-1) for x in t.schedule_free.sequences("x")])
    assert torch.equal(torch.cat([state["model"][name].reshape(-1) for name in t.names]), x)  # the model is x
    assert "x" not in next(iter(state["optimizer"]["state"].values()))  # (x is stored once)

    restarted = trainer()
    restarted.load_state_dict(checkpointer.load()["trainer"])
    assert digest(restarted) == saved
    assert [t.step().loss for _ in range(4)] == [restarted.step().loss for _ in range(4)]
    assert digest(restarted) == digest(t)


def test_a_tied_head_is_stored_as_its_embeddings_x() -> None:
    """The tiny model ties its head to the embeddings: both names must hold x in the checkpoint, or
    loading the head's name last would overwrite the restored x with y."""
    t = trainer()
    for _ in range(3):
        t.step()
    state = t.state_dict()
    aliases = t._aliases()
    assert aliases, "the tiny model no longer ties its head: this test checks nothing"
    x_of = dict(zip(t.names, t.schedule_free.sequences("x"), strict=True))
    for alias, owner in aliases.items():
        assert torch.equal(state["model"][alias], x_of[owner]) and torch.equal(
            state["model"][owner], x_of[owner]
        )


def test_cosine_decays_from_warmup_to_the_floor_and_holds_there() -> None:
    """AdamW's cosine: linear warm-up, the peak right after it, half-way at the middle, the floor at
    ``total_steps`` and held beyond (the run the schedule guessed too short for)."""
    cfg = TrainConfig(
        lr=1e-3, warmup_steps=10, schedule="cosine", total_steps=110, min_lr_ratio=0.1, threads=1
    )
    cfg.validate()
    t = InnerTrainer(
        ModelConfig(preset="tiny"), DataConfig(source="stdlib"), cfg, World.from_environment("cpu")
    )

    def lr_at(step: int) -> float:
        t.steps = step - 1
        return t._lr()

    assert lr_at(5) == pytest.approx(5e-4)
    assert lr_at(10) == pytest.approx(1e-3)
    assert lr_at(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(110) == pytest.approx(1e-4)
    assert lr_at(500) == pytest.approx(1e-4)
    constant = TrainConfig(lr=1e-3, warmup_steps=10, threads=1)
    t.cfg = constant
    assert lr_at(500) == 1e-3


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"optimizer": "sgd"}, "optimizer", "must be one of adamw, adamw-schedulefree"),
        (
            {"optimizer": "adamw-schedulefree", "schedule": "cosine", "total_steps": 100},
            "schedule",
            "takes no schedule",
        ),
        ({"schedule": "cosine"}, "total_steps", "needs total_steps > warmup_steps"),
        ({"sf_beta": 1.0}, "sf_beta", "must be in (0, 1)"),
        ({"sf_momentum": -0.1}, "sf_momentum", "must be in [0, 1)"),
        ({"sf_z": "mean"}, "sf_z", "must be one of average, shift, reset"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio", "must be in [0, 1]"),
    ],
)
def test_bad_optimizer_settings_name_the_field(fields: dict, field: str, words: str) -> None:
    cfg = TrainConfig(**fields)
    with pytest.raises(ConfigError) as caught:
        cfg.validate()
    assert caught.value.field == field and words in str(caught.value)


def test_sites_whose_global_states_differ_never_meet() -> None:
    """What a site's global state holds is part of its model identity: an AdamW site, a schedule-free
    site that averages z and one that does not key their groups apart, and a refusal names the
    optimizer; an AdamW site's identity is on the wire as it always was."""
    adamw = InnerTrainer(
        ModelConfig(preset="tiny"),
        DataConfig(source="stdlib"),
        TrainConfig(threads=1),
        World.from_environment("cpu"),
    )
    averaging, shifting = trainer(sf_z="average").identity, trainer(sf_z="shift").identity
    assert len({adamw.identity.key, averaging.key, shifting.key}) == 3
    assert not averaging.same_model(adamw.identity) and not averaging.same_model(shifting)
    assert averaging.differences(adamw.identity) == [
        "inner optimizer's global state (train.optimizer, train.sf_z)"
    ]
    assert len(adamw.identity.to_wire().split("|")) == 6
    for identity in (adamw.identity, averaging, shifting):
        assert ModelIdentity.from_wire(identity.to_wire()) == identity


def test_export_takes_x_from_a_global_state_of_x_and_z(tmp_path: Path) -> None:
    """A swarm that averages z keeps x then z in its global state; export writes x."""
    from greenswarm.node.export import describe_model, export_run

    t = trainer()
    for _ in range(3):
        t.step()
    run = tmp_path / "run"
    describe_model(run, t.model, t.names, t.shapes, ModelConfig(preset="tiny"), t.identity)
    flat = t.full_parameters()
    Checkpointer(run).save({"outer": [flat, torch.zeros_like(flat)], "site": {"outer_round": 3}})
    export_run(run, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    exported = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(exported, flat[: t.num_parameters])
    assert math.isfinite(float(exported.sum()))


def test_the_benchmark_runs_a_cosine_and_a_schedule_free_swarm_over_the_trace() -> None:
    """``benchmarks/schedule_free.py`` on a few rounds: both runs train the same tokens (the windows,
    not the optimizer, decide them), a cosine's length is what each site will train, and the curve
    starts at the untrained model."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sf_bench", Path(__file__).parents[1] / "benchmarks" / "schedule_free.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(
        preset="tiny",
        steps=1,
        round_minutes=240.0,
        batch=2,
        seq_len=32,
        lr=1e-3,
        eval_batches=1,
        device="cpu",
    )
    cosine = bench.run("cosine-known", "diloco", 0, args)
    free = bench.run("sf", "fedavg", 0, args)
    assert cosine["tokens"] == free["tokens"] > 0
    assert (
        cosine["site_steps"] == free["site_steps"] and sum(cosine["site_steps"]) * 2 * 32 == cosine["tokens"]
    )
    assert cosine["curve"][0] == free["curve"][0]  # the same untrained model, the same held-out batches
    assert all(math.isfinite(loss) for _, loss in cosine["curve"] + free["curve"])


def test_a_site_adopting_a_swarm_state_continues_its_average_instead_of_restarting_it() -> None:
    """``train.sf_keep_average``: a fresh site that adopts another's x and z with its averaging weights
    keeps x on its first step (c is small: x averages the other's history); without them (or without
    the setting, the default) its c is 1 and x becomes its own z at once. Weights that are not finite
    and non-negative are ignored."""
    veteran = trainer()
    for _ in range(20):
        veteran.step()
    state, weights = veteran.full_parameters(), veteran.averaging_weights()
    n = veteran.num_parameters
    gap = float((state[n:] - state[:n]).norm())
    assert gap > 0

    for given, keep, kept in ((weights, True, True), (None, True, False), (weights, False, False)):
        fresh = trainer(sf_keep_average=keep)
        fresh.load_full_parameters(state, weights=given)
        fresh.step()
        after = fresh.full_parameters()
        moved = float((after[:n] - state[:n]).norm())
        if kept:
            assert moved < 0.2 * gap, (moved, gap)
        else:
            assert torch.equal(after[:n], after[n:])  # x replaced by the fresh site's z
    optimizer = trainer().schedule_free
    for bad in ({"weight_sum": float("nan"), "lr_max": 1e-3}, {"weight_sum": -1.0, "lr_max": 1e-3}, {"x": 1}):
        optimizer.adopt_weights(bad)
        assert optimizer.param_groups[0]["weight_sum"] == 0.0
