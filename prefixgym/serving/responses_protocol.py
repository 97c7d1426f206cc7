"""OpenAI's Responses API request, and its translation to a chat-completions body and back.

`ResponsesRequest` checks types strictly and refuses, by name, what a chat body cannot
say: tools other than functions; input items other than message, function_call,
function_call_output and reasoning; content parts other than text. A string `input` is
one user message. Sampling values are the chat handler's to check.

`to_chat_body` writes the chat-completions body:
  1) this request's `instructions` as a leading system message;
  2) the conversation of `previous_response_id` (a `StoredResponse`; its instructions are
     not carried over, as OpenAI's are not; nor are its tools);
  3) `input`: messages as they are; consecutive function_call items (and the assistant
     message right before them) as one assistant message with `tool_calls`;
     function_call_output as a tool message; reasoning items dropped;
  4) `max_output_tokens` as `max_tokens`, function tools and `tool_choice` in chat's form
     (where "required" and a named function are forced, as for chat),
     `n` = 1; "message.output_text.logprobs" in `include` as `logprobs`.
`from_chat_answer` writes the Response: a reasoning item (the answer's
`reasoning_content`), a message item with the text and its logprobs, a function_call item
per tool call; usage with `cached_tokens`; "incomplete" when the reply hit
`max_output_tokens`; the answer's `metadata.weight_version` added to the request's
`metadata`. Token ids as vLLM's Responses API gives them: with `enable_response_messages`
(or `return_token_ids`), `input_messages` and `output_messages`, each one item
`{"type": "raw_message_tokens", "message", "tokens"}`; the input's `message` is "" (a
chat answer does not carry the rendered prompt), the output's is the reply's text.
Accepted and ignored: `text` (no output format is enforced, as chat's `response_format`
is not), `reasoning`, and `include` but for the logprobs. A field sent as null is a field
not sent. Refused by name: what lives on OpenAI's servers, a `conversation` or a stored
`prompt`.

Knows OpenAI's two wire shapes; nothing of HTTP, tokenizers, templates or the engine.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Tag,
    ValidationInfo,
    field_validator,
)

from prefixgym.serving.bodies import parse_request
from prefixgym.serving.protocol import APIError, RequestBody
from prefixgym.types import JSONObject

_STRICT = ConfigDict(extra="ignore", strict=True)
_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text")
_LOGPROBS = "message.output_text.logprobs"
_SERVER_STATE = {
    "conversation": "this server keeps no conversations; send the history in input, or "
                    "previous_response_id",
    "prompt": "this server keeps no stored prompts; send instructions and input"}
_PASSED = ("model", "temperature", "top_p", "top_k", "seed", "stop", "top_logprobs",
           "parallel_tool_calls", "chat_template_kwargs")
"""Fields that go to the chat body under the same name, when given."""


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning"]


def _item_kind(item: Any) -> str:
    return str(item.get("type", "message") if isinstance(item, dict) else item.type)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestBody):
    """A `POST /v1/responses` body; unknown fields are ignored. Sampling values are
    checked by the chat handler they pass to."""

    model: str | None = None
    input: list[InputItem]
    """A string is one user message."""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    text: JSONObject | None = None
    reasoning: JSONObject | None = None
    # vLLM's extras
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: JSONObject | None = None
    return_token_ids: bool = False
    enable_response_messages: bool = False
    # OpenAI's server-side state, refused
    conversation: Any = None
    prompt: Any = None

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_server_state(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(_SERVER_STATE[str(info.field_name)])

    @field_validator("input", mode="before")
    @classmethod
    def _input_kinds(cls, value: object) -> object:
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of items")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise ValueError(f"item {i} is not an object")
            kind = item.get("type", "message")
            if kind not in _ITEM_KINDS:
                raise ValueError(f"item {i} is a {kind!r} item; this server takes "
                                 f"{', '.join(_ITEM_KINDS)} items")
            parts = item.get("content" if kind == "message" else "output")
            for part in parts if isinstance(parts, list) else []:
                part_kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if part_kind not in _TEXT_PARTS:
                    raise ValueError(f"item {i} holds a part of type {part_kind!r}; this "
                                     f"server takes text only ({', '.join(_TEXT_PARTS)})")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: object) -> object:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            if kind != "function":
                raise ValueError(f"tool {i} is a {kind!r} tool; this server runs function "
                                 "tools only")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: object) -> object:
        if (value not in ("auto", "none", "required") if isinstance(value, str) else
                isinstance(value, dict) and value.get("type") != "function"):
            raise ValueError("this server takes 'auto', 'none', 'required' or a function "
                             "({'type': 'function', 'name': ...})")
        return value

    @property
    def wants_tokens(self) -> bool:
        return self.enable_response_messages or self.return_token_ids


@dataclass(frozen=True)
class StoredResponse:
    """A response kept for `previous_response_id` (read-only once stored)."""

    conversation: list[JSONObject]
    """Its chat messages without its instructions, then its reply."""
    response: JSONObject


def parse_responses_request(body: bytes | JSONObject) -> ResponsesRequest:
    """A Responses request from its JSON body (bytes as read, or parsed); APIError 400."""
    return parse_request(ResponsesRequest, body)


def to_chat_body(req: ResponsesRequest, previous: StoredResponse | None) -> JSONObject:
    """Step 2: the chat-completions body for `req`, continuing `previous` (APIError 400
    when there is no message at all)."""
    messages = [*_instructions(req), *(previous.conversation if previous else []),
                *_input_messages(req.input)]
    if not messages:
        raise APIError(400, "input holds no messages", "input")
    body: JSONObject = {"messages": messages, "n": 1, "stream": False}
    body.update({name: getattr(req, name) for name in _PASSED
                 if getattr(req, name) is not None})
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)}
            for tool in req.tools]
    if isinstance(req.tool_choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if _LOGPROBS in (req.include or []):
        body["logprobs"] = True
    if req.wants_tokens:
        body["return_token_ids"] = True
    return body


def stored_conversation(req: ResponsesRequest, chat_body: JSONObject,
                        answer: JSONObject) -> list[JSONObject]:
    """What a later `previous_response_id` continues: the chat messages of `chat_body`
    but its instructions, then the answer's reply."""
    reply = {k: v for k, v in answer["choices"][0]["message"].items()
             if k in ("role", "content", "tool_calls")}
    return [*chat_body["messages"][len(_instructions(req)):], reply]


