"""``greenswarm node``: load the site config, run the site until its trace ends or it is stopped."""

from __future__ import annotations

import json
import logging

from greenswarm.errors import ConfigError
from greenswarm.network import check_peers
from greenswarm.node.config import load_site_config
from greenswarm.procs import on_termination, reap_children

log = logging.getLogger("greenswarm.node")


def run_node(config: str, initial_peers: list[str] | None, overrides: list[str], run_dir: str | None) -> int:
    cfg = load_site_config(config, overrides)
    if initial_peers:
        cfg.swarm.initial_peers = check_peers(initial_peers, "--initial-peers")
    if run_dir:
        cfg.node.run_dir = run_dir

    from greenswarm.node.site import SiteNode

    try:
        node = SiteNode(cfg)
    except ConfigError as e:  # checks that need the trace (the region) still point at the config file
        raise e.located(where=e.where or config) from None
    on_termination(node.request_stop)
    try:
        summary = node.run()
    finally:
        reap_children()
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return 0
