"""TrainingClient: forward_backward, optim_step, save/load of the train phase.

1) Validate the whole request before any compute (loss name and config, then every
   datum, by `train_batch.prepare_request`): a bad request raises ValueError naming the
   datum and key, and changes nothing.
2) Compute: `train_pass.run_pass` chunks the datums within the
   `max_tokens_per_forward` budget (with `share_prefixes`, the default, each chunk a
   prefix trie whose shared positions are computed once), runs forward, the loss (a
   **sum** of weight x per-token loss, see `losses.py`) and its gradients (with the
   chunked head, the default, the head's backward on the loss rows only).
3) Commit: the gradients are added to the parameters' `.grad` only when the whole call
   succeeded with finite values, so accumulated gradients are never half-updated.
   `train_computed_tokens` counts the positions run through the model (a shared
   prefix once per chunk, padding not at all); `train_shared_tokens` the positions
   that sharing spared.
4) `optim_step` applies AdamW to the accumulated gradients and zeroes them
   (`optimizer.py`, also for what a non-finite gradient norm or weight does: by
   default the update is skipped and counted; NaN/inf weights are never published
   or saved, nor finite ones whose forward overflows: `weight_probe.py`).

What trains is given: by default every parameter of the model that requires grad
(full training); a LoRA client (`EngineService.create_lora_training_client`) passes
its adapters' parameters, the module that holds them (what `save_state` writes), and
the callable that writes them for a sampler (`save_weights_for_sampler`).

With `recompute_activations`, the first forward_backward also fixes glibc's mmap
threshold for the process (`malloc_tuning.py`): otherwise freed activations stay
resident in the worker's malloc arena and the peak grows with every datum. It is part
of that memory option because it costs time too (a mapping per large tensor).

Calls run in order on one worker thread and return `APIFuture`s, so they are safe to
issue from any thread, e.g. while another thread samples. This module knows nothing
of tokenizers, caches or the sampler: publishing weights is a callable it is given.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Generic, TypeVar, TypeVarTuple

import torch

from prefixgym.engine import malloc_tuning
from prefixgym.engine.checkpoint_io import (
    capture_rng_state,
    load_checkpoint,
    nonfinite_tensor,
    restore_rng_state,
    save_checkpoint,
)
from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer import losses
from prefixgym.engine.trainer.custom_loss import (
    CustomLossFn,
    linear_datums,
    logprob_gradients,
    merged_output,
)
from prefixgym.engine.trainer.optimizer import AdamWUpdate, named
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.train_batch import PreparedDatum, prepare_request
from prefixgym.engine.trainer.train_pass import PassOptions, autocast_for, run_pass
from prefixgym.engine.trainer.weight_probe import require_samplable
from prefixgym.engine.usage import UsageLedger
from prefixgym.futures import APIFuture
from prefixgym.protocols import SamplingClient
from prefixgym.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
SamplerT = TypeVar("SamplerT", bound=SamplingClient)
"""What `publish` returns: the service's SamplingClient (this wing never imports it)."""


