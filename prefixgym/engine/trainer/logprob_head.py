"""Target logprobs from final-norm outputs, a chunk of rows at a time: the logits of all
positions are never held at once.

The plain head (`Transformer.head` then `losses.target_logprobs_of_logits`) materialises (N, V)
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

`loss_surrogate` trains through this head without running its backward on rows the
loss does not read (an RL datum's prompt: most of its positions): their logprobs are
computed without gradient, the loss's gradient with respect to each logprob is taken
first, and the parameters' gradient then comes from the rows the loss reads (its
docstring has the steps).

Under autocast the matmuls run in the autocast dtype as in the plain head; the
log-softmax is float32. This module knows `Transformer.head` and
`output_weight`; not losses, datums or how rows were gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from prefixgym.engine.model import Transformer

__all__ = ["CHUNK_ELEMENTS", "HeadRows", "chunk_rows", "head_is_frozen", "loss_surrogate",
           "target_logprobs"]

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
        out: Tensor = _FrozenHead.apply(h_N_C, model.output_weight, targets_N, n_rows,
                                        model.config.logit_divisor, model.config.final_softcap)
        return out
    if h_N_C.shape[0] <= n_rows:  # one chunk: recomputing it would lower no peak
        return _chunk_logprobs(model, h_N_C, targets_N)
    pieces = [checkpoint(_chunk_logprobs, model, h, t, use_reentrant=False,
                         preserve_rng_state=False)
              for h, t in zip(h_N_C.split(n_rows), targets_N.split(n_rows))]
    return torch.cat(pieces)


def _chunk_logprobs(model: Transformer, h_n_C: Tensor, targets_n: Tensor) -> Tensor:
    """The plain head's ops on these rows (`losses.target_logprobs_of_logits`' fused kernel)."""
    return -F.cross_entropy(model.head(h_n_C), targets_n, reduction="none")


class _FrozenHead(torch.autograd.Function):
    """Step 2's frozen-head path: logprobs and their gradient w.r.t. h, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, h_N_C: Tensor, weight_V_C: Tensor, targets_N: Tensor,
                rows: int, divisor: float, softcap: float | None) -> Tensor:
        logprobs: list[Tensor] = []
        d_h: list[Tensor] = []
        for h, t in zip(h_N_C.split(rows), targets_N.split(rows)):
            logits = F.linear(h, weight_V_C)
            if divisor != 1.0:  # the model's logit divisor, as `Transformer.head` divides
                logits = logits / divisor
            capped = None
            if softcap is not None:  # and its soft-cap, cap * tanh(logits / cap)
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            logp_n_V = torch.log_softmax(logits.float(), dim=1)
            logprobs.append(logp_n_V.gather(1, t[:, None]).squeeze(1))
            # d logprob / d logits = onehot(t) - softmax, built in place over the logprobs
            d_logits = logp_n_V.exp_().neg_()
            d_logits.scatter_add_(1, t[:, None], torch.ones_like(t, dtype=d_logits.dtype)[:, None])
            if capped is not None:  # through the cap: d tanh = 1 - tanh^2
                d_logits.mul_(1.0 - capped.float().square())
            d_h_n = torch.matmul(d_logits.to(weight_V_C.dtype), weight_V_C)
            d_h.append((d_h_n / divisor if divisor != 1.0 else d_h_n).to(h_N_C.dtype))
        ctx.save_for_backward(torch.cat(d_h))
        return torch.cat(logprobs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None, None, None]:
        (d_h_N_C,) = ctx.saved_tensors
        grad_N = grads[0]
        return (grad_N[:, None].to(d_h_N_C.dtype) * d_h_N_C), None, None, None, None, None


@dataclass
class HeadRows:
    """What the head turns into logprobs for one chunk of datums: the distinct
    (final-norm row, target) pairs its cells read, and which pair each cell reads."""

    h_P_C: Tensor  # final-norm outputs, one per pair (in the autograd graph when training)
    targets_P: Tensor  # int64 target ids
    pair_B_T: Tensor  # int64 (B, T): each cell's pair; P (one past the last) on the padding

    def to_grid(self, logprobs_P: Tensor) -> Tensor:
        """(B, T) logprobs of the cells from the pairs' (P,) logprobs; 0 on the padding.
        By `index_select`: a pair read by many cells gets their gradients added in order."""
        padded = torch.cat((logprobs_P, logprobs_P.new_zeros(1)))
        return padded.index_select(0, self.pair_B_T.reshape(-1)).view(self.pair_B_T.shape)


