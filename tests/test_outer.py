"""The outer step and its bookkeeping: the math every site must apply identically to stay in step."""

from __future__ import annotations

import hashlib

import pytest
import torch

from greenswarm.averaging.outer import (
    GENESIS,
    OuterOptimizer,
    flatten,
    group_bits,
    next_lineage,
    unflatten,
)


def test_nesterov_matches_torch_sgd() -> None:
    """DiLoCo's outer step is torch's Nesterov SGD on theta_global with the pseudo-gradient as grad."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen)
    ours = OuterOptimizer(start, lr=0.7, momentum=0.9, nesterov=True)
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(6):
        grad = torch.randn(1000, generator=gen)
        ours.step(grad)
        ref.grad = grad.clone()
        sgd.step()
        torch.testing.assert_close(ours.params, ref.detach(), rtol=1e-6, atol=1e-6)


def test_plain_momentum_matches_torch_sgd() -> None:
    """Without Nesterov the update is the heavy-ball buffer, as in torch."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(64, generator=gen)
    ours = OuterOptimizer(start, lr=0.5, momentum=0.8, nesterov=False)
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.5, momentum=0.8)
    for _ in range(5):
        grad = torch.randn(64, generator=gen)
        ours.step(grad)
        ref.grad = grad.clone()
        sgd.step()
    torch.testing.assert_close(ours.params, ref.detach())


def test_from_config_diloco_keeps_settings() -> None:
    """``diloco`` uses the configured lr, momentum and Nesterov flag."""
    opt = OuterOptimizer.from_config(torch.zeros(3), "diloco", lr=0.7, momentum=0.9, nesterov=True)
    assert (opt.lr, opt.momentum, opt.nesterov) == (0.7, 0.9, True)


def test_fedavg_replaces_global_by_the_local_average() -> None:
    """FedAvg (lr 1, no momentum): theta_global - mean(delta_i) is exactly the mean of the local models."""
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(256, generator=gen)
    locals_ = [theta + torch.randn(256, generator=gen) for _ in range(3)]
    opt = OuterOptimizer.from_config(theta, "fedavg", lr=0.7, momentum=0.9, nesterov=True)
    assert (opt.lr, opt.momentum) == (1.0, 0.0)
    averaged = torch.stack([opt.pseudo_gradient(loc) for loc in locals_]).mean(0)
    opt.step(averaged)
    torch.testing.assert_close(opt.params, torch.stack(locals_).mean(0))


def test_optimizer_copies_its_initial_vector() -> None:
    """The global model must not alias the trainer's tensor, or training would move it."""
    initial = torch.ones(4)
    opt = OuterOptimizer(initial, lr=0.7, momentum=0.9, nesterov=True)
    initial.add_(1)
    assert torch.equal(opt.params, torch.ones(4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_pseudo_gradient_is_refused(bad: float) -> None:
    """A NaN/Inf average must not poison the global model or the momentum."""
    opt = OuterOptimizer(torch.zeros(4), lr=0.7, momentum=0.9, nesterov=True)
    opt.step(torch.ones(4))
    params, momentum = (t.clone() for t in opt.state_tensors())
    with pytest.raises(FloatingPointError):
        opt.step(torch.tensor([0.0, bad, 0.0, 0.0]))
    assert torch.equal(opt.params, params) and torch.equal(opt.momentum_buffer, momentum)


def test_state_tensors_round_trip_and_shape_check() -> None:
    """Catching up loads (params, momentum) from a peer; a wrong size is refused."""
    a = OuterOptimizer(torch.randn(10), lr=0.7, momentum=0.9, nesterov=True)
    a.step(torch.randn(10))
    b = OuterOptimizer(torch.zeros(10), lr=0.7, momentum=0.9, nesterov=True)
    b.load_state_tensors([t.clone() for t in a.state_tensors()])
    assert b.digest() == a.digest()
    torch.testing.assert_close(b.momentum_buffer, a.momentum_buffer)
    with pytest.raises(ValueError):
        b.load_state_tensors([torch.zeros(9), torch.zeros(9)])


def test_flatten_unflatten_round_trip() -> None:
    """Parameters of any shapes and dtypes go to one fp32 vector and come back as views."""
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 3).to(torch.bfloat16)]
    flat = flatten(tensors)
    assert flat.dtype == torch.float32 and flat.shape == (12 + 5 + 6,)
    views = unflatten(flat, [t.shape for t in tensors])
    for view, t in zip(views, tensors, strict=True):
        torch.testing.assert_close(view, t.float())
    views[1].fill_(7.0)  # views share storage with the flat vector
    assert torch.all(flat[12:17] == 7.0)


