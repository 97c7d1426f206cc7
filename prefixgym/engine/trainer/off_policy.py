"""Off-policy corrections: importance weights for tokens a different policy sampled.

The sampler that drew a datum's tokens (a bf16 server, weights one or more updates
old) is not the policy the trainer holds. Three policies are in play for one token:

- pi_sampler: the sampler's logprob, the datum's `logprobs` input;
- pi_old: the trainer's weights **before this update**, i.e. the logprob the trainer
  computes for the same token in this forward pass, taken without gradient
  (`sg(logp_t)`);
- pi_theta: the same forward's logprob with its gradient (`logp_t`).

The correction splits the loss's ratio pi_theta / pi_sampler into two factors, as
verl's decoupled form does: the loss itself sees pi_theta / pi_old (its clip, if any,
is a trust region around the weights before the update) and the per-token weight is
multiplied by a detached importance weight on rho = pi_old / pi_sampler:

    rho_t   = exp(sg(logp_t) - logp_sampler_t)                      per token
    rho_seq = exp(mean_{t in loss}(sg(logp_t) - logp_sampler_t))    per sequence (geometric
                                                                    mean; every token of
                                                                    the row gets it)
    tis: w = min(rho, cap)                  (truncated IS; `cap` from verl: 2.0)
    mis: w = rho if low <= rho <= high else 0   (masked IS; [0.125, 8] from prime-rl)

so the loss runs with `logprobs` := sg(logp) and `weights` := weights x w. Without a
cap or mask hit, importance_sampling's gradient is unchanged (w * pi_theta/pi_old =
pi_theta/pi_sampler in value). `corrected` returns the new inputs and the metric sums
`off_policy/weight` (w) and `off_policy/capped` or `off_policy/masked` (1 where the
cap or mask acted), summed over loss positions like every loss metric.

The settings travel in `loss_fn_config` as numbers (the service's config is a map of
floats): `off_policy_tis_cap` (truncated) or `off_policy_mis_low` and
`off_policy_mis_high` (masked), and `off_policy_sequence` (1: per sequence, 0: per
token, the default). None of them: no correction. Knows tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

TIS_CAP, MIS_LOW, MIS_HIGH, SEQUENCE = (
    "off_policy_tis_cap", "off_policy_mis_low", "off_policy_mis_high", "off_policy_sequence")
KEYS = (TIS_CAP, MIS_LOW, MIS_HIGH, SEQUENCE)
"""The `loss_fn_config` keys of a correction (absent: no correction)."""


@dataclass(frozen=True)
class Correction:
    """One correction: `mode` tis (weights above `high` cut to it) or mis (weights
    outside [low, high] set to 0), per token or per sequence."""

    mode: str  # "tis" | "mis"
    per_sequence: bool
    low: float
    high: float


def correction_of(config: Mapping[str, float]) -> Correction | None:
    """The correction a validated loss config asks for (None: none)."""
    per_sequence = bool(config.get(SEQUENCE, 0.0))
    if TIS_CAP in config:
        return Correction("tis", per_sequence, 0.0, config[TIS_CAP])
    if MIS_LOW in config:
        return Correction("mis", per_sequence, config[MIS_LOW], config[MIS_HIGH])
    return None


def check_config(config: Mapping[str, float]) -> None:
    """ValueError, one line, unless the correction keys of `config` make one correction."""
    given = [k for k in KEYS if k in config]
    if not given:
        return
    if TIS_CAP in config and (MIS_LOW in config or MIS_HIGH in config):
        raise ValueError(f"loss_fn_config: {TIS_CAP} (truncated) and {MIS_LOW}/{MIS_HIGH} "
                         "(masked) are two corrections; give one")
    if (MIS_LOW in config) != (MIS_HIGH in config):
        raise ValueError(f"loss_fn_config: masked IS needs both {MIS_LOW} and {MIS_HIGH}")
    if given == [SEQUENCE]:
        raise ValueError(f"loss_fn_config[{SEQUENCE!r}] needs a correction: {TIS_CAP}, or "
                         f"{MIS_LOW} and {MIS_HIGH}")
    if config.get(SEQUENCE, 0.0) not in (0.0, 1.0):
        raise ValueError(f"loss_fn_config[{SEQUENCE!r}] = {config[SEQUENCE]} must be 0 (per "
                         "token) or 1 (per sequence)")
    if TIS_CAP in config and config[TIS_CAP] < 1.0:
        raise ValueError(f"loss_fn_config[{TIS_CAP!r}] = {config[TIS_CAP]} is the importance "
                         "weight's upper bound; it must be >= 1")
    if MIS_LOW in config and not 0.0 <= config[MIS_LOW] <= 1.0 <= config[MIS_HIGH]:
        raise ValueError(f"loss_fn_config: masked IS keeps weights in [{MIS_LOW}, {MIS_HIGH}] "
                         f"= [{config[MIS_LOW]}, {config[MIS_HIGH]}]; it needs "
                         "0 <= low <= 1 <= high")


def importance_weights(
    logprobs_B_T: Tensor, sampler_logprobs_B_T: Tensor, mask_B_T: Tensor, correction: Correction,
) -> tuple[Tensor, Tensor]:
    """(w_B_T, acted_B_T): the detached weights and where the cap or mask acted, both
    zero outside `mask_B_T` (the loss positions)."""
    log_rho_B_T = (logprobs_B_T.detach().double() - sampler_logprobs_B_T.double()) * mask_B_T
    if correction.per_sequence:
        count_B = mask_B_T.sum(dim=1).clamp_min(1)
        log_rho_B_T = (log_rho_B_T.sum(dim=1) / count_B)[:, None].expand_as(log_rho_B_T)
    rho_B_T = torch.exp(log_rho_B_T)
    if correction.mode == "tis":
        acted_B_T = rho_B_T > correction.high
        w_B_T = rho_B_T.clamp(max=correction.high)
    else:
        acted_B_T = (rho_B_T < correction.low) | (rho_B_T > correction.high)
        w_B_T = torch.where(acted_B_T, torch.zeros_like(rho_B_T), rho_B_T)
    return w_B_T * mask_B_T, acted_B_T & mask_B_T


def corrected(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], correction: Correction,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The loss inputs with the correction applied (see the module docstring), and its
    metric sums over the loss positions."""
    mask_B_T = inputs["loss_mask"] != 0 if "loss_mask" in inputs else inputs["weights"] != 0
    w_B_T, acted_B_T = importance_weights(logprobs_B_T, inputs["logprobs"], mask_B_T, correction)
    out = dict(inputs)
    out["logprobs"] = logprobs_B_T.detach().to(inputs["logprobs"].dtype)
    out["weights"] = inputs["weights"] * w_B_T.to(inputs["weights"].dtype)
    acted = "off_policy/capped" if correction.mode == "tis" else "off_policy/masked"
    return out, {"off_policy/weight": float(w_B_T.sum()), acted: float(acted_B_T.sum())}
