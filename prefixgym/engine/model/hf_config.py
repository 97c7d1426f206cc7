"""A Hugging Face config.json as a `ModelConfig`: which family it is, its shape, its
RoPE and the family's knobs -- or one line naming the field we cannot honour.

1) The family from `model_type` (`families.py`); an unknown one is refused with the
   supported list.
2) Fields no family here computes are refused when set: soft-capping, experts, a
   sliding window switched on, MLP biases, activations other than SiLU (part 2 of the
   families work adds windows and experts).
3) The shape, with every field type-checked (a list where an int belongs is refused,
   never coerced).
4) RoPE, from transformers 5.x's `rope_parameters` or 4.x's `rope_scaling` and
   top-level fields: plain, linear, dynamic, yarn, longrope, llama3; a partial rotary
   width where the family's transformers code applies one.
5) `max_seq_len`: the checkpoint's `max_position_embeddings`, capped at 32768 unless
   asked, and at the positions where our numbers are transformers' exactly: "dynamic"
   RoPE changes its base past `max_position_embeddings`, "longrope" switches to its long
   factors past `original_max_position_embeddings`, and Phi-3's sliding window starts
   to cut past `sliding_window` positions.

This module knows config fields; no tensors (`hf_checkpoint.py`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from prefixgym.engine.model.config import ModelConfig, RopeScaling
from prefixgym.engine.model.families import SUPPORTED_MODEL_TYPES, Family, family_of_model_type
from prefixgym.types import JSONObject

__all__ = ["DEFAULT_MAX_SEQ_LEN_CAP", "config_from_hf", "read_hf_config"]

DEFAULT_MAX_SEQ_LEN_CAP = 32768
"""Checkpoints often claim 32k-128k positions; the RoPE tables stop here unless asked."""
_UNSUPPORTED = {  # field -> (its value is a problem when, why)
    "attn_logit_softcapping": (lambda v: v is not None, "attention logit soft-capping"),
    "final_logit_softcapping": (lambda v: v is not None, "final logit soft-capping"),
    "num_experts": (lambda v: bool(v), "mixtures of experts"),
    "num_local_experts": (lambda v: bool(v), "mixtures of experts"),
    "n_routed_experts": (lambda v: bool(v), "mixtures of experts"),
    "use_sliding_window": (lambda v: bool(v), "sliding-window attention"),
    "mlp_bias": (lambda v: bool(v), "MLP biases"),
}


class _Reader:
    """Type-checked fields of one config.json, errors naming the file and field."""

    def __init__(self, cfg: JSONObject, path: Path) -> None:
        self.cfg, self.path = cfg, path

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def raw(self, key: str, default: Any = None) -> Any:  # a JSON value, not yet validated
        value = self.cfg.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, source: JSONObject | None = None) -> int:
        value = (source if source is not None else self.cfg).get(key)
        if value is None:
            if default is None:
                raise self.error(f"required field {key!r} is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(f"field {key!r} must be an integer, got {value!r}")
        return value

    def float(self, key: str, default: float, source: JSONObject | None = None) -> float:
        value = (source if source is not None else self.cfg).get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(
                value):
            raise self.error(f"field {key!r} must be a number, got {value!r}")
        return float(value)


def config_from_hf(
    cfg: JSONObject, path: Path | str = "config.json", max_seq_len: int | None = None
) -> ModelConfig:
    """Steps 1-5: `cfg` (a parsed config.json) as a `ModelConfig`; ValueError naming the
    file and field where a family here cannot compute it exactly."""
    read = _Reader(cfg, Path(path))
    # 1)
    family = family_of_model_type(cfg.get("model_type"))
    if family is None:
        raise read.error(f"unsupported model_type {cfg.get('model_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    # 2)
    for key, (bad, what) in _UNSUPPORTED.items():
        if key in cfg and bad(cfg[key]):
            raise read.error(f"{key}={cfg[key]!r}: {what} is not supported for "
                             f"{family.name} checkpoints yet")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise read.error(f"unsupported hidden_act {act!r}; only 'silu' is supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise read.error("layer_types other than 'full_attention' (sliding windows) are not "
                         "supported yet")
    # 3)
    dim, n_heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim_override = None
    if cfg.get("head_dim") is not None and read.int("head_dim") * n_heads != dim:
        head_dim_override = read.int("head_dim")
    head_dim = head_dim_override or (dim // n_heads if n_heads else 0)
    max_positions = read.int("max_position_embeddings", default=2048) or 2048
    # 4)
    theta, scaling, rotary_dim, exact_positions = _rope(read, family, head_dim, max_positions)
    # 5)
    window = cfg.get("sliding_window") if family.name == "phi3" else None
    if window is not None:
        exact_positions = min(exact_positions or window, read.int("sliding_window"))
    if max_seq_len is None:
        max_seq_len = min(max_positions, DEFAULT_MAX_SEQ_LEN_CAP, exact_positions or max_positions)
    elif exact_positions and max_seq_len > exact_positions:
        raise read.error(f"max_seq_len={max_seq_len}: past {exact_positions} positions this "
                         "checkpoint's RoPE or window computes otherwise than here")
    try:
        return ModelConfig(
            vocab_size=read.int("vocab_size"),
            dim=dim,
            n_layers=read.int("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=read.int("num_key_value_heads", default=n_heads) or n_heads,
            hidden_dim=read.int("intermediate_size"),
            max_seq_len=max_seq_len,
            rope_theta=theta,
            norm_eps=read.float("rms_norm_eps", 1e-6),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim_override=head_dim_override,
            family=family.name,
            rope_scaling=scaling,
            rotary_dim=rotary_dim,
            **family.knobs(read.raw),
        )
    except (ValueError, TypeError) as err:
        raise read.error(str(err)) from None


def _rope(read: _Reader, family: Family, head_dim: int, max_positions: int
          ) -> tuple[float, RopeScaling, int | None, int]:
    """(rope_theta, the scaling, the rotary width or None, the positions up to which it
    is exact, 0 for all) from either config layout."""
    merged: JSONObject = {}
    for field in ("rope_scaling", "rope_parameters"):  # 4.x, then 5.x (which wins)
        spec = read.cfg.get(field)
        if spec is not None and not isinstance(spec, dict):
            raise read.error(f"{field} must be an object or null, got {spec!r}")
        merged.update(spec or {})
    theta = read.float("rope_theta", read.float("rope_theta", 10000.0), source=merged)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    where = "rope_parameters" if read.cfg.get("rope_parameters") else "rope_scaling"
    partial = read.float("partial_rotary_factor",
                         read.float("partial_rotary_factor", 1.0), source=merged)
    rotary_dim = None
    if partial != 1.0 and family.partial_rotary:
        rotary_dim = int(head_dim * partial)
    elif partial != 1.0 and kind not in ("default", None):
        # transformers' code for it ignores the factor with plain RoPE (as here) and
        # cannot apply the narrower tables a scaled RoPE would build from it
        raise read.error(f"partial_rotary_factor={partial} with {kind!r} RoPE: transformers' "
                         f"{family.name} rotates every dim, so these numbers are undefined")
    original = read.int("original_max_position_embeddings",
                        read.int("original_max_position_embeddings", 0), source=merged)

    def factor(default: float | None = None) -> float:
        value = read.float("factor", 0.0, source=merged) or default
        if value is None:
            raise read.error(f"{where} of type {kind!r} needs 'factor'")
        return value

    def need_original() -> int:
        if not original:
            raise read.error(f"{where} of type {kind!r} needs 'original_max_position_embeddings'")
        return original

    if kind == "default":
        return theta, RopeScaling(), rotary_dim, 0
    if kind == "linear":
        return theta, RopeScaling("linear", factor=factor()), rotary_dim, 0
    if kind == "dynamic":  # transformers' NTK base changes only past max_position_embeddings
        factor()
        return theta, RopeScaling(), rotary_dim, max_positions
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", factor=factor(), original_max_positions=need_original(),
            low_freq_factor=read.float("low_freq_factor", 1.0, source=merged),
            high_freq_factor=read.float("high_freq_factor", 4.0, source=merged)), rotary_dim, 0
    if kind == "yarn":
        orig = need_original()
        f = factor(max_positions / orig)
        return theta, RopeScaling(
            "yarn", factor=f, original_max_positions=orig,
            beta_fast=read.float("beta_fast", 0.0, source=merged) or 32.0,
            beta_slow=read.float("beta_slow", 0.0, source=merged) or 1.0,
            truncate=bool(merged.get("truncate", True)),
            attention_factor=_yarn_attention_factor(read, merged, f)), rotary_dim, 0
    if kind == "longrope":
        orig = need_original() if original else max_positions
        short = merged.get("short_factor")
        if not isinstance(short, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in short):
            raise read.error(f"{where} of type 'longrope' needs 'short_factor', a list of numbers")
        f = factor(max_positions / orig)
        attention = read.float("attention_factor", 0.0, source=merged) or (
            1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig)))
        return theta, RopeScaling("longrope", short_factor=tuple(float(x) for x in short),
                                  attention_factor=attention), rotary_dim, orig
    raise read.error(f"unsupported {where} type {kind!r}; supported: default, linear, "
                     "dynamic, yarn, longrope, llama3")


def _yarn_attention_factor(read: _Reader, merged: JSONObject, factor: float) -> float:
    given = read.float("attention_factor", 0.0, source=merged)
    if given:
        return given

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = merged.get("mscale"), merged.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, read.float("mscale", 1.0, source=merged)) / mscale(
            factor, read.float("mscale_all_dim", 1.0, source=merged))
    return mscale(factor)


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
