"""A Hugging Face config.json's RoPE (hf_config.py's step 4): the base, the scaling
and the rotary width of the full-attention layers, and the sliding-window layers' own
plain base where they have one.

Read from transformers 5.x's `rope_parameters` or 4.x's `rope_scaling` and top-level
fields (5.x's win): plain, linear, dynamic, yarn, longrope, llama3; a partial rotary
width where the family's transformers code applies one; with one set of parameters per
layer kind (5.x's {"full_attention": ..., "sliding_attention": ...}, 4.x's
`rope_local_base_freq`), the windowed layers' own plain RoPE base. `exact_positions`
says up to where our tables are transformers' exactly: "dynamic" RoPE changes its base
past `max_position_embeddings`, "longrope" switches to its long factors past
`original_max_position_embeddings` (0: everywhere).

Knows config fields and `RopeScaling`; the tables themselves are rope.py's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from prefixgym.engine.model.config import RopeScaling
from prefixgym.engine.model.families import Family
from prefixgym.engine.model.hf_fields import ConfigReader
from prefixgym.types import JSONObject

__all__ = ["LAYER_TYPES", "HFRope", "read_rope"]

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The `layer_types` entries we compute."""


class HFRope(NamedTuple):
    theta: float
    scaling: RopeScaling
    rotary_dim: int | None
    exact_positions: int  # 0: exact at every position
    local_theta: float | None  # the sliding-window layers' own base; None: the same tables


def read_rope(read: ConfigReader, family: Family, head_dim: int, max_positions: int) -> HFRope:
    """The checkpoint's RoPE; ValueError naming the file and field where it is one we
    cannot compute exactly."""
    global_rope, local_rope = _rope_specs(read)
    theta, scaling, rotary_dim, exact_positions = _rope(read, global_rope, family, head_dim,
                                                        max_positions)
    local_theta = None
    if local_rope is not None:
        local_theta, local_scaling, _, _ = _rope(read, local_rope, family, head_dim,
                                                 max_positions)
        if local_scaling != RopeScaling():
            raise read.error("a scaled RoPE on the sliding-window layers is not supported")
        if local_theta == theta and scaling == RopeScaling():
            local_theta = None  # the same tables
    return HFRope(theta, scaling, rotary_dim, exact_positions, local_theta)


def _rope_specs(read: ConfigReader) -> tuple[JSONObject, JSONObject | None]:
    """The RoPE fields of the full-attention layers, merged flat (4.x's `rope_scaling`
    and top-level fields, then 5.x's `rope_parameters`, which win), and those of the
    sliding-window layers when they have their own (else None)."""
    merged: JSONObject = {}
    local: JSONObject | None = None
    for field in ("rope_scaling", "rope_parameters"):
        spec = read.cfg.get(field)
        if spec is not None and not isinstance(spec, dict):
            raise read.error(f"{field} must be an object or null, got {spec!r}")
        if spec and any(kind in spec for kind in LAYER_TYPES):  # one set per layer kind
            full, local = spec.get("full_attention"), spec.get("sliding_attention")
            for kind, value in (("full_attention", full), ("sliding_attention", local)):
                if value is not None and not isinstance(value, dict):
                    raise read.error(f"{field}.{kind} must be an object, got {value!r}")
            spec = full
        merged.update(spec or {})
    if "rope_local_base_freq" in read.cfg and local is None:  # 4.x Gemma 3
        local = {"rope_type": "default", "rope_theta": read.float("rope_local_base_freq", 1.0)}
    return merged, local


def _rope(read: ConfigReader, merged: JSONObject, family: Family, head_dim: int,
          max_positions: int) -> tuple[float, RopeScaling, int | None, int]:
    """(rope_theta, the scaling, the rotary width or None, the positions up to which it
    is exact, 0 for all) from one layer kind's merged RoPE fields."""
    theta = read.float("rope_theta", read.float("rope_theta", 10000.0), source=merged)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
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
    scaling, exact = _scaling(read, merged, kind, max_positions)
    return theta, scaling, rotary_dim, exact


def _scaling(read: ConfigReader, merged: JSONObject, kind: str,
             max_positions: int) -> tuple[RopeScaling, int]:
    """(the scaling of RoPE type `kind`, the positions up to which it is exact, 0 for
    all) from one layer kind's merged RoPE fields."""
    where = "rope_parameters" if read.cfg.get("rope_parameters") else "rope_scaling"
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
        return RopeScaling(), 0
    if kind == "linear":
        return RopeScaling("linear", factor=factor()), 0
    if kind == "dynamic":  # transformers' NTK base changes only past max_position_embeddings
        factor()
        return RopeScaling(), max_positions
    if kind == "llama3":
        return RopeScaling(
            "llama3", factor=factor(), original_max_positions=need_original(),
            low_freq_factor=read.float("low_freq_factor", 1.0, source=merged),
            high_freq_factor=read.float("high_freq_factor", 4.0, source=merged)), 0
    if kind == "yarn":
        orig = need_original()
        f = factor(max_positions / orig)
        return RopeScaling(
            "yarn", factor=f, original_max_positions=orig,
            beta_fast=read.float("beta_fast", 0.0, source=merged) or 32.0,
            beta_slow=read.float("beta_slow", 0.0, source=merged) or 1.0,
            truncate=bool(merged.get("truncate", True)),
            attention_factor=_yarn_attention_factor(read, merged, f)), 0
    if kind == "longrope":
        orig = need_original() if original else max_positions
        short = merged.get("short_factor")
        if not isinstance(short, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in short):
            raise read.error(f"{where} of type 'longrope' needs 'short_factor', a list of numbers")
        f = factor(max_positions / orig)
        attention = read.float("attention_factor", 0.0, source=merged) or (
            1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig)))
        return RopeScaling("longrope", short_factor=tuple(float(x) for x in short),
                           attention_factor=attention), orig
    raise read.error(f"unsupported {where} type {kind!r}; supported: default, linear, "
                     "dynamic, yarn, longrope, llama3")


def _yarn_attention_factor(read: ConfigReader, merged: JSONObject, factor: float) -> float:
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
