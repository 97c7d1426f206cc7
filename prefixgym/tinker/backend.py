"""Our rollouts and trainer on the hosted service: `prefixgym train --backend tinker`.

Two thin adapters give the hosted service's clients our protocols
(`protocols.SamplingClient`, `protocols.TrainingClient`), converting every call
(`convert.py`):
- `TinkerSampler.sample` sends our prompt and sampling params as tinker's and returns
  our `SampleResponse`, its `usage` rebuilt from `prompt_cache_hit_tokens` (cached)
  and the prompt length (computed), and added to the run's ledger.
- `TinkerTrainer` sends our datums as tinker's; `save_state(dir)` saves on the
  service and writes the `tinker://` path (and the step) into `dir`, which
  `load_state(dir)` reads back, so `DIR/checkpoints` resumes as with the local engine.
`connect` builds both from a tinker `ServiceClient` (`TINKER_API_KEY` is the SDK's to
read). This module knows tinker's clients and our protocols; not the engine.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tinker import types as tt

from prefixgym.futures import APIFuture
from prefixgym.protocols import UsageSink
from prefixgym.tinker import convert
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepOutput,
    SampleResponse,
    SamplingParams,
    Usage,
)

STATE_FILE = "tinker.json"
"""In a checkpoint's `train/` directory: the service's path of the saved state, the step."""


def _ids(prompt: ModelInput | list[int]) -> list[int]:
    return prompt.to_ints() if isinstance(prompt, ModelInput) else ModelInput.from_ints(
        list(prompt)).to_ints()


class TinkerSampler:
    """`protocols.SamplingClient` over a tinker `SamplingClient`."""

    def __init__(self, sampler: Any, ledger: UsageSink | None = None) -> None:
        self._sampler = sampler
        self._ledger = ledger

    def sample(self, prompt: ModelInput | list[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        ids = _ids(prompt)
        params = convert.to_tinker_sampling_params(sampling_params or SamplingParams())
        future = self._sampler.sample(prompt=tt.ModelInput.from_ints(ids),
                                      num_samples=num_samples, sampling_params=params,
                                      include_prompt_logprobs=include_prompt_logprobs)
        return APIFuture(future.future()).map(
            lambda response: self._record(convert.from_tinker_sample_response(response,
                                                                              len(ids))))

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        ids = _ids(prompt)
        future = self._sampler.compute_logprobs(tt.ModelInput.from_ints(ids))

        def done(logprobs: list[float | None]) -> list[float | None]:
            self._add(Usage(prefill_computed_tokens=len(ids)))
            return list(logprobs)

        return APIFuture(future.future()).map(done)

    def _record(self, response: SampleResponse) -> SampleResponse:
        self._add(response.usage)
        return response

    def _add(self, usage: Usage) -> None:
        if self._ledger is not None:
            self._ledger.add(usage)


class TinkerTrainer:
    """`protocols.TrainingClient` over a tinker `TrainingClient`."""

    def __init__(self, training: Any, ledger: UsageSink | None = None) -> None:
        self._training = training
        self._ledger = ledger
        self._step = 0

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None,
                         ) -> APIFuture[ForwardBackwardOutput]:
        datums = list(data)
        usage = Usage(train_computed_tokens=sum(d.model_input.length for d in datums),
                      train_loss_tokens=sum(d.num_loss_tokens for d in datums))
        future = self._training.forward_backward(
            [convert.to_tinker_datum(d) for d in datums], loss_fn,
            dict(loss_fn_config) if loss_fn_config else None)

        def done(out: tt.ForwardBackwardOutput) -> ForwardBackwardOutput:
            if self._ledger is not None:
                self._ledger.add(usage)
            return convert.from_tinker_forward_backward(out, usage)

        return APIFuture(future.future()).map(done)

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        params = tt.AdamParams(learning_rate=adam.learning_rate, beta1=adam.beta1,
                               beta2=adam.beta2, eps=adam.eps, weight_decay=adam.weight_decay,
                               grad_clip_norm=adam.grad_clip_norm)
        future = self._training.optim_step(adam_params=params)

        def done(out: tt.OptimStepResponse) -> OptimStepOutput:
            self._step += 1
            return OptimStepOutput(metrics={**(out.metrics or {}), "step": float(self._step)})

        return APIFuture(future.future()).map(done)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> TinkerSampler:
        return TinkerSampler(self._training.save_weights_and_get_sampling_client().result(),
                             self._ledger)

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        # (the service keeps the optimizer's state whatever `with_optimizer` says: it
        # takes no room here, where only the state's name is written)
        saved = self._training.save_state(f"prefixgym-{uuid.uuid4().hex[:12]}").result()
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / STATE_FILE).write_text(json.dumps({"path": saved.path, "step": self._step}))
        return APIFuture.completed(os.fspath(path))

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        state_file = Path(path) / STATE_FILE
        if not state_file.exists():
            raise FileNotFoundError(f"{state_file} is missing: not a checkpoint of a "
                                    "--backend tinker run")
        state = json.loads(state_file.read_text())
        self._training.load_state_with_optimizer(state["path"]).result()
        self._step = int(state["step"])
        return APIFuture.completed(self._step)


def connect(service_client: Any, base_model: str, lora_rank: int, seed: int,
            ledger: UsageSink) -> tuple[TinkerTrainer, TinkerSampler, Any]:
    """A trainer, a sampler of its starting weights, and the tokenizer, on the service."""
    training = service_client.create_lora_training_client(base_model=base_model,
                                                          rank=lora_rank, seed=seed).result()
    trainer = TinkerTrainer(training, ledger)
    return trainer, trainer.save_weights_and_get_sampling_client(), training.get_tokenizer()
