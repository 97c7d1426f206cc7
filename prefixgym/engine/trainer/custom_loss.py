"""`forward_backward_custom`'s middle: a user's loss over logprobs turned into datums.

The training client runs it in three steps (`TrainingClient._run_custom`):

1) a forward pass (no gradients) gives every datum's target logprobs;
2) `logprob_gradients`: the user's `loss_fn(data, logprobs)` and autograd give the loss
   and g_i = d(loss)/d(logprobs_i), per datum;
3) `linear_datums`: the linear loss sum_i g_i . logprobs_i has the same gradient with
   respect to the parameters as the user's loss (the chain rule, exact), and it is
   `cross_entropy` with weights -g; a forward/backward of those datums adds it.
   `merged_output` reports what the caller sees: the first pass's logprobs, both
   passes' computed tokens, the user's loss value and metrics.

This module knows the prepared datums and the wire types; not the model, the passes
or the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from prefixgym.engine.trainer.train_batch import PreparedDatum
from prefixgym.types import Datum, ForwardBackwardOutput

Tensor = torch.Tensor

CustomLossFn = Callable[[list[Datum], list[Tensor]], tuple[Tensor, Mapping[str, float]]]
"""`forward_backward_custom`'s loss: (data, per-datum logprobs) -> (scalar loss, metrics)."""


def logprob_gradients(
    data: Sequence[Datum], first: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[float, Mapping[str, float], list[Tensor | None]]:
    """(the loss's value, `loss_fn`'s metrics, d(loss)/d(logprobs_i) per datum, None
    where the loss does not use datum i) from the logprobs of the first pass."""
    leaves = [torch.tensor(out["logprobs"], dtype=torch.float32, requires_grad=True)
              for out in first.loss_fn_outputs]
    loss, user_metrics = loss_fn(list(data), leaves)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError("forward_backward_custom: loss_fn must return (a scalar tensor, "
                         f"a dict of floats) first, got {type(loss).__name__}")
    grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
    return float(loss.detach().sum()), dict(user_metrics or {}), list(grads)


def linear_datums(prepared: list[PreparedDatum], grads: list[Tensor | None]) -> list[PreparedDatum]:
    """The datums of the linear loss -sum w . logp with w = -g: the same parameter
    gradient; their loss positions (where the head runs backward) are where g is not 0."""
    linear = []
    for p, g in zip(prepared, grads, strict=True):
        g_T = torch.zeros(p.length, dtype=torch.float64) if g is None else g.double()
        inputs = {**p.inputs, "weights": -g_T, "loss_mask": (g_T != 0).double()}
        linear.append(PreparedDatum(p.tokens_T, inputs, p.num_loss_tokens))
    return linear


def merged_output(first: ForwardBackwardOutput, linear: ForwardBackwardOutput, value: float,
                  user_metrics: Mapping[str, float]) -> ForwardBackwardOutput:
    """The call's output: the first pass's logprobs; usage of both passes (both ran: both
    count as computed); the linear pass's metrics with the user's loss value and
    metrics in place of the linear loss's."""
    usage = linear.usage.model_copy(update={
        "train_computed_tokens": first.usage.train_computed_tokens
        + linear.usage.train_computed_tokens,
        "train_shared_tokens": first.usage.train_shared_tokens
        + linear.usage.train_shared_tokens})
    metrics = {**linear.metrics, "loss:sum": value, "loss": value,
               **{k: float(v) for k, v in user_metrics.items()}}
    del metrics["nll/mean"]  # of the linear loss, meaningless here
    metrics["loss/mean_per_loss_token"] = value / max(linear.usage.train_loss_tokens, 1)
    metrics["train_computed_tokens"] = float(usage.train_computed_tokens)
    metrics["train_shared_tokens"] = float(usage.train_shared_tokens)
    return ForwardBackwardOutput(loss_fn_outputs=first.loss_fn_outputs, metrics=metrics,
                                 usage=usage)
