"""Model presets and a deterministic random-init builder.

DiLoCo averages the *progress* of sites that must have started from the same weights, so
:func:`build_model` is bit-identical for a given seed, whatever the device it is built for. The
vocabulary size is not part of a preset: it comes from the tokenizer, so one preset serves the byte
tokenizer and a 128k-token tokenizer alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    """Which model a site trains. All sites of one swarm must use the same values."""

    preset: str = "tiny"
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


def model_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of ``cfg.preset`` with the tokenizer's vocabulary size.

    Special-token ids are left unset: they matter for generation, not for next-token training, and
    the presets' defaults (e.g. GPT-2's 50256) would not fit a small vocabulary.
    """
    cfg.validate()
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
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


def build_model(cfg: ModelConfig, vocab_size: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A randomly initialised causal LM, bit-identical for the same ``cfg.seed`` (and preset, vocab).

    Weights are drawn on the CPU from a private generator state (the caller's RNG is untouched) and
    then moved, so a site on CUDA starts from exactly the weights of a site on another GPU model or
    on CPU. ``device="meta"`` builds the structure without memory, to count big presets.
    """
    from transformers import AutoModelForCausalLM

    config = model_config(cfg, vocab_size)
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model.to(device)


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
