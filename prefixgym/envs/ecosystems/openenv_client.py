"""OpenEnv env servers as envs: `--env openenv:URL` (e.g. `openenv:http://127.0.0.1:8000`).

An OpenEnv server keeps an env instance per WebSocket session (`/ws`; its plain HTTP
`/reset` and `/step` make a fresh env per call, useless for an episode). So each
episode opens a session at reset -- `{"type": "reset", "data": {"seed": s}}` -- steps in
it -- `{"type": "step", "data": {ACTION_FIELD: reply}}` -- and closes it when the
episode ends (`{"type": "close"}`), or at the next reset, or when the env is closed.
A server at its capacity (`max_concurrent_envs`, 1 by default) answers with an error:
that episode ends as an env error, counted apart from failures. Resets and steps run
in a worker thread (`areset`/`astep`), so a group's sessions open together.

`--env-kwargs`:
- `action_field` ("message"): the action's field that carries the reply;
- `observation_field` (none): the observation's field shown as the user turn; by
  default the first of `prompt` (at reset), the `messages`' contents, `text`,
  `message`, `content`, `echoed_message`, else the observation as JSON;
- `system_prompt`, `max_turns` (64), `timeout_s` (30, per message).
The episode's reward is the sum of the server's rewards; success is an episode the
server ended with a positive last reward. OpenEnv servers have no scripted expert:
train with `--sft-steps 0`. An env whose reset ignores the seed is refused by `train`.

Knows OpenEnv's WebSocket messages (openenv-core 0.3 and 0.10) and `websockets`;
nothing of tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from prefixgym.envs.base import AgentEnv, Observation, Outcome

_TEXT_FIELDS = ("text", "message", "content", "echoed_message", "observation")


class OpenEnvSession(AgentEnv):
    """An OpenEnv server's env, a WebSocket session per episode."""

    expert_available = False

    def __init__(self, url: str, action_field: str = "message",
                 observation_field: str | None = None, system_prompt: str = "",
                 max_turns: int = 64, timeout_s: float = 30.0) -> None:
        super().__init__(max_turns=max_turns)
        base = url.rstrip("/")
        self.url = base
        self.ws_url = ("ws" + base[4:] if base.startswith("http") else base) + "/ws"
        self.action_field, self.observation_field = action_field, observation_field
        self.system_prompt, self.timeout_s = system_prompt, float(timeout_s)
        self._socket: Any = None
        self._session = contextlib.ExitStack()

    @classmethod
    def create(cls, url: str, kwargs: dict[str, Any]) -> OpenEnvSession:
        if not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv:{url}: the server's URL must start with http:// or "
                             "https:// (or ws://, wss://)")
        try:
            return cls(url, **kwargs)
        except TypeError as e:
            raise ValueError(f"openenv:{url}: {e}") from None

    # --- a session per episode ---------------------------------------------------------

    def _reset_task(self) -> str:
        from websockets.sync.client import connect

        self._end_session()
        self._session = contextlib.ExitStack()  # (websockets wants its connection entered)
        self._socket = self._session.enter_context(connect(
            self.ws_url, open_timeout=self.timeout_s, close_timeout=self.timeout_s))
        data = {} if self.reset_seed is None else {"seed": self.reset_seed}
        reply = self._call({"type": "reset", "data": data})
        return self._render(reply.get("observation") or {}, first=True)

    def _act(self, text: str) -> Outcome:
        reply = self._call({"type": "step", "data": {self.action_field: text}})
        reward, done = float(reply.get("reward") or 0.0), bool(reply.get("done"))
        message = self._render(reply.get("observation") or {}, first=False)
        if done:
            self._end_session()
        return Outcome(message, rewards={"env": reward}, done=done, success=done and reward > 0)

    def close(self) -> None:
        self._end_session()

    async def areset(self, *, seed: int | None = None,
                     options: dict[str, Any] | None = None
                     ) -> tuple[Observation, dict[str, Any]]:
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(self, action: str) -> Any:
        return await asyncio.to_thread(self.step, action)

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message of the session and read the server's answer (RuntimeError for
        an error: a server at capacity, an action it refuses, its env failing)."""
        from websockets.exceptions import ConnectionClosed

        if self._socket is None:
            raise RuntimeError("the OpenEnv session is closed")
        try:
            self._socket.send(json.dumps(message))
        except ConnectionClosed:
            pass  # a server that refused the session says why before closing: read it
        try:
            answer = json.loads(self._socket.recv(timeout=self.timeout_s))
        except ConnectionClosed as e:
            self._end_session()
            raise RuntimeError(f"OpenEnv server {self.url} closed the session ({e})") from None
        if answer.get("type") == "error":
            error = answer.get("data") or {}
            self._end_session()
            raise RuntimeError(f"OpenEnv server {self.url}: {error.get('message', 'an error')}"
                               f" ({error.get('code', 'no code')})")
        data: dict[str, Any] = answer.get("data") or {}
        return data

    def _end_session(self) -> None:
        socket, self._socket = self._socket, None
        if socket is None:
            return
        try:
            socket.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001, S110 - a session the server ended already
            pass
        self._session.close()

    # --- what the model reads -----------------------------------------------------------

    def _render(self, observation: dict[str, Any], first: bool) -> str:
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        if first and isinstance(observation.get("prompt"), str) and observation["prompt"]:
            return str(observation["prompt"])
        messages = observation.get("messages")
        if isinstance(messages, list) and messages:
            return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                             for m in messages)
        for field in _TEXT_FIELDS:
            if isinstance(observation.get(field), str):
                return str(observation[field])
        shown = {k: v for k, v in observation.items() if k not in ("metadata", "reward", "done")}
        return json.dumps(shown, sort_keys=True)
