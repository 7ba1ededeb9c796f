"""Digests of exact contents: what two processes compare to prove they hold the same bits.

One walk serves the round agreement (a site's global state and the averaged pseudo-gradient) and
checkpoints (a nested payload of tensors and plain values).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def content_digest(obj: Any) -> str:
    """A digest of ``obj``: tensors by dtype, shape and bytes; lists, tuples and dicts in order (dict
    keys sorted); every other value by its type and repr."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy; 0-dim too (Adam's step)
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            for key in sorted(x, key=repr):
                h.update(repr(key).encode())
                walk(x[key])
        elif isinstance(x, list | tuple):
            h.update(f"L{len(x)}".encode())
            for item in x:
                walk(item)
        else:
            h.update(f"V{type(x).__name__}:{x!r}".encode())

    walk(obj)
    return h.hexdigest()
