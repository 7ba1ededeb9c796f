"""Model presets and a deterministic random-init builder.

DiLoCo averages the *progress* of sites that must have started from the same weights, so
:func:`build_model` is bit-identical for a given seed, whatever the device it is built for. The
vocabulary size is not part of a preset: it comes from the tokenizer, so one preset serves the byte
tokenizer and a 128k-token tokenizer alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from greenswarm.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Preset:
    """A model family and its shape; ``vocab_size`` is filled in from the tokenizer."""

    family: str  # "llama" or "gpt2"
    shape: dict[str, Any] = field(default_factory=dict)
    description: str = ""


PRESETS: dict[str, Preset] = {
    # ~1.08 M parameters with the byte tokenizer: trains at tens of steps/s on one CPU thread.
    "tiny": Preset(
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        "CPU-sized Llama (hidden 128, 4 layers) for tests and demos",
    ),
    # ~99 M parameters with the byte tokenizer: the 100M-class model for codec and memory measurements.
    "small": Preset(
        "llama",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            intermediate_size=2560,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        "Llama with hidden 768, 12 layers (~99 M with the byte tokenizer)",
    ),
    # GPT-2 medium's shape; dropout off, as in modern pretraining (and steps stay reproducible).
    "gpt2-medium": Preset(
        "gpt2",
        dict(
            n_embd=1024,
            n_layer=24,
            n_head=16,
            n_positions=1024,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "GPT-2 medium shape (~355 M with GPT-2's 50257-token vocabulary)",
    ),
    # Llama-3.2-1B's shape (~1.24 B with its 128256-token vocabulary).
    "llama-1b": Preset(
        "llama",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        "Llama-3.2-1B shape",
    ),
}


@dataclass
class ModelConfig:
    """Which model a site trains. All sites of one swarm must use the same values.

    The architecture is one of :data:`PRESETS` (``preset``, random init), any causal LM that
    transformers builds from a Hugging Face ``config.json`` (``config``: the file, or a directory
    holding one; random init), or a local Hugging Face model directory whose weights the site starts
    from (``init_from``: continued pretraining). ``config`` and ``init_from`` take the place of
    ``preset``; the vocabulary is then the config's, which must cover the tokenizer's.
    """

    preset: str = "tiny"
    config: str | None = None  # a Hugging Face config.json (or its directory): the architecture
    init_from: str | None = None  # a local Hugging Face model directory: start from its weights
    tokenizer: str = "bytes"  # "bytes" or a local Hugging Face tokenizer directory
    seed: int = 0  # the random init; identical at every site

    def validate(self) -> None:
        """Raise :class:`ConfigError` (field = this dataclass's field name) for a bad value."""
        if self.preset not in PRESETS:
            raise ConfigError(
                f"unknown preset {self.preset!r}; choose one of {', '.join(sorted(PRESETS))}",
                field="preset",
            )
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ConfigError("must be 'bytes' or a local tokenizer directory", field="tokenizer")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"must be a non-negative integer, got {self.seed!r}", field="seed")
        if self.config is not None and self.init_from is not None:
            raise ConfigError(
                "give model.config or model.init_from, not both (a model directory has its own config.json)",
                field="init_from",
            )
        if self.config is not None:
            config_file(self.config, "config")
        if self.init_from is not None:
            path = weights_dir(self.init_from)
            own = [name for name in TOKENIZER_FILES if (path / name).is_file()]
            if own and self.tokenizer == "bytes":
                raise ConfigError(
                    f"model.init_from {self.init_from!r} has its own tokenizer ({own[0]}); set "
                    f"model.tokenizer: {self.init_from} (its embeddings would read byte ids as its tokens)",
                    field="tokenizer",
                )

    @property
    def source(self) -> str:
        """Where the architecture (and weights) come from, as logs and summaries say it."""
        if self.init_from is not None:
            return f"weights of {self.init_from}"
        if self.config is not None:
            return f"config {self.config}"
        return f"preset {self.preset}"


#: file names of a Hugging Face model directory's weights (single file or sharded with an index)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


