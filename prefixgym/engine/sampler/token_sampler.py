"""Pick the next token of every running row at once: greedy, temperature, top-k, top-p.

Randomness comes from one uniform number per row, drawn by the caller from that
row's own generator, so a row's tokens depend only on its seed and its logits, never
on which other rows share the batch. Tokens are drawn by inverse CDF over the
filtered, temperature-scaled distribution.

The returned logprob of a token is its log-probability under the model's own
distribution: temperature 1, no top-k/top-p filtering -- the same quantity the
trainer's forward pass computes, so importance ratios start at 1.

This module knows nothing of requests, slots, caches or tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Per-row decoding settings as tensors, built once per batch composition."""

    temperature_B: torch.Tensor  # float32; 0 = greedy
    top_k_B: torch.Tensor  # int64; -1 = off
    top_p_B: torch.Tensor  # float32; 1 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_greedy: bool = True
    all_unit_temperature: bool = False

    @classmethod
    def build(cls, temperatures: list[float], top_ks: list[int], top_ps: list[float],
              device: torch.device | str = "cpu") -> RowParams:
        return cls(
            temperature_B=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_k_B=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p_B=torch.tensor(top_ps, dtype=torch.float32, device=device),
            all_greedy=all(t == 0 for t in temperatures),
            any_top_k=any(k > 0 for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_greedy=any(t == 0 for t in temperatures),
            all_unit_temperature=all(t == 1.0 for t in temperatures),
        )


def sample_tokens(
    logits_B_V: torch.Tensor, params: RowParams, uniforms: list[float]
) -> tuple[list[int], list[float]]:
    """(token per row, its logprob) for one decode step.

    `uniforms[b]` in [0, 1) is row b's random draw (ignored for greedy rows). Raises
    ValueError when a row's logits are not finite (weights gone NaN/inf): such a row
    has no distribution to sample from, and token 0 with logprob nan is no answer.
    """
    logits_B_V = logits_B_V.float()
    if params.all_greedy:
        tokens_B = logits_B_V.argmax(dim=-1)
    else:
        tokens_B = _sample_filtered(logits_B_V, params, uniforms)
    picked_B = logits_B_V.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
    logprobs = (picked_B - torch.logsumexp(logits_B_V, dim=-1)).tolist()
    if not all(map(math.isfinite, logprobs)):  # in Python: cheaper than two kernels here
        raise ValueError("the model's logits are not finite (NaN or inf weights, or an "
                         "overflow): nothing was sampled")
    return tokens_B.tolist(), logprobs


def _sample_filtered(
    logits_B_V: torch.Tensor, params: RowParams, uniforms: list[float]
) -> torch.Tensor:
    # the work each step skips when no row needs it: scaling, filters, fallbacks
    temperature_B = params.temperature_B
    if params.all_unit_temperature:
        scaled_B_V = logits_B_V
    else:
        scaled_B_V = logits_B_V / temperature_B.clamp_min(1e-6).unsqueeze(1)
    V = scaled_B_V.shape[1]
    if params.any_top_k:
        k_B = torch.where(params.top_k_B > 0, params.top_k_B.clamp(max=V), V)
        k_max = int(k_B.max())
        top_values_B_K = scaled_B_V.topk(k_max, dim=-1).values
        threshold_B = top_values_B_K.gather(1, (k_B - 1).clamp(max=k_max - 1).unsqueeze(1))
        scaled_B_V = scaled_B_V.masked_fill(scaled_B_V < threshold_B, float("-inf"))
    if params.any_top_p:
        sorted_B_V, order_B_V = scaled_B_V.sort(dim=-1, descending=True)
        probs_sorted = sorted_B_V.softmax(dim=-1)
        mass_before_B_V = probs_sorted.cumsum(dim=-1) - probs_sorted
        # rows without top-p keep everything, exactly as they would in a batch of their own
        top_p_B = torch.where(params.top_p_B < 1.0, params.top_p_B, float("inf"))
        drop_sorted = mass_before_B_V >= top_p_B.unsqueeze(1)  # the first token always stays
        drop_B_V = torch.zeros_like(drop_sorted).scatter(1, order_B_V, drop_sorted)
        scaled_B_V = scaled_B_V.masked_fill(drop_B_V, float("-inf"))
    probs_B_V = scaled_B_V.softmax(dim=-1)
    cdf_B_V = probs_B_V.cumsum(dim=-1)
    u_B = torch.tensor(uniforms, dtype=torch.float32, device=cdf_B_V.device) * cdf_B_V[:, -1]
    drawn_B = torch.searchsorted(cdf_B_V, u_B.unsqueeze(1), right=True).squeeze(1).clamp(max=V - 1)
    # rounding at the top of the CDF can land on a filtered token: fall back to the best kept
    kept = probs_B_V.gather(1, drawn_B.unsqueeze(1)).squeeze(1) > 0
    if not bool(kept.all()):
        drawn_B = torch.where(kept, drawn_B, scaled_B_V.argmax(dim=-1))
    if params.any_greedy:
        drawn_B = torch.where(temperature_B == 0, logits_B_V.argmax(dim=-1), drawn_B)
    return drawn_B
