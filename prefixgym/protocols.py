"""The client protocols that rollouts and the trainer depend on.

Two implementations stand behind `SamplingClient`: the built-in engine's
(`prefixgym.engine.sampling`) and the OpenAI-compatible HTTP backend
(`prefixgym.serving.openai_client`). Rollouts, evaluation and GRPO are typed against
these protocols and never import `engine/` internals.
"""

from __future__ import annotations

from typing import Any, Protocol

from prefixgym.futures import APIFuture
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepOutput,
    SampleResponse,
    SamplingParams,
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


class TrainingClient(Protocol):
    def forward_backward(
        self, datums: list[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]: ...

    def save_weights_and_get_sampling_client(self) -> SamplingClient: ...

    def save_state(self, path: Any) -> Any: ...

    def load_state(self, path: Any) -> Any: ...
