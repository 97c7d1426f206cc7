"""TrainingClient: forward_backward, optim_step, save/load of the train phase.

1) Validate the whole request before any compute (loss name and config, then every
   datum via `train_batch.prepare_datum`): a bad request raises ValueError naming the
   datum and key, and changes nothing.
2) Group the datums into chunks within the `max_tokens_per_forward` budget. With
   `share_prefixes` (the default) a chunk is a prefix trie (`prefix_trie.py`): the
   token prefixes its datums share are computed once, in waves whose later branches
   attend to the earlier ones' keys/values (`shared_forward.py`). Without, datums are
   right-padded into (B, T) batches (`train_batch.make_chunks`). Causal attention
   makes both equal to running datums one by one; padded positions get weight 0.
3) Per chunk: forward, per-token target logprobs, the loss (a **sum** of weight x
   per-token loss, see `losses.py`), gradients. Gradients are staged and added to
   the parameters' `.grad` only when the whole call succeeded with finite values,
   so accumulated gradients are never half-updated. `train_computed_tokens` counts
   the positions run through the model (a shared prefix once per chunk, padding not
   at all); `train_shared_tokens` the positions that sharing spared.
4) `optim_step` applies AdamW to the accumulated gradients and zeroes them.

Calls run in order on one worker thread and return `APIFuture`s, so they are safe to
issue from any thread, e.g. while another thread samples. This module knows nothing
of tokenizers, caches or the sampler: publishing weights is a callable it is given.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, TypeVarTuple

import torch

from prefixgym.engine import losses
from prefixgym.engine.checkpoint_io import (
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from prefixgym.engine.model import Transformer
from prefixgym.engine.shared_forward import context_weight, plan_logprobs
from prefixgym.engine.train_batch import (
    Chunk,
    PreparedDatum,
    make_chunks,
    make_shared_chunks,
    prepare_datum,
)
from prefixgym.engine.usage import UsageLedger
from prefixgym.futures import APIFuture
from prefixgym.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput, Usage

if TYPE_CHECKING:
    from prefixgym.engine.sampling import SamplingClient

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
Tensor = torch.Tensor


class TrainingClient:
    """Trains `model` in place. See the module docstring for the order of operations.

    `compute_dtype=torch.bfloat16` runs forward/backward under autocast with fp32
    master weights (a bf16 model simply trains in bf16). `seed` seeds a generator
    owned by this client (saved with the state) for stochastic training ops.
    `share_prefixes=False` computes every datum's every position (the reference path).
    """

    def __init__(
        self,
        model: Transformer,
        publish: Callable[[], SamplingClient] | None = None,
        ledger: UsageLedger | None = None,
        seed: int = 0,
        compute_dtype: torch.dtype = torch.float32,
        max_tokens_per_forward: int = 8192,
        share_prefixes: bool = True,
    ) -> None:
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}"
            )
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        self.model = model
        self.ledger = ledger if ledger is not None else UsageLedger()
        self.compute_dtype = compute_dtype
        self.max_tokens_per_forward = max_tokens_per_forward
        self.share_prefixes = share_prefixes
        self._publish = publish
        self._optimizer: torch.optim.AdamW | None = None
        self._step = 0
        self._generator = torch.Generator().manual_seed(seed)
        # the worker runs on its creator's thread count: torch gives a new thread the
        # process default, which the engine thread moves while it tunes (threads.py)
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="prefixgym-train", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load_state`)."""
        return self._step

    # -- requests ------------------------------------------------------------------

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Add d(loss)/d(params) to the accumulated gradients; return logprobs, metrics, usage."""
        request = self._validate(datums, loss_fn, loss_fn_config)
        return self._submit(self._run, *request, True)

    def forward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward_backward` without gradients (evaluation); counted as train compute."""
        request = self._validate(datums, loss_fn, loss_fn_config)
        return self._submit(self._run, *request, False)

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        """One AdamW update from the accumulated gradients, then zero them."""
        if not isinstance(adam, AdamParams):
            adam = AdamParams.model_validate(adam)
        return self._submit(self._optim_step, adam)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Publish the current weights as a new version and return a SamplingClient for them."""
        if self._publish is None:
            raise RuntimeError(
                "this TrainingClient has no publish callable; create it with "
                "LocalService.create_training_client() to sample from trained weights"
            )
        return self._submit(self._publish).result()

    def save_state(self, path: str | os.PathLike[str]) -> APIFuture[str]:
        """Save weights, optimizer state, step and RNG states to directory `path`, atomically.

        Gradients accumulated since the last `optim_step` are not saved. Returns once saved.
        """
        self._submit(self._save_state, os.fspath(path)).result()
        return APIFuture.completed(os.fspath(path))

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        """Restore what `save_state` wrote (model of the same architecture); drops pending grads."""
        step = self._submit(self._load_state, os.fspath(path)).result()
        return APIFuture.completed(step)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # -- worker side -----------------------------------------------------------------

    def _submit(self, fn: Callable[[*Ts], T], *args: *Ts) -> APIFuture[T]:
        return APIFuture(self._worker.submit(fn, *args))

    def _validate(
        self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None
    ) -> tuple[list[PreparedDatum], losses.LossSpec, dict[str, float]]:
        spec = losses.get_loss(loss_fn)
        config = losses.validate_config(loss_fn, loss_fn_config)
        if isinstance(datums, (str, bytes)) or not isinstance(datums, Sequence):
            raise ValueError(  # noqa: TRY004 - bad input is a ValueError throughout prefixgym
                f"datums must be a list of Datum, got {type(datums).__name__}"
            )
        if len(datums) == 0:
            raise ValueError("datums is empty; forward_backward needs at least one Datum")
        cfg = self.model.config
        prepared = [
            prepare_datum(i, d, spec, loss_fn, cfg.vocab_size, cfg.max_seq_len)
            for i, d in enumerate(datums)
        ]
        return prepared, spec, config

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        param = next(self.model.parameters())
        if self.compute_dtype == torch.float32 or param.dtype != torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(param.device.type, dtype=self.compute_dtype)

    def _chunks(self, prepared: list[PreparedDatum], device: torch.device) -> list[Chunk]:
        if self.share_prefixes:
            weight = context_weight(self.model.config)
            return make_shared_chunks(prepared, self.max_tokens_per_forward, weight, device)
        return make_chunks(prepared, self.max_tokens_per_forward, device)

    def _logprobs(self, chunk: Chunk) -> Tensor:
        """(B, T) logprobs of the chunk's targets, through the trie plan or plainly."""
        targets_B_T = chunk.inputs["target_tokens"]
        if chunk.plan is not None:
            return plan_logprobs(self.model, chunk.plan, targets_B_T, self._autocast)
        with self._autocast():
            logits_B_T_V = self.model(chunk.tokens_B_T)
        return losses.target_logprobs(logits_B_T_V, targets_B_T)

    def _run(
        self,
        prepared: list[PreparedDatum],
        spec: losses.LossSpec,
        config: dict[str, float],
        backward: bool,
    ) -> ForwardBackwardOutput:
        params = [p for p in self.model.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        staged: list[Tensor | None] = [None] * len(params)
        loss_total = 0.0
        metric_sums: dict[str, float] = {}
        logprobs_out: list[list[float]] = [[] for _ in prepared]
        chunks = self._chunks(prepared, device)
        for chunk in chunks:
            with torch.set_grad_enabled(backward):
                logprobs_B_T = self._logprobs(chunk)
                loss, sums = spec.fn(logprobs_B_T, chunk.inputs, config)
            if backward:
                chunk_grads = torch.autograd.grad(loss, params, allow_unused=True)
                for k, g in enumerate(chunk_grads):
                    prev = staged[k]
                    if g is not None:
                        staged[k] = g if prev is None else prev + g
            loss_total += float(loss.detach())
            for key, value in sums.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
            rows = logprobs_B_T.detach().double().cpu()
            for b, j in enumerate(chunk.indices):
                logprobs_out[j] = rows[b, : prepared[j].length].tolist()
        bad_grad = any(g is not None and not bool(torch.isfinite(g).all()) for g in staged)
        if not math.isfinite(loss_total) or bad_grad:
            raise ValueError(
                f"the loss ({loss_total}) or its gradient is not finite (an importance ratio "
                "exp(logp - sampler logprob) may have overflowed); gradients left unchanged"
            )
        # Commit: only now do accumulated gradients change.
        for param, staged_grad in zip(params, staged):
            if staged_grad is not None:
                param.grad = staged_grad if param.grad is None else param.grad.add_(staged_grad)
        computed = sum(chunk.computed_tokens for chunk in chunks)
        usage = Usage(
            train_computed_tokens=computed,
            train_shared_tokens=sum(p.length for p in prepared) - computed,
            train_loss_tokens=sum(p.num_loss_tokens for p in prepared),
        )
        self.ledger.add(usage)
        n_loss = max(usage.train_loss_tokens, 1)
        metrics = {
            "loss": loss_total,
            "loss/mean_per_loss_token": loss_total / n_loss,
            "train_computed_tokens": float(usage.train_computed_tokens),
            "train_shared_tokens": float(usage.train_shared_tokens),
            "train_loss_tokens": float(usage.train_loss_tokens),
            **{key: value / n_loss for key, value in metric_sums.items()},
        }
        return ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": lp} for lp in logprobs_out], metrics=metrics, usage=usage
        )

    def _optim_step(self, adam: AdamParams) -> OptimStepOutput:
        params = [p for p in self.model.parameters() if p.requires_grad]
        betas = (adam.beta1, adam.beta2)
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(
                params,
                lr=adam.learning_rate,
                betas=betas,
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        for group in self._optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=betas, eps=adam.eps, weight_decay=adam.weight_decay
            )
        grads = [g for g in (p.grad for p in params) if g is not None]
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(
                params, adam.grad_clip_norm, torch.tensor(grad_norm, device=grads[0].device)
            )
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._step += 1
        return OptimStepOutput(
            metrics={
                "grad_norm": grad_norm,
                "step": float(self._step),
                "learning_rate": adam.learning_rate,
            }
        )

    def _save_state(self, path: str) -> None:
        state = {
            "step": self._step,
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "rng": capture_rng_state(),
            "generator": self._generator.get_state(),
        }
        save_checkpoint(path, self.model, state)

    def _load_state(self, path: str) -> int:
        state = load_checkpoint(path, self.model)
        self.model.zero_grad(set_to_none=True)
        if state["optimizer"] is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._optimizer = torch.optim.AdamW(params)
            self._optimizer.load_state_dict(state["optimizer"])
        else:
            self._optimizer = None
        self._step = int(state["step"])
        restore_rng_state(state["rng"])
        self._generator.set_state(state["generator"])
        return self._step
