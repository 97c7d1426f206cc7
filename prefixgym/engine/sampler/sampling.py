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
from prefixgym.engine.sampler.requests import RoundItem
from prefixgym.futures import APIFuture
from prefixgym.types import ModelInput, SampleRequest, SampleResponse, SamplingParams

if TYPE_CHECKING:
    from prefixgym.engine.sampler.engine import Engine


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
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """Decode `num_samples` continuations of `prompt` (one shared prefill).

        With `include_prompt_logprobs=True` the whole prompt is recomputed (no cache
        read) and `response.prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]),
        None for i = 0. `topk_prompt_logprobs=k` gives each prompt position's k most
        likely tokens (`response.topk_prompt_logprobs`), computed the same way.
        `prompt_logprobs_last_n=n` scores only the last n prompt tokens (the entries
        before them are None), so the prefix before them may be served from the cache
        (the hosted service's parameters, with its rules).
        """
        item = self._item(prompt, num_samples, sampling_params, include_prompt_logprobs,
                          topk_prompt_logprobs, prompt_logprobs_last_n)
        return self._engine.submit_many([item], self._model, self.weights_version)[0]

    def sample_many(
        self, requests: Sequence[SampleRequest], include_prompt_logprobs: bool = False
    ) -> list[APIFuture[SampleResponse]]:
        """`sample` for each request, queued atomically as one round in this order: the
        round enters the engine in one step, whatever other threads submit meanwhile (a
        deterministic engine runs it alone). Bad input in any request raises a
        ValueError and queues none."""
        items = [self._item(r.prompt, r.num_samples, r.sampling_params, include_prompt_logprobs)
                 for r in requests]
        return self._engine.submit_many(items, self._model, self.weights_version)

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        """log p(token i | tokens before i) for every position; None for the first.

        Recomputes the whole sequence (never read from the cache; counted as prefill
        computed).
        """
        item = RoundItem(_ids(prompt), SamplingParams(max_tokens=0), 1, True)
        [future] = self._engine.submit_many([item], self._model, self.weights_version)
        return future.map(lambda response: list(response.prompt_logprobs or []))

    def _item(
        self, prompt: ModelInput | list[int], num_samples: int, params: SamplingParams | None,
        include_prompt_logprobs: bool, topk: int = 0, last_n: int | None = None,
    ) -> RoundItem:
        """One request for the engine, with this client's default stop ids added."""
        params = params if params is not None else SamplingParams()
        if self.default_stop_token_ids:
            merged = list(dict.fromkeys([*params.stop_token_ids, *self.default_stop_token_ids]))
            params = params.model_copy(update={"stop_token_ids": merged})
        return RoundItem(_ids(prompt), params, num_samples, include_prompt_logprobs, topk, last_n)


def _ids(prompt: ModelInput | list[int]) -> list[int]:
    if isinstance(prompt, ModelInput):
        return prompt.to_ints()
    if isinstance(prompt, (list, tuple)):
        return ModelInput.from_ints(list(prompt)).to_ints()  # validates: non-empty, >= 0
    raise ValueError(f"prompt must be a ModelInput or a list of token ids, got {type(prompt).__name__}")
