"""RoPE's tables: the rotation frequencies of a `ModelConfig`, scaled as its
`RopeScaling` says, and the cos/sin of every position.

The formulas are the published ones, as transformers computes them (its
`modeling_rope_utils.py` is the reference the tests compare with): plain RoPE,
"linear" (positions divided by a factor), "llama3" (low frequencies divided by the
factor, high ones kept, a smooth ramp between), "yarn" (a ramp between interpolated and
extrapolated frequencies over the dims, and an attention factor on cos/sin) and
"longrope" (one divisor per frequency, and an attention factor). Every frequency is
computed in float32 from an int64 range, as transformers does, so the tables match it.
A partial rotary width (Phi-3) rotates the first `rotary_width` dims of each head only.

This module knows the config; not weights, checkpoints or how positions are batched.
"""

from __future__ import annotations

import math

import torch

from prefixgym.engine.model.config import ModelConfig

__all__ = ["inverse_frequencies", "rope_tables"]


def inverse_frequencies(config: ModelConfig, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """(rotary_width / 2,) float32: each rotated pair's angle per position."""
    scaling = config.rope_scaling
    dim = config.rotary_width
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    base_powers = config.rope_theta ** exponents
    if scaling.kind == "default":
        return 1.0 / base_powers
    if scaling.kind == "linear":
        return 1.0 / base_powers / scaling.factor
    if scaling.kind == "longrope":
        factors = torch.tensor(scaling.short_factor, dtype=torch.float32, device=device)
        return 1.0 / (factors * base_powers)
    if scaling.kind == "llama3":
        return _llama3(1.0 / base_powers, scaling.factor, scaling.original_max_positions,
                       scaling.low_freq_factor, scaling.high_freq_factor)
    return _yarn(base_powers, dim, config.rope_theta, scaling.factor,
                 scaling.original_max_positions, scaling.beta_fast, scaling.beta_slow,
                 scaling.truncate)


def rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (max_seq_len, rotary_width) each, times the attention factor, cast to
    `dtype` as transformers casts them to the activations'. The sin table's first half is
    negated: rotate-half becomes one roll (`layers._apply_rope`).

    Each table's two halves hold the same angles, so cos and sin are computed on one half
    and copied into both (the same bits as on the whole; at Gemma 3's 32k positions the
    full tables took ~0.3 s of a load)."""
    inv_freq = inverse_frequencies(config, device)
    positions = torch.arange(config.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # (S, D/2)
    factor = config.rope_scaling.attention_factor
    half = freqs.shape[1]
    cos = torch.empty(freqs.shape[0], 2 * half, dtype=dtype, device=device)  # (S, D)
    sin = torch.empty_like(cos)
    for table, values in ((cos, freqs.cos()), (sin, freqs.sin())):
        if factor != 1.0:
            values *= factor
        table[:, half:] = values  # (the cast to `dtype`, as the whole table's)
        if table is sin:
            values.neg_()
        table[:, :half] = values
    return cos, sin


def _llama3(inv_freq: torch.Tensor, factor: float, original: int, low_freq_factor: float,
            high_freq_factor: float) -> torch.Tensor:
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base_powers: torch.Tensor, dim: int, base: float, factor: float, original: int,
          beta_fast: float, beta_slow: float, truncate: bool) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=base_powers.device) - low)
            / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * base_powers)
    extrapolated = 1.0 / base_powers
    return interpolated * (1 - extrapolation) + extrapolated * extrapolation
