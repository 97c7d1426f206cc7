"""The train phase's update: AdamW on the accumulated gradients, and what a non-finite
value does to it.

1) Check the learning rate (an AdamW step that would overflow float32 changes nothing
   and raises), set the request's hyperparameters on the optimizer.
2) The gradient norm. Not finite (finite gradients can still overflow it): the update
   is skipped -- weights and Adam moments untouched, the gradients dropped, counted in
   `skipped`, `skipped_nonfinite` 1 in its metrics -- or, with
   `nonfinite_update="error"`, raises after the same skip.
3) Clip to `grad_clip_norm`, step, zero the gradients, count the step.
4) An update that leaves NaN/inf in the weights it moved raises: such weights are
   never published or saved.

The torch optimizer is made on the first update (or by `load`), with AdamW's fused
kernel where the device has one. Knows parameters and `AdamParams`; not datums,
losses or where its state is saved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.types import NONFINITE_UPDATES, AdamParams, NonfiniteUpdate, OptimStepOutput

__all__ = ["AdamWUpdate", "make_adamw", "named"]


def make_adamw(params: Sequence[torch.nn.Parameter], adam: AdamParams) -> torch.optim.AdamW:
    """torch's AdamW, its fused kernel where the parameters' device has one (on CPU a
    step of `tiny` takes ~21 ms against ~70 ms for the loop per tensor; the results
    differ from that loop's in the last bit, the same from run to run)."""
    kwargs: dict[str, Any] = dict(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                                  eps=adam.eps, weight_decay=adam.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError:  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **kwargs)


class AdamWUpdate:
    """AdamW over `params` (named in errors by `names`, a name per parameter), steps 1-4.
    `step`: updates applied; `skipped`: updates skipped for a non-finite gradient norm."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 nonfinite_update: NonfiniteUpdate = "skip") -> None:
        if nonfinite_update not in NONFINITE_UPDATES:
            raise ValueError(f"nonfinite_update must be one of {NONFINITE_UPDATES}, got "
                             f"{nonfinite_update!r}")
        self.params = list(params)
        self.names = list(names)
        self.nonfinite_update = nonfinite_update
        self.optimizer: torch.optim.AdamW | None = None
        self.step = 0
        self.skipped = 0

    def apply(self, adam: AdamParams) -> OptimStepOutput:
        # 1) AdamW's first step moves by lr / (1 - beta1) and decays by 1 - lr * weight_decay
        lr = adam.learning_rate
        if max(lr / (1 - adam.beta1), lr * adam.weight_decay) > torch.finfo(torch.float32).max:
            raise ValueError(f"learning rate {adam.learning_rate:g} overflows float32 in AdamW's "
                             "update; nothing changed")
        if self.optimizer is None:
            self.optimizer = make_adamw(self.params, adam)
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        # 2)
        grads = [g for g in (p.grad for p in self.params) if g is not None]
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(grad_norm):
            return self._skip(grad_norm, adam)
        # 3)
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(
                self.params, adam.grad_clip_norm, torch.tensor(grad_norm, device=grads[0].device)
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        # 4) only what the optimizer moved can have become non-finite (a LoRA base is frozen)
        bad = nonfinite_tensor(zip(self.names, self.params, strict=True))
        if bad is not None:
            raise ValueError(
                f"optim_step {self.step} (learning rate {adam.learning_rate:g}) left NaN or inf "
                f"in {bad}: these weights will not be published or saved; load a checkpoint"
            )
        return self._output(grad_norm, adam, skipped=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any] | None:
        return self.optimizer.state_dict() if self.optimizer is not None else None

    def load(self, optimizer_state: dict[str, Any] | None, step: int) -> None:
        """Restore `state_dict()` and the step count (None: a fresh optimizer)."""
        self.optimizer = None
        if optimizer_state is not None:
            self.optimizer = make_adamw(self.params, AdamParams())  # the saved hyper-
            self.optimizer.load_state_dict(optimizer_state)  # parameters replace these
        self.step = step

    def _skip(self, grad_norm: float, adam: AdamParams) -> OptimStepOutput:
        """Drop the accumulated gradients; weights and optimizer state stay as they are."""
        self.zero_grad()
        self.skipped += 1
        if self.nonfinite_update == "error":
            raise ValueError(
                f"the gradient norm is {grad_norm} (not finite): update skipped, weights and "
                "optimizer state unchanged, gradients dropped"
            )
        return self._output(grad_norm, adam, skipped=True)

    def _output(self, grad_norm: float, adam: AdamParams, skipped: bool) -> OptimStepOutput:
        return OptimStepOutput(metrics={
            "grad_norm": grad_norm,
            "step": float(self.step),
            "learning_rate": adam.learning_rate,
            "skipped_nonfinite": float(skipped),
        })


def named(model: torch.nn.Module, params: Iterable[torch.nn.Parameter]) -> list[str]:
    """Each parameter's name in `model` ("param i", its index, where the model does not
    hold it): what a non-finite weight is called in the error."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"param {i}") for i, p in enumerate(params)]
