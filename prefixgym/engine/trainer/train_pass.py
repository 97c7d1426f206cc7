"""One pass of a training call's datums through the model: logprobs, loss, gradients.

`run_pass` is the compute of `forward_backward` and `forward`, once the call is
validated (`train_batch.prepare_request`):

1) Group the datums into chunks within the `max_tokens` budget. With
   `share_prefixes` a chunk is a prefix trie (`prefix_trie.py`): the token prefixes
   its datums share are computed once, in waves whose later branches attend to the
   earlier ones' keys/values (`shared_forward.py`). Without, datums are right-padded
   into (B, T) batches (`train_batch.make_chunks`). Causal attention makes both equal
   to running datums one by one; padded positions get weight 0.
2) Per chunk: forward, per-token target logprobs, the loss (a **sum** of weight x
   per-token loss, see `losses.py`) and, with `backward`, the gradient of every
   parameter given. With the chunked head (`chunked_head`, the default) the output
   head's backward runs only on the rows in the loss (`logprob_head.loss_gradients`:
   a prompt's rows get a forward only). `recompute` checkpoints every block
   (`Transformer.hidden`).
3) Sum the chunks: loss, metric sums, gradients (per parameter, None where no chunk
   reached it), each datum's logprobs and the positions computed (a shared prefix
   once per chunk, padding not at all).
4) `PassResult.output` turns the sums into the call's answer: logprobs, usage and
   metrics (the loss metrics as means per loss position).

Nothing is written to the parameters: the caller decides whether the result is
committed (`TrainingClient` adds the gradients only when all of them are finite).
This module knows models, chunks and losses; not datums' validation, optimizers,
usage ledgers or futures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer import logprob_head, losses
from prefixgym.engine.trainer.shared_forward import context_weight, plan_logprobs, plan_rows
from prefixgym.engine.trainer.train_batch import (
    Chunk,
    PreparedDatum,
    make_chunks,
    make_shared_chunks,
)
from prefixgym.types import ForwardBackwardOutput, Usage

__all__ = ["PassOptions", "PassResult", "autocast_for", "run_pass"]

Tensor = torch.Tensor
Autocast = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class PassOptions:
    """How a pass computes: the chunk budget, prefix sharing, the chunked head and
    recomputation give the same results up to float rounding; `autocast` sets the
    compute dtype (`autocast_for`)."""

    max_tokens: int  # positions per chunk (context rows weighted, see context_weight)
    share_prefixes: bool
    chunked_head: bool
    recompute: bool
    autocast: Autocast


@dataclass
class PassResult:
    logprobs: list[list[float]]  # per datum, one per position
    loss: float
    metric_sums: dict[str, float]
    grads: list[Tensor | None]  # per parameter; empty without backward
    computed_tokens: int

    def output(self, prepared: Sequence[PreparedDatum]) -> ForwardBackwardOutput:
        """The call's answer: per-datum logprobs, its usage (positions computed, those
        sharing spared, loss positions) and metrics (the loss sum, its mean per loss
        position, the usage, and each loss metric as a mean per loss position)."""
        usage = Usage(
            train_computed_tokens=self.computed_tokens,
            train_shared_tokens=sum(p.length for p in prepared) - self.computed_tokens,
            train_loss_tokens=sum(p.num_loss_tokens for p in prepared),
        )
        n_loss = max(usage.train_loss_tokens, 1)
        metrics = {
            "loss:sum": self.loss,
            "loss": self.loss,  # the old name of loss:sum
            "loss/mean_per_loss_token": self.loss / n_loss,
            "train_computed_tokens": float(usage.train_computed_tokens),
            "train_shared_tokens": float(usage.train_shared_tokens),
            "train_loss_tokens": float(usage.train_loss_tokens),
            **{key: value / n_loss for key, value in self.metric_sums.items()},
        }
        return ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": lp} for lp in self.logprobs], metrics=metrics,
            usage=usage)


def autocast_for(model: Transformer, compute_dtype: torch.dtype) -> Autocast:
    """Autocast to `compute_dtype` for an fp32 model; nothing otherwise (a bf16 model
    computes in bf16, an fp32 compute dtype needs no cast)."""
    param = next(model.parameters())
    if compute_dtype == torch.float32 or param.dtype != torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(param.device.type, dtype=compute_dtype)


def run_pass(
    model: Transformer, params: Sequence[torch.nn.Parameter], prepared: list[PreparedDatum],
    spec: losses.LossSpec, config: dict[str, float], backward: bool, options: PassOptions,
) -> PassResult:
    """Steps 1-3 over `prepared`; gradients of `params` when `backward`."""
    device = params[0].device if params else torch.device("cpu")
    # 1)
    if options.share_prefixes:
        chunks = make_shared_chunks(prepared, options.max_tokens, context_weight(model.config),
                                    device)
    else:
        chunks = make_chunks(prepared, options.max_tokens, device)
    result = PassResult([[] for _ in prepared], 0.0, {}, [None] * len(params) if backward else [],
                        sum(chunk.computed_tokens for chunk in chunks))
    for chunk in chunks:
        # 2)
        if backward:
            with torch.enable_grad():
                logprobs_B_T, loss, sums, chunk_grads = _chunk_gradients(
                    model, params, chunk, spec, config, options)
            for k, g in enumerate(chunk_grads):
                prev = result.grads[k]
                if g is not None:
                    result.grads[k] = g if prev is None else prev + g
        else:
            with torch.no_grad():
                logprobs_B_T = _logprobs(model, chunk, options)
                loss, sums = spec.fn(logprobs_B_T, chunk.inputs, config)
        # 3)
        result.loss += float(loss.detach())
        for key, value in sums.items():
            result.metric_sums[key] = result.metric_sums.get(key, 0.0) + value
        rows = logprobs_B_T.detach().double().cpu()
        for b, j in enumerate(chunk.indices):
            result.logprobs[j] = rows[b, : prepared[j].length].tolist()
    return result


def _head_rows(model: Transformer, chunk: Chunk, options: PassOptions) -> logprob_head.HeadRows:
    """The chunk's final-norm rows and targets for the chunked head."""
    targets_B_T = chunk.inputs["target_tokens"]
    if chunk.plan is not None:
        return plan_rows(model, chunk.plan, targets_B_T, options.autocast,
                         recompute=options.recompute)
    with options.autocast():
        h_B_T_C = model.hidden(chunk.tokens_B_T, recompute=options.recompute)
    B, T, C = h_B_T_C.shape
    cells_B_T = torch.arange(B * T, device=targets_B_T.device).view(B, T)
    return logprob_head.HeadRows(h_B_T_C.reshape(B * T, C), targets_B_T.reshape(B * T),
                                 cells_B_T)


