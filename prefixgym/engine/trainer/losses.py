"""Per-token training losses: cross_entropy, importance_sampling, ppo, cispo, dro, gspo,
stable_reinforce, as the hosted service documents them (its "Loss Functions" pages; each
function's docstring gives the formula).

Each loss takes the current model's logprob of every target token (`logprobs_B_T`,
differentiable) and the datum tensors of the same shape, and returns
`(loss_sum, metric_sums)`:

- `loss_sum` is a scalar tensor, a **sum** over positions of weight x per-token loss,
  as the hosted service does: no mean over tokens or sequences is taken, so users
  scale the loss through `weights` and `advantages` (e.g. weights 1/num_tokens for a
  per-token mean). Padded positions carry weight 0 and contribute nothing.
- `metric_sums` maps a metric name to a per-token quantity summed over the **loss
  positions** (`inputs["loss_mask"]`, see `types.loss_positions`). The caller divides by the
  number of loss positions to report means, so sums from several chunks add up exactly.

Weights default to 1 where a datum has none; the caller passes them filled in, with the
loss mask. Each row of the (B, T) tensors is one datum (gspo's sequence ratio is per
row). Clip thresholds are **bounds on the ratio** (`clamp(r, low, high)`), as the
service takes them. `loss_of` runs a loss with the off-policy correction its config asks
for (`off_policy.py`; those of `types.OFF_POLICY_LOSS_FN_NAMES` take one). This module
knows nothing of models, datums or batching: only tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixgym.engine.trainer import off_policy
from prefixgym.types import OFF_POLICY_LOSS_FN_NAMES

Tensor = torch.Tensor
MetricSums = dict[str, float]
LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], tuple[Tensor, MetricSums]]


def target_logprobs_of_logits(logits_B_T_V: Tensor, targets_B_T: Tensor) -> Tensor:
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
    mask = _mask(inputs)
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
    """The PPO clipped surrogate (service docs: "PPO").

        r_t  = exp(logp_t - logp_sampler_t)
        loss = -sum_t w_t * min(r_t * A_t, clamp(r_t, low, high) * A_t)

    Inputs: `logprobs` (logp_sampler), `advantages` (A), `weights` (w).
    Config: `clip_low_threshold` = low and `clip_high_threshold` = high, **bounds** on
    the ratio (default 0.8 and 1.2, i.e. eps = 0.2 either side).
    Metric "clip_fraction": share of loss positions where the clipped term is the
    smaller one and differs from the unclipped term (its gradient is zero there).
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"])
    return _clipped_surrogate(logprobs_B_T, ratio_B_T, weights_B_T, advantages_B_T, inputs,
                              config)


def cispo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """CISPO (service docs: "CISPO"; Chen et al. 2025, arXiv 2506.13585): the clipped
    ratio, detached, weights the log-likelihood, so no token's gradient is zeroed.

        r_t  = exp(logp_t - logp_sampler_t)
        loss = -sum_t w_t * sg(clamp(r_t, low, high)) * logp_t * A_t

    Inputs: `logprobs`, `advantages`, `weights`. Config: `clip_low_threshold` = low and
    `clip_high_threshold` = high, bounds on the ratio (default 0 and 4: one-sided).
    Metric "clip_fraction": share of loss positions whose ratio was clamped.
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"])
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    coef_B_T = torch.clamp(ratio_B_T.detach(), low, high)
    loss = -(weights_B_T * coef_B_T * logprobs_B_T * advantages_B_T).sum()
    metrics = _ratio_metrics(logprobs_B_T, inputs, ratio_B_T)
    clamped = (coef_B_T != ratio_B_T.detach()) & _mask(inputs)
    metrics["clip_fraction"] = float(clamped.sum())
    return loss, metrics


def dro(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """DRO (service docs: "DRO"; Richemond et al. 2024, arXiv 2405.19107): the
    log-likelihood times the advantage, less a quadratic penalty on the log-ratio.

        loss = -sum_t w_t * (logp_t * A_t - beta/2 * (logp_t - logp_sampler_t)^2)

    Inputs: `logprobs`, `advantages` (the "soft" advantage DRO expects, computed by the
    caller), `weights`. Config: `beta` (default 0.05: the service's example value; its
    default is not published).
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    log_ratio_B_T = logprobs_B_T - inputs["logprobs"]
    objective_B_T = logprobs_B_T * advantages_B_T - 0.5 * config["beta"] * log_ratio_B_T**2
    loss = -(weights_B_T * objective_B_T).sum()
    return loss, _ratio_metrics(logprobs_B_T, inputs, torch.exp(log_ratio_B_T))


