"""Choosing a round's wire format: every member of a group computes the same choice from the same data.

Each member adds a :func:`wire_offer` to the metadata hivemind gathers during matchmaking: its
configured format (or ``auto``), the versions of the formats it can decode, the link rate it
measured in its last all-reduce, and its round budget. hivemind hands every member the same gathered
list, so :func:`choose_wire` -- a pure function of it -- gives every member the same format without
another message. A group whose members configured different fixed formats, or whose decoders
differ in version, is refused with an error naming the peer: averaging bytes that one member
reads differently from another would be garbage.

``auto`` picks, per round, the most precise of ``bf16``, ``int8`` and ``int7-zstd`` whose transfer
fits the round budget on the slowest member's measured link, else ``int7-zstd``; before any member
has measured its link, ``int7-zstd``. Coding speed is not part of the choice: zstd codes hundreds of
MB/s (benchmarks/wire_formats.py), far above the WAN links this is for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from greenswarm.averaging.codecs import WIRE_FORMATS, WireFormat

#: formats ``auto`` chooses between, most precise first
AUTO_CANDIDATES = ("bf16", "int8", "int7-zstd")


class WireMismatch(RuntimeError):
    """Members of a group cannot agree on a wire format; the round must not run."""


def wire_offer(wire: str, measured_mbit: float | None, budget_s: float) -> dict[str, Any]:
    """What this member tells its group about its wire format (goes into the gathered metadata)."""
    return {
        "wire": wire,
        "formats": {name: f.version for name, f in WIRE_FORMATS.items()},
        "mbit": None if measured_mbit is None else float(measured_mbit),
        "budget_s": float(budget_s),
    }


def transfer_s(fmt: WireFormat, numel: int, group_size: int, mbit: float) -> float:
    """Seconds a member's link spends on one all-reduce of ``numel`` values in ``fmt``: it sends
    (n-1)/n of its vector and receives as much back, in both phases of the butterfly."""
    wire_bytes = 2 * numel * fmt.nominal_bytes * (group_size - 1) / group_size
    return 8 * wire_bytes / (mbit * 1e6)


def choose_wire(offers: Mapping[str, Mapping[str, Any]], numel: int) -> WireFormat:
    """The wire format of a round, from each member's offer (peer id -> offer)."""
    missing = sorted(p for p, o in offers.items() if not isinstance(o, Mapping) or "wire" not in o)
    if missing:
        raise WireMismatch(f"peer(s) {', '.join(missing)} sent no wire format (another greenswarm version?)")
    fixed = {p: o["wire"] for p, o in offers.items() if o["wire"] != "auto"}
    if len(set(fixed.values())) > 1:
        listed = ", ".join(f"{p[-8:]}={w}" for p, w in sorted(fixed.items()))
        raise WireMismatch(f"members use different wire formats ({listed}); set averaging.wire alike")
    if fixed:
        name = next(iter(fixed.values()))
    else:
        rates = [float(o["mbit"]) for o in offers.values() if o.get("mbit")]
        budget = min(float(o.get("budget_s", 0.0)) for o in offers.values())
        slowest = min(rates) if rates else None
        name = AUTO_CANDIDATES[-1]
        if slowest is not None:
            for candidate in AUTO_CANDIDATES:
                if transfer_s(WIRE_FORMATS[candidate], numel, len(offers), slowest) <= budget:
                    name = candidate
                    break
    fmt = WIRE_FORMATS.get(name)
    if fmt is None:
        raise WireMismatch(f"wire format {name!r} is unknown to this peer")
    for peer, offer in offers.items():
        theirs = offer.get("formats", {}).get(name) if isinstance(offer.get("formats"), Mapping) else None
        if theirs != fmt.version:
            raise WireMismatch(
                f"peer {peer} decodes {name} version {theirs}, this peer version {fmt.version}; "
                "upgrade greenswarm on both"
            )
    return fmt


def offers_of(gathered: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Mapping[str, Any]]:
    """Peer id -> wire offer, from (peer id, gathered user data) pairs."""
    return {
        str(p): (data.get("wire_offer") if isinstance(data, Mapping) else None) or {} for p, data in gathered
    }
