"""`POST /v1/chat/completions`: OpenAI's chat API on the engine, for chat clients
(verifiers' `vf-eval`, OpenEnv agents, ART, the `openai` package).

A request goes as a completion does (app.py), with two more steps:
  1) the body, bounded and labelled JSON, parsed into a `ChatRequest` (strict types,
     text that is valid Unicode, OpenAI's roles; null is "not sent"). Taken and not
     acted on: `response_format` (no grammar: the reply is what the model wrote;
     docs/agents.md says why) and `parallel_tool_calls`. `tool_choice` "none" is kept
     (its replies are not read for calls). Refused by name: content parts other than
     text, `top_logprobs` above 0, the legacy `functions`/`function_call`;
  2) the messages made a prompt: a call whose messages extend an earlier call's plus the
     reply this server gave continues that call's sampled ids and renders only the new
     messages (`chat_history.py`, the seed's rule: history is never re-tokenized); any
     other call is rendered turn by turn by the tokenizer's chat template, `tools` passed
     to it (and `chat_template_kwargs`, vLLM's name, e.g. `{"enable_thinking": false}`),
     with the generation prompt; a template the conversation builder cannot use turn by
     turn renders the messages whole. A template that refuses the messages is a 400 with
     its reason. A `tool_choice` of "required" or a function ends the prompt with the
     opening of a call in the model's tool-call syntax (`prompting.tool_choice`: Hermes'
     `<tool_call>{"name": "f", "arguments":`), as prompt tokens; one that cannot be
     forced (no tools, an unknown function, a syntax that cannot write the call, a
     template rendered whole) is a 400 naming `tool_choice`. Then this server's limits,
     as for completions (`max_n`, the request's tokens; `max_tokens` defaults to what
     the limit leaves);
  3) one engine request: the prompt is prefilled once for the `n` choices, and
     served from the prefix cache where an earlier request shares its start (a chat
     client that resends the whole conversation each turn hits it, as long as the
     template renders the history as it rendered it before);
  4) each choice's text (after the forced opening, if any), cut at a stop string, with
     the calls written in the model's syntax (the built-in template's, Qwen's and
     Hermes' `<tool_call>{...}</tool_call>` blocks) turned into OpenAI `tool_calls` when
     the request has tools (`reads_tool_calls`); a forced reply that still writes no
     call is answered as text, the opening included; logprobs of the sampled tokens
     (no top alternatives); the sampled `token_ids` (and with `return_token_ids`, the
     prompt's, the opening included), and usage with `cached_tokens`.
With `stream`, the same answer goes as server-sent chunks once it is sampled (the
engine returns whole sequences): a role chunk, a content chunk and a finish chunk per
choice, a usage chunk with `stream_options.include_usage`, then `[DONE]`.

Knows the HTTP shapes and the tokenizer's template; the engine only through the
sampling client it is handed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.call_tree import Pending
from prefixgym.prompting.tool_choice import ToolChoiceError, forced_opening
from prefixgym.prompting.tool_syntax import HermesSyntax, ParsedCall
from prefixgym.serving.admission import RequestLimits
from prefixgym.serving.bodies import parse_request, read_body
from prefixgym.serving.chat_history import ChatHistory
from prefixgym.serving.protocol import (
    APIError,
    SamplingFields,
    decode_ids,
    describe_validation_error,
    valid_text,
)
from prefixgym.serving.weights import ServedWeights
from prefixgym.types import JSONObject, SampleResponse


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[JSONObject] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: object) -> object:
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"holds a part of type {kind!r}; this server takes text "
                                 "parts only ({'type': 'text', 'text': ...})")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self, raw_calls: bool = False) -> JSONObject:
        """What a chat template reads: role and text, and the tool fields given (a
        call's `arguments` as an object, which templates render; OpenAI sends a string;
        `raw_calls` keeps them as sent)."""
        out: JSONObject = {"role": "system" if self.role == "developer" else self.role,
                           "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = (list(self.tool_calls) if raw_calls else
                                 [_arguments_as_object(call) for call in self.tool_calls])
        return out


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: JSONObject | None = None
    chat_template_kwargs: JSONObject | None = None
    functions: Any = None
    function_call: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("this server gives each sampled token's logprob, not the most "
                             "likely alternatives; send 0 or leave it out")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> Any:
        raise ValueError("OpenAI's legacy function calling is not served; send `tools` "
                         "(and `tool_choice`) instead")

    @property
    def reads_tool_calls(self) -> bool:
        """Whether replies are read for tool calls: with tools, unless `tool_choice` is
        "none" (the tools are still in the prompt, and a call the model writes stays text)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("messages")
    @classmethod
    def _texts(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(messages):
            valid_text(m.text, f"messages[{i}].content")
        return messages

    def template_messages(self) -> list[JSONObject]:
        """The messages as sent (tool calls' arguments as strings), for a call tree."""
        return [m.for_template(raw_calls=True) for m in self.messages]

    def render(self, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
        """The prompt's ids: the messages through the tokenizer's chat template, with the
        generation prompt (ValueError: no template, or it refused them)."""
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError("this server's tokenizer has no chat template; use "
                             "/v1/completions with a rendered prompt")
        try:
            text = tokenizer.apply_chat_template(
                [m.for_template() for m in self.messages],
                tools=list[Any](self.tools) if self.tools else None,
                add_generation_prompt=True, tokenize=False, **(self.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template raises what its author wrote
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"the chat template refused these messages: {first}") from None
        return list(tokenizer.encode(str(text), add_special_tokens=False))


def add_chat_route(
    app: FastAPI, authorize: Callable[[Request], None], weights: ServedWeights,
    tokenizer: PreTrainedTokenizerBase | None, limits: RequestLimits,
) -> Callable[[ChatRequest], Awaitable[JSONObject]]:
    """`POST /v1/chat/completions` on `app`, under the same key and limits as completions.
    Returns the handler (a parsed request -> its answer), which /v1/responses calls too."""
    history = ChatHistory(tokenizer) if tokenizer is not None else None

    async def complete(req: ChatRequest) -> JSONObject:
        limits.check_model_and_n(weights, req.model, req.n)
        limits.check_chars(sum(len(m.text) for m in req.messages), "messages", "messages")
        try:  # 2)
            pending = await run_in_threadpool(history.begin, req) if history else None
            if pending is None:  # rendered whole: there is no syntax to force a call in
                forced_opening(req.tool_choice, req.tools or [], None)
            prompt = (pending.prompt if pending is not None
                      else await run_in_threadpool(req.render, tokenizer))
        except ToolChoiceError as e:
            raise APIError(400, str(e), "tool_choice") from None
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], "messages") from None
        asked = req.max_completion_tokens or req.max_tokens
        room = limits.max_request_tokens - len(prompt)
        if room < 1 or (asked is not None and asked > room):
            raise APIError(400, f"the messages render to {len(prompt)} tokens"
                                f"{f' and max_tokens is {asked}' if asked else ''}: this "
                                f"server's limit is {limits.max_request_tokens} tokens per "
                                "request", "max_tokens")
        sampler, weight_version = weights.sampler_for(req.model, not req.ignore_eos)
        try:  # 3)
            params = req.engine_params(asked or room)
            response = await sampler.sample(prompt, num_samples=req.n, sampling_params=params)
        except ValidationError as e:
            raise APIError(400, *describe_validation_error(e)) from None
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0]) from None
        answer = await run_in_threadpool(_answer, req, prompt, response, tokenizer,  # 4)
                                         req.model or weights.model_name, history, pending)
        answer["metadata"] = {"weight_version": weight_version}
        return answer

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        authorize(request)
        body = await read_body(request, limits.max_body_bytes)  # 1)
        req = await run_in_threadpool(parse_chat_request, body)
        answer = await complete(req)
        if req.stream:
            return StreamingResponse(chat_stream(answer, req), media_type="text/event-stream")
        return JSONResponse(answer)

    return complete


