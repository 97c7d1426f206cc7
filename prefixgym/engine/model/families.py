"""The model families a local checkpoint may hold, as data: for each, the Hugging Face
`model_type`s it covers, the module names its checkpoints use for our fused layers, and
the decoder knobs its config sets (`config.py`). One decoder serves them all; a family
is a converter, not a model (litgpt's `Config`, transformers' modular files).

| family  | differs from Llama by                                                   |
|---------|-------------------------------------------------------------------------|
| llama   | (RoPE scaling: linear, dynamic, yarn, longrope, llama3: `hf_config.py`) |
| qwen2   | q/k/v biases                                                            |
| qwen3   | q/k RMSNorm over each head                                              |
| phi3    | fused qkv_proj and gate_up_proj; partial rotary; a window (`hf_config`) |
| smollm3 | layers without RoPE (`no_rope_layers`)                                  |
| olmo2   | norms after each sublayer; q/k RMSNorm over all heads                   |
| granite | embedding, attention, residual and logit multipliers                   |

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

__all__ = ["FAMILIES", "LAYERS", "Family", "family_named", "family_of_model_type",
           "module_shapes"]

LAYERS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")
"""Our projections of each block, each one or more HF modules (`Family.hf_modules`)."""

Knobs = Callable[[Callable[[str, Any], Any]], dict[str, Any]]
"""(read(field, default) -> value) -> the family's ModelConfig fields."""


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
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    """The norms our `attn_norm` and `mlp_norm` are (before or after each sublayer)."""
    knobs: Knobs = lambda read: {}  # noqa: E731
    partial_rotary: bool = False
    """Whether transformers' code for it rotates a partial width (`partial_rotary_factor`)."""

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


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "LlamaForCausalLM", knobs=_biases),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM",
           knobs=lambda read: {"qkv_bias": True, "out_bias": False}),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM",
           knobs=lambda read: {**_biases(read), "qk_norm": "head"}),
    Family("phi3", ("phi3",), "Phi3ForCausalLM", qkv=("self_attn.qkv_proj",),
           gate_up=("mlp.gate_up_proj",), partial_rotary=True),
    Family("smollm3", ("smollm3",), "SmolLM3ForCausalLM", knobs=_smollm3),
    Family("olmo2", ("olmo2",), "Olmo2ForCausalLM",
           norms=("post_attention_layernorm", "post_feedforward_layernorm"),
           knobs=lambda read: {**_biases(read), "post_norms": True, "qk_norm": "all_heads"}),
    Family("granite", ("granite",), "GraniteForCausalLM", knobs=_granite),
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
