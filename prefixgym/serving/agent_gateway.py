"""The endpoint agent programs call during training: OpenAI's API, one base URL a rollout.

`AgentGateway` serves `/rollouts/{key}/v1/chat/completions`, `/rollouts/{key}/v1/responses`
(responses.py, over the chat route) and `/rollouts/{key}/v1/models` on a loopback port, in
a thread of its own. A rollout `open`s a key with its `CallTree` and the sampler of the
weights it samples from, hands its program `base_url`, and `close`s the key when the
program returns: a call that arrives after that (or for a key never opened) is a 404, so
nothing passes from one rollout to the next.

A call (`RolloutSession.complete`):
  1) the request's model must be the rollout's (404 otherwise, and the rollout is marked
     failed: a program that calls another model is not training this one);
  2) its messages go to the tree, which continues the conversation of the reply they
     extend and renders only what is new (`prompting.call_tree`);
  3) one engine request samples its `n` choices from that prompt (the prefix cache serves
     what earlier calls computed); the run's temperature and reply length unless the
     program sets its own; a seed fixed by (rollout seed, call number) unless it sets one;
  4) each reply is recorded in the tree exactly as sampled, and answered in OpenAI's shape
     with vLLM's extras: `token_ids`, `prompt_token_ids`, logprobs, `cached_tokens`, tool
     calls parsed in the model's own syntax, reasoning apart as `reasoning_content`.
With an API key every route wants `Authorization: Bearer KEY`, as `prefixgym serve`'s do;
bodies and `n` have its limits. The chat format's end-of-turn ids go with every call that
names no stop strings, so a remote sampler (vLLM behind `--sampler-url`) stops where the
built-in engine does; a sampler that cannot be reached or fails answers 502.

In auto-open mode (`AutoOpen`: `prefixgym proxy`) the gateway opens its sessions itself:
a key's first call opens it with a fresh tree, plain `/v1/...` is the key "default", and
`POST /rollouts/{key}/close` (`/v1/close`) ends a session and hands it to `on_close`.

Knows HTTP, OpenAI's shapes and the sampling protocol; not envs, rewards or training.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from prefixgym.prompting.call_tree import (
    CallMessage,
    CallTree,
    Pending,
    call_messages,
    reply_message,
)
from prefixgym.protocols import SamplingClient
from prefixgym.serving.bodies import read_body
from prefixgym.serving.chat import ChatRequest, chat_stream, parse_chat_request
from prefixgym.serving.errors import install_error_handlers
from prefixgym.serving.protocol import APIError, decode_ids, describe_validation_error
from prefixgym.serving.responses import ResponseStore, add_responses_route
from prefixgym.types import JSONObject, ModelInput, SampleResponse, SamplingParams

_KEY = re.compile(r"[A-Za-z0-9._\-]{1,200}")
MAX_N = 64
MAX_BODY_BYTES = 64 << 20
DEFAULT_SESSION = "default"
"""The session key of the plain `/v1/...` routes (auto-open mode)."""
log = logging.getLogger("prefixgym.serve")


@dataclass
class SamplingDefaults:
    """What a call that does not say samples with: the run's settings."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class RolloutSession:
    """One rollout's calls: its tree, its sampler, its seed, and what went wrong."""

    tree: CallTree
    sampler: SamplingClient
    model: str
    seed: int
    defaults: SamplingDefaults
    errors: list[str] = field(default_factory=list)
    """One line per call this endpoint refused (a wrong model, a bad request)."""

    async def complete(self, req: ChatRequest) -> JSONObject:
        """Steps 1-4 for one chat request; APIError for one it refuses."""
        if req.model is not None and req.model != self.model:
            raise self.refuse(APIError(
                404, f"model {req.model!r} does not exist; this rollout trains {self.model!r}",
                "model", "not_found_error"))
        if req.n > MAX_N:
            raise self.refuse(APIError(400, f"n = {req.n} exceeds the limit of {MAX_N}", "n"))
        if req.tools and self.tree.syntax is None:
            raise self.refuse(APIError(400, "this model's chat template has no tool-call syntax "
                                            "prefixgym knows, so a request cannot have tools",
                                       "tools"))
        try:
            messages = call_messages([m.for_template(raw_calls=True) for m in req.messages])
            pending = await run_in_threadpool(self.tree.begin, messages, req.tools or [])
        except ValueError as e:
            raise self.refuse(APIError(400, str(e).splitlines()[0], "messages")) from None
        try:
            params = self.params(req, pending.call)
            response = await self.sampler.sample(ModelInput.from_ints(pending.prompt),
                                                 num_samples=req.n, sampling_params=params)
        except ValidationError as e:
            raise self.refuse(APIError(400, *describe_validation_error(e))) from None
        except ValueError as e:
            raise self.refuse(APIError(400, str(e).splitlines()[0])) from None
        except (ConnectionError, RuntimeError) as e:  # the sampler's server, or the engine
            log.warning("a call's sampler failed", exc_info=e)
            raise APIError(502, f"the sampler failed: {_first_line(e)}", None,
                           "upstream_error") from None
        return await run_in_threadpool(self.answer, req, pending, response)

    def refuse(self, error: APIError) -> APIError:
        self.errors.append(f"{error.status}: {error.message}")
        return error

    def params(self, req: ChatRequest, call: int) -> SamplingParams:
        given = req.model_fields_set
        d = self.defaults
        return SamplingParams(
            max_tokens=req.max_completion_tokens or req.max_tokens or d.max_tokens,
            temperature=req.temperature if "temperature" in given else d.temperature,
            top_p=req.top_p if "top_p" in given else d.top_p, top_k=req.top_k,
            stop=req.stop_strings, stop_token_ids=self.stop_token_ids(req),
            seed=req.seed if req.seed is not None else _mix(self.seed, call))

    def stop_token_ids(self, req: ChatRequest) -> list[int]:
        """The call's own, and the chat format's end-of-turn ids unless it names stop
        strings (some samplers, tinker's, stop at strings or at ids, never both)."""
        own = list(req.stop_token_ids or [])
        if req.stop_strings:
            return own
        return list(dict.fromkeys([*own, *self.tree.format.stop_token_ids]))

    def answer(self, req: ChatRequest, pending: Pending, response: SampleResponse) -> JSONObject:
        """Step 4: record each reply in the tree and answer in OpenAI's shape."""
        tokenizer = self.tree.tokenizer
        choices = []
        for i, seq in enumerate(response.sequences):
            reasoning: list[str | None] = [None]

            def message_of(text: str) -> CallMessage:
                cut = req.cut_at_stop(text, seq.stop_reason)
                msg, reasoning[0] = reply_message(cut, self.tree.syntax, bool(req.tools))
                return msg

            info = {"weights_version": response.weights_version,
                    "usage": response.usage.model_dump() if i == 0 else None,
                    "shared_by": len(response.sequences)}
            msg = self.tree.add_reply(pending, seq.tokens, seq.logprobs, seq.stop_reason,
                                      message_of, info)
            calls = [{"id": f"call_{pending.call}_{i}_{k}", "type": "function",
                      "function": {"name": c.name, "arguments": _json(c.arguments)}}
                     for k, c in enumerate(msg.tool_calls)]
            message: JSONObject = {"role": "assistant",
                                   "content": msg.content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            if reasoning[0] is not None:
                message["reasoning_content"] = reasoning[0]
            choices.append({
                "index": i, "message": message, "token_ids": list(seq.tokens),
                "prompt_token_ids": pending.prompt if i == 0 else None,
                "finish_reason": "tool_calls" if calls else seq.stop_reason,
                "logprobs": {"content": [
                    {"token": piece, "logprob": value, "bytes": list(piece.encode()),
                     "top_logprobs": []}
                    for piece, value in zip((decode_ids(tokenizer, [t], False)
                                             for t in seq.tokens), seq.logprobs)]}})
        sampled = sum(len(s.tokens) for s in response.sequences)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model, "choices": choices,
            "usage": {"prompt_tokens": len(pending.prompt), "completion_tokens": sampled,
                      "total_tokens": len(pending.prompt) + sampled,
                      "prompt_tokens_details": {
                          "cached_tokens": response.usage.prefill_cached_tokens}},
            "metadata": {"weight_version": response.weights_version}}


