"""A Hugging Face config.json as a `ModelConfig`: which family it is, its shape, its
RoPE and the family's knobs -- or one line naming the field we cannot honour.

1) The family from `model_type` (`families.py`); an unknown one is refused with the
   supported list.
2) Fields no family here computes are refused when set: experts, MLP biases,
   bidirectional attention, activations other than SiLU and tanh GeLU, and soft-caps
   or windows in a family whose transformers code does not apply them the same way.
3) The shape, with every field type-checked (hf_fields.py: a list where an int
   belongs is refused, never coerced).
4) RoPE (hf_rope.py), from transformers 5.x's `rope_parameters` or 4.x's
   `rope_scaling` and top-level fields: plain, linear, dynamic, yarn, longrope, llama3;
   a partial rotary width where the family's transformers code applies one; with one
   set of parameters per layer kind, the windowed layers' own plain RoPE base.
5) Sliding windows: per layer, `sliding_window` where the family's code applies it
   (every layer, or those `layer_types` marks "sliding_attention").
6) `max_seq_len`: the checkpoint's `max_position_embeddings`, capped at 32768 unless
   asked, and at the positions where our numbers are transformers' exactly: "dynamic"
   RoPE changes its base past `max_position_embeddings`, "longrope" switches to its long
   factors past `original_max_position_embeddings`.

This module knows config fields; no tensors (`hf_checkpoint.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import transformers

from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.families import SUPPORTED_MODEL_TYPES, Family, family_of_model_type
from prefixgym.engine.model.hf_fields import ConfigReader
from prefixgym.engine.model.hf_rope import LAYER_TYPES, read_rope
from prefixgym.types import JSONObject

__all__ = ["DEFAULT_MAX_SEQ_LEN_CAP", "config_from_hf", "read_hf_config"]

DEFAULT_MAX_SEQ_LEN_CAP = 32768
"""Checkpoints often claim 32k-128k positions; the RoPE tables stop here unless asked."""
_UNSUPPORTED = {  # field -> (its value is a problem when, why)
    "num_experts": (lambda v: bool(v), "mixtures of experts"),
    "num_local_experts": (lambda v: bool(v), "mixtures of experts"),
    "n_routed_experts": (lambda v: bool(v), "mixtures of experts"),
    "mlp_bias": (lambda v: bool(v), "MLP biases"),
    "use_bidirectional_attention": (lambda v: bool(v), "bidirectional attention"),
}
_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
"""Read by the knobs of a family with `Family.softcaps` (Gemma's); refused in the others."""
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(
    cfg: JSONObject, path: Path | str = "config.json", max_seq_len: int | None = None
) -> ModelConfig:
    """Steps 1-6: `cfg` (a parsed config.json) as a `ModelConfig`; ValueError naming the
    file and field where a family here cannot compute it exactly."""
    read = ConfigReader(cfg, Path(path))
    # 1)
    family = family_of_model_type(cfg.get("model_type"))
    if family is None and transformers_knows(cfg.get("model_type")):
        return _transformers_config(read, cfg, max_seq_len)
    if family is None:
        raise read.error(f"unsupported model_type {cfg.get('model_type')!r}: neither a family "
                         f"here ({', '.join(SUPPORTED_MODEL_TYPES)}) nor one transformers "
                         f"{transformers.__version__} knows")
    # 2)
    activation = _supported_activation(read, family)
    # 3)
    dim, n_heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim_override = None
    if cfg.get("head_dim") is not None and read.int("head_dim") * n_heads != dim:
        head_dim_override = read.int("head_dim")
    head_dim = head_dim_override or (dim // n_heads if n_heads else 0)
    max_positions = read.int("max_position_embeddings", default=2048) or 2048
    n_layers = read.int("num_hidden_layers")
    # 4)
    rope = read_rope(read, family, head_dim, max_positions)
    exact_positions = rope.exact_positions
    # 5)
    windows = _windows(read, family, n_layers)
    # 6)
    if max_seq_len is None:
        max_seq_len = min(max_positions, DEFAULT_MAX_SEQ_LEN_CAP, exact_positions or max_positions)
    elif exact_positions and max_seq_len > exact_positions:
        raise read.error(f"max_seq_len={max_seq_len}: past {exact_positions} positions this "
                         "checkpoint's RoPE computes otherwise than here")
    try:
        return ModelConfig(**{  # the family's knobs last: they may name the activation
            "activation": activation, **dict(
            vocab_size=read.int("vocab_size"),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=read.int("num_key_value_heads", default=n_heads) or n_heads,
            hidden_dim=read.int("intermediate_size"),
            max_seq_len=max_seq_len,
            rope_theta=rope.theta,
            norm_eps=read.float("rms_norm_eps", 1e-6),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_by_default)),
            head_dim_override=head_dim_override,
            family=family.name,
            rope_scaling=rope.scaling,
            rotary_dim=rope.rotary_dim,
            layer_windows=windows,
            local_rope_theta=rope.local_theta),
            **family.knobs(read.field)})
    except (ValueError, TypeError) as err:
        raise read.error(str(err)) from None