def _logprobs(model: Transformer, chunk: Chunk, options: PassOptions) -> Tensor:
    """(B, T) logprobs of the chunk's targets, through the trie plan or plainly."""
    targets_B_T = chunk.inputs["target_tokens"]
    if options.chunked_head:
        rows = _head_rows(model, chunk, options)
        with options.autocast():
            return rows.to_grid(logprob_head.target_logprobs(model, rows.h_P_C, rows.targets_P))
    if chunk.plan is not None:
        return plan_logprobs(model, chunk.plan, targets_B_T, options.autocast,
                             recompute=options.recompute)
    with options.autocast():
        logits_B_T_V = model(chunk.tokens_B_T, recompute=options.recompute)
    return losses.target_logprobs_of_logits(logits_B_T_V, targets_B_T)


def _chunk_gradients(
    model: Transformer, params: Sequence[torch.nn.Parameter], chunk: Chunk,
    spec: losses.LossSpec, config: dict[str, float], options: PassOptions,
) -> tuple[Tensor, Tensor, dict[str, float], Sequence[Tensor | None]]:
    """(logprobs_B_T, loss, metric sums, a gradient per parameter) of one chunk."""
    if options.chunked_head:  # the head's backward only where the loss reads
        return logprob_head.loss_gradients(
            model, _head_rows(model, chunk, options), chunk.inputs["loss_mask"] > 0,
            lambda logprobs_B_T: spec.fn(logprobs_B_T, chunk.inputs, config),
            params, options.autocast)
    logprobs_B_T = _logprobs(model, chunk, options)
    loss, sums = spec.fn(logprobs_B_T, chunk.inputs, config)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return logprobs_B_T.detach(), loss.detach(), sums, grads