#: files that say a model directory comes with a Hugging Face tokenizer of its own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def config_file(spec: str, field: str) -> Path:
    """The ``config.json`` that ``spec`` names (the file, or a directory holding one)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("must be the path of a Hugging Face config.json or its directory", field=field)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{spec!r}: no such file (a Hugging Face config.json, or a directory holding one; "
            "Hub names are not fetched)",
            field=field,
        )
    return path


def weights_dir(spec: str) -> Path:
    """The local Hugging Face model directory ``spec`` names, refused without a config or weights."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("must be a local Hugging Face model directory", field="init_from")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"{spec!r} is not a directory (a local Hugging Face model directory; Hub names are not "
            "fetched: download the model and pass its directory)",
            field="init_from",
        )
    config_file(str(path), "init_from")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{spec!r} has no weights ({' or '.join(WEIGHT_FILES[::2])})", field="init_from")
    return path


def model_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of the site's model: ``cfg.preset`` with the tokenizer's vocabulary size,
    or the ``config.json`` of ``cfg.config`` / ``cfg.init_from`` (whose vocabulary must cover it).

    A preset's special-token ids are left unset: they matter for generation, not for next-token
    training, and the presets' defaults (e.g. GPT-2's 50256) would not fit a small vocabulary.
    """
    cfg.validate()
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if cfg.config is not None or cfg.init_from is not None:
        return _file_config(cfg, vocab_size)
    preset = PRESETS[cfg.preset]
    common: dict[str, Any] = dict(
        vocab_size=int(vocab_size),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=False,  # training never reuses a KV cache
        attn_implementation="sdpa",  # fused attention kernels; supported by both families
    )
    if preset.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**preset.shape, **common)
    if preset.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(**preset.shape, **common)
    raise AssertionError(f"preset {cfg.preset!r} has unknown family {preset.family!r}")


def _file_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The config.json that ``model.config`` or ``model.init_from`` names, checked against the
    tokenizer, with training's settings (no KV cache)."""
    from transformers import AutoConfig

    field_name = "init_from" if cfg.init_from is not None else "config"
    path = config_file(cfg.init_from if cfg.init_from is not None else cfg.config, field_name)  # type: ignore[arg-type]
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError, JSON errors ...
        raise ConfigError(
            f"{path}: not a config transformers can read: {_one_line(e)}", field=field_name
        ) from e
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < vocab_size:
        raise ConfigError(
            f"{path}: vocab_size {vocab} does not cover the tokenizer's {vocab_size} tokens "
            f"(model.tokenizer: {cfg.tokenizer})",
            field=field_name,
        )
    config.use_cache = False  # training never reuses a KV cache
    return config


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def build_model(cfg: ModelConfig, vocab_size: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The site's causal LM: randomly initialised, bit-identical for the same ``cfg.seed`` (and
    architecture, vocab), or loaded from ``cfg.init_from``'s weights.

    Weights are drawn (or read) on the CPU, in fp32, with a private generator state (the caller's RNG
    is untouched) and then moved, so a site on CUDA starts from exactly the weights of a site on
    another GPU model or on CPU. ``device="meta"`` builds the structure without memory, to count big
    models.
    """
    from transformers import AutoModelForCausalLM

    config = model_config(cfg, vocab_size)
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            return _from_config(AutoModelForCausalLM, config, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        with torch.device("cpu"):
            if cfg.init_from is not None:
                model = _from_pretrained(AutoModelForCausalLM, cfg.init_from)
            else:
                model = _from_config(AutoModelForCausalLM, config, cfg)
    model.train()
    return model.to(device)


def _from_config(auto: Any, config: PretrainedConfig, cfg: ModelConfig) -> torch.nn.Module:
    """``auto.from_config`` in fp32 with fused attention (``sdpa``) where the architecture has it, else
    ``eager``; an architecture that is not a causal LM is one line naming the config."""
    field_name = "config" if cfg.config is not None else ("init_from" if cfg.init_from else "preset")
    try:
        try:
            return auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        except ValueError as e:  # this architecture has no sdpa kernel (said in the error)
            if "sdpa" not in str(e).lower() and "attention" not in str(e).lower():
                raise
            return auto.from_config(config, dtype=torch.float32, attn_implementation="eager")
    except (ValueError, KeyError, ImportError) as e:
        raise ConfigError(
            f"transformers cannot build a causal LM from {cfg.source}: {_one_line(e)}", field=field_name
        ) from e


def _from_pretrained(auto: Any, directory: str) -> torch.nn.Module:
    from transformers.utils import logging as transformers_logging

    path = weights_dir(directory)
    transformers_logging.disable_progress_bar()  # a bar per start in the node's log says nothing
    try:
        model = auto.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    except Exception as e:  # damaged weights, an unknown architecture, missing tensors ...
        raise ConfigError(
            f"cannot load a causal LM from {directory!r}: {_one_line(e)}", field="init_from"
        ) from e
    model.config.use_cache = False
    return model


@dataclass(frozen=True)
class ModelIdentity:
    """What must be equal at every site of a swarm: architecture, parameter count, tokenizer and the
    weights training starts from.

    ``digest`` covers the architecture's config (less what does not change the computation: names,
    versions, the KV cache, the attention kernel), every parameter's name and shape, and the
    tokenizer's fingerprint; ``weights`` is a fingerprint of the starting weights (a preset's seed, a
    config's seed, an ``init_from`` directory's weights): sites that start from different weights would
    average progress made from different places. ``transformers`` is the library's version, named in
    a refusal because a config's keys can differ between versions. ``state`` is what the site's global
    state holds (the trainer's ``state_layout``: ``params`` with AdamW, schedule-free ``x`` or ``x+z``):
    sites that average different things must not meet. A progress record carries :meth:`to_wire`; a
    site refuses to train with a site whose identity differs, naming both.
    """

    architecture: str
    parameters: int
    tokenizer: str
    digest: str
    weights: str
    transformers: str = ""
    state: str = "params"

    def __str__(self) -> str:
        return (
            f"{self.architecture}, {self.parameters:,} parameters, tokenizer {self.tokenizer}, "
            f"starting weights {self.weights} [{self.digest}]"
        )

    @property
    def key(self) -> str:
        """What averaging groups are keyed by: sites of another model, or of another optimizer's
        global state, never meet this one."""
        base = f"{self.digest}-{self.weights}"
        return base if self.state == "params" else f"{base}-{self.state.replace('/', '-').replace('+', '')}"

    def differences(self, other: ModelIdentity) -> list[str]:
        """What differs from ``other``, in words."""
        named = [
            what
            for what, a, b in (
                ("architecture", self.architecture, other.architecture),
                ("parameter count", self.parameters, other.parameters),
                ("tokenizer", self.tokenizer, other.tokenizer),
                ("starting weights (model.seed, model.init_from)", self.weights, other.weights),
                ("inner optimizer's global state (train.optimizer, train.sf_z)", self.state, other.state),
            )
            if a != b
        ]
        if not named and self.key != other.key:
            versions = ""
            if self.transformers != other.transformers:
                versions = f" (transformers {self.transformers} here, {other.transformers} there)"
            named = [f"configuration{versions}"]
        return named

    def same_model(self, other: ModelIdentity | None) -> bool:
        """Whether ``other`` trains this model from this start (the library versions may differ)."""
        return other is not None and other.key == self.key

    def to_wire(self) -> str:
        fields = (self.architecture, str(self.parameters), self.tokenizer, self.digest, self.weights)
        extra = () if self.state == "params" else (self.state,)  # (as an AdamW site always wrote it)
        return "|".join((*fields, self.transformers, *extra))

    @classmethod
    def from_wire(cls, text: str) -> ModelIdentity | None:
        """The identity a record carries (None when it is not one)."""
        parts = text.split("|")
        if len(parts) not in (6, 7) or not parts[1].isdigit():
            return None
        return cls(parts[0], int(parts[1]), parts[2], parts[3], parts[4], parts[5], *parts[6:])


#: config keys that name, version or tune a model without changing what it computes
_NOT_ARCHITECTURE = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "attn_implementation",
    "_attn_implementation", "_attn_implementation_autoset", "architectures", "output_attentions",
    "output_hidden_states", "return_dict", "_commit_hash", "bos_token_id", "eos_token_id", "pad_token_id",
}  # fmt: skip


def model_identity(
    model: torch.nn.Module, tokenizer_fingerprint: str, cfg: ModelConfig, state: str = "params"
) -> ModelIdentity:
    """The :class:`ModelIdentity` of a model built from ``cfg`` (unsharded, not yet trained) and its
    tokenizer.

    The starting weights are named by their recipe where they are drawn (``seed-N``: the random init
    of the architecture the digest describes), not by their bits: a CPU's vector unit changes the last
    bits of ``normal_`` (x86 AVX2 against aarch64), and those sites must still train together. Weights
    read from ``init_from`` are the file's bits on every host, so they are fingerprinted."""
    import transformers

    config = model.config  # type: ignore[union-attr]
    arch = {k: v for k, v in config.to_dict().items() if k not in _NOT_ARCHITECTURE}
    shapes = [(name, list(p.shape)) for name, p in model.named_parameters()]
    blob = json.dumps([arch, shapes, tokenizer_fingerprint], sort_keys=True, default=str).encode()
    digest = hashlib.blake2b(blob, digest_size=6).hexdigest()
    return ModelIdentity(
        str(config.model_type),
        count_parameters(model),
        tokenizer_fingerprint,
        digest,
        f"init-{weights_fingerprint(model)}" if cfg.init_from is not None else f"seed-{cfg.seed}",
        str(transformers.__version__),
        state,
    )


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, per_tensor: int = 1024) -> str:
    """A fingerprint of a model's weights from ``per_tensor`` evenly spaced values of each tensor, its
    first and last included, with each tensor's sum: cheap at any size (a billion parameters are not
    hashed at every start) and, for two sets of weights that differ anywhere, different but by chance."""
    digest = hashlib.blake2b(digest_size=4)
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), per_tensor), device=flat.device)
        sample = flat.index_select(0, index.round().long()).to("cpu", torch.float32)
        digest.update(sample.numpy().tobytes())
        digest.update(flat.double().sum().to("cpu").numpy().tobytes())
    return digest.hexdigest()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once); works on ``meta`` models."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model_or_config: torch.nn.Module | PretrainedConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layer * d_attn * seq_len`` (PaLM / nanoGPT MFU).

    ``N`` counts the parameters that take part in matrix multiplies: all of them except embedding
    *lookups* (position embeddings, and the input embedding when it is not tied to the output head;
    a tied embedding is counted once, as the head). ``6 N`` is forward (2) plus backward (4) for those
    weights; the second term is the attention scores and weighted sum (``QK^T`` and ``AV``), with
    ``d_attn = n_heads * head_dim`` and without discounting the causal mask, as in the usual MFU
    convention. Multiply by tokens/s and divide by peak FLOP/s for MFU.
    """
    if isinstance(model_or_config, torch.nn.Module):
        model = model_or_config
        config = model.config  # type: ignore[union-attr]
    else:
        config = model_or_config
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    n = _matmul_parameters(model)
    n_layer = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return float(6 * n + 12 * n_layer * n_heads * int(head_dim) * int(seq_len))


def _matmul_parameters(model: torch.nn.Module) -> int:
    total = count_parameters(model)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_weight = out.weight if out is not None else None
    lookups = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            w = module.weight
            if id(w) in seen or (out_weight is not None and w is out_weight):
                continue
            seen.add(id(w))
            lookups += w.numel()
    return total - lookups


def causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a ``(B, T + 1)`` token window (as yielded by ``TokenBatches``).

    Inputs are ``batch[:, :-1]`` and targets ``batch[:, 1:]``, already shifted. Passing ``labels=`` to
    a transformers model would shift them a second time, hence this helper.
    """
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
