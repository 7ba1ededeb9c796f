"""A site listens on the same port across its trainer's starts (``run_dir/listen.json``).

A site's peer id is its identity's, but its address is wherever its p2p daemon listens; with the
default ``/tcp/0`` every trainer start and every released site's presence
(:mod:`greenswarm.node.presence`) would get a new port. The other sites' daemons still hold the old
address for that peer id: a dial to it fails, and libp2p then refuses to try it again for a while
("dial backoff"), so a site that caught up right after a restart could not download the state its
peer served from a new port (seen: ``failed to dial ... dial backoff``). Keeping the port keeps every
address the swarm holds for the site valid. A port that another process took meanwhile is given up
for a new one, with a line that says so.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from greenswarm.private_files import write_private

FILE = "listen.json"

_EPHEMERAL = re.compile(r"^(/ip[46]/[^/]+/tcp/)0$")
_TCP_PORT = re.compile(r"/tcp/(\d+)")


def remembered(run_dir: str | Path, host_maddrs: list[str]) -> list[str]:
    """``host_maddrs`` with each ephemeral TCP port (``/tcp/0``) replaced by the port this site's daemon
    listened on before, if it did (``host_maddrs`` itself otherwise)."""
    try:
        port = int(json.loads((Path(run_dir) / FILE).read_text())["tcp_port"])
    except (OSError, ValueError, KeyError, TypeError):
        return list(host_maddrs)
    return [_EPHEMERAL.sub(rf"\g<1>{port}", maddr) for maddr in host_maddrs]


def remember(run_dir: str | Path, host_maddrs: list[str], visible_maddrs: list[str]) -> None:
    """Keep the TCP port the daemon chose for an ephemeral ``host_maddrs`` (from its ``visible_maddrs``),
    for the next start; nothing when the configured port is fixed."""
    if not any(_EPHEMERAL.match(m) for m in host_maddrs):
        return
    own = [str(m) for m in visible_maddrs if "p2p-circuit" not in str(m)]  # (not a relay's port)
    ports = {int(p) for m in own for p in _TCP_PORT.findall(m)}
    if len(ports) != 1:  # none (a relayed site may announce none of its own), or several: nothing kept
        return
    write_private(Path(run_dir) / FILE, json.dumps({"tcp_port": ports.pop()}).encode())


def forget(run_dir: str | Path, log: logging.Logger, why: str) -> None:
    """The remembered port cannot be had (``why``): the next start takes a new one."""
    log.warning("listening on a new port: the one this site used before is %s", why)
    (Path(run_dir) / FILE).unlink(missing_ok=True)
