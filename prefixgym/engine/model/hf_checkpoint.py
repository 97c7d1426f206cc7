"""Load a local Hugging Face Llama or Qwen2 checkpoint (config.json + *.safetensors)
into the built-in `Transformer`.

Steps: 1) read and check config.json, 2) translate it into a `ModelConfig`,
3) index the tensors of every *.safetensors file, 4) map HF names onto ours
(q/k/v and gate/up are concatenated into our fused projections), checking shapes,
5) materialise the model from those tensors, 6) hand the freed temporaries back to
the system (`malloc_tuning.release_free_memory`).

This module knows HF config fields and tensor names; it does not download anything,
does not read tokenizers, and refuses what the model cannot compute exactly
(RoPE scaling, sliding windows, MLP biases, activations other than SiLU). Every
refusal is a ValueError naming the file: a config field of the wrong type (a list
where an int belongs), an unreadable *.safetensors file, a tensor of the wrong shape
or of a non-floating-point dtype, or one holding NaN or inf.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from prefixgym.engine import malloc_tuning
from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.decoder import Transformer
from prefixgym.types import JSONObject

__all__ = ["config_from_hf", "load_hf_checkpoint", "read_hf_config"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
DEFAULT_MAX_SEQ_LEN_CAP = 32768
"""Checkpoints often claim 32k-128k positions; the RoPE tables stop here unless asked."""


def _require(cfg: JSONObject, key: str, path: Path) -> Any:  # a JSON value, not yet validated
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{path}: required field {key!r} is missing")
    return cfg[key]


def _int(cfg: JSONObject, key: str, path: Path, default: int | None = None) -> int:
    """Field `key` as an int: required without a default; a float, string, list or bool
    is refused rather than coerced."""
    value = _require(cfg, key, path) if default is None else cfg.get(key)
    if value is None:
        assert default is not None
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{path}: field {key!r} must be an integer, got {value!r}")
    return value


def _float(cfg: JSONObject, key: str, path: Path, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{path}: field {key!r} must be a number, got {value!r}")
    return float(value)


def _check_rope(cfg: JSONObject, path: Path) -> float:
    """Return rope_theta; refuse any RoPE scaling (transformers 4.x and 5.x layouts)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: {field} must be an object or null, got {spec!r}")  # noqa: TRY004
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(
                f"{path}: unsupported {field} type {kind!r}; only plain RoPE "
                "(rope_scaling null / rope_type 'default') is supported"
            )
        if spec.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{path}: unsupported {field}.partial_rotary_factor")
    for source in (params, scaling, cfg):
        if source.get("rope_theta") is not None:
            return _float(source, "rope_theta", path, 10000.0)
    return 10000.0


def config_from_hf(
    cfg: JSONObject, path: Path | str = "config.json", max_seq_len: int | None = None
) -> ModelConfig:
    """Translate an HF Llama/Qwen2 config dict into a `ModelConfig` (ValueError if unsupported)."""
    path = Path(path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: unsupported hidden_act {act!r}; only 'silu' is supported")
    if cfg.get("mlp_bias", False):
        raise ValueError(f"{path}: mlp_bias=true is not supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{path}: layer_types other than 'full_attention' are not supported")

    dim = _int(cfg, "hidden_size", path)
    n_heads = _int(cfg, "num_attention_heads", path)
    head_dim_override = None
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", path)
        if head_dim * n_heads != dim:
            head_dim_override = head_dim
    if max_seq_len is None:
        max_positions = _int(cfg, "max_position_embeddings", path, default=2048) or 2048
        max_seq_len = min(max_positions, DEFAULT_MAX_SEQ_LEN_CAP)
    if model_type == "qwen2":
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bool(cfg.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=_int(cfg, "vocab_size", path),
            dim=dim,
            n_layers=_int(cfg, "num_hidden_layers", path),
            n_heads=n_heads,
            n_kv_heads=_int(cfg, "num_key_value_heads", path, default=n_heads) or n_heads,
            hidden_dim=_int(cfg, "intermediate_size", path),
            max_seq_len=max_seq_len,
            rope_theta=_check_rope(cfg, path),
            norm_eps=_float(cfg, "rms_norm_eps", path, 1e-6),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            head_dim_override=head_dim_override,
        )
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


class _TensorIndex:
    """Which *.safetensors file holds each tensor name; loads on demand."""

    def __init__(self, directory: Path) -> None:
        self.files = sorted(directory.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files found")
        self.where: dict[str, Path] = {}
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        self.where.setdefault(key, file)
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file} is not a readable safetensors file: {e}") from None

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key not in self.where:
            raise ValueError(f"checkpoint tensor {key!r} is missing (looked in {self.files})")
        file = self.where[key]
        try:
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read tensor {key!r}: {e}") from None
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{file}: tensor {key!r} has dtype {tensor.dtype}; weights are "
                             "floating-point")
        if nonfinite_tensor([(key, tensor)]) is not None:
            raise ValueError(f"{file}: tensor {key!r} holds NaN or inf values")
        converted = tensor.to(dtype)
        if nonfinite_tensor([(key, converted)]) is not None:
            raise ValueError(f"{file}: tensor {key!r} overflows to inf in {dtype}")
        return converted


