"""Every part of hivemind that greenswarm uses although hivemind does not promise to keep it.

greenswarm pins hivemind (1.1.12) and leans on some of its internals: it overrides the averager's
aggregation and all-reduce hooks, pokes the matchmaking's group key, runs its own all-reduce runner
on hivemind's part containers, dials peers through the daemon client and registers p2pd flag sets.
A new hivemind could rename any of them and break a swarm at run time, in the middle of a round.
This table names each one, by the hivemind class that holds it, so that

* ``tests/test_hivemind_internals.py`` fails loudly, before anything runs, when the installed
  hivemind lacks one (:func:`missing`), and
* the same test fails when greenswarm starts using a private hivemind name that is not listed here,
  so the table stays the whole list.

A leaf module: hivemind is imported only inside :func:`missing`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

#: "module:Class" (or "module:" for module attributes) -> the internal names greenswarm reads,
#: writes, calls or overrides there
INTERNALS: dict[str, tuple[str, ...]] = {
    # greenswarm.averaging.codecs: greenswarm's wire codecs go into hivemind's codec registry
    "hivemind.compression.serialization:": ("_BASE_COMPRESSION_TYPES",),
    # greenswarm.averaging.averager.SwarmAverager (a subclass)
    "hivemind.averaging.averager:DecentralizedAverager": (
        "_aggregate_with_group",  # overridden: the round's report and timeout
        "_run_allreduce_inplace_",  # overridden: the exact runner, wire choice, screening
        "_matchmaking",  # the group key and expected size, set per round
        "_outer_pipe",  # calls into the averager process
        "_p2p",
        "_running_groups",  # where groupmates' part requests find this round's runner
        "_state_updated",
        "last_updated",
        "serializer",
        "get_stub",
        "rpc_join_group",  # overridden: admission
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
        "_communicate_with_peer",  # overridden: exact results, the sender closes
        "rpc_aggregate_part",  # overridden: the reducer lingers
        "_accumulate_parts_streaming",  # overridden: parts screened against claims
        "_ban_sender",
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
    "hivemind.averaging.partition:TensorPartReducer": ("finished", "accumulate_part", "num_parts"),
    # greenswarm.node.rejoin: re-dial the entry points through the daemon's client
    "hivemind.p2p.p2p_daemon:P2P": ("_client", "FORCE_REACHABILITY_MAPPING"),
}


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
