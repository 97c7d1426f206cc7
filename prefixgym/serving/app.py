"""The HTTP face of the built-in engine: OpenAI-compatible completions and chat.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (chat.py), `POST /v1/responses`
(responses.py, over the chat handler), `GET /v1/models`,
`GET /health`, and the weight routes of `serving.weights` (`/update_weights_from_disk`,
`/v1/load_lora_adapter`, ...).
With an API key configured, every route but /health wants `Authorization: Bearer KEY`
(401 otherwise), as OpenAI-compatible servers do; that check and this server's limits
are `admission.py`'s.

A completion request goes:
  1) read the body, refusing one not labelled `application/json` (415) or larger
     than `max_body_bytes` (413) (`bodies.py`, as every route with a body does);
  2) parse JSON (400 "request body is not valid JSON: ...", or nested deeper than
     `MAX_JSON_DEPTH`) and check fields and this server's limits (400; unknown
     model 404); text is tokenized only when it could fit in `max_request_tokens`;
  3) submit to the engine and *await* its future, so the event loop keeps serving
     while the engine thread prefills and decodes (engine ValueError -> 400);
  4) answer in OpenAI's shape, plus what RL needs: each choice's sampled `token_ids`
     and `usage.prompt_tokens_details.cached_tokens` (prompt positions served from
     the prefix cache), and `metadata.weight_version`: the weights that sampled it.
Parsing, tokenizing and rendering run in worker threads, never on the event loop, so
a large prompt does not hold up /health or other requests. Every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}` in one line; a 500 says only that
the server failed (the exception goes to the server's log, not to the client).

The app knows the engine service's public interface and the tokenizer it is given
(for text prompts and the `text` of answers); it knows nothing of caches, batching or
training.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from prefixgym.engine.service import EngineService
from prefixgym.serving.admission import RequestLimits, bearer_check
from prefixgym.serving.bodies import parse_json_object, read_body
from prefixgym.serving.chat import add_chat_route, parse_chat_request
from prefixgym.serving.config import ServeConfig
from prefixgym.serving.errors import install_error_handlers
from prefixgym.serving.protocol import (
    APIError,
    CompletionRequest,
    decode_ids,
    describe_validation_error,
)
from prefixgym.serving.responses import ResponseStore, add_responses_route
from prefixgym.serving.weights import ServedWeights, add_weight_routes
from prefixgym.types import JSONObject, SampleResponse


def create_app(
    service: EngineService, tokenizer: PreTrainedTokenizerBase | None,
    config: ServeConfig | None = None,
) -> FastAPI:
    """An app serving `service`'s latest weights; `tokenizer` (None: token ids only)
    encodes text prompts and decodes the answers' text."""
    config = config or ServeConfig()
    limits = RequestLimits.of(config, service.max_seq_len, tokenizer)
    authorize = bearer_check(config.api_key)
    app = FastAPI(title="prefixgym serve", docs_url=None, redoc_url=None, openapi_url=None)
    weights = ServedWeights(service, config.model_name)

    install_error_handlers(app)
    add_weight_routes(app, weights, authorize, config.max_body_bytes)
    complete_chat = add_chat_route(app, authorize, weights, tokenizer, limits)

    async def chat_for_responses(_: Request, body: JSONObject) -> JSONObject:
        return await complete_chat(parse_chat_request(body))

    add_responses_route(app, "/v1/responses", chat_for_responses, authorize,
                        config.max_body_bytes, ResponseStore())
    add_model_routes(app, authorize, weights, service.max_seq_len)
    add_completion_route(app, authorize, weights, tokenizer, limits)
    return app


