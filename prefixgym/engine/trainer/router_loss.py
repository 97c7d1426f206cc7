"""The routers' load-balancing loss of a mixture-of-experts model (Switch Transformer's,
as transformers' `load_balancing_loss_func` computes it), for `TrainerOptions.
router_aux_loss_coef`: off (0) by default, as RL recipes train.

1) `recorded_router_logits(model)`: while open, every `MixtureOfExperts` appends its
   router logits (N, E), in call order: forward f's MoE layers are entries
   [f * L, (f + 1) * L) of the list.
2) `load_balancing_loss(logits, valid, ...)`: the rows of real positions only (each
   forward's `valid` mask; padding is left out), over every layer and forward at once:
   E x sum_e (share of top-k picks that went to e) x (mean router probability of e).
   Its gradient reaches the routers through the probabilities (the picks are counts).

Over a call split into chunks, each chunk's loss is added (transformers takes one over
its batch); a shared prefix's positions count once (transformers counts them per
sequence). This module knows the model's MoE layers; not losses of tokens or datums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from prefixgym.engine.model import MixtureOfExperts, Transformer

__all__ = ["load_balancing_loss", "recorded_router_logits"]

Tensor = torch.Tensor


@contextlib.contextmanager
def recorded_router_logits(model: Transformer) -> Iterator[list[Tensor]]:
    """Step 1."""
    layers = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    logits: list[Tensor] = []
    for layer in layers:
        layer.router_logits = logits
    try:
        yield logits
    finally:
        for layer in layers:
            layer.router_logits = None


def load_balancing_loss(logits: Sequence[Tensor], valid: Sequence[Tensor], moe_layers: int,
                        top_k: int) -> Tensor:
    """Step 2: `logits` as recorded over the forwards whose real positions `valid` marks
    (one bool mask per forward, its rows flattened in the logits' order)."""
    rows = [logits[i][valid[i // moe_layers].reshape(-1)] for i in range(len(valid) * moe_layers)]
    probs = torch.softmax(torch.cat(rows).float(), dim=-1)
    num_experts = probs.shape[-1]
    picks = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    share = torch.bincount(picks, minlength=num_experts).float() / probs.shape[0]
    return (share * probs.mean(dim=0)).sum() * num_experts