def test_flatten_into_out() -> None:
    """``out=`` reuses a buffer (the node flattens every round without reallocating)."""
    out = torch.empty(6)
    result = flatten([torch.ones(2, 2), torch.zeros(2)], out=out)
    assert result is out
    assert out.tolist() == [1, 1, 1, 1, 0, 0]


def test_next_lineage_ignores_member_order() -> None:
    """Members compute the lineage independently, each listing the group in its own order."""
    a = next_lineage(GENESIS, 5, ["peerA", "peerB", "peerC"])
    b = next_lineage(GENESIS, 5, ["peerC", "peerA", "peerB"])
    assert a == b


def test_next_lineage_is_the_swarms_shared_format() -> None:
    """Every site computes lineages alone, so the format is a protocol: a site that hashed anything
    else (another separator, unsorted members, a longer digest) would never match its group again.
    The value is sha256 over "parent|slot|sorted members", cut to 16 hex digits."""
    members = ["peerB", "peerA"]
    spec = hashlib.sha256(b"genesis|5|peerA|peerB").hexdigest()[:16]
    assert next_lineage(GENESIS, 5, members) == spec
    assert next_lineage(spec, 6, members) == hashlib.sha256(f"{spec}|6|peerA|peerB".encode()).hexdigest()[:16]


def test_next_lineage_depends_on_everything() -> None:
    """A different round, group or parent lineage means a different global state."""
    base = next_lineage(GENESIS, 5, ["peerA", "peerB"])
    assert next_lineage(GENESIS, 6, ["peerA", "peerB"]) != base
    assert next_lineage(GENESIS, 5, ["peerA", "peerC"]) != base
    assert next_lineage(GENESIS, 5, ["peerA"]) != base
    assert next_lineage("other", 5, ["peerA", "peerB"]) != base
    assert next_lineage(base, 6, ["peerA", "peerB"]) != next_lineage(GENESIS, 6, ["peerA", "peerB"])


def test_group_bits_shape_and_determinism() -> None:
    """Group keys are 24 bits of 0/1, the same for everyone in the same round and lineage."""
    bits = group_bits(GENESIS)
    assert len(bits) == 24 and set(bits) <= {"0", "1"}
    assert group_bits(GENESIS) == bits
    assert len(group_bits(GENESIS, nbits=8)) == 8


def test_group_bits_separate_lineages() -> None:
    """Sites with different global states (or rounds) must not land in the same averaging group."""
    lineages = [GENESIS] + [next_lineage(GENESIS, r, ["p"]) for r in range(20)]
    assert len({group_bits(lin) for lin in lineages}) == len(lineages)


def test_the_global_digest_is_hashed_once_per_state_and_follows_every_change() -> None:
    """A cached digest is what hashing the parameters now gives, after an applied step and an adoption."""
    from greenswarm.node.global_state import GlobalState

    state = GlobalState(OuterOptimizer(torch.zeros(8), lr=0.7, momentum=0.9, nesterov=True), "a")
    first = state.digest()
    assert state.digest() == first == state.outer.digest()
    state.apply(torch.full((8,), 0.1), slot=1, members=["p"])
    assert state.digest() == state.outer.digest() != first
    state.adopt({"outer_round": 0, "lineage": "genesis", "round_index": -1}, [torch.zeros(8), torch.zeros(8)])
    assert state.digest() == first
