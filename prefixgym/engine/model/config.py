"""The shape and numerics of the built-in decoder: `ModelConfig` and the `PRESETS`.

A `ModelConfig` is a frozen, validated description (widths, heads, RoPE base, norm
epsilon, biases); `PRESETS` names the two built-in sizes. This module knows nothing
of torch, weights or checkpoints: `decoder.py` builds a `Transformer` from a config and
`hf_checkpoint.py` reads one from a Hugging Face `config.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PRESETS", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a `Transformer`; validated on construction."""

    vocab_size: int
    """Number of token ids the embedding and output head cover."""
    dim: int
    """Width of the residual stream (HF `hidden_size`)."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int
    """Key/value heads per layer; `n_heads` must be a multiple of it (GQA)."""
    hidden_dim: int
    """Width of the SwiGLU MLP (HF `intermediate_size`)."""
    max_seq_len: int = 2048
    """Longest position the RoPE tables cover; positions must be below it."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Whether the output head reuses the token embedding matrix."""
    qkv_bias: bool = False
    """Whether the q/k/v projections have a bias (Qwen2; Llama `attention_bias`)."""
    out_bias: bool = False
    """Whether the attention output projection has a bias (Llama `attention_bias`)."""
    head_dim_override: int | None = None
    """Per-head width when it is not `dim // n_heads` (HF `head_dim`)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim_override is None and self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "set head_dim_override"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.norm_eps > 0):
            raise ValueError(f"ModelConfig.norm_eps must be positive, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.dim // self.n_heads

    @property
    def kv_elements_per_position(self) -> int:
        """Key and value elements one position keeps: both, in every layer, for every KV
        head (the KV pool's block size, a request's KV bound and the trainer's context
        rows are all this times something)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim


PRESETS: dict[str, ModelConfig] = {
    # ~5.3M parameters; few layers because per-layer Python overhead dominates decode.
    "tiny": ModelConfig(
        vocab_size=4096,
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=768,
        max_seq_len=2048,
    ),
    # ~29M parameters.
    "small": ModelConfig(
        vocab_size=4096,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=1536,
        max_seq_len=2048,
    ),
}