def _instructions(req: ResponsesRequest) -> list[JSONObject]:
    return [{"role": "system", "content": req.instructions}] if req.instructions else []


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _input_messages(items: list[Any]) -> list[JSONObject]:
    messages: list[JSONObject] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
    return messages  # reasoning items: the model's reasoning is not replayed


def from_chat_answer(req: ResponsesRequest, chat_body: JSONObject,
                     answer: JSONObject) -> JSONObject:
    """Step 4: the Response object for the chat `answer` to `chat_body`."""
    choice = answer["choices"][0]
    usage = answer["usage"]
    incomplete = choice["finish_reason"] == "length"
    weights = {k: str(v) for k, v in (answer.get("metadata") or {}).items() if v is not None}
    response: JSONObject = {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": answer.get("model", chat_body.get("model")), "output": _output_items(choice),
        "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "tools": [tool.model_dump() for tool in req.tools or []],
        "tool_choice": (req.tool_choice.model_dump() if isinstance(
            req.tool_choice, ToolChoiceFunction) else req.tool_choice or "auto"),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature, "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens, "text": {"format": {"type": "text"}},
        "metadata": {**(req.metadata or {}), **weights},
        "usage": {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details")
                                                       or {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}}
    if req.wants_tokens:
        response["input_messages"] = [{"type": "raw_message_tokens", "message": "",
                                       "tokens": choice.get("prompt_token_ids") or []}]
        response["output_messages"] = [{"type": "raw_message_tokens",
                                        "message": choice["message"].get("content") or "",
                                        "tokens": choice.get("token_ids") or []}]
    return response


def _output_items(choice: JSONObject) -> list[JSONObject]:
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    items: list[JSONObject] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "status": status, "content": [{"type": "reasoning_text",
                                                     "text": message["reasoning_content"]}]})
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
                      "role": "assistant", "content": [{
                          "type": "output_text", "text": message.get("content") or "",
                          "annotations": [], "logprobs": logprobs}]})
    items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
               "name": call["function"]["name"], "arguments": call["function"]["arguments"],
               "status": "completed"} for call in calls]
    return items
