"""The poisoning faults: what a malicious member would put on the wire, for tests of the group's defences.

They run in the averager process, on the coded update, after the clean update's norm was claimed in
the group's metadata -- so a screen that trusts the claim alone is fooled, and only the reducers'
checks against it (:mod:`greenswarm.averaging.exact`) and the void-slice rule can stop the poison.
"""

from __future__ import annotations

import logging

import torch
from hivemind.compression import CompressionBase

from greenswarm.averaging.codecs import CarriesNaN
from greenswarm.faults import FaultPlan

log = logging.getLogger(__name__)


def poison(coded: torch.Tensor, compression: CompressionBase, faults: FaultPlan) -> CompressionBase:
    """The ``poison-nan``, ``poison-scale`` and ``poison-part`` faults: ``coded`` becomes NaN, 1000x
    the update, or 1000x its second half. Returns the codec to send with: greenswarm's own formats
    refuse to encode NaN, so a NaN poisoner sends through :class:`CarriesNaN`, as a hand-written peer
    would (without it, the poisoner's sends fail and its groupmates never see the poison)."""
    nan, scale = faults.fires("poison-nan"), faults.fires("poison-scale")  # count all of them
    part = faults.fires("poison-part")
    if nan:
        log.warning("fault injected: poison-nan (this site sends NaN as its update)")
        coded.fill_(float("nan"))
        return CarriesNaN(compression)
    if scale:
        log.warning("fault injected: poison-scale (this site sends 1000x its update)")
        coded.mul_(1000)
    if part:  # the first half stays clean: the reducers of that slice see nothing wrong with it
        log.warning("fault injected: poison-part (this site sends 1000x the second half of its update)")
        coded[coded.numel() // 2 :].mul_(1000)
    return compression