def _supported_activation(read: ConfigReader, family: Family) -> str:
    """Step 2: refuse what this family cannot compute; the MLP's activation, our name."""
    cfg = read.cfg
    for key, (bad, what) in _UNSUPPORTED.items():
        if what == "mixtures of experts" and family.experts:
            continue
        if key in cfg and bad(cfg[key]):
            raise read.error(f"{key}={cfg[key]!r}: {what} is not supported for "
                             f"{family.name} checkpoints yet")
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if not (family.quantization and method == family.quantization):
            raise read.error(f"quantization_config (quant_method {method!r}): quantized "
                             f"checkpoints are not supported (gpt-oss's MXFP4 experts are)")
    for key in () if family.softcaps else _SOFTCAPS:
        if cfg.get(key) is not None:
            raise read.error(f"{key}={cfg[key]!r}: soft-capping is not supported for "
                             f"{family.name} checkpoints")
    act = cfg.get(family.activation_field, family.default_activation)
    if act not in _ACTIVATIONS:
        raise read.error(f"unsupported {family.activation_field} {act!r}; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


def _windows(read: ConfigReader, family: Family, n_layers: int) -> tuple[int, ...] | None:
    """Step 5: each layer's window (0: none), or None when no layer has one."""
    window = read.cfg.get("sliding_window")
    types = read.cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n_layers):
        raise read.error(f"layer_types must be a list of {n_layers} strings, got {types!r}")
    for kind in types or ():
        if kind not in LAYER_TYPES:
            raise read.error(f"layer_types entry {kind!r} is not supported; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    if family.window_switch and not read.cfg.get(family.window_switch):
        return None  # (transformers' config nulls the window then)
    if window is None or family.windows == "none":
        if types is not None and family.windows == "none" and "sliding_attention" in types \
                and window is not None:
            raise read.error(f"sliding windows are not supported for {family.name} "
                             "checkpoints (transformers' code does not apply them)")
        return None
    size = read.int("sliding_window")
    if size < 1:
        raise read.error(f"sliding_window must be at least 1, got {size}")
    if family.windows == "all":
        return (size,) * n_layers
    if types is None and family.windows_from:  # an older config.json: windows from layer k
        first = read.int(family.windows_from, 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if types is None:  # an older config.json: the family's default pattern
        every = read.int("sliding_window_pattern", family.window_pattern)
        if every < 1:
            raise read.error(f"sliding_window_pattern must be at least 1, got {every}")
        types = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(n_layers)]
    return tuple(size if kind == "sliding_attention" else 0 for kind in types)


def transformers_knows(model_type: object) -> bool:
    """Whether transformers has a causal-LM class for this `model_type` (a family with
    no code here then runs through transformers' code: hf_fallback.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _transformers_config(read: ConfigReader, cfg: JSONObject, max_seq_len: int | None) -> ModelConfig:
    """The shape of a model transformers' own code will run (family "transformers"),
    read through transformers' config class (its field names differ per family); the
    load checks the rest (hf_fallback.py)."""
    try:
        text = transformers.AutoConfig.for_model(**cfg).get_text_config()
    except (ValueError, TypeError, KeyError) as err:
        raise read.error(f"transformers cannot read it: {err}") from None
    n_heads, dim = text.num_attention_heads, text.hidden_size
    positions = getattr(text, "max_position_embeddings", None) or 2048
    if max_seq_len is None:
        max_seq_len = min(positions, DEFAULT_MAX_SEQ_LEN_CAP)
    try:
        return ModelConfig(
            vocab_size=text.vocab_size, dim=dim, n_layers=text.num_hidden_layers,
            n_heads=n_heads, n_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
            hidden_dim=getattr(text, "intermediate_size", None) or 4 * dim,
            max_seq_len=max_seq_len, family="transformers",
            head_dim_override=getattr(text, "head_dim", None) or dim // n_heads,
            tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)))
    except ValueError as err:
        raise read.error(str(err)) from None


def read_hf_config(directory: str | os.PathLike[str], max_seq_len: int | None = None
                   ) -> ModelConfig:
    """The directory's config.json as a `ModelConfig` (cheap; no tensor is read).
    FileNotFoundError without one, ValueError naming the file and field."""
    return config_from_hf(read_raw_config(directory), Path(directory) / "config.json",
                          max_seq_len)


def read_raw_config(directory: str | os.PathLike[str]) -> JSONObject:
    """The directory's config.json, parsed (FileNotFoundError, or ValueError naming it)."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found (expected an HF checkpoint directory)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")  # noqa: TRY004
    return raw
