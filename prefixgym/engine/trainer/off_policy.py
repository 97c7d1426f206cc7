"""Off-policy corrections: importance weights for tokens a different policy sampled.

The sampler that drew a datum's tokens (a bf16 server, weights one or more updates
old) is not the policy the trainer holds. Three policies are in play for one token:

- pi_sampler: the sampler's logprob, the datum's `logprobs` input;
- pi_old: the trainer's weights **before this update**, i.e. the logprob the trainer
  computes for the same token in this forward pass, taken without gradient
  (`sg(logp_t)`);
- pi_theta: the same forward's logprob with its gradient (`logp_t`).

Each correction weighs a token by a detached importance weight on

    rho_t   = exp(sg(logp_t) - logp_sampler_t)                      per token
    rho_seq = exp(mean_{t in loss}(sg(logp_t) - logp_sampler_t))    per sequence (geometric
                                                                    mean; every token of
                                                                    the row gets it)
    tis: w = min(rho, cap)                  (truncated IS; `cap` from verl: 2.0)
    mis: w = rho if low <= rho <= high else 0   (masked IS; [0.125, 8] from prime-rl)

in one of two forms:

- **sampler ratio** (the default; verl's `bypass_mode`): the loss keeps its ratio
  pi_theta / pi_sampler, which already weighs a token by rho in value, so a clip (ppo,
  gspo) stays a trust region around the policy that sampled, and the token's weight is
  multiplied by c = w / rho: min(1, cap / rho) for tis, 1 or 0 for mis. Where no cap
  or mask acts, c = 1 and the loss is exactly the uncorrected one, for every loss.
- **decoupled** (AReaL's and verl's decoupled PPO): the loss's ratio becomes
  pi_theta / pi_old (`logprobs` := sg(logp), so a clip is a trust region around the
  weights before this update) and the weight is multiplied by w. With one update per
  batch, as here, that ratio is 1 where it is evaluated and a clip never acts: the
  form is for trainers that take several updates from one batch. Only the losses
  whose ratio the split keeps meaning take it (`types.DECOUPLED_LOSS_FN_NAMES`).

In both, importance_sampling's gradient per token is w x grad logp. `corrected` returns
the new inputs and the metric sums `off_policy/weight` (w) and `off_policy/capped` or
`off_policy/masked` (1 where the cap or mask acted), summed over loss positions like
every loss metric.

The settings travel in `loss_fn_config` as numbers (the service's config is a map of
floats): `off_policy_tis_cap` (truncated) or `off_policy_mis_low` and
`off_policy_mis_high` (masked), `off_policy_sequence` (1: per sequence, 0: per token,
the default) and `off_policy_decoupled` (1: decoupled, 0: sampler ratio, the default).
None of the first three: no correction. Knows tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from prefixgym.types import DECOUPLED_LOSS_FN_NAMES

Tensor = torch.Tensor

TIS_CAP, MIS_LOW, MIS_HIGH, SEQUENCE, DECOUPLED = (
    "off_policy_tis_cap", "off_policy_mis_low", "off_policy_mis_high", "off_policy_sequence",
    "off_policy_decoupled")
KEYS = (TIS_CAP, MIS_LOW, MIS_HIGH, SEQUENCE, DECOUPLED)
"""The `loss_fn_config` keys of a correction (absent: no correction)."""


@dataclass(frozen=True)
class Correction:
    """One correction: `mode` tis (weights above `high` cut to it) or mis (weights
    outside [low, high] set to 0), per token or per sequence, in the sampler-ratio or
    the decoupled form."""

    mode: str  # "tis" | "mis"
    per_sequence: bool
    low: float
    high: float
    decoupled: bool = False


def correction_of(config: Mapping[str, float]) -> Correction | None:
    """The correction a validated loss config asks for (None: none)."""
    per_sequence, decoupled = bool(config.get(SEQUENCE, 0.0)), bool(config.get(DECOUPLED, 0.0))
    if TIS_CAP in config:
        return Correction("tis", per_sequence, 0.0, config[TIS_CAP], decoupled)
    if MIS_LOW in config:
        return Correction("mis", per_sequence, config[MIS_LOW], config[MIS_HIGH], decoupled)
    return None


def check_config(loss_fn: str, config: Mapping[str, float]) -> None:
    """ValueError, one line, unless the correction keys of `config` make one correction
    that `loss_fn` takes."""
    given = [k for k in KEYS if k in config]
    if not given:
        return
    if TIS_CAP in config and (MIS_LOW in config or MIS_HIGH in config):
        raise ValueError(f"loss_fn_config: {TIS_CAP} (truncated) and {MIS_LOW}/{MIS_HIGH} "
                         "(masked) are two corrections; give one")
    if (MIS_LOW in config) != (MIS_HIGH in config):
        raise ValueError(f"loss_fn_config: masked IS needs both {MIS_LOW} and {MIS_HIGH}")
    if not {TIS_CAP, MIS_LOW} & set(given):
        raise ValueError(f"loss_fn_config{given} needs a correction: {TIS_CAP}, or "
                         f"{MIS_LOW} and {MIS_HIGH}")
    for key, zero, one in ((SEQUENCE, "per token", "per sequence"),
                           (DECOUPLED, "the sampler ratio", "decoupled")):
        if config.get(key, 0.0) not in (0.0, 1.0):
            raise ValueError(f"loss_fn_config[{key!r}] = {config[key]} must be 0 ({zero}) "
                             f"or 1 ({one})")
    if config.get(DECOUPLED, 0.0) and loss_fn not in DECOUPLED_LOSS_FN_NAMES:
        raise ValueError(f"loss_fn_config[{DECOUPLED!r}]: {loss_fn!r} takes no decoupled "
                         f"correction (these do: {', '.join(DECOUPLED_LOSS_FN_NAMES)}); its penalty "
                         "is on the log-ratio to the sampler itself")
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
    log_rho_B_T = _log_rho(logprobs_B_T, sampler_logprobs_B_T, mask_B_T, correction.per_sequence)
    return _weights(torch.exp(log_rho_B_T), mask_B_T, correction)


def corrected(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], correction: Correction,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The loss inputs with the correction applied in its form (see the module
    docstring), and its metric sums over the loss positions."""
    mask_B_T = inputs["loss_mask"] != 0 if "loss_mask" in inputs else inputs["weights"] != 0
    rho_B_T = torch.exp(_log_rho(logprobs_B_T, inputs["logprobs"], mask_B_T,
                                 correction.per_sequence))
    w_B_T, acted_B_T = _weights(rho_B_T, mask_B_T, correction)
    out = dict(inputs)
    if correction.decoupled:
        out["logprobs"] = logprobs_B_T.detach().to(inputs["logprobs"].dtype)
        factor_B_T = w_B_T
    else:  # c = w / rho where the cap or mask acted, 1 elsewhere: the loss's ratio carries rho
        factor_B_T = torch.where(acted_B_T, w_B_T / rho_B_T, 1.0) * mask_B_T
    out["weights"] = inputs["weights"] * factor_B_T.to(inputs["weights"].dtype)
    acted = "off_policy/capped" if correction.mode == "tis" else "off_policy/masked"
    return out, {"off_policy/weight": float(w_B_T.sum()), acted: float(acted_B_T.sum())}


def _weights(rho_B_T: Tensor, mask_B_T: Tensor, correction: Correction) -> tuple[Tensor, Tensor]:
    """`importance_weights`' answer from rho."""
    if correction.mode == "tis":
        acted_B_T = rho_B_T > correction.high
        w_B_T = rho_B_T.clamp(max=correction.high)
    else:
        acted_B_T = (rho_B_T < correction.low) | (rho_B_T > correction.high)
        w_B_T = torch.where(acted_B_T, torch.zeros_like(rho_B_T), rho_B_T)
    return w_B_T * mask_B_T, acted_B_T & mask_B_T


def _log_rho(logprobs_B_T: Tensor, sampler_logprobs_B_T: Tensor, mask_B_T: Tensor,
             per_sequence: bool) -> Tensor:
    """log rho per token, or the row's mean over its loss positions at each of them."""
    log_rho_B_T = (logprobs_B_T.detach().double() - sampler_logprobs_B_T.double()) * mask_B_T
    if not per_sequence:
        return log_rho_B_T
    count_B = mask_B_T.sum(dim=1).clamp_min(1)
    return (log_rho_B_T.sum(dim=1) / count_B)[:, None].expand_as(log_rho_B_T)