class TrainingClient(Generic[SamplerT]):
    """Trains `model` in place, computing as `options` says (`options.py`: the dtype,
    prefix sharing, what backward keeps, the non-finite policy). See the module
    docstring for the order of operations.

    `publish(check) -> sampling client` backs `save_weights_and_get_sampling_client`
    (the service's: this wing never imports the sampler); it runs `check()`, the
    weights' probe (`weight_probe.py`), when it likes (the service: while it packs) but
    before the new version is anyone's, and raises what it raises. `params`: the
    parameters the optimizer updates (default: every one that requires grad);
    `state_module`: the module whose tensors `save_state` writes and `load_state` reads
    (default: the model); `save_for_sampler(name) -> path` backs `save_weights_for_sampler`.
    """

    def __init__(
        self,
        model: Transformer,
        options: TrainerOptions | None = None,
        *,
        publish: Callable[[Callable[[], None]], SamplerT] | None = None,
        ledger: UsageLedger | None = None,
        params: Sequence[torch.nn.Parameter] | None = None,
        state_module: torch.nn.Module | None = None,
        save_for_sampler: Callable[[str], str] | None = None,
    ) -> None:
        self.model = model
        self.options = options if options is not None else TrainerOptions()
        self.ledger = ledger if ledger is not None else UsageLedger()
        self._publish = publish
        self._params = (list(params) if params is not None
                        else [p for p in model.parameters() if p.requires_grad])
        self._update = AdamWUpdate(self._params, named(model, self._params),
                                   self.options.nonfinite_update)
        self._state_module = state_module if state_module is not None else model
        self._save_for_sampler = save_for_sampler
        # the worker runs on its creator's thread count: torch gives a new thread the
        # process default, which the engine thread moves while it tunes (threads.py)
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="prefixgym-train", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.options.compute_dtype

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load_state`)."""
        return self._update.step

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates."""
        return self._params

    @property
    def state_module(self) -> torch.nn.Module:
        """The module whose tensors `save_state` writes and `load_state` reads."""
        return self._state_module

    @property
    def nonfinite_update(self) -> str:
        """What an update with a non-finite gradient norm does: "skip" or "error"."""
        return self._update.nonfinite_update

    @property
    def skipped_updates(self) -> int:
        """Updates skipped for a non-finite gradient norm (not restored by `load_state`)."""
        return self._update.skipped

    @property
    def _optimizer(self) -> torch.optim.AdamW | None:
        """The torch optimizer (None before the first update)."""
        return self._update.optimizer

    # -- requests ------------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str | None = None,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Add d(loss)/d(params) to the accumulated gradients; return logprobs, metrics, usage.
        `data` and `loss_fn` as the hosted service names them."""
        request = self._validate(data, _loss_arg(loss_fn), loss_fn_config)
        return self._submit(self._timed, "forward_backward", partial(self._run, *request, True))

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str | None = None,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward_backward` without gradients (evaluation); counted as train compute."""
        request = self._validate(data, _loss_arg(loss_fn), loss_fn_config)
        return self._submit(self._timed, "forward_backward", partial(self._run, *request, False))

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on a loss of your own over the per-token logprobs, as the hosted service's
        `forward_backward_custom`: `loss_fn(data, logprobs)` gets `logprobs[i]`, a 1-D
        float32 tensor (requires_grad) of datum i's target logprobs, and returns
        `(loss, metrics)`: a scalar tensor and a dict of floats.

        Exact by autograd (the chain rule, not an approximation): 1) a forward pass gives
        the logprobs; 2) `loss_fn` and autograd give g = d(loss)/d(logprobs); 3) a
        forward/backward of the linear loss sum_i g_i . logprobs_i (cross_entropy with
        weights -g) adds d(loss)/d(params) to the gradients -- two forwards, as the
        service does. Only `target_tokens` is needed (and `weights`, which count as the
        loss positions); every input goes to `loss_fn` unchanged. Metrics: `loss:sum` is
        `loss`'s value, then `loss_fn`'s own."""
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be a callable (data, logprobs) -> (loss, metrics), "
                             f"got {type(loss_fn).__name__}")
        request = self._validate(data, "cross_entropy", None, any_keys=True)
        return self._submit(self._timed, "forward_backward",
                            partial(self._run_custom, data, request[0], loss_fn))

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        """One AdamW update from the accumulated gradients, then zero them."""
        if not isinstance(adam, AdamParams):
            adam = AdamParams.model_validate(adam)
        return self._submit(self._timed, "optim_step", partial(self._update.apply, adam))

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplerT:
        """Publish the current weights as a new version and return a SamplingClient for them."""
        if self._publish is None:
            raise RuntimeError(
                "this TrainingClient has no publish callable; create it with "
                "LocalService.create_training_client() to sample from trained weights"
            )
        return self._submit(self._timed, "publish", partial(self._publish, partial(
            require_samplable, self.model, self._params, "publishing weights"))).result()

    def save_weights_for_sampler(self, name: str | os.PathLike[str]) -> APIFuture[str]:
        """Write the trained weights where a sampler can load them (a LoRA client: a
        PEFT adapter directory at path `name`); the future's result is its absolute path."""
        if self._save_for_sampler is None:
            raise RuntimeError(
                "save_weights_for_sampler writes LoRA adapters; this client trains every "
                "weight (use save_state, or create_lora_training_client)"
            )
        if not os.fspath(name):
            raise ValueError("save_weights_for_sampler needs a non-empty name")
        save, path = self._save_for_sampler, os.fspath(name)
        return self._submit(self._checked, f"saving weights for a sampler to {path}",
                            lambda: save(path))

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        """Save weights, optimizer state, step and RNG states to directory `path`, atomically
        (`with_optimizer=False`: all but the optimizer state, which `load_state` then
        starts afresh).

        Gradients accumulated since the last `optim_step` are not saved. Returns once saved.
        Like every save and publish, refuses (ValueError) weights nothing could sample
        from (`_checked`).
        """
        where = os.fspath(path)
        self._submit(self._checked, f"saving a checkpoint to {where}",
                     lambda: self._save_state(where, with_optimizer)).result()
        return APIFuture.completed(os.fspath(path))

    def load_state(
        self, path: str | os.PathLike[str], with_optimizer: bool = True
    ) -> APIFuture[int]:
        """Restore what `save_state` wrote (model of the same architecture); drops pending
        grads. `with_optimizer=False` restores the weights only and starts the optimizer
        afresh at step 0 (the hosted service's `load_state`), as does a state saved without
        the optimizer's."""
        step = self._submit(self._load_state, os.fspath(path), with_optimizer).result()
        return APIFuture.completed(step)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # -- worker side -----------------------------------------------------------------

    def _submit(self, fn: Callable[[*Ts], T], *args: *Ts) -> APIFuture[T]:
        return APIFuture(self._worker.submit(fn, *args))

    def _timed(self, phase: str, fn: Callable[[], T]) -> T:
        """`fn()`, its seconds added to the ledger's `phase` (on the worker)."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.ledger.add_seconds(phase, time.perf_counter() - start)

    def _validate(
        self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
        any_keys: bool = False,
    ) -> tuple[list[PreparedDatum], losses.LossSpec, dict[str, float]]:
        cfg = self.model.config
        return prepare_request(datums, loss_fn, loss_fn_config, cfg.vocab_size, cfg.max_seq_len,
                               any_keys)

    def _run(
        self,
        prepared: list[PreparedDatum],
        spec: losses.LossSpec,
        config: dict[str, float],
        backward: bool,
        record_usage: bool = True,
    ) -> ForwardBackwardOutput:
        o = self.options
        if o.recompute_activations:  # once per process; a no-op without glibc
            malloc_tuning.fix_mmap_threshold()
        options = PassOptions(o.max_tokens_per_forward, o.share_prefixes, o.chunked_head,
                              o.recompute_activations, autocast_for(self.model, o.compute_dtype),
                              o.router_aux_loss_coef)
        result = run_pass(self.model, self._params, prepared, spec, config, backward, options)
        staged, loss_total = result.grads, result.loss
        bad_grad = nonfinite_tensor((str(k), g) for k, g in enumerate(staged) if g is not None)
        if not math.isfinite(loss_total) or bad_grad is not None:
            raise ValueError(
                f"the loss ({loss_total}) or its gradient is not finite (an importance ratio "
                "exp(logp - sampler logprob) may have overflowed); gradients left unchanged"
            )
        # Commit: only now do accumulated gradients change.
        for param, staged_grad in zip(self._params, staged):
            if staged_grad is not None:
                param.grad = staged_grad if param.grad is None else param.grad.add_(staged_grad)
        out = result.output(prepared)
        if record_usage:
            self.ledger.add(out.usage)
        return out

    def _run_custom(
        self, data: Sequence[Datum], prepared: list[PreparedDatum], loss_fn: CustomLossFn
    ) -> ForwardBackwardOutput:
        """The steps of `custom_loss.py`: logprobs, the user's gradients, the linear loss."""
        spec = losses.get_loss("cross_entropy")
        first = self._run(prepared, spec, {}, False, record_usage=False)  # 1)
        value, user_metrics, grads = logprob_gradients(data, first, loss_fn)  # 2)
        linear = self._run(linear_datums(prepared, grads), spec, {}, True,  # 3)
                           record_usage=False)
        out = merged_output(first, linear, value, user_metrics)
        self.ledger.add(out.usage)
        return out

    def _checked(self, doing: str, then: Callable[[], T]) -> T:
        """`then()`, once the weights pass `weight_probe.require_samplable` (ValueError
        "not <doing>: ..." otherwise)."""
        require_samplable(self.model, self._params, doing)
        return then()

    def _save_state(self, path: str, with_optimizer: bool = True) -> None:
        state: dict[str, object] = {"step": self._update.step, "rng": capture_rng_state()}
        if with_optimizer:
            state["optimizer"] = self._update.state_dict()
        save_checkpoint(path, self._state_module, state)

    def _load_state(self, path: str, with_optimizer: bool = True) -> int:
        state = load_checkpoint(path, self._state_module)
        self.model.zero_grad(set_to_none=True)
        if not with_optimizer or "optimizer" not in state:
            self._update.load(None, 0)
            return 0
        self._update.load(state["optimizer"], int(state["step"]))
        restore_rng_state(state["rng"])  # (a "generator" saved by older versions: unused)
        return self._update.step


def _loss_arg(loss_fn: str | None) -> str:
    if loss_fn is None:
        raise ValueError(f"forward_backward needs loss_fn, one of {sorted(losses.LOSSES)}")
    return loss_fn
