"""Check, at start, that the bootstrap's relay carries long streams.

p2pd starts two relay services: the configured one (raised limits) and go-libp2p's default one
(128 KiB and 2 min per relayed connection). They race at start-up, and when the default one wins
every relayed stream is reset at 131072 bytes, which stalls all-reduce between NAT'ed sites
(docs/nat.md). ``GOMAXPROCS=1`` makes the configured one win most of the time; this check makes it
a guarantee: two throw-away peers behind the relay push :data:`CHECK_BYTES` (well over 128 KiB)
through it, and the bootstrap restarts its daemon until the transfer survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct

from greenswarm.network import BEHIND_NAT_MODE, _register_p2pd_modes

log = logging.getLogger("greenswarm.bootstrap")

CHECK_BYTES = 1 << 20  # 8 x the default relay's 128 KiB limit
PROTOCOL = "greenswarm-relay-check"


async def _relay_carries(boot: str, nbytes: int, timeout: float) -> tuple[bool, str]:
    from hivemind.p2p import P2P

    _register_p2pd_modes()
    behind = {
        "initial_peers": [boot],
        "no_listen": True,  # reachable only through the relay, so the transfer must cross it
        "announce_maddrs": [f"{boot}/p2p-circuit"],
        "force_reachability": BEHIND_NAT_MODE,
        "use_auto_relay": True,
        "trusted_relays": [boot],
        "dht_mode": "client",
    }
    receiver = await P2P.create(**behind)
    sender = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client")
    try:

        async def count(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = 0
            try:
                while got < nbytes:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    got += len(chunk)
            finally:
                with contextlib.suppress(OSError):  # the stream may already be reset: that is the finding
                    writer.write(struct.pack("!Q", got))
                    await writer.drain()
                    writer.close()

        await receiver.add_binary_stream_handler(PROTOCOL, count)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:  # the receiver's reservation on the relay takes a moment; then the sender finds
            try:  # it by peer id through the bootstrap, which knows only its circuit address
                _, reader, writer = await sender.call_binary_stream_handler(receiver.peer_id, PROTOCOL)
                break
            except Exception as err:
                if asyncio.get_running_loop().time() > deadline:
                    return False, f"cannot reach a peer through the relay: {err}"
                await asyncio.sleep(0.2)
        block = b"\0" * 65536
        try:
            for _ in range(nbytes // len(block)):
                writer.write(block)
                await writer.drain()
            answer = await asyncio.wait_for(reader.readexactly(8), timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as err:
            return False, f"relayed stream broke ({type(err).__name__})"
        finally:
            writer.close()
        got = struct.unpack("!Q", answer)[0]
        return got >= nbytes, f"{got} of {nbytes} bytes arrived through the relay"
    finally:
        await sender.shutdown()
        await receiver.shutdown()


def relay_carries(boot: str, nbytes: int = CHECK_BYTES, timeout: float = 15.0) -> tuple[bool, str]:
    """Whether ``nbytes`` get through the relay at ``boot`` (a multiaddr with /p2p/ID) in one stream."""
    try:
        return asyncio.run(asyncio.wait_for(_relay_carries(boot, nbytes, timeout), 3 * timeout))
    except Exception as err:  # any failure to run the check is a failed check, with its reason
        return False, f"relay check failed: {type(err).__name__}: {err}"


def check_address(listen: list[str], visible: list[str], peer_id: str) -> str:
    """The address of this bootstrap that the check's local peers should dial: loopback if the
    bootstrap listens there (a cloud host often cannot reach its own public IP), else the first
    visible address."""
    for m in visible:
        if m.startswith("/ip4/127.0.0.1/"):
            return m
    for m in listen:
        parts = m.split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[2] in ("0.0.0.0", "127.0.0.1") and parts[4] != "0":
            return f"/ip4/127.0.0.1/tcp/{parts[4]}/p2p/{peer_id}"
    return visible[0]
