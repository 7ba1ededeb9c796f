"""``greenswarm node``: load the site config, run the site until its trace ends or it is stopped.

With ``node.restart: on-crash`` (the default) the node runs under :mod:`greenswarm.node.supervisor`,
which forks a new node from its already-imported state whenever the node dies by a signal.
"""

from __future__ import annotations

import json
import logging
import sys

from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.network import check_peers
from greenswarm.node.config import SiteConfig, load_site_config
from greenswarm.procs import exit_with_parent, on_termination, reap_children

log = logging.getLogger("greenswarm.node")


def run_node(config: str, initial_peers: list[str] | None, overrides: list[str], run_dir: str | None) -> int:
    cfg = load_site_config(config, overrides)
    if initial_peers:
        cfg.swarm.initial_peers = check_peers(initial_peers, "--initial-peers")
    if run_dir:
        cfg.node.run_dir = run_dir
    if cfg.node.restart == "never":
        return _run_site(cfg, config)

    from greenswarm.node.supervisor import supervise

    def node() -> int:
        try:
            return _run_site(cfg, config, supervised=True)
        except GreenswarmError as e:  # in the forked node: report as the CLI would, exit with its code
            print(f"greenswarm node: error: {e}", file=sys.stderr, flush=True)
            return e.exit_code
        except KeyboardInterrupt:
            return 130

    return supervise(node, cfg.node.max_restarts, cfg.node.restart_window_s, preload=lambda: _preload(cfg))


def _run_site(cfg: SiteConfig, config: str, supervised: bool = False) -> int:
    from greenswarm.node.site import SiteNode

    try:
        node = SiteNode(cfg)
    except ConfigError as e:  # checks that need the trace (the region) still point at the config file
        raise e.located(where=e.where or config) from None
    on_termination(node.request_stop)
    if supervised:
        exit_with_parent(on_orphaned=node.request_stop)  # the supervisor was killed: stop cleanly
    try:
        summary = node.run()
    finally:
        reap_children()
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
