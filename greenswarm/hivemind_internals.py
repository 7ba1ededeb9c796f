"""The one seam between greenswarm and hivemind's internals: every part of hivemind that greenswarm
uses although hivemind does not promise to keep it.

greenswarm pins hivemind (1.1.12) and leans on some of its internals. A new hivemind could rename
any of them and break a swarm at run time, in the middle of a round. So:

* everything greenswarm *reaches into* -- the matchmaking's group key, the averager process's
  command pipe, the table where groupmates find a round's runner, the state-download stream, the
  daemon client that re-dials an entry point, the codec registry and the p2pd flag table -- is
  done by a function in this module, and nowhere else;
* what can only be done inside a subclass -- :class:`~greenswarm.averaging.averager.SwarmAverager`
  overriding the averager's aggregation, all-reduce and RPC hooks,
  :class:`~greenswarm.averaging.exact.ExactAllReduceRunner` overriding the all-reduce runner's, and
  :class:`~greenswarm.averaging.aggregation.TrimmedMeanReducer` the part reducer's accumulator --
  stays in those classes, and every hivemind name they use is listed in :data:`INTERNALS`;
* ``tests/test_hivemind_internals.py`` fails loudly, before anything runs, when the installed
  hivemind lacks a listed name (:func:`missing`), when greenswarm touches a private hivemind name
  that is not listed, and when one is touched outside this module and the two subclasses.

A leaf module: hivemind is imported only inside its functions.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from typing import Any

#: "module:Class" (or "module:" for module attributes) -> the internal names greenswarm reads,
#: writes, calls or overrides there
INTERNALS: dict[str, tuple[str, ...]] = {
    # greenswarm.averaging.codecs: greenswarm's wire codecs go into hivemind's codec registry
    "hivemind.compression.serialization:": ("_BASE_COMPRESSION_TYPES",),
    # greenswarm.averaging.averager.SwarmAverager (a subclass)
    "hivemind.averaging.averager:DecentralizedAverager": (
        "_step",  # overridden: an error the step's future holds is read
        "_aggregate_with_group",  # overridden: the round's report and timeout
        "_run_allreduce_inplace_",  # overridden: the exact runner, wire choice, screening
        "_matchmaking",  # the group key and expected size, set per round
        "_outer_pipe",  # calls into the averager process
        "_p2p",
        "_running_groups",  # where groupmates' part requests find this round's runner
        "_pending_groups_registered",  # set once a search registered its group
        "_state_updated",
        "last_updated",
        "serializer",
        "get_stub",
        "rpc_join_group",  # overridden: admission
        "rpc_aggregate_part",  # overridden: a group this site is not in is answered at once
        "rpc_download_state",  # overridden: admission
        "get_current_state",  # overridden: the site's global state
    ),
    "hivemind.averaging.matchmaking:Matchmaking": (
        "group_key_manager",
        "target_group_size",
        "potential_leaders",
    ),
    "hivemind.averaging.key_manager:GroupKeyManager": ("group_bits", "target_group_size"),
    "hivemind.averaging.matchmaking:PotentialLeaders": ("target_group_size",),
    # greenswarm.averaging.exact.ExactAllReduceRunner (a subclass)
    "hivemind.averaging.allreduce:AllReduceRunner": (
        "run",  # overridden: all or nothing
        "finalize",  # overridden: a failed runner's error is read
        "_future",
        "_communicate_with_peer",  # overridden: exact results, the sender closes
        "rpc_aggregate_part",  # overridden: the reducer lingers
        "_accumulate_parts_streaming",  # overridden: parts screened against claims
        "_ban_sender",
        "active_senders",
        "banned_senders",
        "all_senders_started",
        "_generate_input_for_peer",
        "_get_peer_stub",
        "should_delay_results",
        "tensor_part_container",
        "tensor_part_reducer",
        "parts_for_local_averaging",
        "sender_peer_ids",
        "ordered_peer_ids",
        "reducer_timeout",
        "modes",
        "weight",
    ),
    "hivemind.averaging.partition:TensorPartContainer": (
        "return_deltas",
        "local_tensors",
        "failed_size",
        "total_size",
        "num_parts_by_peer",
        "register_processed_part",
        "register_failed_reducer",
    ),
    "hivemind.averaging.partition:TensorPartReducer": (
        "finished",
        "accumulate_part",
        "num_parts",
        "num_parts_received",
        # greenswarm.averaging.aggregation.TrimmedMeanReducer (a subclass): its accumulator keeps parts
        "reset_accumulators",  # overridden: the parts' keeper in place of the running sum
        "accumulator",  # (whose add_ and div_ the base class calls as a part arrives and completes)
        "part_shapes",
        "num_senders",
        "current_part_index",
    ),
    # greenswarm.node.rejoin: re-dial the entry points through the daemon's client; the relay pass
    # (greenswarm.bootstrap.relay_gate, greenswarm.node.relay_pass): a unary call with raw bytes
    "hivemind.p2p.p2p_daemon:P2P": ("_client", "FORCE_REACHABILITY_MAPPING"),
    "hivemind.p2p.p2p_daemon_bindings.p2pclient:Client": ("add_unary_handler", "call_unary_handler"),
    # greenswarm.node.supervisor: each forked node gets cross-process locks of its own
    "hivemind.utils.mpfuture:MPFuture": ("reset_backend",),
}


# ---------------------------------------------------------------------------------------- the seam


def register_codec(name: str, codec: Any) -> None:
    """Put ``codec`` in hivemind's codec registry under the compression type ``name`` (its decoder for
    every tensor that arrives with that type)."""
    from hivemind.compression import serialization

    serialization._BASE_COMPRESSION_TYPES[name] = codec


def add_p2pd_mode(name: str, flags: dict[str, Any]) -> None:
    """Teach hivemind's P2P a named set of p2pd flags, chosen by ``force_reachability=name`` (hivemind
    passes ``FORCE_REACHABILITY_MAPPING[force_reachability]`` to p2pd and has no other way to add one)."""
    from hivemind.p2p import P2P

    P2P.FORCE_REACHABILITY_MAPPING.setdefault(name, flags)


def p2pd_mode(name: str | None) -> dict[str, Any]:
    """The p2pd flags hivemind's P2P passes for ``force_reachability=name`` (none for None)."""
    from hivemind.p2p import P2P

    return dict(P2P.FORCE_REACHABILITY_MAPPING.get(name, {})) if name else {}