def parse_chat_request(body: bytes | JSONObject) -> ChatRequest:
    """A chat request from its JSON body (bytes as read, or parsed); APIError 400."""
    return parse_request(ChatRequest, body)


def _arguments_as_object(call: JSONObject) -> JSONObject:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def _tool_calls(text: str) -> tuple[str, list[JSONObject]]:
    """The text outside `<tool_call>` blocks, and the blocks that hold a call (a JSON
    object with a name) as OpenAI tool calls; a block that does not stays in the text."""
    content, calls = HermesSyntax().parse(text)
    return content, openai_tool_calls(calls)


def openai_tool_calls(calls: Sequence[ParsedCall], ids: Sequence[str] | None = None
                      ) -> list[JSONObject]:
    """Parsed calls in OpenAI's `tool_calls` shape, with `ids` (default: random ones)."""
    ids = ids if ids is not None else [f"call_{uuid.uuid4().hex[:24]}" for _ in calls]
    return [{"id": call_id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                  ensure_ascii=False)}}
            for call_id, c in zip(ids, calls)]


def logprobs_content(tokenizer: PreTrainedTokenizerBase | None, tokens: Sequence[int],
                     logprobs: Sequence[float]) -> JSONObject:
    """A choice's `logprobs` in chat's shape: each sampled token's text and logprob."""
    return {"content": [{"token": piece, "logprob": value, "bytes": list(piece.encode()),
                         "top_logprobs": []}
                        for piece, value in zip((decode_ids(tokenizer, [t], False)
                                                 for t in tokens), logprobs)]}


