"""The client protocols that rollouts and the trainer depend on.

Two implementations stand behind `SamplingClient`: the built-in engine's
(`prefixgym.engine.sampler.sampling`) and the OpenAI-compatible HTTP backend
(`prefixgym.serving.openai_client`, and `serving.pool` over several servers); the engine's
is also a `RoundSamplingClient`, which takes a list of requests as one atomic round.
Behind `TrainingClient`: the engine's
(`prefixgym.engine.trainer.training`), its DDP wrapper (`engine.distributed`), and one that
pushes every update to remote samplers (`serving.weight_sync.RemoteWeightSync`).
Rollouts, evaluation and GRPO are typed against these protocols and never import
`engine/` internals; `UsageSink` is where an HTTP sampler reports what it used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from prefixgym.futures import APIFuture
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepOutput,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    Usage,
)


class SamplingClient(Protocol):
    def sample(
        self,
        prompt: ModelInput | list[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]: ...

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]: ...


@runtime_checkable
class RoundSamplingClient(SamplingClient, Protocol):
    """A sampler that also takes a list of requests as one atomic round, in order (the
    engine's). Rollouts in lockstep submit each turn of all their episodes so."""

    def sample_many(
        self, requests: Sequence[SampleRequest], include_prompt_logprobs: bool = False
    ) -> list[APIFuture[SampleResponse]]: ...


class TrainingClient(Protocol):
    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]: ...

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient: ...

    def save_state(self, path: str | os.PathLike[str]) -> APIFuture[str]: ...

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]: ...


class UsageSink(Protocol):
    """Receives each response's usage (the engine's `UsageLedger` is one)."""

    def add(self, usage: Usage) -> None: ...