def add_model_routes(app: FastAPI, authorize: Callable[[Request], None],
                     weights: ServedWeights, max_seq_len: int) -> None:
    """`GET /health` (no key needed) and `GET /v1/models`: the base model and its adapters."""
    created = int(time.time())
    model_name = weights.model_name

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONObject:
        authorize(request)
        card = {"object": "model", "created": created, "owned_by": "prefixgym"}
        # adapters as vLLM and SGLang list them: their path as `root`, the base as `parent`
        return {"object": "list", "data": [
            {"id": model_name, **card, "max_model_len": max_seq_len, "root": model_name,
             "parent": None},
            *({"id": name, **card, "max_model_len": max_seq_len, "root": path,
               "parent": model_name} for name, path in weights.adapter_paths.items())]}


def add_completion_route(app: FastAPI, authorize: Callable[[Request], None],
                         weights: ServedWeights, tokenizer: PreTrainedTokenizerBase | None,
                         limits: RequestLimits) -> None:
    """`POST /v1/completions`, in the four steps of the module docstring."""
    max_request_tokens = limits.max_request_tokens

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        authorize(request)
        # 1) a bounded body labelled JSON
        body = await read_body(request, limits.max_body_bytes)
        # 2) parse and check
        req = await run_in_threadpool(_parse, body)
        limits.check_model_and_n(weights, req.model, req.n)
        for text in req.prompt_texts:
            limits.check_chars(len(text), "prompt text", "prompt")
        try:
            prompt = await run_in_threadpool(req.prompt_ids, tokenizer)
            params = req.sampling_params()
        except ValidationError as e:
            raise APIError(400, *describe_validation_error(e)) from None
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        if len(prompt) + req.max_tokens > max_request_tokens:
            raise APIError(400, f"prompt has {len(prompt)} tokens and max_tokens is "
                                f"{req.max_tokens}: {len(prompt) + req.max_tokens} exceeds this "
                                f"server's limit of {max_request_tokens} tokens per request",
                           "max_tokens")
        # 3) sample without blocking the event loop
        sampler, weight_version = weights.sampler_for(req.model, not req.ignore_eos)
        with_prompt_logprobs = req.echo and req.wants_logprobs
        try:
            response = await sampler.sample(prompt, num_samples=req.n, sampling_params=params,
                                            include_prompt_logprobs=with_prompt_logprobs)
        except ValidationError as e:
            raise APIError(400, *describe_validation_error(e)) from None
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0]) from None
        # 4) OpenAI's shape
        answer = await run_in_threadpool(_render, req, prompt, response, tokenizer,
                                         req.model or weights.model_name)
        answer["metadata"] = {"weight_version": weight_version}
        return JSONResponse(answer)


def _parse(body: bytes) -> CompletionRequest:
    payload = parse_json_object(body)
    try:
        return CompletionRequest.model_validate(payload)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        if param == "prompt" and e.errors()[0]["type"] != "value_error":  # a union's branches
            message = ("prompt must be a string, a list of token ids, or a list holding one "
                       "of those")
        raise APIError(400, message, param) from None


def _render(req: CompletionRequest, prompt: list[int], response: SampleResponse,
            tokenizer: PreTrainedTokenizerBase | None, model_name: str) -> JSONObject:
    prompt_text = decode_ids(tokenizer, prompt, req.skip_special_tokens) if req.echo else ""
    choices = []
    for i, seq in enumerate(response.sequences):
        text = req.reply_text(tokenizer, seq.tokens, seq.stop_reason,
                              keep_stop=req.include_stop_str_in_output)
        choice: JSONObject = {
            "index": i, "text": prompt_text + text, "finish_reason": seq.stop_reason,
            "logprobs": None, "token_ids": list(seq.tokens),
        }
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(prompt)
        if req.wants_logprobs:
            ids, values = list(seq.tokens), list[float | None](seq.logprobs)
            if req.echo:
                ids, values = prompt + ids, list(response.prompt_logprobs or []) + values
            pieces = [decode_ids(tokenizer, [t], False) for t in ids]
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": values,
                                  "top_logprobs": None, "text_offset": offsets}
        choices.append(choice)
    completion_tokens = sum(len(s.tokens) for s in response.sequences)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": model_name, "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": response.usage.prefill_cached_tokens},
        },
    }
