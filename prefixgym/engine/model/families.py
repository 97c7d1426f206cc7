"""The model families a local checkpoint may hold, as data: for each, the Hugging Face
`model_type`s it covers, the module names its checkpoints use for our fused layers, and
the decoder knobs its config sets (`config.py`). One decoder serves them all; a family
is a converter, not a model (litgpt's `Config`, transformers' modular files).

| family    | differs from Llama by                                                |
|-----------|----------------------------------------------------------------------|
| llama     | (RoPE scaling: linear, dynamic, yarn, longrope, llama3: `hf_config`) |
| qwen2     | q/k/v biases; with `use_sliding_window`, windows on the layers from  |
|           | `max_window_layers` on                                               |
| qwen3     | q/k RMSNorm over each head; Qwen2's windows                          |
| qwen3_moe | Qwen3's, mixtures of experts for MLPs (`mlp_only_layers` and         |
|           | `decoder_sparse_step` pick which layers)                             |
| phi3      | fused qkv_proj and gate_up_proj; partial rotary; a window everywhere |
| smollm3   | layers without RoPE (`no_rope_layers`)                               |
| olmo2     | norms after each sublayer; q/k RMSNorm over all heads                |
| olmo3     | OLMo 2's, with windows by `layer_types` and their own RoPE           |
| granite   | embedding, attention, residual and logit multipliers                 |
| mistral   | a window on every layer                                              |
| gpt_oss   | experts with biases, a biased top-k-then-softmax router, clamped     |
|           | SwiGLU, attention sinks, windows by `layer_types`, MXFP4 experts     |
| gemma2    | norms on both sides, (1 + w) norms, GeGLU, scaled embeddings,        |
|           | soft-capped attention and logits, windows by `layer_types`           |
| gemma3    | Gemma 2's (no soft-caps by default), q/k norms, the windowed layers' |
|           | own RoPE base                                                        |

Which layers have a sliding window, and which RoPE they use, `hf_config.py` reads
(`Family.windows` says how the family's transformers code picks them).

`hf_config.py` reads a config.json into a `ModelConfig` through these; `hf_checkpoint.py`
and `hf_export.py` move tensors in and out by their names; `lora.py` and
`peft_format.py` split adapters along the same modules. Knows names and config fields,
never tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixgym.engine.model.config import ModelConfig

__all__ = ["FAMILIES", "LAYERS", "NORMS", "Family", "family_named", "family_of_model_type",
           "EXPERT_MODULES", "block_norms", "module_shapes"]

LAYERS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")
"""Our projections of each block, each one or more HF modules (`Family.hf_modules`)."""

NORMS = ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm")
"""Our norms of each block, in the order of `Family.norms` (the last two with
`ModelConfig.norms == "both"` only)."""

Knobs = Callable[[Callable[[str, Any], Any]], dict[str, Any]]
"""(read(field, default) -> value, default when the field is absent) -> the family's
ModelConfig fields."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architecture: str
    """transformers' class for it (config.json `architectures`)."""
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    """The modules whose output rows, in order, make our `attn.wqkv`."""
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    """The modules whose output rows, in order, make our `mlp.w_gate_up`."""
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """The HF norms our NORMS are, in order (before or after each sublayer)."""
    knobs: Knobs = lambda read: {}  # noqa: E731
    partial_rotary: bool = False
    """Whether transformers' code for it rotates a partial width (`partial_rotary_factor`)."""
    windows: str = "none"
    """Which layers transformers' code gives `sliding_window`: "none", "all" (Mistral,
    Phi-3) or "layer_types" (those marked "sliding_attention": Gemma, OLMo 3)."""
    window_switch: str = ""
    """A config field that must be true for any window to apply (Qwen2/3's
    `use_sliding_window`); "": none."""
    windows_from: str = ""
    """Without `layer_types`: the config field from whose index on layers are windowed
    (Qwen2/3's `max_window_layers`); "": `window_pattern` decides."""
    window_pattern: int = 0
    """Without `layer_types`: layer i is windowed unless (i + 1) is a multiple of this
    (transformers' default for the family; Gemma 3 reads `sliding_window_pattern`)."""
    activation_field: str = "hidden_act"
    """The config field naming the MLP's activation."""
    default_activation: str = "silu"
    """The activation when config.json leaves `activation_field` out."""
    softcaps: bool = False
    """Whether its transformers code soft-caps attention and final logits
    (`attn_logit_softcapping`, `final_logit_softcapping`); refused where not."""
    tied_by_default: bool = False
    """`tie_word_embeddings` when config.json leaves it out."""
    experts: str = ""
    """How its checkpoints store experts, if it has them ("" : it has none):
    "per_expert" (`mlp.gate` router, `mlp.experts.{e}.gate_proj.weight`, ... or stacked:
    Qwen3-MoE) or "interleaved" (gpt-oss: `mlp.router` with a bias,
    `mlp.experts.gate_up_proj` of (E, C, 2F) with gate and up interleaved, `down_proj`
    (E, F, C), their biases; or MXFP4 `_blocks` and `_scales` in their place)."""
    quantization: str = ""
    """The `quantization_config.quant_method` its checkpoints may carry ("mxfp4": gpt-oss's
    experts); "": none, a quantized checkpoint is refused."""
    plain: bool = False
    """Whether a config of the shape fields and the q/k/v and output biases alone
    describes it, so `hf_export` can write a config.json for a model that was not loaded
    from one (a preset)."""

    def hf_modules(self, ours: str) -> tuple[str, ...]:
        """Our layer (one of LAYERS) -> its HF modules, in row order."""
        return {"attn.wqkv": self.qkv, "attn.wo": ("self_attn.o_proj",),
                "mlp.w_gate_up": self.gate_up, "mlp.w_down": ("mlp.down_proj",)}[ours]


