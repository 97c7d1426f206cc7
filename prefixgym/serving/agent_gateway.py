"""The endpoint agent programs call during training: OpenAI's API, one base URL a rollout.

`AgentGateway` serves `/rollouts/{key}/v1/chat/completions`, `/rollouts/{key}/v1/responses`
(responses.py, over the chat route) and `/rollouts/{key}/v1/models` on a loopback port, in
a thread of its own. A rollout `open`s a key with its `CallTree` and the sampler of the
weights it samples from, hands its program `base_url`, and `close`s the key when the
program returns: a call that arrives after that (or for a key never opened) is a 404, so
nothing passes from one rollout to the next.

A call goes to its rollout's `RolloutSession` (agent_session.py), which keeps a line for
each call refused, malformed ones included. With an API key every route wants
`Authorization: Bearer KEY`, as `prefixgym serve`'s do; bodies are bounded.

In auto-open mode (`AutoOpen`: `prefixgym proxy`) the gateway opens its sessions itself:
a key's first call opens it with a fresh tree, plain `/v1/...` is the key "default", and
`POST /rollouts/{key}/close` (`/v1/close`) ends a session and hands it to `on_close`.

Knows HTTP, OpenAI's shapes and the sampling protocol; not envs, rewards or training.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from prefixgym.prompting.call_tree import (
    CallTree,
)
from prefixgym.protocols import SamplingClient
from prefixgym.serving.admission import bearer_check
from prefixgym.serving.agent_session import RolloutSession, SamplingDefaults
from prefixgym.serving.bodies import BodyError, read_body
from prefixgym.serving.chat import ChatRequest, chat_stream, parse_chat_request
from prefixgym.serving.errors import install_error_handlers
from prefixgym.serving.protocol import APIError
from prefixgym.serving.responses import ResponseStore, add_responses_route
from prefixgym.types import JSONObject

_KEY = re.compile(r"[A-Za-z0-9._\-]{1,200}")
MAX_BODY_BYTES = 64 << 20
DEFAULT_SESSION = "default"
"""The session key of the plain `/v1/...` routes (auto-open mode)."""


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
        self._authorize = bearer_check(api_key)
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

    def _create_app(self) -> FastAPI:
        app = FastAPI(title="prefixgym agent gateway", docs_url=None, redoc_url=None,
                      openapi_url=None)
        install_error_handlers(app)
        auto = self.auto_open

        def refused(request: Request, error: APIError | BodyError) -> None:
            self.session(_key_of(request)).refuse(error)

        async def chat(request: Request, body: JSONObject) -> JSONObject:
            session = self.session(_key_of(request))
            return await session.complete(_parsed(session, body))

        async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
            self._authorize(request)
            session = self.session(_key_of(request))
            try:
                body = await read_body(request, MAX_BODY_BYTES)
            except BodyError as e:
                raise session.refuse(e) from None
            req = _parsed(session, body)
            answer = await session.complete(req)
            if req.stream:
                return StreamingResponse(chat_stream(answer, req), media_type="text/event-stream")
            return JSONResponse(answer)

        async def models(request: Request) -> JSONObject:
            self._authorize(request)
            model = self.model if self.auto_open else self.session(_key_of(request)).model
            return {"object": "list", "data": [{"id": model, "object": "model",
                                                "created": 0, "owned_by": "prefixgym"}]}

        async def close(request: Request) -> JSONObject:
            self._authorize(request)
            key = _key_of(request)
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
                                MAX_BODY_BYTES, store, refused)
        if auto is not None:
            app.add_api_route("/rollouts/{key}/close", close, methods=["POST"])
            app.add_api_route("/v1/close", close, methods=["POST"])
        return app


def _key_of(request: Request) -> str:
    """The session key a route's path names (the plain `/v1/...` routes: the default)."""
    return str(request.path_params.get("key", DEFAULT_SESSION))


def _parsed(session: RolloutSession, body: bytes | JSONObject) -> ChatRequest:
    """The chat request in `body`; a malformed one is refused, and recorded by `session`."""
    try:
        return parse_chat_request(body)
    except (APIError, BodyError) as e:
        raise session.refuse(e) from None
