"""`POST /v1/responses`: OpenAI's Responses API over a chat-completions handler, for agent
programs written against it (`client.responses.create`).

A request goes:
  1) the body, bounded and labelled JSON (bodies.py), parsed into a `ResponsesRequest`
     (responses_protocol.py: what it takes, and how it translates);
  2) the stored conversation of `previous_response_id` (400 when this store has none
     under that id), and the chat-completions body `to_chat_body` writes from both;
  3) the chat handler answers that body: its checks and errors are this route's (a
     refusal naming `max_tokens` or `messages` names `max_output_tokens` or `input`);
  4) `from_chat_answer` writes the Response; kept in the `ResponseStore` (unless `store`
     is false) for `previous_response_id` and `GET {path}/{id}`, found only under the base
     URL that made it (its path parameters: a rollout key);
  5) answered as JSON, or with `stream` as server-sent events replaying the finished
     response (`stream_events`: the whole text in one delta).

Knows HTTP and the Responses API's events; the model only through the chat handler.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from prefixgym.serving.bodies import BodyError, read_body
from prefixgym.serving.protocol import APIError
from prefixgym.serving.responses_protocol import (
    ResponsesRequest,
    StoredResponse,
    from_chat_answer,
    parse_responses_request,
    stored_conversation,
    to_chat_body,
)
from prefixgym.types import JSONObject

ChatHandler = Callable[[Request, JSONObject], Awaitable[JSONObject]]
"""Answers a chat-completions body (for the request that carried it) with a chat
answer, or raises APIError."""
_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}
_EMPTY_ITEMS: dict[str, JSONObject] = {
    "message": {"content": []}, "reasoning": {"content": []}, "function_call": {"arguments": ""}}
"""What an output item holds when `response.output_item.added` announces it."""


class ResponseStore:
    """The last `capacity` stored responses by key, least recently used out first;
    thread-safe. `get` refreshes an entry; `put` may evict the oldest."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, stored: StoredResponse) -> None:
        with self._lock:
            self._entries[key] = stored
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, key: str) -> StoredResponse | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)



def stream_events(response: JSONObject) -> Iterator[str]:
    """A finished `response` as OpenAI's server-sent events: created, in_progress, each
    output item (added, its content or arguments, done), then completed (or incomplete)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    begun = {**response, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None}
    yield event("response.created", response=begun)
    yield event("response.in_progress", response=begun)
    for index, item in enumerate(response["output"]):
        empty = _EMPTY_ITEMS[item["type"]]
        yield event("response.output_item.added", output_index=index,
                    item={**item, **empty, "status": "in_progress"})
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            yield event("response.function_call_arguments.delta", **where,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        for k, part in enumerate(item.get("content") or []):
            yield from _part_events(event, {**where, "content_index": k}, part)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event(f"response.{response['status']}", response=response)


def _part_events(event: Callable[..., str], where: JSONObject, part: JSONObject
                 ) -> Iterator[str]:
    if part["type"] == "reasoning_text":
        yield event("response.reasoning_text.delta", **where, delta=part["text"])
        yield event("response.reasoning_text.done", **where, text=part["text"])
        return
    yield event("response.content_part.added", **where,
                part={**part, "text": "", "logprobs": []})
    yield event("response.output_text.delta", **where, delta=part["text"],
                logprobs=part["logprobs"])
    yield event("response.output_text.done", **where, text=part["text"],
                logprobs=part["logprobs"])
    yield event("response.content_part.done", **where, part=part)


def add_responses_route(app: FastAPI, path: str, chat: ChatHandler,
                        authorize: Callable[[Request], None], max_body_bytes: int,
                        store: ResponseStore,
                        refused: Callable[[Request, APIError | BodyError], None] | None = None
                        ) -> None:
    """`POST path` (steps 1-5) and `GET path/{response_id}` (a stored response) on `app`;
    `path` may hold path parameters (`/rollouts/{key}/v1/responses`). `refused` hears of
    each request refused before it reaches `chat` (which hears of its own)."""

    def chat_body(request: Request, req: ResponsesRequest) -> JSONObject:
        previous = None
        if req.previous_response_id is not None:
            previous = store.get(_key(request, req.previous_response_id))
            if previous is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' "
                                    "not found.", "previous_response_id")
        return to_chat_body(req, previous)

    @app.post(path, response_model=None)
    async def create_response(request: Request) -> JSONResponse | StreamingResponse:
        authorize(request)
        try:
            raw = await read_body(request, max_body_bytes)
            req = await run_in_threadpool(parse_responses_request, raw)
            body = chat_body(request, req)
        except (APIError, BodyError) as e:
            if refused is not None:
                refused(request, e)
            raise
        try:
            answer = await chat(request, body)
        except APIError as e:
            e.param = _CHAT_PARAMS.get(e.param or "", e.param)
            raise
        response = from_chat_answer(req, body, answer)
        if req.store:
            store.put(_key(request, response["id"]),
                      StoredResponse(stored_conversation(req, body, answer), response))
        if req.stream:
            return StreamingResponse(stream_events(response), media_type="text/event-stream")
        return JSONResponse(response)

    @app.get(path.rstrip("/") + "/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONObject:
        authorize(request)
        stored = store.get(_key(request, response_id))
        if stored is None:
            raise APIError(404, f"No response found with id '{response_id}'.", "response_id",
                           "not_found_error")
        return stored.response


def _key(request: Request, response_id: str) -> str:
    """A response's key in the store: its id under the base URL's path parameters."""
    scope = sorted((k, v) for k, v in request.path_params.items() if k != "response_id")
    return json.dumps([scope, response_id])
