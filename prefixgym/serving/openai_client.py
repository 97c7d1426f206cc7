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

Each response's `weights_version` is the label of the weights that sampled it, read
from `metadata.weight_version` (SGLang, `prefixgym serve`), or for an adapter
(`version_from="model"`) from the answer's `model`, which vLLM and SGLang set to
the adapter's name; None where the server says neither.

Requests run on a thread pool with one shared httpx client (`server_http.ServerHTTP`),
so a future works with `.result()` and with `await`; `sample_now` is the same request
made on the calling thread (what `serving.pool` uses). The client also offers the
server's weight routes (`update_weights_from_disk`, `load_lora_adapter`,
`unload_lora_adapter`, `loaded_adapters`, `served_weights_version`: `remote_weights.py`),
which `serving.weight_sync` pushes new weights with. This module knows nothing of the
engine; an HTTP 4xx answer becomes a ValueError carrying the server's message, an
unreachable server a ConnectionError, an HTTP 5xx a RuntimeError.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from typing import Literal, Self

import httpx
from transformers import PreTrainedTokenizerBase

from prefixgym.futures import APIFuture
from prefixgym.protocols import UsageSink
from prefixgym.serving.remote_weights import RemoteWeights
from prefixgym.serving.server_http import ServerHTTP
from prefixgym.types import (
    JSONObject,
    ModelInput,
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
        self.http = ServerHTTP(base_url, api_key, timeout, max_concurrency, transport)
        self.weights = RemoteWeights(self.http)
        self.base_url, self.root_url = self.http.base_url, self.http.root_url
        self.tokenizer = tokenizer
        self.ledger = ledger
        self._model = model
        self._model_lock = threading.Lock()
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
            self.sample_now, ids, num_samples, params, include_prompt_logprobs))

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        """log p(token i | tokens before i) for every position (None first), via `echo`."""
        ids = _ids(prompt)
        return APIFuture(self._pool.submit(lambda: self._prompt_logprobs(ids)[0]))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker side -----------------------------------------------------------------

    @property
    def model(self) -> str:
        with self._model_lock:
            if self._model is None:
                data = self.http.call("GET", "/models").get("data") or []
                if not data:
                    raise ValueError(f"{self.base_url}/models lists no model; pass model=")
                self._model = str(data[0]["id"])
            return self._model

    def sample_now(self, ids: list[int], n: int, params: SamplingParams,
                   with_prompt_logprobs: bool = False, model: str | None = None,
                   version_from: Literal["metadata", "model"] = "metadata") -> SampleResponse:
        """One completions request on this thread; `model` overrides the served model
        (an adapter's name), `version_from` says where the weights' label is read."""
        body: JSONObject = {
            "model": model or self.model, "prompt": ids, "n": n, "max_tokens": params.max_tokens,
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
        data = self.http.call("POST", "/completions", body)
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
                              weights_version=_weights_version(data, version_from),
                              prompt_cache_hit_tokens=usage.prefill_cached_tokens)

    def prompt_logprobs_now(self, ids: list[int], model: str | None = None
                            ) -> tuple[list[float | None], str | None]:
        """`compute_logprobs` on this thread, with the label of the weights that computed it."""
        values, version = self._prompt_logprobs(ids, model)
        return values, version

    def _prompt_logprobs(self, ids: list[int], model: str | None = None
                         ) -> tuple[list[float | None], str | None]:
        body: JSONObject = {"model": model or self.model, "prompt": ids, "max_tokens": 0,
                                "echo": True, "logprobs": 1, "temperature": 1.0}
        try:
            data = self.http.call("POST", "/completions", body)
        except (ValueError, RuntimeError):  # vLLM refuses max_tokens=0: sample one, drop it
            data = self.http.call("POST", "/completions", {**body, "max_tokens": 1})
        choices = data.get("choices") or []
        if not choices:
            raise ValueError("the server returned no choices for an echo request")
        values = _prompt_part(choices[0], len(ids))
        usage = Usage(prefill_computed_tokens=len(ids))
        if self.ledger is not None:
            self.ledger.add(usage)
        return values, _weights_version(data, "model" if model else "metadata")

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

    # -- pushing weights: the server's weight routes (serving/remote_weights.py) -----

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> str:
        """Full weights from `model_path`, labelled `weight_version` (`RemoteWeights`)."""
        return self.weights.update_weights_from_disk(model_path, weight_version)

    def served_weights_version(self) -> str | None:
        """The label of the weights a vLLM server holds (None: it does not say)."""
        return self.weights.served_weights_version()

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        self.weights.load_lora_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.weights.unload_lora_adapter(lora_name)

    def loaded_adapters(self) -> dict[str, str]:
        """The server's loaded LoRA adapters, name -> the path it loaded each from."""
        return self.weights.loaded_adapters()


def _weights_version(data: JSONObject, version_from: str) -> str | None:
    """The label of the weights that answered (see the module docstring)."""
    if version_from == "model":
        model = data.get("model")
        return str(model) if model is not None else None
    version = (data.get("metadata") or {}).get("weight_version")
    return str(version) if version is not None else None


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