async def dial(p2p: Any, peer: Any, addr: Any) -> None:
    """Connect the daemon to ``peer`` at ``addr`` (hivemind's P2P has no public dial)."""
    await p2p._client.connect(peer, [addr])


async def add_unary_handler(p2p: Any, name: str, handler: Any) -> None:
    """Answer unary calls to protocol ``name`` with ``handler(request: bytes, caller: PeerID) -> bytes``
    (the caller's id is the one the transport authenticated); hivemind's public handlers want protobufs."""
    await p2p._client.add_unary_handler(name, handler)


async def call_unary(p2p: Any, peer: Any, name: str, data: bytes) -> bytes:
    """Call ``peer``'s unary handler ``name`` with ``data``; its answer."""
    return await p2p._client.call_unary_handler(peer, name, data)


def fresh_future_locks() -> None:
    """Give this process, and every helper it forks from now on, hivemind's cross-process future locks
    of its own.

    hivemind makes them once, at import (a ``multiprocessing.Lock`` is a semaphore in shared memory), so
    every process forked from the importer shares them. A process killed while it holds one -- a
    helper of a crashed node, SIGKILLed or ended by ``os._exit`` in the middle of sending a result --
    leaves it held for good, and then every later sender blocks forever: a supervised node forked
    again after a crash hung in ``DHT.wait_until_ready`` because its new DHT process waited on the
    dead helper's lock to report that it was ready. Call it right after a fork, before any hivemind
    part starts: hivemind's reset also drops the process's future backend (its result pipe), which a
    freshly forked process would make anew anyway, but which would break futures already pending.
    """
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()


def set_group(averager: Any, bits: str, target: int) -> None:
    """(averager process) The next round's group key bits and expected group size, everywhere
    hivemind's matchmaking keeps a copy of them."""
    matchmaking = averager._matchmaking
    matchmaking.group_key_manager.group_bits = bits
    matchmaking.group_key_manager.target_group_size = target
    matchmaking.target_group_size = target
    matchmaking.potential_leaders.target_group_size = target