@dataclass
class AutoOpen:
    """Sessions the gateway opens itself: a key's first call opens it with a tree from
    `make_tree`, sampled by `sampler` (a random seed each); closing it hands it to
    `on_close`, which returns how many sequences it recorded."""

    make_tree: Callable[[], CallTree]
    sampler: SamplingClient
    on_close: Callable[[str, RolloutSession], int]


class AgentGateway:
    """OpenAI's API for agent programs, a base URL per open rollout (module docstring)."""

    def __init__(self, model: str, defaults: SamplingDefaults | None = None,
                 api_key: str | None = None, host: str = "127.0.0.1",
                 auto_open: AutoOpen | None = None) -> None:
        self.model = model
        self.defaults = defaults or SamplingDefaults()
        self.api_key = api_key
        self.auto_open = auto_open
        self._sessions: dict[str, RolloutSession] = {}
        self._lock = threading.Lock()
        self.app = self._create_app()
        self._host = host
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- rollouts -------------------------------------------------------------------

    def open(self, key: str, tree: CallTree, sampler: SamplingClient, seed: int,
             temperature: float | None = None) -> str:
        """Serve rollout `key` at a base URL of its own until `close(key)`: its calls
        continue `tree` and sample from `sampler`. Returns the URL."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"a rollout key is letters, digits and . _ - only, got {key!r}")
        if not self.url:
            self.start()
        defaults = self.defaults if temperature is None else dataclasses.replace(
            self.defaults, temperature=temperature)
        session = RolloutSession(tree, sampler, self.model, seed, defaults)
        with self._lock:
            if key in self._sessions:
                raise ValueError(f"rollout {key!r} is open already")
            self._sessions[key] = session
        return f"{self.url}/rollouts/{key}/v1"

    def close(self, key: str) -> list[str]:
        session = self.take(key)
        return list(session.errors) if session is not None else []

    def take(self, key: str) -> RolloutSession | None:
        """Stop serving `key`; its session, None when it was not open."""
        with self._lock:
            return self._sessions.pop(key, None)

    def take_all(self) -> dict[str, RolloutSession]:
        """Stop serving every open key; their sessions, in the order they opened."""
        with self._lock:
            taken, self._sessions = self._sessions, {}
        return taken

    def session(self, key: str) -> RolloutSession:
        """The open session of `key` (in auto-open mode, opened now if need be); 404."""
        auto = self.auto_open
        with self._lock:
            found = self._sessions.get(key)
            if found is None and auto is not None and _KEY.fullmatch(key):
                found = self._sessions[key] = RolloutSession(
                    auto.make_tree(), auto.sampler, self.model, secrets.randbelow(2**31 - 1),
                    self.defaults)
        if found is None:
            raise APIError(404, f"no rollout {key!r} is open: its program has returned, or the "
                                "base_url is not one prefixgym gave", None, "not_found_error")
        return found

    # -- the server -----------------------------------------------------------------

    def start(self, port: int = 0) -> None:
        """uvicorn on `port` (0: a free one), in a daemon thread."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(self.app, host=self._host, port=port,
                                               log_level="error", lifespan="off"))
        thread = threading.Thread(target=server.run, name="agent-gateway", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent gateway's server did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        self._server, self._thread = server, thread
        self.url = f"http://{self._host}:{port}"

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True  # type: ignore[attr-defined]
            self._thread.join(timeout=10)
        self._server = self._thread = None
        self.url = ""

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           None, "authentication_error")

    def _create_app(self) -> FastAPI:
        app = FastAPI(title="prefixgym agent gateway", docs_url=None, redoc_url=None,
                      openapi_url=None)
        install_error_handlers(app)
        auto = self.auto_open

        def key_of(request: Request) -> str:
            return str(request.path_params.get("key", DEFAULT_SESSION))

        async def chat(request: Request, body: JSONObject) -> JSONObject:
            return await self.session(key_of(request)).complete(parse_chat_request(body))

        async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
            self._authorize(request)
            session = self.session(key_of(request))
            req = parse_chat_request(await read_body(request, MAX_BODY_BYTES))
            answer = await session.complete(req)
            if req.stream:
                return StreamingResponse(chat_stream(answer, req), media_type="text/event-stream")
            return JSONResponse(answer)

        async def models(request: Request) -> JSONObject:
            self._authorize(request)
            model = self.model if self.auto_open else self.session(key_of(request)).model
            return {"object": "list", "data": [{"id": model, "object": "model",
                                                "created": 0, "owned_by": "prefixgym"}]}

        async def close(request: Request) -> JSONObject:
            self._authorize(request)
            key = key_of(request)
            session = self.take(key)
            if session is None or auto is None:
                raise APIError(404, f"no session {key!r} is open", None, "not_found_error")
            return {"session": key,
                    "sequences": await run_in_threadpool(auto.on_close, key, session)}

        store = ResponseStore()
        for base in ("/rollouts/{key}/v1", "/v1"):
            app.add_api_route(f"{base}/chat/completions", chat_completions, methods=["POST"],
                              response_model=None)
            app.add_api_route(f"{base}/models", models, methods=["GET"])
            add_responses_route(app, f"{base}/responses", chat, self._authorize,
                                MAX_BODY_BYTES, store)
        if auto is not None:
            app.add_api_route("/rollouts/{key}/close", close, methods=["POST"])
            app.add_api_route("/v1/close", close, methods=["POST"])
        return app


def _mix(seed: int, k: int) -> int:
    return (seed * 1_000_003 + k * 7919) % (2**31 - 1)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _json(value: object) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