def _state_dict_from_hf(
    index: _TensorIndex, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """HF tensor names → our fused layout."""
    prefix = "model." if "model.embed_tokens.weight" in index else ""
    C, V, F = config.dim, config.vocab_size, config.hidden_dim
    q_out = config.n_heads * config.head_dim
    kv_out = config.n_kv_heads * config.head_dim

    def get(name: str, *shape: int) -> torch.Tensor:
        return index.get(prefix + name, tuple(shape), dtype)

    sd: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": get("embed_tokens.weight", V, C),
        "norm.weight": get("norm.weight", C),
    }
    for i in range(config.n_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        sd[ours + "attn_norm.weight"] = get(hf + "input_layernorm.weight", C)
        sd[ours + "mlp_norm.weight"] = get(hf + "post_attention_layernorm.weight", C)
        sd[ours + "attn.wqkv.weight"] = torch.cat(
            [
                get(hf + "self_attn.q_proj.weight", q_out, C),
                get(hf + "self_attn.k_proj.weight", kv_out, C),
                get(hf + "self_attn.v_proj.weight", kv_out, C),
            ]
        )
        if config.qkv_bias:
            sd[ours + "attn.wqkv.bias"] = torch.cat(
                [
                    get(hf + "self_attn.q_proj.bias", q_out),
                    get(hf + "self_attn.k_proj.bias", kv_out),
                    get(hf + "self_attn.v_proj.bias", kv_out),
                ]
            )
        sd[ours + "attn.wo.weight"] = get(hf + "self_attn.o_proj.weight", C, q_out)
        if config.out_bias:
            sd[ours + "attn.wo.bias"] = get(hf + "self_attn.o_proj.bias", C)
        sd[ours + "mlp.w_gate_up.weight"] = torch.cat(
            [
                get(hf + "mlp.gate_proj.weight", F, C),
                get(hf + "mlp.up_proj.weight", F, C),
            ]
        )
        sd[ours + "mlp.w_down.weight"] = get(hf + "mlp.down_proj.weight", C, F)
    if not config.tie_embeddings:
        sd["output.weight"] = index.get("lm_head.weight", (V, C), dtype)
    return sd


def read_hf_config(directory: str | os.PathLike[str], max_seq_len: int | None = None
                   ) -> ModelConfig:
    """Steps 1-2 alone: the directory's config.json as a `ModelConfig` (cheap; no tensor
    is read). FileNotFoundError without one, ValueError naming the file and field."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found (expected an HF checkpoint directory)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")  # noqa: TRY004
    return config_from_hf(raw, config_path, max_seq_len)


def load_hf_checkpoint(
    directory: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
) -> Transformer:
    """Build a `Transformer` from a local HF Llama/Qwen2 directory (train mode)."""
    root = Path(directory)
    # 1) + 2) config.json, as our config
    config = read_hf_config(root, max_seq_len)
    # 3) + 4) tensors, renamed and fused
    state_dict = _state_dict_from_hf(_TensorIndex(root), config, dtype)
    # 5) no random init for weights that are about to be replaced
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.build_rope_tables(torch.device("cpu"))  # in the weights' dtype, as HF casts cos/sin
    del state_dict
    # 6) the checks' and fusions' freed temporaries leave malloc's arenas (glibc only)
    malloc_tuning.release_free_memory()
    return model
