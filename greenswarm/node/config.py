"""The site config: one dataclass per component, composed into what ``greenswarm node`` loads.

A site YAML has one section per component (``swarm``, ``model``, ``data``, ``train``, ``scheduler``,
``energy``, ``averaging``, ``node``, ``eval``) plus the site's ``name`` and ``region``; every field has a
default except those two, so a minimal config is three lines.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from greenswarm.averaging.config import AveragingConfig
from greenswarm.configuration import load_config
from greenswarm.errors import ConfigError
from greenswarm.network import SwarmConfig
from greenswarm.node.data import DataConfig
from greenswarm.node.evaluation import EvalConfig
from greenswarm.node.model import ModelConfig
from greenswarm.scheduler.config import EnergyConfig, SchedulerConfig
from greenswarm.scheduler.release import ReleaseConfig
from greenswarm.timefmt import parse_instant
from greenswarm.traces import Trace, load_trace

_SITE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

Device = Literal["auto", "cpu", "cuda"]
#: fp32, or bf16 autocast (parameters stay fp32)
Precision = Literal["fp32", "bf16"]
#: on-crash: fork a new node at once when it dies by a signal; never: end with it
Restart = Literal["on-crash", "never"]
Launcher = Literal["local", "command", "slurm"]
#: the placeholders a ``node.start_command`` or ``node.stop_command`` may use (greenswarm.node.launchers)
PLACEHOLDERS = ("trainer", "config", "run_dir", "site", "signal")
#: the inner optimizer: AdamW with ``train.schedule``, or Schedule-Free AdamW (node/schedule_free.py)
Optimizer = Literal["adamw", "adamw-schedulefree"]
#: AdamW's learning rate after warm-up: held, or cosine-decayed to ``min_lr_ratio`` over ``total_steps``
Schedule = Literal["constant", "cosine"]
#: how a swarm moves schedule-free ``z`` with ``x`` (docs/schedule_free.md)
ZMode = Literal["average", "shift", "reset"]


def _check_choice(value: object, kind: object, name: str) -> None:
    """The ``Literal`` check the loader makes, again for configs built in code."""
    if value not in get_args(kind):
        raise ConfigError(f"must be one of {', '.join(get_args(kind))}, got {value!r}", field=name)


@dataclass
class TrainConfig:
    """The inner loop: the optimizer with warm-up, gradient accumulation up to ``batch_size`` sequences.

    ``batch_size`` is the site's effective batch per optimizer step (all ranks together);
    ``micro_batch_size`` is what one rank holds in one forward/backward.

    ``optimizer``: ``adamw`` (the learning rate after warm-up as ``schedule`` says: ``constant``, or
    ``cosine`` down to ``min_lr_ratio`` x ``lr`` at ``total_steps`` inner steps and held there, which
    needs the run's length in advance), or ``adamw-schedulefree``, which needs none (a curtailed run
    never knows it; docs/schedule_free.md): ``sf_beta`` interpolates where gradients are taken,
    ``sf_momentum`` is ScheduleFree+'s inner momentum (0: off), and ``sf_z`` says how the swarm moves
    the optimizer's ``z`` with the model -- ``average`` it too (twice the bytes per round), ``shift`` it
    by the same outer step, or ``reset`` it to the model. ``sf_keep_average``: a site that adopts the
    swarm's state (entering a window behind it) takes the averaging weights served with it and keeps
    averaging into the adopted x; off (the default, measured better in benchmarks/schedule_free.py), its
    own weights restart the average when it has taken fewer steps. Every site of a swarm must configure
    ``optimizer`` and ``sf_z`` alike (they decide what a round averages; a differing site never meets
    the others' groups).

    ``max_steps_per_s`` caps the inner steps per wall second (0, the default: as fast as the machine
    goes), for a machine shared with other work, a demo on a laptop, or a test swarm that needs a few
    steps per window (``greenswarm.node.pacing``).
    """

    batch_size: int = 8
    micro_batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0
    device: Device = "auto"
    precision: Precision = "fp32"
    threads: int = 0  # torch CPU threads per process (0: torch's default)
    optimizer: Optimizer = "adamw"
    schedule: Schedule = "constant"
    total_steps: int = 0  # inner steps the cosine schedule spans (schedule: cosine)
    min_lr_ratio: float = 0.1
    sf_beta: float = 0.9
    sf_momentum: float = 0.0
    sf_z: ZMode = "average"
    sf_keep_average: bool = False
    max_steps_per_s: float = 0.0  # a cap on inner steps per wall second (0: as fast as it can)

    @property
    def schedule_free(self) -> bool:
        return self.optimizer == "adamw-schedulefree"

    @property
    def state_layout(self) -> str:
        """What the site's flat vector, and so its global state, holds: ``params`` (AdamW), schedule-free
        ``x+z`` (``sf_z: average``) or ``x/shift``, ``x/reset``. Part of the model's identity (sites that
        hold different things never average together) and of every checkpoint."""
        if not self.schedule_free:
            return "params"
        return "x+z" if self.sf_z == "average" else f"x/{self.sf_z}"

    def validate(self) -> None:
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})",
                field="batch_size",
            )
        for name in ("lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ConfigError(f"must be {'> 0' if name == 'lr' else '>= 0'}, got {value}", field=name)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"must be in [0, 1), got {getattr(self, name)}", field=name)
        if not math.isfinite(self.max_steps_per_s) or self.max_steps_per_s < 0:
            raise ConfigError(
                f"must be >= 0 (0: no cap), got {self.max_steps_per_s}", field="max_steps_per_s"
            )
        if self.warmup_steps < 0 or self.threads < 0:
            name = "warmup_steps" if self.warmup_steps < 0 else "threads"
            raise ConfigError("must be >= 0", field=name)
        for name, kind in (
            ("device", Device),
            ("precision", Precision),
            ("optimizer", Optimizer),
            ("schedule", Schedule),
            ("sf_z", ZMode),
        ):
            _check_choice(getattr(self, name), kind, name)
        if self.schedule == "cosine":
            if self.schedule_free:
                raise ConfigError(
                    "a schedule-free optimizer takes no schedule (leave schedule: constant)", field="schedule"
                )
            if self.total_steps <= self.warmup_steps:
                raise ConfigError(
                    f"the cosine schedule needs total_steps > warmup_steps ({self.warmup_steps}), "
                    f"got {self.total_steps}",
                    field="total_steps",
                )
        if self.total_steps < 0:
            raise ConfigError("must be >= 0", field="total_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"must be in [0, 1], got {self.min_lr_ratio}", field="min_lr_ratio")
        if not 0 < self.sf_beta < 1:
            raise ConfigError(f"must be in (0, 1), got {self.sf_beta}", field="sf_beta")
        if not 0 <= self.sf_momentum < 1:
            raise ConfigError(f"must be in [0, 1), got {self.sf_momentum}", field="sf_momentum")


@dataclass
class NodeConfig:
    """Where the node keeps its files and how often it reports.

    Progress records are refreshed every ``progress_refresh_s`` wall seconds (and at every state
    change) and expire after ``progress_ttl_s``, so a dead site leaves the table by itself.
    ``restart: on-crash`` keeps the imports in a supervisor process and forks a new node at once when
    the node dies by a signal (see :mod:`greenswarm.node.supervisor`).
    ``checkpoint_every_s``: after an outer step, write the checkpoint only when at least this many wall
    seconds have passed since the last one (0: after every outer step). A ~1 B-parameter site's
    checkpoint is ~20 GB, too much for every round; a site that crashes resumes from its last one,
    catches up with the swarm and trains the data since then again. A stop always writes one, and so
    does an outer step whose held-out loss may be kept among the best (``eval.keep_best``).
    ``metrics_port``: serve Prometheus metrics on ``metrics_host:metrics_port`` (None or 0: off;
    docs/metrics.md). Loopback by default: the metrics name the site and its peer id.
    ``launcher``: how the agent starts the trainer after a release (docs/release.md): ``local``
    forks it; ``command`` runs ``start_command`` (``{trainer}``, ``{config}``, ``{run_dir}``,
    ``{site}``) and stops it with a signal to its process group or ``stop_command`` (also
    ``{signal}``); ``slurm`` submits it as a batch job (``sbatch --wait``, with ``sbatch_args``) and
    cancels it with ``scancel``; see :mod:`greenswarm.node.launchers`.
    ``ranks``: the trainer's processes on this machine (one per GPU). More than one runs the trainer
    under torchrun (``--standalone --nproc-per-node ranks``), started by the agent, so a multi-GPU
    site releases its GPUs between windows too; a node started under your own torchrun keeps them.
    """

    run_dir: str = "runs/site"
    progress_refresh_s: float = 2.0
    progress_ttl_s: float = 15.0
    swarm_poll_s: float = 1.0
    rejoin_s: float = 10.0  # how often to check that an initial peer is connected, and re-dial if not
    idle_wall_s: float = 0.5  # longest single wall sleep while IDLE (keeps signals and records responsive)
    stop_at_trace_end: bool = True
    stop_at: str | None = None  # an ISO instant of clock time at which the node stops (e.g. a deadline)
    restart: Restart = "on-crash"
    max_restarts: int = 5  # more crashes than this within restart_window_s end the node (status 1)
    restart_window_s: float = 600.0
    log_every_s: float = 10.0
    keep_globals: int = (
        0  # keep the global model of the last N outer steps in run_dir/globals (for inspection)
    )
    checkpoint_every_s: float = (
        0.0  # write the checkpoint after an outer step only this often (0: every step)
    )
    metrics_port: int | None = None  # Prometheus endpoint (None or 0: off)
    metrics_host: str = "127.0.0.1"
    launcher: Launcher = "local"  # how the agent starts the trainer (greenswarm.node.launchers)
    start_command: str | None = None  # launcher: command: runs the trainer, exits with its status
    stop_command: str | None = None  # launcher: command: ends it (default: a signal to its group)
    sbatch_args: list[str] = field(default_factory=list)  # launcher: slurm: e.g. [--gres=gpu:4]
    ranks: int = 1  # the trainer's processes (torchrun's --nproc-per-node when more than one)

    def validate(self) -> None:
        _check_choice(self.restart, Restart, "restart")
        _check_choice(self.launcher, Launcher, "launcher")
        self._validate_commands()
        if self.stop_at is not None:
            try:
                parse_instant(self.stop_at)
            except ConfigError as err:
                raise err.located("stop_at") from None
        if self.max_restarts < 0:
            raise ConfigError(f"must be >= 0, got {self.max_restarts}", field="max_restarts")
        if self.ranks < 1:
            raise ConfigError(f"must be >= 1, got {self.ranks}", field="ranks")
        for name in ("keep_globals", "checkpoint_every_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)
        for name in (
            "progress_refresh_s",
            "progress_ttl_s",
            "swarm_poll_s",
            "rejoin_s",
            "idle_wall_s",
            "log_every_s",
            "restart_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", field=name)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"must be a TCP port (0 or unset: off), got {self.metrics_port}", field="metrics_port"
            )
        if not self.metrics_host.strip():
            raise ConfigError("must name an address to bind (127.0.0.1 by default)", field="metrics_host")
        if self.progress_ttl_s <= self.progress_refresh_s:
            raise ConfigError(
                f"must exceed progress_refresh_s ({self.progress_refresh_s}) or records flicker",
                field="progress_ttl_s",
            )

    def _validate_commands(self) -> None:
        """``launcher: command`` needs a start command; placeholders are checked now, not at the
        first window."""
        if self.launcher == "command" and not (self.start_command or "").strip():
            raise ConfigError(
                "launcher: command needs the command that runs the trainer, e.g. 'ssh gpu1 {trainer}'",
                field="start_command",
            )
        for name in ("start_command", "stop_command"):
            template = getattr(self, name)
            if template is None:
                continue
            try:
                template.format(**dict.fromkeys(PLACEHOLDERS, ""))
            except (KeyError, IndexError, ValueError) as err:
                raise ConfigError(
                    f"{template!r}: unknown placeholder or stray brace ({err}); "
                    f"use {', '.join('{' + p + '}' for p in PLACEHOLDERS)}",
                    field=name,
                ) from None


@dataclass
class SiteConfig:
    """Everything one site node needs. ``name`` identifies the site in the swarm's progress table;
    ``region`` is its grid region: a column of the trace."""

    name: str
    region: str
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: whether the site ends its trainer between windows (docs/release.md): ``auto`` by default, when a
    #: gap is worth more than a restart; its presence keeps it in the swarm meanwhile
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    def validate(self) -> None:
        if not _SITE_RE.match(self.name):
            raise ConfigError(f"{self.name!r}: use up to 64 letters, digits, '.', '-' or '_'", field="name")
        if not self.region.strip():
            raise ConfigError("must name a region (a column of the trace)", field="region")
        if self.data.claimed:  # claimed shards leave the held-out shard to nobody (shard_claims.py)
            self._check_claimed()
        elif self.eval.enabled:  # a loss measured on documents the site trains on would pick the wrong "best"
            try:
                self.eval.check_against(self.data)
            except ConfigError as e:
                raise e.located("eval") from None

    def _check_claimed(self) -> None:
        """With ``data.sharding: claim`` the held-out shard is one of the swarm's shards, left out of
        every claim, and at least one shard is left to claim."""
        count = self.data.num_shards
        if self.eval.num_shards not in (0, count):
            raise ConfigError(
                f"with data.sharding 'claim' the held-out shard is one of data.num_shards ({count}): "
                f"leave eval.num_shards at 0 or set it to {count}, got {self.eval.num_shards}",
                field="eval.num_shards",
            )
        if count < 2:
            raise ConfigError(
                "with sharding 'claim' the swarm's corpus needs at least 2 shards (one is held out for "
                f"evaluation), and many more than the swarm's ranks: got {count}",
                field="data.num_shards",
            )
        if self.eval.shard_index >= count:
            raise ConfigError(
                f"the held-out shard must be one of data.num_shards ({count}): got {self.eval.shard_index}",
                field="eval.shard_index",
            )
        if self.data.shard_index:
            raise ConfigError(
                "with data.sharding 'claim' the site reads the shards it claims, not a shard of its own: "
                f"leave data.shard_index at 0 (got {self.data.shard_index}), or use sharding 'fixed'",
                field="data.shard_index",
            )

    def load_trace(self, path: str | None = None) -> Trace:
        """The site's trace (or the file at ``path``, read the same way), refused when it lacks the
        site's region (which only the file can tell)."""
        trace = load_trace(path or self.scheduler.trace, **self.scheduler.trace_options())
        if self.region not in trace.regions:
            raise ConfigError(
                f"{self.region!r} is not in trace {trace.source}; it has: {', '.join(trace.regions)}",
                field="region",
            )
        return trace


def load_site_config(path: str | Path | None, overrides: list[str] | None = None) -> SiteConfig:
    """Load a site config from YAML plus ``--set`` overrides; errors name file:line or the override."""
    return load_config(SiteConfig, path, overrides)