LossOfGrid = Callable[[Tensor], tuple[Tensor, Any]]


def _split_by_loss(rows: HeadRows, in_loss_B_T: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1's pair indices: (those an in-loss cell reads, the others); every pair
    when no cell is in the loss, for the zero gradients the loss's own backward would
    give."""
    n_pairs = int(rows.targets_P.shape[0])
    read = torch.zeros(n_pairs + 1, dtype=torch.bool, device=in_loss_B_T.device)
    read[rows.pair_B_T[in_loss_B_T]] = True
    if not read[:n_pairs].any():
        read[:n_pairs] = True
    return read[:n_pairs].nonzero().squeeze(1), (~read[:n_pairs]).nonzero().squeeze(1)


def loss_surrogate(
    model: Transformer, rows: HeadRows, in_loss_B_T: Tensor, loss_of_grid: LossOfGrid,
    autocast: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    extra_loss: Tensor | None = None,
) -> tuple[Tensor, Tensor, Any, Tensor]:
    """A scalar whose gradient with respect to every parameter is d loss / d params,
    with the head's backward only on the rows whose logprob the loss depends on.
    `loss_of_grid(logprobs_B_T) -> (loss, extra)`; `in_loss_B_T` (bool) marks the cells
    the loss is expected to read (its loss positions). Returns the detached (B, T)
    logprobs, the detached loss, `extra` and the surrogate, whose backward is the
    caller's (`torch.autograd.grad`, or into the parameters' `.grad`). Most cells of an
    RL datum are prompt, which the loss does not train on: their head rows need a
    forward (their logprobs are returned) but no backward.

    1) The pairs read by an in-loss cell: logprobs with gradient; the others without.
    2) The loss on a detached copy of all of them, and by autograd on that alone its
       gradient g_p with respect to each pair's logprob.
    3) A pair outside step 1's set with g_p != 0 (a loss whose gradient reaches cells
       outside its loss positions) has its logprob computed again, with gradient.
    4) The surrogate sum_p g_p * logprob_p over the pairs with gradient: its gradient is
       by the chain rule the loss's (g is constant there), exactly; plus `extra_loss`, a term
       of the loss computed apart from the logprobs (the routers' balancing loss), in
       the same backward. The returned loss does not include it.
    The head's cost: a forward on every pair and a backward on the loss pairs only
    (the pairs of step 3 get a second forward), against a backward on every pair.
    """
    n_pairs = int(rows.targets_P.shape[0])
    with_grad, without = _split_by_loss(rows, in_loss_B_T)

    def head(pairs: Tensor) -> Tensor:
        """The logprobs of these pairs, with gradient where grad mode is on."""
        with autocast():
            return target_logprobs(model, rows.h_P_C.index_select(0, pairs),
                                   rows.targets_P.index_select(0, pairs))

    # 1)
    lp = head(with_grad)
    picked = [(with_grad, lp)]
    logprobs_P = lp.detach().new_zeros(n_pairs).index_copy(0, with_grad, lp.detach())
    if without.numel():
        with torch.no_grad():
            logprobs_P.index_copy_(0, without, head(without).to(logprobs_P.dtype))
    # 2)
    leaf_P = logprobs_P.requires_grad_()
    loss, extra = loss_of_grid(rows.to_grid(leaf_P))
    (g_P,) = torch.autograd.grad(loss, leaf_P, allow_unused=True, materialize_grads=True)
    # 3)
    stray = without[g_P.index_select(0, without) != 0]
    if stray.numel():
        picked.append((stray, head(stray)))
    # 4)
    surrogate = sum((g_P.index_select(0, idx) * lp).sum() for idx, lp in picked)
    assert isinstance(surrogate, Tensor)  # step 1 picked at least one pair
    if extra_loss is not None:
        surrogate = surrogate + extra_loss
    return rows.to_grid(leaf_P.detach()), loss.detach(), extra, surrogate
