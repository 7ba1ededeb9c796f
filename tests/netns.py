"""A NAT test topology made of Linux network namespaces: one hub (the public host) and N sites.

Each site namespace is joined to the hub by one veth pair and to nothing else. The hub has a
"public" address on its loopback (``HUB_ADDR``) that every site routes to through its own link;
forwarding is off in the hub, so a packet from one site to another site's address has nowhere to
go. Sites therefore reach the hub and only the hub -- what an outbound-only NAT allows -- and any
traffic between two sites must be carried by a process on the hub (a relay).

Links can be shaped with ``tc qdisc ... tbf`` (netem is not available on this kernel). Everything
created here is named with a per-topology random tag and torn down by :meth:`Topology.close`, which
the fixture calls even when a test fails; :func:`sweep` removes leftovers of crashed runs (and only
those: a topology whose maker is alive belongs to a run going on beside this one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HUB_ADDR = "10.77.0.1"
PREFIX = "gsn"
#: one file per live topology, named by its tag, holding the pid of the process that made it: a sweep
#: removes only topologies whose maker is gone, never those of a run going on beside it (a second test
#: session, a benchmark) -- sweeping every ``gsn`` namespace broke a NAT test running concurrently
OWNERS = Path("/run/greenswarm-netns")
UNOWNED_MAX_AGE_S = 900.0


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def _run(ns: str, *cmd: str) -> str:
    proc = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip netns exec {ns} {' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


@dataclass
class Site:
    """One site namespace: its name, its address, and the hub's end of its link."""

    ns: str
    addr: str
    hub_if: str
    site_if: str


@dataclass
class Topology:
    tag: str
    hub: str
    sites: list[Site] = field(default_factory=list)

    def exec_prefix(self, ns: str) -> list[str]:
        """Prefix a command with this to run it inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def shape(self, rate_mbit: float, burst_kb: int = 256, latency_ms: int = 50) -> None:
        """Limit every link to ``rate_mbit`` in both directions (tbf on each veth end's egress)."""
        for s in self.sites:
            for ns, dev in ((self.hub, s.hub_if), (s.ns, s.site_if)):
                _run(
                    ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{latency_ms}ms",
                )  # fmt: skip

    def hub_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes the hub received from (rx) and sent to (tx) each site, from its link counters."""
        out = {}
        for s in self.sites:
            base = Path("/sys/class/net")  # read through the namespace: sysfs is per netns
            rx = int(_run(self.hub, "cat", str(base / s.hub_if / "statistics" / "rx_bytes")))
            tx = int(_run(self.hub, "cat", str(base / s.hub_if / "statistics" / "tx_bytes")))
            out[s.ns] = {"rx": rx, "tx": tx}
        return out

    def reachable(self, src_ns: str, dst_addr: str, port: int = 9) -> bool:
        """Whether a TCP connection from ``src_ns`` to ``dst_addr:port`` gets *any* answer (an accept
        or a refusal); False when packets go nowhere (what the topology promises between sites)."""
        code = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(1.5)\n"
            "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except OSError: print('unreachable')\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", src_ns, "python3", "-c", code, dst_addr, str(port)],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out in ("open", "refused")

    def close(self) -> None:
        """Delete every namespace (their veths go with them). Safe to call twice."""
        for ns in [s.ns for s in self.sites] + [self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        (OWNERS / self.tag).unlink(missing_ok=True)


def make_topology(n_sites: int) -> Topology:
    """Build the hub and ``n_sites`` site namespaces; on any failure, remove what was made."""
    tag = secrets.token_hex(3)
    topo = Topology(tag=tag, hub=f"{PREFIX}{tag}h")
    OWNERS.mkdir(parents=True, exist_ok=True)
    (OWNERS / tag).write_text(str(os.getpid()))
    try:
        _ip("netns", "add", topo.hub)
        _ip("link", "set", "lo", "up", ns=topo.hub)
        _ip("addr", "add", f"{HUB_ADDR}/32", "dev", "lo", ns=topo.hub)
        _run(topo.hub, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
        for i in range(1, n_sites + 1):
            ns = f"{PREFIX}{tag}s{i}"
            hub_if, site_if = f"{PREFIX}{tag}h{i}", f"{PREFIX}{tag}s{i}"
            site = Site(ns=ns, addr=f"10.77.{i}.2", hub_if=hub_if, site_if=site_if)
            topo.sites.append(site)
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", hub_if, "type", "veth", "peer", "name", site_if)
            _ip("link", "set", hub_if, "netns", topo.hub)
            _ip("link", "set", site_if, "netns", ns)
            _ip("addr", "add", f"10.77.{i}.1/24", "dev", hub_if, ns=topo.hub)
            _ip("addr", "add", f"{site.addr}/24", "dev", site_if, ns=ns)
            _ip("link", "set", hub_if, "up", ns=topo.hub)
            _ip("link", "set", site_if, "up", ns=ns)
            _ip("route", "add", "default", "via", f"10.77.{i}.1", ns=ns)
    except Exception:
        topo.close()
        raise
    return topo


def sweep() -> None:
    """Remove namespaces left by earlier runs that died before their tear-down (their maker is gone);
    a topology whose maker still runs is left alone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or name.startswith(f"{PREFIX}probe"):
            continue  # (a probe lives for a moment, inside a run's own check)
        tag = name[len(PREFIX) : len(PREFIX) + 6]
        if _maker_alive(tag):
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        (OWNERS / tag).unlink(missing_ok=True)


def _maker_alive(tag: str) -> bool:
    """Whether the process that made topology ``tag`` still runs (without an owner file -- an older
    version made it -- whether it is younger than a NAT test could last)."""
    try:
        pid = int((OWNERS / tag).read_text())
    except (OSError, ValueError):
        made = Path("/run/netns") / f"{PREFIX}{tag}h"
        return made.exists() and time.time() - made.stat().st_mtime < UNOWNED_MAX_AGE_S
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def topology_for_test(n_sites: int) -> Iterator[Topology]:
    """A fresh topology of ``n_sites`` for one test, removed afterwards; the test skips with the reason
    where namespaces cannot be made, and fails instead where ``GREENSWARM_REQUIRE_NAT=1``."""
    import pytest

    reason = available()
    if reason:
        if os.environ.get("GREENSWARM_REQUIRE_NAT") == "1":
            pytest.fail(f"NAT tests are required here but cannot run: {reason}")
        pytest.skip(reason)
    sweep()
    topo = make_topology(n_sites)
    try:
        yield topo
    finally:
        topo.close()
