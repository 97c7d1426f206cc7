"""Trajectories -> Datums: one training sequence per episode, built complete, once.

An episode's tokens form one growing sequence (each prompt extends the previous
prompt plus its reply), so one `Datum` trains the whole episode in one forward pass,
computing every position once. It covers the tokens up to the end of the last
reply: inputs `tokens[:end-1]`, targets `tokens[1:end]`; position i predicts token
i+1, so its weight is non-zero exactly when token i+1 was sampled.

The losses are sums over tokens. Callers pass `batch_loss_tokens` (the loss tokens of
the whole batch) and the datum divides by it, so that an update is a per-token mean
whatever B, G and episode lengths are: RL datums carry `advantage / batch_loss_tokens`
on the sampled targets (weights stay 1), SFT datums carry `1 / batch_loss_tokens` as
their weights.

This module knows token ids and advantages; not envs, tokenizers or models.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgym.rollouts.types import Trajectory
from prefixgym.types import Datum, ModelInput


def loss_mask(trajectory: Trajectory) -> list[bool]:
    """Per input position of the episode's datum: does its target count in the loss?"""
    return trajectory.sampled_mask[1 : trajectory.trained_length]


def num_loss_tokens(trajectories: Sequence[Trajectory]) -> int:
    return sum(sum(loss_mask(t)) for t in trajectories)


def rl_datum(
    trajectory: Trajectory, advantage: float, batch_loss_tokens: int,
    kl_penalty: Sequence[float] | None = None,
) -> Datum:
    """Inputs, targets, the sampler's logprobs, weights 1 on sampled targets, and there
    advantages `(advantage - kl_penalty[i]) / batch_loss_tokens` (0 elsewhere)."""
    end = trajectory.trained_length
    weights = [1.0 if m else 0.0 for m in loss_mask(trajectory)]
    advantages = [advantage * w for w in weights]
    if kl_penalty is not None:
        advantages = [a - k if w else a for a, k, w in zip(advantages, kl_penalty, weights)]
    return Datum(
        model_input=ModelInput.from_ints(trajectory.tokens[: end - 1]),
        loss_fn_inputs={
            "target_tokens": trajectory.tokens[1:end],
            "weights": weights,
            "logprobs": trajectory.logprobs[1:end],
            "advantages": [a / batch_loss_tokens for a in advantages],
        },
    )


def sft_datum(trajectory: Trajectory, batch_loss_tokens: int) -> Datum:
    """Inputs, targets, and weights `1 / batch_loss_tokens` on the reply tokens."""
    end = trajectory.trained_length
    return Datum(
        model_input=ModelInput.from_ints(trajectory.tokens[: end - 1]),
        loss_fn_inputs={
            "target_tokens": trajectory.tokens[1:end],
            "weights": [(1.0 if m else 0.0) / batch_loss_tokens for m in loss_mask(trajectory)],
        },
    )


def trainable(trajectory: Trajectory) -> bool:
    """Whether the episode gives a datum: it did not fail and has a sampled target."""
    return not trajectory.failed and trajectory.trained_length >= 2 and any(loss_mask(trajectory))
