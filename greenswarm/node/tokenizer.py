"""Tokenizers behind one small interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``.

Pretraining starts from random init, so the tokenizer only has to be *the same at every site*. The
default byte-level tokenizer needs no download and no files, so a swarm runs offline anywhere; a real
run can instead point at a local Hugging Face tokenizer directory (never fetched from the Hub here,
because sites must not silently diverge on whatever the Hub serves today).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from greenswarm.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the model builder need from a tokenizer."""

    vocab_size: int
    eos_id: int
    fingerprint: str  # equal at two sites exactly when they tokenize alike

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS/EOS/PAD: a vocabulary that exists everywhere.

    Every string round-trips exactly, no file is needed, and the vocabulary is tiny, which keeps the
    ``tiny`` preset's embedding small enough to train on a CPU.
    """

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    fingerprint = "bytes/259"  # what sites compare: every byte tokenizer is this one

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes; no special tokens are added (the caller places EOS)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens; broken UTF-8 sequences become U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face tokenizer behind the :class:`ByteTokenizer` interface."""

    def __init__(self, tokenizer: Any, name: str = ""):
        self.tokenizer = tokenizer
        self.name = name
        # len() counts added tokens too, which is what the embedding must cover.
        self.vocab_size = len(tokenizer)
        eos = _first_not_none(
            tokenizer.eos_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id
        )
        if eos is None:
            raise ConfigError(
                f"tokenizer {name!r} has no eos, sep, pad or bos token to separate documents with",
                field="tokenizer",
            )
        self.eos_id = int(eos)
        bos = tokenizer.bos_token_id
        pad = tokenizer.pad_token_id
        self.bos_id = int(bos) if bos is not None else self.eos_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.fingerprint = f"hf/{self.vocab_size}/{_tokenizer_digest(tokenizer)}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the tokenizer's own BOS/EOS (the data pipeline places EOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> :class:`ByteTokenizer`; anything else is a local Hugging Face tokenizer directory.

    Only local files are read (``local_files_only=True``): a Hub name would make each site depend on
    the network and on the Hub's current revision, and sites must tokenize identically.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("must be 'bytes' or the path of a local tokenizer directory", field="tokenizer")
    if spec == "bytes":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if not os.path.isdir(path):
        raise ConfigError(
            f"{spec!r} is neither 'bytes' nor an existing local tokenizer directory "
            "(Hub names are not fetched; download the tokenizer and pass its directory)",
            field="tokenizer",
        )
    from transformers import AutoTokenizer  # heavy; only needed for this branch

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError, ...)
        raise ConfigError(
            f"cannot load a tokenizer from {spec!r}: {type(e).__name__}: {e}", field="tokenizer"
        ) from e
    return HFTokenizer(tok, name=spec)


def _first_not_none(*values: int | None) -> int | None:
    for v in values:
        if v is not None:
            return v
    return None


#: text whose tokens show how a tokenizer splits: cases, digits, whitespace runs, punctuation, accents,
#: scripts other than Latin, emoji and a control character
PROBE = (
    "The quick brown fox -- jumps over 1,234,567 lazy dogs!\n\tIndented  twice;\r\n"
    "naïve café Ünïcödé, 日本語のテキスト, русский текст, عربى, 🙂👍🏽\x07 end."
)


def _tokenizer_digest(tokenizer: Any) -> str:
    """What two sites compare: how the tokenizer splits text, not where it lies or how a library version
    serialises it -- the vocabulary by id, the special tokens, and the tokens of :data:`PROBE`."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(map(str, tokenizer.all_special_tokens))
    probe = tokenizer.encode(PROBE, add_special_tokens=False)
    state = json.dumps([vocab, special, probe], ensure_ascii=False)
    return hashlib.blake2b(state.encode(), digest_size=4).hexdigest()
