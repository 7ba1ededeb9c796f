"""``greenswarm node``: load the site config, run the site until its trace ends or it is stopped.

With ``node.restart: on-crash`` (the default) the node runs under :mod:`greenswarm.node.supervisor`,
which forks a new node from its already-imported state whenever the node dies by a signal. With
``node.launcher: command`` or ``slurm``, or ``node.ranks`` above 1 (a torchrun group, which cannot be
forked), this process is the agent and starts the trainer as a command (:mod:`greenswarm.node.launchers`).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time

from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.network import check_peers
from greenswarm.node.config import SiteConfig, load_site_config
from greenswarm.node.releasing import LAUNCHED_ENV, RANK0_READY
from greenswarm.procs import exit_at_once, exit_with_parent, on_termination, reap_children, set_process_name

log = logging.getLogger("greenswarm.node")


def run_node(config: str, initial_peers: list[str] | None, overrides: list[str], run_dir: str | None) -> int:
    cfg = load_site_config(config, overrides)
    if initial_peers:
        cfg.swarm.initial_peers = check_peers(initial_peers, "--initial-peers")
    if run_dir:
        cfg.node.run_dir = run_dir
    ranks = os.environ.get("LOCAL_WORLD_SIZE")  # (set by torchrun: this process is one of its ranks)
    if ranks is not None and cfg.node.ranks > 1 and ranks != str(cfg.node.ranks):
        raise ConfigError(
            f"is {cfg.node.ranks} but torchrun started {ranks} ranks on this machine; start greenswarm "
            "node without torchrun (it runs one for node.ranks), or leave node.ranks at 1",
            field="node.ranks",
        )
    if cfg.node.launcher in ("command", "slurm") or (cfg.node.ranks > 1 and ranks is None):
        return _run_launched(cfg, config, initial_peers, overrides)
    if cfg.node.restart == "never":
        launched = bool(os.environ.get(LAUNCHED_ENV))
        code = _run_site(cfg, config, supervised=launched)
        if launched:  # a trainer its agent started as a command: the agent waits on this exit
            exit_at_once(code)
        return code

    from greenswarm.node.releasing import wait_for_window
    from greenswarm.node.supervisor import supervise

    def node() -> int:
        try:
            return _run_site(cfg, config, supervised=True)
        except GreenswarmError as e:  # in the forked node: report as the CLI would, exit with its code
            print(f"greenswarm node: error: {e}", file=sys.stderr, flush=True)
            return e.exit_code
        except KeyboardInterrupt:
            return 130

    def preload() -> None:
        _preload(cfg)
        pin_replay_start(cfg)  # (after the imports: the replay starts when the first node can)

    return supervise(
        node,
        cfg.node.max_restarts,
        cfg.node.restart_window_s,
        preload=preload,
        released=lambda stopped: wait_for_window(cfg, stopped, log),
        presence=lambda: _presence(cfg),
    )


def _presence(cfg: SiteConfig) -> int:
    """The released site in the swarm (a forked child of the agent; see greenswarm.node.presence)."""
    from greenswarm.node.presence import run_presence

    return run_presence(cfg)


def _run_launched(cfg: SiteConfig, config: str, initial_peers: list[str] | None, overrides: list[str]) -> int:
    """``node.launcher: command`` or ``slurm``, or several ``node.ranks``: this process is the agent;
    the trainer runs through the operator's command, as a Slurm job or as a torchrun group
    (:mod:`greenswarm.node.launchers`), on the agent's clock."""
    from greenswarm.node.launchers import run_command_launcher, slurm_commands, trainer_command
    from greenswarm.node.releasing import wait_for_window
    from greenswarm.node.supervisor import become_subreaper

    become_subreaper()  # (a torchrun killed by a signal leaves its ranks to us, to end before a restart)
    pin_replay_start(cfg)
    os.makedirs(cfg.node.run_dir, exist_ok=True)  # (a batch job's output goes there from its start)
    pinned = cfg.scheduler.clock.start_wall
    extra = [f"scheduler.clock.start_wall={pinned!r}"] if pinned is not None else []
    restarts = cfg.node.max_restarts
    trainer = trainer_command(
        config, initial_peers, [*overrides, *extra], cfg.node.run_dir, cfg.node.ranks, restarts
    )
    values = {
        "trainer": shlex.join(trainer),
        "trainer_wrap": shlex.quote("exec " + shlex.join(trainer)),  # (sbatch --wrap's whole script)
        "config": config,
        "run_dir": os.path.abspath(cfg.node.run_dir),
        "site": cfg.name,
    }
    start: str | list[str]
    if cfg.node.launcher == "slurm":
        start, stop = slurm_commands(cfg.node.sbatch_args)
    elif cfg.node.launcher == "command":
        start, stop = cfg.node.start_command or "", cfg.node.stop_command
    else:  # local, with several ranks: torchrun, with no shell in between
        start, stop = trainer, None
    return run_command_launcher(
        start,
        stop,
        values,
        released=lambda stopped: wait_for_window(cfg, stopped, log),
        presence=lambda: _presence(cfg),
        max_restarts=restarts,
        window_s=cfg.node.restart_window_s,
    )


def pin_replay_start(cfg: SiteConfig) -> None:
    """A replay that starts "now" (no ``start_wall``, no ``start_file``) starts when the supervisor
    does, once: every node it forks -- after a crash or a release -- goes on with the same clock
    instead of replaying the trace from its start again."""
    clock = cfg.scheduler.clock
    if clock.kind == "replay" and clock.start_wall is None and clock.start_file is None:
        clock.start_wall = time.time()


def _run_site(cfg: SiteConfig, config: str, supervised: bool = False) -> int:
    from greenswarm.node.releasing import RELEASED_EXIT
    from greenswarm.node.site import SiteNode

    try:
        node = SiteNode(cfg, supervised=supervised)
    except ConfigError as e:  # checks that need the trace (the region) still point at the config file
        raise e.located(where=e.where or config) from None
    on_termination(node.request_stop)
    if node.world.distributed and node.world.is_leader:
        set_process_name(RANK0_READY)  # (a stop from the agent may come now: see greenswarm.node.launchers)
    if supervised:
        exit_with_parent(on_orphaned=node.request_stop)  # the supervisor was killed: stop cleanly
    try:
        summary = node.run()
    finally:
        reap_children()
    if node.releaser.released:  # (torchrun calls any status but 0 a failure: the marker says it there)
        return 0 if node.world.distributed else RELEASED_EXIT
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return 0


def _preload(cfg: SiteConfig) -> None:
    """Import what a node needs (torch, hivemind, the model's transformers classes) before forking it,
    so a restarted node skips seconds of imports. Builds the model on the meta device: no memory, no
    compute, no threads."""
    import greenswarm.node.site  # noqa: F401  (torch, hivemind)
    from greenswarm.node.model import build_model
    from greenswarm.node.tokenizer import load_tokenizer

    try:
        build_model(cfg.model, load_tokenizer(cfg.model.tokenizer).vocab_size, device="meta")
    except Exception as e:  # the node itself will report it, with its context
        log.debug("preloading the model failed: %r", e)
