"""TrainerOptions: how a TrainingClient computes -- its dtype, whether shared prefixes
are computed once, what it keeps for backward, how many positions go in one forward,
and what an update with a non-finite gradient does.

One object, made once (by a command from its flags, or by
`service.create_training_client(share_prefixes=False)` from keywords) and handed down.
None of these changes what a call means: the same datums give the same losses and
gradients, up to float rounding (and bit for bit for `recompute_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixgym.types import TRAINING_DEFAULTS, NonfiniteUpdate, check_training_settings

__all__ = ["TrainerOptions"]


@dataclass(frozen=True)
class TrainerOptions:
    """The trainer's settings; see each field. Those `prefixgym train` sets from its flags
    take their defaults and checks from `types.TrainingSettings`."""

    compute_dtype: torch.dtype = torch.float32
    """torch.bfloat16 runs forward/backward under autocast with fp32 master weights and
    optimizer state (a bf16 model simply trains in bf16)."""
    nonfinite_update: NonfiniteUpdate = TRAINING_DEFAULTS.nonfinite_update
    """An update whose gradient norm is NaN or inf: "skip" (weights unchanged, counted) or
    "error" (raise)."""
    share_prefixes: bool = TRAINING_DEFAULTS.share_prefixes
    """Compute each token prefix shared by a call's datums once; False runs every datum's
    every position (the reference path)."""
    chunked_head: bool = True
    """Target logprobs a chunk of positions at a time: never all positions' logits at
    once (`logprob_head.py`)."""
    recompute_activations: bool = TRAINING_DEFAULTS.recompute_activations
    """Keep only each block's input for backward and run the block again there: far less
    activation memory for about a third more compute (`malloc_tuning.py` too)."""
    max_tokens_per_forward: int = 8192
    """Positions one forward takes (a shared prefix's context rows weighted less)."""
    router_aux_loss_coef: float = TRAINING_DEFAULTS.router_aux_loss_coef
    """A mixture-of-experts model's load-balancing loss, times this, joins every
    training call's loss (`router_loss.py`); 0, the default, as RL recipes train."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{self.compute_dtype}")
        check_training_settings(self.nonfinite_update, self.router_aux_loss_coef)
        if self.max_tokens_per_forward < 1:
            raise ValueError(
                f"max_tokens_per_forward must be >= 1, got {self.max_tokens_per_forward}")
