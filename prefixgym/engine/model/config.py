"""The shape and numerics of the built-in decoder: `ModelConfig` and the `PRESETS`.

A `ModelConfig` is a frozen, validated description (widths, heads, RoPE and its
scaling, norm epsilon, biases) plus the few knobs by which the families people train
differ (litgpt's way: one decoder, data per family): q/k norms (Qwen3 per head, OLMo 2
over all heads), norms after each sublayer instead of before (OLMo 2), layers without
RoPE (SmolLM3), partial rotary dims (Phi-3), and Granite's multipliers. `family` names
the checkpoint layout it came from (`families.py`); `PRESETS` names the two built-in
sizes. This module knows nothing of torch, weights or checkpoints: `decoder.py` builds
a `Transformer` from a config, `rope.py` its RoPE tables, and `families.py` reads one
from a Hugging Face `config.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["PRESETS", "QK_NORMS", "ROPE_KINDS", "ModelConfig", "RopeScaling"]

ROPE_KINDS = ("default", "linear", "yarn", "longrope", "llama3")
QK_NORMS = ("none", "head", "all_heads")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are scaled, with every value resolved (`rope.py` computes
    the tables; `families.py` reads HF's `rope_parameters`/`rope_scaling` into this).
    transformers' "dynamic" is "default" within the positions it was trained on, and
    "longrope" uses its short factors there: the loader caps `max_seq_len` at those."""

    kind: str = "default"
    """One of ROPE_KINDS."""
    factor: float = 1.0
    """linear: positions divided by it; yarn/llama3: the context extension factor."""
    original_max_positions: int = 0
    """yarn/llama3: the pretraining context the scaling extends."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original/low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original/high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: the ramp's extrapolation bound (rotations)."""
    beta_slow: float = 1.0
    """yarn: the ramp's interpolation bound (rotations)."""
    truncate: bool = True
    """yarn: round the ramp's bounds to whole dimensions."""
    short_factor: tuple[float, ...] = ()
    """longrope: one divisor per frequency."""
    attention_factor: float = 1.0
    """Multiplies cos and sin (yarn's mscale, longrope's sqrt(1 + log s / log L))."""

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {ROPE_KINDS}, got {self.kind!r}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}")
        if self.kind in ("yarn", "llama3") and self.original_max_positions < 1:
            raise ValueError(f"RopeScaling({self.kind!r}) needs original_max_positions")
        if self.kind == "longrope" and not self.short_factor:
            raise ValueError("RopeScaling('longrope') needs short_factor")


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
    family: str = "llama"
    """The checkpoint layout it reads and writes (`families.py`; presets are Llama)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE frequency scaling (default: none)."""
    rotary_dim: int | None = None
    """Dims of each head that RoPE rotates, the first ones (Phi-3's partial rotary);
    None: all of them."""
    rope_layers: tuple[bool, ...] | None = None
    """Per layer, whether it applies RoPE (SmolLM3's no_rope_layers); None: every layer."""
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: "head" (Qwen3: over each head's width),
    "all_heads" (OLMo 2: over all heads' widths at once) or "none"."""
    post_norms: bool = False
    """Norms after each sublayer, on its output (OLMo 2), instead of before, on its input."""
    embedding_multiplier: float = 1.0
    """Scales the token embeddings (Granite)."""
    residual_multiplier: float = 1.0
    """Scales each sublayer's output before it joins the residual stream (Granite)."""
    attention_scale: float | None = None
    """The attention logits' scale; None: 1/sqrt(head_dim) (Granite sets its own)."""
    logit_divisor: float = 1.0
    """Divides the output logits (Granite's logits_scaling)."""

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
        rotary = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        if not 0 < rotary <= self.head_dim or rotary % 2:
            raise ValueError(f"ModelConfig.rotary_dim must be even and in (0, head_dim="
                             f"{self.head_dim}], got {self.rotary_dim!r}")
        if self.rope_scaling.kind == "longrope" and len(self.rope_scaling.short_factor) != (
                rotary // 2):
            raise ValueError(f"longrope short_factor has {len(self.rope_scaling.short_factor)} "
                             f"entries; the rotary width needs {rotary // 2}")
        if self.rope_layers is not None and len(self.rope_layers) != self.n_layers:
            raise ValueError(f"ModelConfig.rope_layers has {len(self.rope_layers)} entries for "
                             f"{self.n_layers} layers")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelConfig.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logit_divisor"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"ModelConfig.{name} must be positive, got {value!r}")
        if self.attention_scale is not None and not (
                self.attention_scale > 0 and math.isfinite(self.attention_scale)):
            raise ValueError(f"ModelConfig.attention_scale must be positive, got "
                             f"{self.attention_scale!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.dim // self.n_heads

    @property
    def rotary_width(self) -> int:
        """Dims of each head that RoPE rotates."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

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