def gspo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """GSPO-token (service docs: "GSPO"; Zheng et al. 2025, arXiv 2507.18071): PPO's
    clipped surrogate on a per-sequence ratio, the geometric mean of the token ratios
    over the positions M that `sequence_ratio_mask` marks.

        s    = exp(mean_{t in M}(sg(logp_t) - logp_sampler_t))        per datum (row)
        s_t  = sg(s) * exp(logp_t - sg(logp_t))      (value s, gradient of logp_t)
        loss = -sum_t w_t * min(s_t * A_t, clamp(s_t, low, high) * A_t)

    Inputs: `logprobs`, `advantages`, `weights`, and `sequence_ratio_mask` (optional;
    without it M is the datum's loss positions). Config: `clip_low_threshold`,
    `clip_high_threshold`, bounds (default 0.8 and 1.2). A row with an empty M has s = 1.
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    in_ratio_B_T = (inputs["sequence_ratio_mask"] != 0) if "sequence_ratio_mask" in inputs \
        else _mask(inputs)
    log_ratio_B_T = (logprobs_B_T.detach() - inputs["logprobs"]) * in_ratio_B_T
    count_B = in_ratio_B_T.sum(dim=1).clamp_min(1)
    seq_log_ratio_B = log_ratio_B_T.sum(dim=1) / count_B  # (B,)
    ratio_B_T = torch.exp(seq_log_ratio_B[:, None] + logprobs_B_T - logprobs_B_T.detach())
    return _clipped_surrogate(logprobs_B_T, ratio_B_T, weights_B_T, advantages_B_T, inputs,
                              config)


def stable_reinforce(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """StableReinforce, **a local stand-in**: the service's objective (docs: "StableReinforce",
    alpha) uses stability information it records at sampling time and is not published.
    Locally the sampler and the trainer share one model and its numerics, and this is
    REINFORCE with the importance weight as a detached coefficient, plus an optional
    penalty on the k3 estimate of KL(sampler || current):

        r_t  = exp(logp_t - logp_sampler_t)
        loss = -sum_t w_t * sg(r_t) * logp_t * A_t  +  kl_coeff * sum_t w_t * (r_t - 1 - log r_t)

    Its gradient at kl_coeff = 0 equals importance_sampling's. Inputs: `logprobs`,
    `advantages`, `weights`. Config: `kl_coeff` (default 0), the key the service names.
    """
    weights_B_T, advantages_B_T = inputs["weights"], inputs["advantages"]
    log_ratio_B_T = logprobs_B_T - inputs["logprobs"]
    ratio_B_T = torch.exp(log_ratio_B_T)
    k3_B_T = torch.expm1(log_ratio_B_T) - log_ratio_B_T
    per_token_B_T = (-ratio_B_T.detach() * logprobs_B_T * advantages_B_T
                     + config["kl_coeff"] * k3_B_T)
    loss = (weights_B_T * per_token_B_T).sum()
    return loss, _ratio_metrics(logprobs_B_T, inputs, ratio_B_T)


def _clipped_surrogate(
    logprobs_B_T: Tensor, ratio_B_T: Tensor, weights_B_T: Tensor, advantages_B_T: Tensor,
    inputs: Mapping[str, Tensor], config: Mapping[str, float],
) -> tuple[Tensor, MetricSums]:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    unclipped_B_T = ratio_B_T * advantages_B_T
    clipped_B_T = torch.clamp(ratio_B_T, low, high) * advantages_B_T
    surrogate_B_T = torch.minimum(unclipped_B_T, clipped_B_T)
    loss = -(weights_B_T * surrogate_B_T).sum()
    metrics = _ratio_metrics(logprobs_B_T, inputs, ratio_B_T)
    is_clipped = (clipped_B_T.detach() < unclipped_B_T.detach()) & _mask(inputs)
    metrics["clip_fraction"] = float(is_clipped.sum())
    return loss, metrics


def _mask(inputs: Mapping[str, Tensor]) -> Tensor:
    mask = inputs.get("loss_mask")
    return inputs["weights"] != 0 if mask is None else mask != 0


def _ratio_metrics(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], ratio_B_T: Tensor
) -> MetricSums:
    mask = _mask(inputs)
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


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP_PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, required=("target_tokens",)),
    "importance_sampling": LossSpec(importance_sampling, required=_RL_INPUTS),
    "ppo": LossSpec(ppo, required=_RL_INPUTS, config_defaults=_CLIP_PPO),
    "cispo": LossSpec(cispo, required=_RL_INPUTS,
                      config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, required=_RL_INPUTS, config_defaults={"beta": 0.05}),
    "gspo": LossSpec(gspo, required=_RL_INPUTS, optional=("weights", "sequence_ratio_mask"),
                     config_defaults=_CLIP_PPO),
    "stable_reinforce": LossSpec(stable_reinforce, required=_RL_INPUTS,
                                 config_defaults={"kl_coeff": 0.0}),
}
"""Each loss of `types.LOSS_FN_NAMES` (the names' one writer), in its order
(`test_losses.py` holds them equal); those of `types.OFF_POLICY_LOSS_FN_NAMES` take the
off-policy correction's config keys too."""
KNOWN_INPUT_KEYS = frozenset(k for s in LOSSES.values() for k in (*s.required, *s.optional))


def loss_of(
    spec: LossSpec, logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> tuple[Tensor, MetricSums]:
    """`spec`'s loss, corrected as `config` asks (`off_policy.py`). In the decoupled form
    the loss's ratio is to the weights before the update; "ratio/mean" and
    "kl_sampler/mean" stay those to the sampler in both forms."""
    correction = off_policy.correction_of(config)
    if correction is None:
        return spec.fn(logprobs_B_T, inputs, config)
    corrected_inputs, sums = off_policy.corrected(logprobs_B_T, inputs, correction)
    loss, metrics = spec.fn(logprobs_B_T, corrected_inputs, config)
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"])
    return loss, {**metrics, **_ratio_metrics(logprobs_B_T, inputs, ratio_B_T), **sums}


def get_loss(loss_fn: str) -> LossSpec:
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[loss_fn]


def validate_config(loss_fn: str, loss_fn_config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss config with defaults filled in; ValueError on an unknown key or a bad value.

    Clip thresholds are bounds on the ratio: `clip_low_threshold` in [0, 1] and
    `clip_high_threshold` >= 1 (the ratio is clamped to [low, high]). `beta` and
    `kl_coeff` are >= 0. The losses of `OFF_POLICY_LOSS_FN_NAMES` also take the off-policy
    correction's keys (`off_policy.check_config`).
    """
    spec = get_loss(loss_fn)
    defaults = dict(spec.config_defaults or {})
    given = dict(loss_fn_config or {})
    corrects_off_policy = loss_fn in OFF_POLICY_LOSS_FN_NAMES
    corrections = sorted(set(given) & set(off_policy.KEYS))
    if corrections and not corrects_off_policy:
        raise ValueError(f"loss_fn_config key(s) {corrections}: {loss_fn!r} takes no off-policy "
                         f"correction (these do: {', '.join(OFF_POLICY_LOSS_FN_NAMES)})")
    unknown = sorted(set(given) - set(defaults) - set(off_policy.KEYS))
    if unknown:
        allowed = sorted({*defaults, *(off_policy.KEYS if corrects_off_policy else ())}
                         ) or "none"
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
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0.0 <= low <= 1.0:
            raise ValueError(
                f"loss_fn_config['clip_low_threshold'] = {low} is the ratio's lower bound "
                "(e.g. 0.8 for eps 0.2); it must be in [0, 1]"
            )
        if high < 1.0:
            raise ValueError(
                f"loss_fn_config['clip_high_threshold'] = {high} is the ratio's upper bound "
                "(e.g. 1.2 for eps 0.2, not the offset 0.2); it must be >= 1"
            )
    for key in ("beta", "kl_coeff"):
        if config.get(key, 0.0) < 0.0:
            raise ValueError(f"loss_fn_config[{key!r}] = {config[key]} must be >= 0")
    off_policy.check_config(loss_fn, config)
    return config
