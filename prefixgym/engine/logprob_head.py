"""Target logprobs from final-norm outputs, a chunk of rows at a time: the logits of all
positions are never held at once.

The plain head (`Transformer.head` then `losses.target_logprobs`) materialises (N, V)
float32 logits and keeps them, or their log-softmax, for backward: with a 151,936-token
vocabulary that is 0.6 MB per position per copy. `target_logprobs` gives the same
values and gradients holding (rows, V) for one chunk of `chunk_rows(V)` rows:

1) Every chunk: logits of its rows, their log-softmax, the target's entry.
2) What backward keeps depends on what needs a gradient:
   - the head frozen (no trainable output matrix, no head adapter: a LoRA client
     without `train_unembed`): d logprob_n / d h_n = W[t_n] - softmax_n @ W, a C-vector,
     is computed in forward per chunk and kept (C floats per row, like h itself);
     backward scales it by the incoming gradient. The same multiply-adds as the plain
     head's backward, moved to forward: no extra compute.
   - otherwise (full training, a head adapter): each chunk runs under
     `torch.utils.checkpoint`, which keeps only the chunk's rows of h and recomputes the
     chunk's logits in backward: one more head matmul per chunk. Rows that fit in one
     chunk run plainly (their logits kept): recomputing them would lower no peak,
     since backward would rebuild them while every activation is still held.
   - without gradients: chunk by chunk, nothing kept.
3) The chunks' logprobs are concatenated in row order.

Under autocast the matmuls run in the autocast dtype as in the plain head; the
log-softmax is float32. This module knows `Transformer.head` and
`output_weight`; not losses, datums or how rows were gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from prefixgym.engine.model import Transformer

__all__ = ["CHUNK_ELEMENTS", "chunk_rows", "head_is_frozen", "target_logprobs"]

Tensor = torch.Tensor
CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk (64 MiB in float32); the rows per chunk are this over the vocabulary."""


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def head_is_frozen(model: Transformer) -> bool:
    """True when nothing in the head trains: the fast path of step 2 applies."""
    return model.head_adapter is None and not model.output_weight.requires_grad


def target_logprobs(
    model: Transformer, h_N_C: Tensor, targets_N: Tensor, rows: int | None = None
) -> Tensor:
    """(N,) float32 log softmax(model.head(h_n))[targets_n], `rows` rows at a time
    (default `chunk_rows(V)`). Steps 1-3."""
    if h_N_C.dim() != 2 or targets_N.shape != h_N_C.shape[:1]:
        raise ValueError(f"target_logprobs wants h (N, C) and targets (N,), got "
                         f"{tuple(h_N_C.shape)} and {tuple(targets_N.shape)}")
    n_rows = rows if rows is not None else chunk_rows(model.config.vocab_size)
    if not torch.is_grad_enabled():
        return torch.cat([_chunk_logprobs(model, h, t)
                          for h, t in zip(h_N_C.split(n_rows), targets_N.split(n_rows))])
    if head_is_frozen(model):
        out: Tensor = _FrozenHead.apply(h_N_C, model.output_weight, targets_N, n_rows)
        return out
    if h_N_C.shape[0] <= n_rows:  # one chunk: recomputing it would lower no peak
        return _chunk_logprobs(model, h_N_C, targets_N)
    pieces = [checkpoint(_chunk_logprobs, model, h, t, use_reentrant=False,
                         preserve_rng_state=False)
              for h, t in zip(h_N_C.split(n_rows), targets_N.split(n_rows))]
    return torch.cat(pieces)


def _chunk_logprobs(model: Transformer, h_n_C: Tensor, targets_n: Tensor) -> Tensor:
    """The plain head's ops on these rows (`losses.target_logprobs`' fused kernel)."""
    return -F.cross_entropy(model.head(h_n_C), targets_n, reduction="none")


class _FrozenHead(torch.autograd.Function):
    """Step 2's frozen-head path: logprobs and their gradient w.r.t. h, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, h_N_C: Tensor, weight_V_C: Tensor, targets_N: Tensor,
                rows: int) -> Tensor:
        logprobs: list[Tensor] = []
        d_h: list[Tensor] = []
        for h, t in zip(h_N_C.split(rows), targets_N.split(rows)):
            logp_n_V = torch.log_softmax(F.linear(h, weight_V_C).float(), dim=1)
            logprobs.append(logp_n_V.gather(1, t[:, None]).squeeze(1))
            # d logprob / d logits = onehot(t) - softmax, built in place over the logprobs
            d_logits = logp_n_V.exp_().neg_()
            d_logits.scatter_add_(1, t[:, None], torch.ones_like(t, dtype=d_logits.dtype)[:, None])
            d_h.append(torch.matmul(d_logits.to(weight_V_C.dtype), weight_V_C).to(h_N_C.dtype))
        ctx.save_for_backward(torch.cat(d_h))
        return torch.cat(logprobs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None]:
        (d_h_N_C,) = ctx.saved_tensors
        grad_N = grads[0]
        return (grad_N[:, None].to(d_h_N_C.dtype) * d_h_N_C), None, None, None