def _biases(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    bias = bool(read("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias}


def _smollm3(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    layers = read("no_rope_layers", None)  # 1: the layer uses RoPE, 0: it does not
    return {**_biases(read),
            "rope_layers": None if layers is None else tuple(bool(x) for x in layers)}


def _granite(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**_biases(read),
            "embedding_multiplier": float(read("embedding_multiplier", 1.0)),
            "residual_multiplier": float(read("residual_multiplier", 1.0)),
            "attention_scale": float(read("attention_multiplier", 1.0)),
            "logit_divisor": float(read("logits_scaling", 1.0))}


def _gemma(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**_biases(read), "norms": "both", "norm_offset": True,
            "embedding_multiplier": float(read("hidden_size", 1)) ** 0.5,
            "embedding_multiplier_rounded": True,
            "attention_scale": float(read("query_pre_attn_scalar", 256)) ** -0.5}


def _gemma2(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**_gemma(read), "attention_softcap": read("attn_logit_softcapping", 50.0),
            "final_softcap": read("final_logit_softcapping", 30.0)}


def _gemma3(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**_gemma(read), "qk_norm": "head",
            "attention_softcap": read("attn_logit_softcapping", None),
            "final_softcap": read("final_logit_softcapping", None)}


def _qwen3_moe(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    n_layers, step = int(read("num_hidden_layers", 0)), int(read("decoder_sparse_step", 1) or 1)
    dense = set(read("mlp_only_layers", None) or ())
    return {**_biases(read), "qk_norm": "head",
            "num_experts": int(read("num_experts", read("num_local_experts", 0)) or 0),
            "experts_per_token": int(read("num_experts_per_tok", 0) or 0),
            "expert_hidden_dim": int(read("moe_intermediate_size", 0) or 0),
            "normalize_router_weights": bool(read("norm_topk_prob", False)),
            "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))}


def _gpt_oss(read: Callable[[str, Any], Any]) -> dict[str, Any]:
    width = int(read("intermediate_size", 0) or 0)
    bias = bool(read("attention_bias", True))
    return {"qkv_bias": bias, "out_bias": bias, "activation": "clamped_swiglu",
            "swiglu_alpha": float(read("swiglu_alpha", 1.702)),
            "swiglu_limit": float(read("swiglu_limit", 7.0)),
            "num_experts": int(read("num_local_experts", 0) or 0),
            "experts_per_token": int(read("num_experts_per_tok", 0) or 0),
            "expert_hidden_dim": width, "router": "topk_softmax", "router_bias": True,
            "expert_bias": True, "attention_sinks": True, "norm_scale_in_fp32": True}


_QWEN_WINDOWS: dict[str, Any] = {"windows": "layer_types",
                                 "window_switch": "use_sliding_window",
                                 "windows_from": "max_window_layers"}
_GEMMA_NORMS = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                "post_feedforward_layernorm")
_OLMO_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "LlamaForCausalLM", knobs=_biases, plain=True),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", **_QWEN_WINDOWS, plain=True,
           knobs=lambda read: {"qkv_bias": True, "out_bias": False}),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", **_QWEN_WINDOWS,
           knobs=lambda read: {**_biases(read), "qk_norm": "head"}),
    Family("phi3", ("phi3",), "Phi3ForCausalLM", qkv=("self_attn.qkv_proj",),
           gate_up=("mlp.gate_up_proj",), partial_rotary=True, windows="all"),
    Family("smollm3", ("smollm3",), "SmolLM3ForCausalLM", knobs=_smollm3),
    Family("olmo2", ("olmo2",), "Olmo2ForCausalLM", norms=_OLMO_NORMS,
           knobs=lambda read: {**_biases(read), "norms": "post", "qk_norm": "all_heads",
                               "norm_scale_in_fp32": True, "rope_in_fp32": True}),
    Family("olmo3", ("olmo3",), "Olmo3ForCausalLM", norms=_OLMO_NORMS, windows="layer_types",
           window_pattern=4,
           knobs=lambda read: {**_biases(read), "norms": "post", "qk_norm": "all_heads",
                               "norm_scale_in_fp32": True, "rope_in_fp32": True}),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", knobs=_qwen3_moe, windows="all",
           experts="per_expert"),
    Family("granite", ("granite",), "GraniteForCausalLM", knobs=_granite),
    Family("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", knobs=_gpt_oss, windows="layer_types",
           window_pattern=2, experts="interleaved", quantization="mxfp4"),
    Family("mistral", ("mistral",), "MistralForCausalLM", windows="all", knobs=_biases),
    Family("gemma2", ("gemma2",), "Gemma2ForCausalLM", norms=_GEMMA_NORMS, knobs=_gemma2,
           windows="layer_types", window_pattern=2, softcaps=True,
           activation_field="hidden_activation", default_activation="gelu_pytorch_tanh",
           tied_by_default=True),
    Family("gemma3", ("gemma3_text",), "Gemma3ForCausalLM", norms=_GEMMA_NORMS,
           knobs=_gemma3, windows="layer_types", window_pattern=6, softcaps=True,
           activation_field="hidden_activation", default_activation="gelu_pytorch_tanh",
           tied_by_default=True),
)


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; known: "
                     f"{', '.join(f.name for f in FAMILIES)}")


def family_of_model_type(model_type: object) -> Family | None:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return None


SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def block_norms(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(our norm, its HF name) of each block's norms, for this config's family."""
    family = family_named(config.family)
    ours = NORMS if config.norms == "both" else NORMS[:2]
    return tuple(zip(ours, family.norms, strict=True))


EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")
"""Each expert's modules in a checkpoint that stores them one by one
(`mlp.experts.{e}.gate_proj.weight`, ...); transformers 5 stacks them in memory as
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, and our `MixtureOfExperts`
does the same."""


def module_shapes(config: ModelConfig, ours: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Our layer ("attn.wqkv", ...) -> (its family's HF module, that module's weight
    shape), in row order: what our fused rows split into."""
    family = family_named(config.family)
    C, F = config.dim, config.hidden_dim
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    rows = {"attn.wqkv": (q, kv, kv), "attn.wo": (C,), "mlp.w_gate_up": (F, F),
            "mlp.w_down": (C,)}[ours]
    fan_in = {"attn.wo": q, "mlp.w_down": F}.get(ours, C)
    modules = family.hf_modules(ours)
    if len(modules) == 1:
        rows = (sum(rows),)
    return tuple((m, (r, fan_in)) for m, r in zip(modules, rows, strict=True))