def _answer(req: ChatRequest, prompt: list[int], response: SampleResponse,
            tokenizer: PreTrainedTokenizerBase | None, model: str,
            history: ChatHistory | None = None, pending: Pending | None = None) -> JSONObject:
    texts = [req.reply_text(tokenizer, s.tokens, s.stop_reason) for s in response.sequences]
    replies = (history.record(req, pending, response, texts)
               if history is not None and pending is not None else None)
    choices = []
    for i, seq in enumerate(response.sequences):
        if replies is not None:  # the calls in the model's own syntax (the history's)
            reply = replies[i][0]
            content, calls = reply.content, openai_tool_calls(reply.tool_calls)
        else:
            content, calls = _tool_calls(texts[i]) if req.reads_tool_calls else (texts[i], [])
        message: JSONObject = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        choice: JSONObject = {
            "index": i, "message": message, "logprobs": None, "token_ids": list(seq.tokens),
            "finish_reason": "tool_calls" if calls else seq.stop_reason}
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(prompt)
        if req.logprobs:
            choice["logprobs"] = logprobs_content(tokenizer, seq.tokens, seq.logprobs)
        choices.append(choice)
    completion_tokens = sum(len(s.tokens) for s in response.sequences)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": model, "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt) + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens":
                                            response.usage.prefill_cached_tokens}},
    }


def chat_stream(answer: JSONObject, req: ChatRequest) -> Iterator[str]:
    """The answer as OpenAI's stream of chat.completion.chunk events."""
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}

    def event(choices: list[Any], **more: Any) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **more})}\n\n"

    for choice in answer["choices"]:
        i, message = choice["index"], choice["message"]
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
        delta: JSONObject = {"content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call}
                                   for k, call in enumerate(message["tool_calls"])]
        yield event([{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                      "finish_reason": None, "token_ids": choice["token_ids"]}])
        yield event([{"index": i, "delta": {}, "logprobs": None,
                      "finish_reason": choice["finish_reason"]}])
    if (req.stream_options or {}).get("include_usage"):
        yield event([], usage=answer["usage"])
    yield "data: [DONE]\n\n"
