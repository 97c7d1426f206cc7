"""Whether trained weights can be sampled from: the check every save and publish makes.

`require_samplable(model, params, compute_dtype, doing)` runs one forward of
`PROBE_TOKENS` positions spread over the vocabulary (about one decode step) and
requires finite logits, what the sampler checks of every token it samples. Otherwise
it raises ValueError "not <doing>: ...", naming a NaN or inf weight, or, when every
weight is finite but too large to survive a forward (an update of learning rate 1e30),
the largest one.

Knows the model's forward and the trained parameters; nothing of losses, optimizers or
where the weights go next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer.optimizer import named
from prefixgym.engine.trainer.train_pass import autocast_for

__all__ = ["PROBE_TOKENS", "require_samplable"]

PROBE_TOKENS = 8
"""Positions of the forward that saves and publishes check the weights with."""


def require_samplable(model: Transformer, params: Sequence[torch.nn.Parameter],
                      compute_dtype: torch.dtype, doing: str) -> None:
    """ValueError "not <doing>: ..." unless a forward of the weights on a few tokens
    gives finite logits (the module docstring)."""
    config = model.config
    n = min(PROBE_TOKENS, config.vocab_size, config.max_seq_len)
    device = model.output_weight.device
    ids = torch.linspace(0, config.vocab_size - 1, n, device=device).round().long()
    with torch.no_grad(), autocast_for(model, compute_dtype)():
        logits = model(ids.unsqueeze(0))
    if bool(torch.isfinite(logits).all()):
        return
    names = named(model, params)
    bad = nonfinite_tensor(zip(names, params, strict=True))
    if bad is not None:
        raise ValueError(f"not {doing}: {bad} holds NaN or inf values")
    with torch.no_grad():
        size, name = max((float(p.abs().max()), n)
                         for n, p in zip(names, params, strict=True) if p.numel())
    raise ValueError(
        f"not {doing}: every weight is finite, but a forward of them overflows (its "
        f"logits are not finite), so nothing could sample from them; the largest is "
        f"{size:.3g}, in {name} (a learning rate too large?)")