def call_averager(averager: Any, method: str, wait_s: float, **kwargs: Any) -> Any:
    """Run the async ``method`` of ``averager`` in its process (it takes a ``future`` keyword and sets
    its result there) and wait up to ``wait_s`` for the result."""
    from hivemind.utils import MPFuture

    future = MPFuture()
    averager._outer_pipe.send((method, [], dict(kwargs, future=future)))
    return future.result(timeout=wait_s)


class _LockedPipe:
    """A pipe end whose ``send`` holds a lock: the node calls into its averager process from several
    threads (the loop, a round beside training, the revocation watch), and two unlocked sends on one
    connection may interleave their bytes."""

    def __init__(self, pipe: Any):
        import threading

        self._pipe, self._lock = pipe, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._pipe.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def lock_outer_pipe(averager: Any) -> None:
    """Serialize every call into ``averager``'s process, hivemind's own (``step``) and ours alike."""
    if not isinstance(averager._outer_pipe, _LockedPipe):
        averager._outer_pipe = _LockedPipe(averager._outer_pipe)


def averager_p2p(averager: Any) -> Any:
    """(averager process) The P2P handle the averager talks through."""
    return averager._p2p


def expose_runner(averager: Any, group_id: bytes, runner: Any) -> None:
    """(averager process) Let groupmates' part requests for round ``group_id`` reach ``runner``."""
    averager._running_groups[group_id].set_result(runner)


def has_group(averager: Any, group_id: bytes) -> bool:
    """(averager process) Whether this site has registered round ``group_id`` (it is in that group)."""
    return group_id in averager._running_groups


def registered_another_group(averager: Any) -> bool:
    """(averager process) Whether this site registered a group (or ended one) since its current search
    began: hivemind clears this flag when a search begins and sets it at each registration."""
    return averager._pending_groups_registered.is_set()


def mark_averaged(averager: Any) -> None:
    """(averager process) Tell hivemind the averaged tensors changed (as its own all-reduce does)."""
    from hivemind.utils import get_dht_time

    averager.last_updated = get_dht_time()
    averager._state_updated.set()


def gathered_metadata(averager: Any, blob: bytes) -> Any:
    """What a member put in ``gather=`` when it joined a group, from hivemind's serialized blob
    (bandwidth, mode, user metadata); raises on a blob that is not one."""
    _bandwidth, _mode, user_bytes = averager.serializer.loads(blob)
    return averager.serializer.loads(user_bytes)


async def download_served_state(
    averager: Any, peer: str, chunk_timeout_s: float
) -> tuple[dict[str, Any], list[Any]] | None:
    """(averager process) The state ``peer`` serves -- (metadata, tensors) -- read from hivemind's
    state-download stream, or None when it served no metadata. Unlike hivemind's own
    ``load_state_from_peers``, the caller chooses the peer."""
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import aiter_with_timeout
    from hivemind.utils.streaming import combine_from_streaming

    stub = averager.get_stub(averager._p2p, PeerID.from_base58(peer), namespace=averager.prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    metadata, tensors, parts = None, [], []
    async for message in aiter_with_timeout(stream, timeout=chunk_timeout_s):
        if message.metadata:
            metadata = averager.serializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return None if metadata is None else (metadata, tensors)


# ---------------------------------------------------------------------------------------- the check


def declared() -> set[str]:
    """Every internal name in the table."""
    return {name for names in INTERNALS.values() for name in names}


def missing() -> list[str]:
    """``module:Class.name`` for every listed internal the installed hivemind lacks.

    A name counts as present when the class (or a base) or module has it as an attribute, or when
    the class's source assigns it (``self.name = ...``: an instance attribute)."""
    gone = []
    for where, names in INTERNALS.items():
        module_name, _, class_name = where.partition(":")
        try:
            owner = importlib.import_module(module_name)
            owner = getattr(owner, class_name) if class_name else owner
        except (ImportError, AttributeError) as err:
            gone.append(f"{where} ({err})")
            continue
        assigned = _assigned(owner) if class_name else set()
        gone += [f"{where}.{name}" for name in names if not hasattr(owner, name) and name not in assigned]
    return gone


def _assigned(cls: type) -> set[str]:
    """Attribute names that hivemind's source of ``cls`` (and its hivemind bases) assigns."""
    names: set[str] = set()
    for base in inspect.getmro(cls):
        if not base.__module__.startswith("hivemind"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
    return names
