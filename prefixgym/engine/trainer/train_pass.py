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
   per-token loss, see `losses.py`; plus, for a mixture-of-experts model with
   `router_aux_coef`, that times the routers' load-balancing loss over the chunk's
   positions, `router_loss.py`) and, with `backward`, the gradient of every
   parameter given. With the chunked head (`chunked_head`, the default) the output
   head's backward runs only on the rows in the loss (`logprob_head.loss_surrogate`:
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer import logprob_head, losses, router_loss
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
    router_aux_coef: float = 0.0  # the load-balancing loss's weight (MoE models)


@dataclass
class PassResult:
    logprobs: list[list[float]]  # per datum, one per position
    loss: float
    metric_sums: dict[str, float]
    grads: list[Tensor | None]  # per parameter; empty without backward
    computed_tokens: int

    def add_chunk(self, loss: Tensor, sums: Mapping[str, float], logprobs_B_T: Tensor,
                  chunk: Chunk, prepared: Sequence[PreparedDatum]) -> None:
        """Add one chunk's loss, metric sums and per-datum logprobs (its rows cut to
        their datums' lengths)."""
        self.loss += float(loss.detach())
        for key, value in sums.items():
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + value
        rows = logprobs_B_T.detach().double().cpu()
        for b, j in enumerate(chunk.indices):
            self.logprobs[j] = rows[b, : prepared[j].length].tolist()

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
    result = PassResult([[] for _ in prepared], 0.0, {}, [],
                        sum(chunk.computed_tokens for chunk in chunks))
    aux = _AuxLoss(model, options.router_aux_coef)
    with _staged_grads(params, backward) as result.grads:
        for chunk in chunks:
            _run_chunk(model, params, prepared, chunk, spec, config, backward, options, aux,
                       result)
    return result


@contextlib.contextmanager
def _staged_grads(params: Sequence[torch.nn.Parameter], backward: bool
                  ) -> Iterator[list[Tensor | None]]:
    """Step 3's gradient sums, by torch's own accumulation into `.grad`: each chunk's
    backward adds its gradient to the sum in place, one parameter at a time, so a
    call holds the sum and one parameter's new gradient, not the sum and a whole
    chunk's gradients (full training of SmolLM2-135M: 0.54 GB more per forward past
    the first). The `.grad` of earlier calls is set aside meanwhile and put back, so
    that the caller commits the sum (yielded: filled in on exit) or drops it."""
    staged: list[Tensor | None] = []
    if not backward:
        yield staged
        return
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield staged
        staged.extend(p.grad for p in params)
    finally:
        for p, g in zip(params, held):
            p.grad = g


def _run_chunk(
    model: Transformer, params: Sequence[torch.nn.Parameter], prepared: list[PreparedDatum],
    chunk: Chunk, spec: losses.LossSpec, config: dict[str, float], backward: bool,
    options: PassOptions, aux: _AuxLoss, result: PassResult,
) -> None:
    """Step 2 on one chunk (its gradients into `.grad`, see `_staged_grads`), and its
    share of step 3's sums."""
    # 2)
    if backward:
        with torch.enable_grad(), aux.recording(chunk):
            logprobs_B_T, loss, sums = _chunk_backward(model, params, chunk, spec, config,
                                                       options, aux)
    else:
        with torch.no_grad(), aux.recording(chunk):
            logprobs_B_T = _logprobs(model, chunk, options)
            loss, sums = losses.loss_of(spec, logprobs_B_T, chunk.inputs, config)
            loss, sums = aux.added(loss, sums)
    result.add_chunk(loss, sums, logprobs_B_T, chunk, prepared)  # 3)


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


def _chunk_backward(
    model: Transformer, params: Sequence[torch.nn.Parameter], chunk: Chunk,
    spec: losses.LossSpec, config: dict[str, float], options: PassOptions, aux: _AuxLoss,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(logprobs_B_T, loss, metric sums) of one chunk; its gradients added to `params`'
    `.grad`."""
    if options.chunked_head:  # the head's backward only where the loss reads
        rows = _head_rows(model, chunk, options)
        extra = aux.loss()
        logprobs_B_T, loss, sums, surrogate = logprob_head.loss_surrogate(
            model, rows, chunk.inputs["loss_mask"] > 0,
            lambda logprobs_B_T: losses.loss_of(spec, logprobs_B_T, chunk.inputs, config),
            options.autocast, extra_loss=extra)
        torch.autograd.backward(surrogate, inputs=list(params))
        loss, sums = aux.added(loss, sums, None if extra is None else extra.detach())
        return logprobs_B_T, loss, sums
    logprobs_B_T = _logprobs(model, chunk, options)
    loss, sums = aux.added(*losses.loss_of(spec, logprobs_B_T, chunk.inputs, config))
    torch.autograd.backward(loss, inputs=list(params))
    return logprobs_B_T.detach(), loss.detach(), sums


class _AuxLoss:
    """The routers' load-balancing loss of the chunk in progress, times its weight
    (nothing for a model without experts or a weight of 0)."""

    def __init__(self, model: Transformer, coef: float) -> None:
        cfg = model.config
        self.model, self.coef = model, coef
        self.moe_layers = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
        self.logits: list[Tensor] = []
        self.valid: list[Tensor] = []

    @contextlib.contextmanager
    def recording(self, chunk: Chunk) -> Iterator[None]:
        if not (self.coef and self.moe_layers):
            yield
            return
        if chunk.plan is None:  # one forward of the right-padded datums
            T = chunk.tokens_B_T.shape[1]
            lengths = torch.tensor(chunk.lengths, device=chunk.tokens_B_T.device)
            self.valid = [torch.arange(T, device=lengths.device) < lengths.unsqueeze(1)]
        else:  # one per wave; a padding cell sits at position 0 past its row's start
            self.valid = [(w.positions_N_L != 0) | (torch.arange(w.positions_N_L.shape[1]) == 0)
                          for w in chunk.plan.waves]
        with router_loss.recorded_router_logits(self.model) as logits:
            self.logits = logits
            yield
        self.logits, self.valid = [], []

    def loss(self) -> Tensor | None:
        """coef x the loss of what the chunk's forwards recorded (None: nothing to add)."""
        if not self.logits:
            return None
        valid = [v.to(self.logits[0].device) for v in self.valid]
        top_k = self.model.config.experts_per_token
        return self.coef * router_loss.load_balancing_loss(self.logits, valid, self.moe_layers,
                                                           top_k)

    def added(self, loss: Tensor, sums: dict[str, float], extra: Tensor | None = None
              ) -> tuple[Tensor, dict[str, float]]:
        """The loss with the weighted aux loss added (`extra`, or computed now)."""
        extra = self.loss() if extra is None else extra
        return (loss, sums) if extra is None else (loss + extra, sums)
