"""SamplingClient: `sample()` and `compute_logprobs()` against one frozen weights version.

A client is a thin, thread-safe handle: it validates nothing itself beyond what the
wire types do, and hands requests to the engine, which refuses bad input
with a ValueError at call time and answers through an `APIFuture` (`.result()` or
`await`). Every response's `usage` is added to the service's ledger by the engine:
prefill computed + prefill cached = prompt length for every request (a G-sample
request counts its prompt once), sampled tokens are summed over the samples.

Logprobs of sampled tokens are under the model's distribution at temperature 1,
without top-k/top-p filtering -- what the trainer's forward pass computes.

`default_stop_token_ids` (the end-of-turn ids the service was given; LocalService
passes its tokenizer's) are added to every request's `stop_token_ids`; create the
client with `stop_at_end_of_turn=False` on the service to turn that off.

The client knows nothing of the cache or of batching: those are the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prefixgym.engine.model import Transformer
from prefixgym.futures import APIFuture
from prefixgym.types import ModelInput, SampleResponse, SamplingParams

if TYPE_CHECKING:
    from prefixgym.engine.engine import Engine


class SamplingClient:
    def __init__(
        self,
        engine: Engine,
        model: Transformer,
        weights_version: int,
        default_stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._engine = engine
        self._model = model
        self.weights_version = weights_version
        self.default_stop_token_ids: tuple[int, ...] = tuple(default_stop_token_ids)

    def sample(
        self,
        prompt: ModelInput | list[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        """Decode `num_samples` continuations of `prompt` (one shared prefill).

        With `include_prompt_logprobs=True` the whole prompt is recomputed (no cache
        read) and `response.prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]),
        None for i = 0.
        """
        return self.sample_many([prompt], num_samples, sampling_params,
                                include_prompt_logprobs)[0]

    def sample_many(
        self,
        prompts: Sequence[ModelInput | list[int]],
        num_samples: int = 1,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        include_prompt_logprobs: bool = False,
    ) -> list[APIFuture[SampleResponse]]:
        """`sample` for several prompts, queued atomically: they reach the engine in this
        order and in the same step, whatever other threads submit meanwhile (so batch
        composition does not depend on thread timing). `sampling_params`: one for all,
        or one per prompt. Refuses all of them (ValueError) if any is bad."""
        per_prompt = (list(sampling_params) if isinstance(sampling_params, Sequence)
                      else [sampling_params] * len(prompts))
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling_params for {len(prompts)} prompts")
        submissions = []
        for prompt, params in zip(prompts, per_prompt):
            params = params if params is not None else SamplingParams()
            if self.default_stop_token_ids:
                merged = list(dict.fromkeys([*params.stop_token_ids,
                                             *self.default_stop_token_ids]))
                params = params.model_copy(update={"stop_token_ids": merged})
            submissions.append((_ids(prompt), self._model, self.weights_version, params,
                                num_samples, include_prompt_logprobs))
        return self._engine.submit_many(submissions)

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        """log p(token i | tokens before i) for every position; None for the first.

        Recomputes the whole sequence (never read from the cache; counted as prefill
        computed).
        """
        future = self._engine.submit(
            _ids(prompt), self._model, self.weights_version, SamplingParams(max_tokens=0),
            num_samples=1, include_prompt_logprobs=True,
        )
        return future.map(lambda response: list(response.prompt_logprobs or []))


def _ids(prompt: ModelInput | list[int]) -> list[int]:
    if isinstance(prompt, ModelInput):
        return prompt.to_ints()
    if isinstance(prompt, (list, tuple)):
        return ModelInput.from_ints(list(prompt)).to_ints()  # validates: non-empty, >= 0
    raise ValueError(f"prompt must be a ModelInput or a list of token ids, got {type(prompt).__name__}")
