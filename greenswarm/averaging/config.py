"""Configuration of a site's averaging rounds and outer optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from greenswarm.errors import ConfigError

OuterKind = Literal["diloco", "fedavg"]
OUTER_KINDS: tuple[str, ...] = get_args(OuterKind)
#: wire formats (greenswarm.averaging.codecs), or "auto": chosen per round from the measured link
WireCodec = Literal["auto", "fp32", "fp16", "scaled-fp16", "bf16", "int8", "int8-zstd", "int7-zstd"]
WIRE_CODECS: tuple[str, ...] = get_args(WireCodec)
#: how a group's pseudo-gradients are combined (greenswarm.averaging.aggregation)
Aggregate = Literal["mean", "trimmed-mean"]
AGGREGATES: tuple[str, ...] = get_args(Aggregate)
#: how much each member's pseudo-gradient counts in a round (greenswarm.averaging.weighting)
Weighting = Literal["tokens", "fednova", "equal"]
WEIGHTINGS: tuple[str, ...] = get_args(Weighting)

#: averaging timeouts for sites on one machine (the demo, tests): rounds that last a few wall seconds
LOOPBACK_TIMEOUTS = {
    "matchmaking_s": 2.0,
    "request_timeout_s": 1.0,
    "allreduce_timeout_s": 20.0,
    "chunk_timeout_s": 5.0,
    "state_timeout_s": 20.0,
    "agreement_timeout_s": 5.0,
}


def _positive(value: float, name: str, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"must be a number, got {value!r}", field=name)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}", field=name)


@dataclass
class AveragingConfig:
    """When sites average and how the result moves the global model.

    Rounds are aligned to the clock: round k ends at the first multiple of ``sync_interval_s`` (clock
    seconds since the Unix epoch) after it starts, so sites agree on round boundaries without talking.
    ``diloco`` applies Nesterov SGD (``outer_lr`` 0.7, ``outer_momentum`` 0.9) to the averaged
    pseudo-gradient; ``fedavg`` replaces the global model with the weighted average of local ones.
    ``wire`` is the format pseudo-gradients travel in (docs/compression.md). ``auto`` lets each
    group pick per round the most precise of ``bf16``, ``int8``, ``int7-zstd`` whose transfer fits
    ``round_budget_s`` on the slowest member's measured link. All members of a group must configure
    the same format (or ``auto``).
    ``error_feedback`` carries what a round's coding left out into the next round's pseudo-gradient.
    ``overlap`` (default true) runs a federated round beside training: the site snapshots its
    pseudo-gradient at the boundary, trains on while the group averages and agrees, and applies the
    outer step when the result arrives, keeping the inner steps taken meanwhile (docs/overlap.md);
    false blocks training for the whole round, as before, for comparison.
    Timeouts are wall seconds and always set: hivemind's defaults wait forever.
    ``matchmaking_s`` is how long a round looks for its group (its deadline is twice that). An
    overlapped round looks at least as long as the site's longest recent inner step, up to a quarter
    of the sync interval: sites reach a boundary when their step in progress ends, up to a step apart.
    ``agreement_timeout_s`` bounds the wait for the group's round digests after an all-reduce (and a
    dissenting site's wait for the majority's state); a member that has not answered by then counts
    as disagreeing.
    ``max_norm_ratio``: a groupmate's pseudo-gradient whose norm is more than this many times the
    group's scale (the other members' updates, now and in their last rounds) is refused before it is
    averaged, as is one with NaN/Inf; 0 turns the norm check off (NaN/Inf are always refused). The
    default, 100, leaves room for sites whose rounds hold very different amounts of training (the
    demo's sites, sharing two cores, differ up to 26x); a swarm of like sites can set 10. See
    docs/security.md.
    ``aggregate``: ``mean`` (the updates weighted by the tokens behind them) or ``trimmed-mean``
    (coordinate by coordinate, the ``trim`` share of the largest and of the smallest values left out,
    the rest averaged with equal weights: one member of four cannot move a value past the others'),
    at its cost in quality and compute (docs/security.md). ``max_tokens_per_s``: the most tokens a
    second any member may claim to have trained; a claim above it times the round's interval (wall
    seconds) is clipped to that, and logged, so no member outweighs the others by saying it worked
    more (a member's certificate may set a lower figure of its own). Every member of a group must
    configure the same ``aggregate``, ``trim`` and ``max_tokens_per_s``: a group that differs is
    refused.
    ``weighting``: how much each member's pseudo-gradient counts in the mean
    (:mod:`greenswarm.averaging.weighting`, docs/weighting.md). ``tokens`` (the default): the tokens it
    trained since its last outer step. ``fednova`` (Wang et al. 2020): each member sends its update
    divided by its inner steps since its last outer step, weighted by its tokens, and the group's
    average is multiplied by the token-weighted mean of the members' steps, so a site that took more
    steps per round does not pull the model towards its own local optimum more than its data share
    says; with equal steps it is ``tokens``. ``equal``: every member counts as one, whatever it trained
    (and whatever it claims). Every member of a group must configure the same ``weighting``: a group
    that differs is refused. A SOLO round has no weighting.
    """

    sync_interval_s: float = 600.0
    outer: OuterKind = "diloco"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    wire: WireCodec = "auto"
    error_feedback: bool = True
    overlap: bool = True
    round_budget_s: float = 30.0
    matchmaking_s: float = 5.0
    request_timeout_s: float = 2.0
    allreduce_timeout_s: float = 60.0
    chunk_timeout_s: float = 10.0
    state_timeout_s: float = 60.0
    agreement_timeout_s: float = 15.0
    max_group_size: int = 64
    max_norm_ratio: float = 100.0
    aggregate: Aggregate = "mean"
    trim: float = 0.25
    max_tokens_per_s: float | None = None
    weighting: Weighting = "tokens"

    @property
    def min_group_size(self) -> int:
        """The least group a round forms: two, or three under the trimmed mean, whose smallest group
        that leaves a value out at each end is three (its median). A pair would average an attacker in
        at half the step (docs/testing.md row 76: a site starved into pairs with one)."""
        return 3 if self.aggregate == "trimmed-mean" else 2

    def rules(self) -> dict[str, object]:
        """What every member of a group must configure alike (gathered and compared each round)."""
        return {
            "aggregate": self.aggregate,
            "trim": self.trim,
            "max_tokens_per_s": self.max_tokens_per_s,
            "weighting": self.weighting,
        }

    def longest_round_s(self) -> float:
        """The longest one round can hold a node when every timeout fires: matchmaking (the step's
        deadline is twice it), the all-reduce, the digest exchange, and a resync's wait for the
        majority's state (agreement timeout) with its download."""
        return (
            2 * self.matchmaking_s
            + self.allreduce_timeout_s
            + 2 * self.agreement_timeout_s
            + self.state_timeout_s
            + 10.0  # the averager process's own slack (SwarmAverager._round_bound_s)
        )

    def validate(self) -> None:
        _positive(self.sync_interval_s, "sync_interval_s")
        if self.outer not in OUTER_KINDS:
            raise ConfigError(f"must be one of {', '.join(OUTER_KINDS)}, got {self.outer!r}", field="outer")
        if self.wire not in WIRE_CODECS:
            raise ConfigError(
                f"must be one of {', '.join(WIRE_CODECS)}, got {self.wire!r}",
                field="wire",
            )
        _positive(self.outer_lr, "outer_lr")
        _positive(self.outer_momentum, "outer_momentum", allow_zero=True)
        if self.outer_momentum >= 1:
            raise ConfigError(f"must be < 1, got {self.outer_momentum!r}", field="outer_momentum")
        for name in (
            "matchmaking_s",
            "request_timeout_s",
            "allreduce_timeout_s",
            "chunk_timeout_s",
            "state_timeout_s",
            "agreement_timeout_s",
            "round_budget_s",
        ):
            _positive(getattr(self, name), name)
        if self.request_timeout_s >= self.matchmaking_s:
            raise ConfigError(
                f"must be smaller than matchmaking_s ({self.matchmaking_s}) or matchmaking can deadlock",
                field="request_timeout_s",
            )
        for name in ("error_feedback", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"must be true or false, got {getattr(self, name)!r}", field=name)
        _positive(self.max_norm_ratio, "max_norm_ratio", allow_zero=True)
        if 0 < self.max_norm_ratio < 1:
            raise ConfigError(
                f"must be 0 (off) or >= 1, got {self.max_norm_ratio!r}: below 1 every update is refused",
                field="max_norm_ratio",
            )
        if self.max_group_size < 2:
            raise ConfigError(f"must be >= 2, got {self.max_group_size}", field="max_group_size")
        if self.aggregate not in AGGREGATES:
            raise ConfigError(
                f"must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}", field="aggregate"
            )
        if self.max_group_size < self.min_group_size:
            raise ConfigError(
                f"must be >= {self.min_group_size} with aggregate: {self.aggregate} (a smaller group "
                f"leaves nothing out), got {self.max_group_size}",
                field="max_group_size",
            )
        _positive(self.trim, "trim", allow_zero=True)
        if not self.trim < 0.5:
            raise ConfigError(f"must be < 0.5 (each side), got {self.trim!r}", field="trim")
        if self.max_tokens_per_s is not None:
            _positive(self.max_tokens_per_s, "max_tokens_per_s")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(
                f"must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}", field="weighting"
            )
