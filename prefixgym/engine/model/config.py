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

__all__ = ["ACTIVATIONS", "NORM_PLACEMENTS", "PRESETS", "QK_NORMS", "ROPE_KINDS", "ROUTERS",
           "ModelConfig", "RopeScaling"]

ROPE_KINDS = ("default", "linear", "yarn", "longrope", "llama3")
QK_NORMS = ("none", "head", "all_heads")
NORM_PLACEMENTS = ("pre", "post", "both")
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
ROUTERS = ("softmax_topk", "topk_softmax")


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
    """Width of the gated MLP (HF `intermediate_size`)."""
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
    norms: str = "pre"
    """Where each sublayer's norm sits: "pre" (on its input: Llama), "post" (on its
    output: OLMo 2) or "both" (a norm on each side: Gemma 2/3)."""
    rope_in_fp32: bool = False
    """RoPE's tables stay fp32 and the rotation runs in fp32, then rounds (OLMo 2/3),
    instead of tables in the weights' dtype (the same in fp32)."""
    norm_scale_in_fp32: bool = False
    """RMSNorms scale in fp32, then round (OLMo 2/3, gpt-oss), instead of rounding, then
    scaling (the same in fp32)."""
    norm_offset: bool = False
    """RMSNorms scale by (1 + weight) and round after scaling (Gemma); the weights are
    stored as the checkpoint holds them."""
    activation: str = "silu"
    """The MLP gate's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU: Gemma) or
    "clamped_swiglu" (gpt-oss: gate clamped above at `swiglu_limit`, up within
    +-limit, (up + 1) * gate * sigmoid(alpha * gate))."""
    swiglu_alpha: float = 1.702
    """clamped_swiglu's sigmoid slope."""
    swiglu_limit: float = 7.0
    """clamped_swiglu's clamp."""
    embedding_multiplier: float = 1.0
    """Scales the token embeddings (Granite; Gemma's sqrt(dim))."""
    embedding_multiplier_rounded: bool = False
    """The multiplier is first rounded to the weights' dtype (Gemma keeps it as a tensor
    of that dtype; Granite multiplies by the float)."""
    residual_multiplier: float = 1.0
    """Scales each sublayer's output before it joins the residual stream (Granite)."""
    attention_scale: float | None = None
    """The attention logits' scale; None: 1/sqrt(head_dim) (Granite sets its own)."""
    logit_divisor: float = 1.0
    """Divides the output logits (Granite's logits_scaling)."""
    attention_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) before the mask (Gemma 2)."""
    final_softcap: float | None = None
    """Output logits become cap * tanh(logit / cap) (Gemma 2)."""
    layer_windows: tuple[int, ...] | None = None
    """Per layer, how many keys a query sees, itself included (a sliding window: key
    positions in (p - window, p]), or 0 for every earlier key; None: 0 everywhere."""
    local_rope_theta: float | None = None
    """The RoPE base of the windowed layers when theirs differs (Gemma 3, OLMo 3); their
    RoPE is then unscaled. None: every layer uses `rope_theta` and `rope_scaling`."""
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP (Qwen3-MoE); 0: every MLP is dense."""
    experts_per_token: int = 0
    """How many experts the router picks for each token (HF `num_experts_per_tok`)."""
    expert_hidden_dim: int = 0
    """Width of each expert's gated MLP (HF `moe_intermediate_size`)."""
    moe_layers: tuple[bool, ...] | None = None
    """Per layer, whether its MLP is the mixture (else a dense one of `hidden_dim`);
    None: every layer's, when there are experts."""
    normalize_router_weights: bool = False
    """The picked experts' probabilities are divided by their sum (HF `norm_topk_prob`)."""
    router: str = "softmax_topk"
    """How experts are picked and weighted: "softmax_topk" (a softmax over every expert,
    in fp32, then the top k: Qwen3-MoE) or "topk_softmax" (the top k logits, then a
    softmax over those: gpt-oss)."""
    router_bias: bool = False
    """The router has a bias (gpt-oss)."""
    expert_bias: bool = False
    """Each expert's projections have biases (gpt-oss)."""
    attention_sinks: bool = False
    """Each head has a learned logit that joins its softmax and takes a share of the
    attention without a value (gpt-oss)."""

    def __post_init__(self) -> None:
        """1) what every model has: the shape, rope_theta, norm_eps; 2) the rotary width
        and which layers rotate; 3) the knobs families differ by. ValueError naming the
        field."""
        self._check_core()
        self._check_rotary()
        self._check_knobs()

    def _check_core(self) -> None:
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

    def _check_rotary(self) -> None:
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

    def _check_knobs(self) -> None:
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"ModelConfig.norms must be one of {NORM_PLACEMENTS}, got "
                             f"{self.norms!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"ModelConfig.router must be one of {ROUTERS}, got {self.router!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got "
                             f"{self.activation!r}")
        for name in ("attention_softcap", "final_softcap", "local_rope_theta", "swiglu_alpha",
                     "swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value!r}")
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.n_layers:
                raise ValueError(f"ModelConfig.layer_windows has {len(self.layer_windows)} "
                                 f"entries for {self.n_layers} layers")
            if any(not isinstance(w, int) or isinstance(w, bool) or w < 0
                   for w in self.layer_windows):
                raise ValueError(f"ModelConfig.layer_windows must hold ints >= 0 (0: no "
                                 f"window), got {self.layer_windows!r}")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts or self.expert_hidden_dim < 1:
                raise ValueError(f"ModelConfig with {self.num_experts} experts needs "
                                 f"experts_per_token in [1, {self.num_experts}] and "
                                 f"expert_hidden_dim >= 1, got {self.experts_per_token} and "
                                 f"{self.expert_hidden_dim}")
            if self.moe_layers is not None and len(self.moe_layers) != self.n_layers:
                raise ValueError(f"ModelConfig.moe_layers has {len(self.moe_layers)} entries "
                                 f"for {self.n_layers} layers")
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

    def window(self, layer: int) -> int:
        """The layer's sliding window in keys, or 0 when it sees every earlier key (a
        window as long as the context is none)."""
        w = 0 if self.layer_windows is None else self.layer_windows[layer]
        return 0 if w >= self.max_seq_len else w

    @property
    def windows(self) -> tuple[int, ...]:
        """`window(layer)` of every layer."""
        return tuple(self.window(i) for i in range(self.n_layers))

    def is_moe(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def uses_local_rope(self, layer: int) -> bool:
        """Whether the layer rotates with the windowed layers' own RoPE tables."""
        return (self.local_rope_theta is not None and self.layer_windows is not None
                and self.layer_windows[layer] > 0)

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
