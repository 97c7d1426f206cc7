"""Per-token training losses: cross_entropy, importance_sampling, ppo.

Each loss takes the current model's logprob of every target token (`logprobs_B_T`,
differentiable) and the datum tensors of the same shape, and returns
`(loss_sum, metric_sums)`:

- `loss_sum` is a scalar tensor, a **sum** over positions of weight x per-token loss,
  as the hosted service does: no mean over tokens or sequences is taken, so users
  scale the loss through `weights` and `advantages` (e.g. weights 1/num_tokens for a
  per-token mean). Padded positions carry weight 0 and contribute nothing.
- `metric_sums` maps a metric name to a per-token quantity summed over the loss
  tokens (positions with a non-zero weight). The caller divides by the number of
  loss tokens to report means, so sums from several chunks of a batch add up exactly.

Weights default to 1 where a datum has none; the caller passes them filled in.
This module knows nothing of models, datums or batching: only tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
MetricSums = dict[str, float]
LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], tuple[Tensor, MetricSums]]


def target_logprobs(logits_B_T_V: Tensor, targets_B_T: Tensor) -> Tensor:
    """log softmax(logits)[target] at every position, in float32 (or the logits' wider dtype)."""
    B, T, V = logits_B_T_V.shape
    logits = logits_B_T_V if logits_B_T_V.dtype == torch.float64 else logits_B_T_V.float()
    nll_N = F.cross_entropy(logits.reshape(B * T, V), targets_B_T.reshape(B * T), reduction="none")
    return -nll_N.view(B, T)  # (B, T)


def cross_entropy(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """Weighted negative log-likelihood.

        loss = -sum_t w_t * logp_t

    Inputs: `weights` (w). Config: none.
    """
    weights_B_T = inputs["weights"]
    loss = -(weights_B_T * logprobs_B_T).sum()
    mask = weights_B_T != 0
    return loss, {"nll/mean": float(-logprobs_B_T.detach()[mask].sum())}


def importance_sampling(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """Policy gradient corrected by the importance ratio to the sampling policy.

        r_t  = exp(logp_t - logp_sampler_t)
        loss = -sum_t w_t * r_t * A_t

    Inputs: `logprobs` (logp_sampler, the sampler's logprob of each target token),
    `advantages` (A), `weights` (w). Config: none. The gradient is
    -sum w * r * A * grad(logp), i.e. REINFORCE weighted by r.
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"])
    loss = -(weights_B_T * ratio_B_T * advantages_B_T).sum()
    return loss, _ratio_metrics(logprobs_B_T, inputs, ratio_B_T)


def ppo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """The PPO clipped surrogate.

        r_t  = exp(logp_t - logp_sampler_t)
        loss = -sum_t w_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

    Inputs: `logprobs` (logp_sampler), `advantages` (A), `weights` (w).
    Config (see `validate_config`): `clip_low_threshold` = eps_low and
    `clip_high_threshold` = eps_high, both **offsets from 1** (not bounds), default 0.2.
    Metric "clip_fraction": share of loss tokens where the clipped term is the
    smaller one and differs from the unclipped term (its gradient is zero there).
    """
    eps_low, eps_high = config["clip_low_threshold"], config["clip_high_threshold"]
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"])
    unclipped_B_T = ratio_B_T * advantages_B_T
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high) * advantages_B_T
    surrogate_B_T = torch.minimum(unclipped_B_T, clipped_B_T)
    loss = -(weights_B_T * surrogate_B_T).sum()
    metrics = _ratio_metrics(logprobs_B_T, inputs, ratio_B_T)
    mask = weights_B_T != 0
    is_clipped = (clipped_B_T.detach() < unclipped_B_T.detach()) & mask
    metrics["clip_fraction"] = float(is_clipped.sum())
    return loss, metrics


def _ratio_metrics(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], ratio_B_T: Tensor
) -> MetricSums:
    mask = inputs["weights"] != 0
    log_ratio = (logprobs_B_T - inputs["logprobs"]).detach()[mask]
    # k3 estimator of KL(sampler || current): r - 1 - log r, >= 0 per token.
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "ratio/mean": float(ratio_B_T.detach()[mask].sum()),
        "kl_sampler/mean": float(k3.sum()),
    }


@dataclass(frozen=True)
class LossSpec:
    """What a loss reads: required and optional `loss_fn_inputs` keys, config defaults."""

    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ("weights",)
    config_defaults: Mapping[str, float] | None = None


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, required=("target_tokens",)),
    "importance_sampling": LossSpec(
        importance_sampling, required=("target_tokens", "logprobs", "advantages")
    ),
    "ppo": LossSpec(
        ppo,
        required=("target_tokens", "logprobs", "advantages"),
        config_defaults={"clip_low_threshold": 0.2, "clip_high_threshold": 0.2},
    ),
}
KNOWN_INPUT_KEYS = frozenset(k for s in LOSSES.values() for k in (*s.required, *s.optional))


def get_loss(loss_fn: str) -> LossSpec:
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[loss_fn]


def validate_config(loss_fn: str, loss_fn_config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss config with defaults filled in; ValueError on an unknown key or a bad value.

    For ppo, `clip_low_threshold` must be in [0, 1) and `clip_high_threshold` >= 0:
    the ratio is clipped to [1 - clip_low_threshold, 1 + clip_high_threshold].
    """
    spec = get_loss(loss_fn)
    defaults = dict(spec.config_defaults or {})
    given = dict(loss_fn_config or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = sorted(defaults) or "none"
        raise ValueError(
            f"loss_fn_config key(s) {unknown} not used by {loss_fn!r} (allowed: {allowed})"
        )
    config = {**defaults}
    for key, value in given.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"loss_fn_config[{key!r}] = {value!r} must be a finite number")
        config[key] = float(value)
    if loss_fn == "ppo":
        if not 0.0 <= config["clip_low_threshold"] < 1.0:
            raise ValueError(
                f"loss_fn_config['clip_low_threshold'] = {config['clip_low_threshold']} is eps_low "
                "(the ratio's lower bound is 1 - eps_low); it must be in [0, 1)"
            )
        if config["clip_high_threshold"] < 0.0:
            raise ValueError(
                f"loss_fn_config['clip_high_threshold'] = {config['clip_high_threshold']} is "
                "eps_high (the ratio's upper bound is 1 + eps_high); it must be >= 0"
            )
    return config
