"""OpenAISamplingClient: the `SamplingClient` interface over an OpenAI completions endpoint.

Point rollouts and evaluation at `prefixgym serve`, vLLM or SGLang: token ids go in
as `prompt`, and come back from each choice's `token_ids` (vLLM and SGLang return it
when asked with `return_token_ids`; `prefixgym serve` always does). Where a server
returns none, the ids are read from `logprobs.tokens` written as `token_id:N` (vLLM's
`--return-tokens-as-token-ids`), and only as a last resort by re-tokenizing the text
with `tokenizer` -- which can differ from what was sampled, so it warns.

Usage maps into prefixgym's ledger: `prompt_tokens_details.cached_tokens` ->
`prefill_cached_tokens`, prompt - cached -> `prefill_computed_tokens`, completion ->
`sampled_tokens` (a server that reports no cached tokens counts all as computed).

Requests run on a thread pool with one shared httpx client, so a future works with
`.result()` and with `await`. The remote server samples from *its own* weights:
prefixgym cannot publish trained weights to it (use it for rollouts and evaluation,
or have the server reload checkpoints itself). This module knows nothing of the
engine; an HTTP 4xx answer becomes a ValueError carrying the server's message.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Self

import httpx
from transformers import PreTrainedTokenizerBase

from prefixgym.futures import APIFuture
from prefixgym.protocols import TrainingClient, UsageSink
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    JSONObject,
    ModelInput,
    OptimStepOutput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Usage,
)


class OpenAISamplingClient:
    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str = "EMPTY",
        timeout: float = 600.0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        ledger: UsageSink | None = None,
        max_concurrency: int = 64,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`base_url` ends in `/v1` (added when missing). `model=None` asks /v1/models.
        `tokenizer` is only for servers that return no token ids; `ledger` (e.g. a UsageLedger)
        receives every response's usage; `transport` replaces httpx's (tests)."""
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.tokenizer = tokenizer
        self.ledger = ledger
        self._model = model
        self._model_lock = threading.Lock()
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}"},
            limits=httpx.Limits(max_connections=max_concurrency), transport=transport,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="prefixgym-openai"
        )
        self._warned_retokenize = False

    # -- the SamplingClient interface ------------------------------------------------

    def sample(
        self,
        prompt: ModelInput | list[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt` from the remote server."""
        ids = _ids(prompt)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        return APIFuture(self._pool.submit(
            self._sample, ids, num_samples, params, include_prompt_logprobs))

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        """log p(token i | tokens before i) for every position (None first), via `echo`."""
        ids = _ids(prompt)
        return APIFuture(self._pool.submit(self._prompt_logprobs, ids))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker side -----------------------------------------------------------------

    @property
    def model(self) -> str:
        with self._model_lock:
            if self._model is None:
                data = self._call("GET", "/models").get("data") or []
                if not data:
                    raise ValueError(f"{self.base_url}/models lists no model; pass model=")
                self._model = str(data[0]["id"])
            return self._model

    def _sample(self, ids: list[int], n: int, params: SamplingParams,
                with_prompt_logprobs: bool) -> SampleResponse:
        body: JSONObject = {
            "model": self.model, "prompt": ids, "n": n, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1,
            "return_token_ids": True, "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if params.top_k != -1:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        if with_prompt_logprobs:
            body["echo"] = True
        data = self._call("POST", "/completions", body)
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise ValueError(f"the server returned {len(choices)} choices for n = {n}")
        skip = len(ids) if with_prompt_logprobs else 0
        sequences = [self._sequence(c, skip) for c in choices]
        prompt_logprobs = None
        if with_prompt_logprobs:
            prompt_logprobs = _prompt_part(choices[0], len(ids))
        usage = _usage(data.get("usage") or {}, len(ids), sequences)
        if self.ledger is not None:
            self.ledger.add(usage)
        return SampleResponse(sequences=sequences, prompt_logprobs=prompt_logprobs, usage=usage,
                              prompt_cache_hit_tokens=usage.prefill_cached_tokens)

    def _prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        body: JSONObject = {"model": self.model, "prompt": ids, "max_tokens": 0,
                                "echo": True, "logprobs": 1, "temperature": 1.0}
        try:
            data = self._call("POST", "/completions", body)
        except (ValueError, RuntimeError):  # vLLM refuses max_tokens=0: sample one, drop it
            data = self._call("POST", "/completions", {**body, "max_tokens": 1})
        choices = data.get("choices") or []
        if not choices:
            raise ValueError("the server returned no choices for an echo request")
        values = _prompt_part(choices[0], len(ids))
        usage = Usage(prefill_computed_tokens=len(ids))
        if self.ledger is not None:
            self.ledger.add(usage)
        return values

    def _sequence(self, choice: JSONObject, skip: int) -> SampledSequence:
        logprobs = choice.get("logprobs") or {}
        values = list(logprobs.get("token_logprobs") or [])[skip:]
        ids = choice.get("token_ids")
        if ids is not None and len(ids) == skip + len(values) and skip:
            ids = ids[skip:]  # a server that echoes the prompt ids too
        if ids is None:
            ids = self._ids_from_logprobs(choice, skip)
        ids = [int(t) for t in ids]
        if len(values) != len(ids):
            raise ValueError(
                f"the server returned {len(ids)} token ids but {len(values)} logprobs; "
                "request logprobs from a server that returns one per sampled token"
            )
        finish = choice.get("finish_reason")
        return SampledSequence(tokens=ids, logprobs=[float(v) for v in values],
                               stop_reason="stop" if finish == "stop" else "length")

    def _ids_from_logprobs(self, choice: JSONObject, skip: int) -> list[int]:
        pieces = list((choice.get("logprobs") or {}).get("tokens") or [])[skip:]
        if pieces and all(isinstance(p, str) and p.startswith("token_id:") for p in pieces):
            return [int(p.removeprefix("token_id:")) for p in pieces]
        if self.tokenizer is None:
            raise ValueError(
                "the server returned no token ids (choices[].token_ids); use a server that "
                "supports return_token_ids (vLLM >= 0.10.2, recent SGLang, prefixgym serve) "
                "or pass tokenizer= to re-tokenize the text as a last resort"
            )
        if not self._warned_retokenize:
            self._warned_retokenize = True
            warnings.warn("the sampling server returned no token ids; re-tokenizing its text, "
                          "which may differ from the tokens it sampled", stacklevel=2)
        text = str(choice.get("text") or "")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _call(self, method: str, path: str, body: JSONObject | None = None) -> JSONObject:
        try:
            reply = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise ConnectionError(f"cannot reach the sampling server at {self.base_url}: "
                                  f"{e}") from e
        if reply.status_code >= 400:
            try:
                message = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = reply.text[:500]
            error = ValueError if reply.status_code < 500 else RuntimeError
            raise error(f"the sampling server answered HTTP {reply.status_code}: {message}")
        data = reply.json()
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004 - a bad answer is a ValueError throughout
                f"the sampling server answered {type(data).__name__}, not an object")
        return data


def _ids(prompt: ModelInput | list[int]) -> list[int]:
    if isinstance(prompt, ModelInput):
        return prompt.to_ints()
    if isinstance(prompt, (list, tuple)):
        return ModelInput.from_ints(list(prompt)).to_ints()
    raise ValueError(f"prompt must be a ModelInput or a list of token ids, got {type(prompt).__name__}")


def _prompt_part(choice: JSONObject, n: int) -> list[float | None]:
    values = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
    if len(values) < n:
        raise ValueError(
            f"the server returned {len(values)} prompt logprobs for a {n}-token prompt; it "
            "does not support echo with logprobs, so compute_logprobs and "
            "include_prompt_logprobs cannot be served by it"
        )
    return [None] + [None if v is None else float(v) for v in values[1:n]]


def _usage(usage: JSONObject, prompt_len: int, sequences: list[SampledSequence]) -> Usage:
    prompt_tokens = int(usage.get("prompt_tokens") or prompt_len)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    cached = max(0, min(cached, prompt_tokens))
    sampled = int(usage.get("completion_tokens") or sum(len(s.tokens) for s in sequences))
    return Usage(prefill_computed_tokens=prompt_tokens - cached, prefill_cached_tokens=cached,
                 sampled_tokens=sampled)


class RemoteSamplingTrainer:
    """A training client whose sampling clients are a remote server's.

    Training calls go to `training`; `save_weights_and_get_sampling_client()` returns
    `sampler`: nothing is published, the remote server samples from its own weights.
    """

    def __init__(self, training: TrainingClient, sampler: OpenAISamplingClient) -> None:
        self.training = training
        self.sampler = sampler

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.training.forward_backward(data, loss_fn, loss_fn_config)

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        return self.training.optim_step(adam)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> OpenAISamplingClient:
        return self.sampler

    def save_state(self, path: str | os.PathLike[str]) -> APIFuture[str]:
        return self.training.save_state(path)

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        return self.training.load_state(path)
