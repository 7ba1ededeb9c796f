"""Wire formats for averaging: what a pseudo-gradient looks like on the wire, and their round trips.

hivemind names a codec on the wire by a closed enum (``CompressionType`` in its runtime.proto) and
finds the decoder in a process-wide registry. Its own 8-bit codecs crash on numpy 2.x, so greenswarm
brings its own and *takes one slot* of that enum for all of them: ``BLOCKWISE_8BIT`` (whose hivemind
decoder needs bitsandbytes, which greenswarm does not install). Every buffer in that slot starts
with a two-byte header -- a greenswarm format tag and its version -- so one slot carries bf16, int8
and int8+entropy, a peer with a different or newer format fails loudly on the first part it
decodes, and a plain hivemind peer (bitsandbytes decoder) cannot mistake the bytes for its own.
Taking the slot instead of compressing outside the averager keeps hivemind's streaming, part
scheduling and load balancing, and the exact runner (:mod:`greenswarm.averaging.exact`) decodes
with whatever the slot holds. See docs/compression.md.

Formats (``averaging.wire``):

* ``fp32``, ``fp16``, ``scaled-fp16`` -- hivemind's own, which work on numpy 2.x;
* ``bf16`` -- the upper half of each fp32 (round to nearest even);
* ``int8`` -- blockwise absmax: blocks of :data:`BLOCK` values share one fp32 scale
  ``absmax / 127`` and each value is ``round(x / scale)`` in [-127, 127] (8.03 bits a value);
* ``int8-zstd`` -- ``int8`` whose codes are then entropy-coded with zstandard (Huffman literals
  under the hood). It pays only when codes are concentrated; AdamW pseudo-gradients are close to
  uniform within a block, so it saves little (benchmarks/wire_formats.py);
* ``int7-zstd`` -- the same blocks with codes in [-63, 63] (half the levels, twice the error, which
  error feedback carries into the next round), entropy-coded: about 7 bits a value on the wire.

Every format is deterministic, so members that decode the same bytes get the same bits, and its
round trip is idempotent on aligned blocks (a vector that already went through it goes through
unchanged), which is what lets error feedback quantize the whole vector once before the all-reduce
splits it into parts (:func:`prepare`).
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    deserialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from greenswarm.averaging.screening import all_finite
from greenswarm.hivemind_internals import register_codec

#: values per int8 block: a power of two, so hivemind's parts (2**19 values at the 1-byte estimate
#: below) always start on a block boundary
BLOCK = 1024
SLOT = runtime_pb2.CompressionType.BLOCKWISE_8BIT
_HEADER = struct.Struct("<BB")  # format tag, format version

TAG_BF16, TAG_INT8, TAG_INT8_ZSTD, TAG_INT7_ZSTD = 1, 2, 3, 4
VERSION = 1
#: largest code magnitude per quantizing format: 127 uses all of int8; 63 halves the levels (7 bits)
LEVELS = {TAG_INT8: 127, TAG_INT8_ZSTD: 127, TAG_INT7_ZSTD: 63}
ENTROPY_CODED = (TAG_INT8_ZSTD, TAG_INT7_ZSTD)
ZSTD_LEVEL = 1


class WireFormatError(ValueError):
    """A part on the wire is not in a format this peer can decode (another greenswarm version?)."""


def _to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


def _blocked(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as rows of :data:`BLOCK` values (a view when its length is a multiple, else zero-padded)."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.reshape(-1, BLOCK)
    padded = torch.zeros(-(-n // BLOCK) * BLOCK, dtype=dtype)
    padded[:n] = x
    return padded.view(-1, BLOCK)


#: blocks coded per pass: ~1 M values (4 MB of fp32), so each pass's temporaries stay in the cache and
#: a ~100 M-value vector is coded without model-sized temporaries (each costs page faults as well as a
#: pass over memory: a round codes and decodes the vector several times, on cores that train)
CHUNK_BLOCKS = 1024


def _row_chunks(x: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """``x`` (flat) as successive chunks of up to :data:`CHUNK_BLOCKS` rows of :data:`BLOCK` values,
    each with its rows' slice: views of ``x``, except the last chunk when ``x`` ends in a partial block
    (that one is a zero-padded copy, a chunk long at most -- not a padded copy of all of ``x``)."""
    n = x.numel()
    rows = -(-n // BLOCK)
    for start in range(0, rows, CHUNK_BLOCKS):
        stop = min(start + CHUNK_BLOCKS, rows)
        if stop * BLOCK <= n:
            yield slice(start, stop), x[start * BLOCK : stop * BLOCK].view(-1, BLOCK)
        else:
            yield slice(start, stop), _blocked(x[start * BLOCK :], x.dtype)


def _int8_encode(x: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, in [-levels, levels]) and per-block scales (fp32) of a flat fp32 vector.

    Elementwise the same arithmetic in any chunking (absmax, one division, one reciprocal, one
    multiplication, round, clamp), so the codes are the same bits however the vector is cut."""
    n = x.numel()
    rows = -(-n // BLOCK)
    codes = torch.empty((rows, BLOCK), dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    for span, chunk in _row_chunks(x):
        scale = _scales(chunk, levels)
        codes[span] = _codes(chunk, scale, levels)
        scales[span] = scale
    return codes.view(-1)[:n], scales


def _scales(chunk: torch.Tensor, levels: int) -> torch.Tensor:
    return chunk.abs().amax(dim=1).div_(float(levels))


def _codes(chunk: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    return (chunk * inverse[:, None]).round_().clamp_(-levels, levels).to(torch.int8)


def _int8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    out = torch.empty(scales.numel() * BLOCK, dtype=torch.float32)
    rows = out.view(-1, BLOCK)
    for span, chunk in _row_chunks(codes):
        torch.mul(chunk.to(torch.float32), scales[span, None], out=rows[span])
    return out[:n]


def _int8_roundtrip(x: torch.Tensor, levels: int) -> torch.Tensor:
    """``_int8_decode(*_int8_encode(x, levels))`` in one pass, without keeping the codes (the same
    bits: codes go through int8 and back, as decoding does, so a code of -0.0 is 0.0 here too).
    Raises on NaN/Inf."""
    n = x.numel()
    out = torch.empty(-(-n // BLOCK) * BLOCK, dtype=torch.float32)
    rows = out.view(-1, BLOCK)
    for span, chunk in _row_chunks(x):
        scale = _scales(chunk, levels)
        if not torch.isfinite(scale).all():  # a block's absmax is NaN/Inf iff the block has one
            raise WireFormatError("refusing to encode a vector with NaN/Inf")
        torch.mul(_codes(chunk, scale, levels).to(torch.float32), scale[:, None], out=rows[span])
    return out[:n]


def _read_only(buffer: memoryview | bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``buffer``'s bytes without copying them (decoding only reads them; torch warns
    about any buffer it cannot write to, and a received message's bytes are such a buffer)."""
    if len(buffer) % torch.empty(0, dtype=dtype).element_size():
        raise WireFormatError(f"a wire part's {len(buffer)} bytes are not whole {dtype} values")
    if not len(buffer):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype)


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat fp32 vector (itself when it is one already)."""
    x = tensor.detach().reshape(-1)
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _refuse_non_finite(x: torch.Tensor) -> None:
    """The bf16 format carries NaN/Inf as they are, so it refuses them before coding."""
    if not all_finite(x):
        raise WireFormatError("refusing to encode a vector with NaN/Inf")


def _zstd():
    import zstandard

    return zstandard


class GreenswarmCompression(CompressionBase):
    """bf16 / int8 / int8+zstd in hivemind's ``BLOCKWISE_8BIT`` slot, told apart by a header."""

    compression_type = SLOT

    def __init__(self, tag: int = TAG_INT8):
        self.tag = tag

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        x = _flat_fp32(tensor)
        if self.tag == TAG_BF16:
            _refuse_non_finite(x)
            chunks = [_to_bf16_bits(x).numpy()]
        else:
            codes, scales = _int8_encode(x, LEVELS[self.tag])
            if not torch.isfinite(scales).all():  # a block's absmax is NaN/Inf iff the block has one
                raise WireFormatError("refusing to encode a vector with NaN/Inf")
            code_bytes = codes.numpy()  # (joined or entropy-coded straight from the tensor's memory)
            if self.tag in ENTROPY_CODED:
                code_bytes = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(code_bytes)
            chunks = [scales.numpy(), code_bytes]
        return runtime_pb2.Tensor(
            compression=SLOT,
            buffer=b"".join([_HEADER.pack(self.tag, VERSION), *chunks]),
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        buf = serialized.buffer
        if len(buf) < _HEADER.size:
            raise WireFormatError("empty greenswarm wire part")
        tag, version = _HEADER.unpack_from(buf)
        if tag not in (TAG_BF16, *LEVELS) or version != VERSION:
            raise WireFormatError(
                f"wire part in greenswarm format {tag} v{version}; this peer decodes formats 1-4 v{VERSION}"
            )
        shape = tuple(serialized.size)
        n = 1
        for d in shape:
            n *= d
        body = memoryview(buf)[_HEADER.size :]
        if tag == TAG_BF16:
            out = _read_only(body, torch.int16).view(torch.bfloat16).float()
        else:
            blocks = -(-n // BLOCK)
            if len(body) < 4 * blocks:
                raise WireFormatError(f"int8 part carries {len(body)} bytes, too few for {blocks} scales")
            scales = torch.frombuffer(bytearray(body[: 4 * blocks]), dtype=torch.float32)  # (aligned copy)
            code_bytes = body[4 * blocks :]
            if tag in ENTROPY_CODED:
                try:
                    code_bytes = _zstd().ZstdDecompressor().decompress(code_bytes, max_output_size=n)
                except _zstd().ZstdError as e:
                    raise WireFormatError(f"damaged entropy-coded codes: {e}") from None
            codes = _read_only(code_bytes, torch.int8)
            if codes.numel() != n:
                raise WireFormatError(f"int8 part carries {codes.numel()} codes, its header says {n}")
            out = _int8_decode(codes, scales)
        if out.numel() != n:
            raise WireFormatError(f"wire part decodes to {out.numel()} values, its header says {n}")
        return out.reshape(shape)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``extract(compress(x))`` without the bytes (the same bits): error feedback codes a whole
        model-sized vector each round, and the entropy stage is lossless, so only the codes matter."""
        flat = _flat_fp32(x)
        if self.tag == TAG_BF16:
            _refuse_non_finite(flat)
            out = flat.to(torch.bfloat16).float()
        else:
            out = _int8_roundtrip(flat, LEVELS[self.tag])
        return out.reshape(x.shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # exact powers of two: hivemind sizes parts as part_size_bytes / (4 * ratio) values, and that
        # must stay a multiple of BLOCK for parts to start on block boundaries
        return 0.5 if self.tag == TAG_BF16 else 0.25


class CarriesNaN(CompressionBase):
    """A codec that puts NaN on the wire where the values have NaN/Inf, as a hand-written peer could.

    greenswarm's own formats refuse to encode NaN/Inf (:class:`GreenswarmCompression`), so a site
    running them cannot send a poisoned part at all -- but a malicious peer writes the bytes itself:
    a NaN scale in an int8 block, NaN bits in bf16. The ``poison-nan`` fault hook sends with this
    codec, so the group's reducers meet NaN on the wire in every format, as they would from such a
    peer. Finite values are coded as ``inner`` codes them, the non-finite ones as 0 and then marked
    (in the block formats the NaN scale takes the whole block); this codec is also what the
    poisoning site reduces its slice with.
    """

    def __init__(self, inner: CompressionBase):
        self.inner = inner
        self.compression_type = inner.compression_type

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        if bool(torch.isfinite(tensor).all()) or not isinstance(self.inner, GreenswarmCompression):
            return self.inner.compress(tensor, info, allow_inplace)  # hivemind's formats carry NaN as is
        bad = ~torch.isfinite(tensor.detach().reshape(-1).float())
        clean = self.inner.compress(torch.where(torch.isfinite(tensor), tensor, 0.0), info)
        body = bytearray(clean.buffer)
        start = _HEADER.size
        if self.inner.tag == TAG_BF16:  # each value's 16 bits: NaN where the input was not finite
            bits = torch.frombuffer(body, dtype=torch.int16, offset=start, count=bad.numel())
            bits[bad] = torch.tensor(float("nan"), dtype=torch.bfloat16).view(torch.int16)
        else:  # a block's scale is NaN when the block held NaN/Inf: every value of it decodes to NaN
            blocks = -(-bad.numel() // BLOCK)
            scales = torch.frombuffer(body, dtype=torch.float32, offset=start, count=blocks)
            scales[_blocked(bad, torch.bool).any(dim=1)] = float("nan")
        clean.buffer = bytes(body)
        return clean

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)


def install() -> None:
    """Put greenswarm's decoder in hivemind's registry slot (idempotent; every process does it on
    import of this module, before any averager forks)."""
    register_codec(runtime_pb2.CompressionType.Name(SLOT), GreenswarmCompression())


install()


@dataclass(frozen=True)
class WireFormat:
    """A named wire format: its hivemind codec and how many bytes a value costs on the wire."""

    name: str
    compression: CompressionBase
    nominal_bytes: float  # per value, before any entropy stage (for choosing a format per round)
    version: int = VERSION

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a peer decodes from this vector (flat fp32)."""
        if isinstance(self.compression, GreenswarmCompression):
            return self.compression.roundtrip(x)
        return deserialize_torch_tensor(self.compression.compress(x, CompressionInfo.from_tensor(x)))

    def encoded_bytes(self, x: torch.Tensor) -> int:
        return len(self.compression.compress(x, CompressionInfo.from_tensor(x)).buffer)


WIRE_FORMATS: dict[str, WireFormat] = {
    "fp32": WireFormat("fp32", NoCompression(), 4.0),
    "fp16": WireFormat("fp16", Float16Compression(), 2.0),
    "scaled-fp16": WireFormat("scaled-fp16", ScaledFloat16Compression(), 2.0),
    "bf16": WireFormat("bf16", GreenswarmCompression(TAG_BF16), 2.0),
    "int8": WireFormat("int8", GreenswarmCompression(TAG_INT8), 1.0 + 4.0 / BLOCK),
    "int8-zstd": WireFormat("int8-zstd", GreenswarmCompression(TAG_INT8_ZSTD), 1.0 + 4.0 / BLOCK),
    "int7-zstd": WireFormat("int7-zstd", GreenswarmCompression(TAG_INT7_ZSTD), 7.0 / 8 + 4.0 / BLOCK),
}


def wire_format(name: str) -> WireFormat:
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown wire format {name!r}; known: {', '.join(WIRE_FORMATS)}") from None
