"""verifiers 0.4 environments as envs: `--env verifiers:NAME`.

NAME is a verifiers taskset id: a module verifiers loads (`verifiers.v1.tasksets.NAME`,
or any importable module that exports one `Taskset`, and optionally its own `Env`,
which then runs the episode's turns: a user simulator, a game). verifiers drives the
model itself, through chat requests; this adapter turns that around:

1) One `_Host` per NAME and process runs verifiers on a background event loop: the
   environment is loaded with prefixgym's in-process harness (the agent program as a
   chat call in this process: no uv, no subprocess; exported for verifiers as the
   top-level `prefixgym_verifiers`), inside `env.serving()`, and its interception
   server's client is a `_Bridge`.
2) `reset(seed)` starts `run_episode` on the task the seed picks (`tasks[seed % n]`)
   and waits for its first chat request: the request's system message is the
   episode's system prompt, its user message the first observation.
3) `step(reply)` answers the pending request with the reply and waits for what comes
   next: another request, whose messages after the reply are the next observation,
   or the end, when verifiers has scored the episode: its reward (and components).
The episode's tokens stay exact: prefixgym's conversation appends the sampled ids and
the env's new messages; the history verifiers sends back is not re-read.

`--env-kwargs`: `success_reward` (1.0: an episode whose reward reaches it succeeds),
`max_turns` (64), `timeout_s` (120, per exchange) and `config`, verifiers' own env
config merged in (e.g. `{"max_rounds": 5}` for the env's fields). Limits: the model is
offered no tools (verifiers runs a taskset's tools as MCP servers, which this harness
does not start), and there is no scripted expert (train with `--sft-steps 0`). Knows verifiers 0.4's environment API and its interception
server's client cache (`env._interception.clients`, the one private part); nothing of
tokens.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire

from prefixgym.envs.base import AgentEnv, Outcome

MODEL = "prefixgym"
"""The model name verifiers' requests carry."""
HARNESS = "prefixgym_verifiers"
"""The top-level module that exports the in-process harness: verifiers loads a harness
by a module name without dots (`vf-eval ... --env.agent.harness.id prefixgym_verifiers`
runs it too)."""
KEY_VARIABLE = "PREFIXGYM_VERIFIERS_KEY"


class InProcessHarness(vf.Harness[vf.HarnessConfig]):
    """The agent program as one chat call made in this process, per segment: the
    task's prompt (or, resumed, the conversation so far) in, the reply appended."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # the default resume() launches again on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False  # allowed on the subprocess runtime, which then starts nothing

    async def setup(self, runtime: Any) -> None:
        return None

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, *args: Any, **kwargs: Any) -> Any:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(m) for m in prompt)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


@dataclass
class _Request:
    messages: list[dict[str, Any]]


@dataclass
class _End:
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    error: str = ""


class _Episode:
    """One verifiers episode as its env sees it: the events verifiers sends (requests,
    then the end), and the pending request's answer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: queue.Queue[_Request | _End] = queue.Queue()
        self.answer: asyncio.Future[str] | None = None
        self.run: Future[None] | None = None

    def next(self, timeout_s: float) -> _Request | _End:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"verifiers sent nothing for {timeout_s:g} s") from None

    def reply(self, text: str) -> None:
        answer = self.answer
        if answer is None:
            raise RuntimeError("verifiers is not waiting for a reply")
        self.answer = None
        self.loop.call_soon_threadsafe(answer.set_result, text)

    def cancel(self) -> None:
        if self.run is not None:
            self.run.cancel()


class _Bridge(vf.Client):
    """verifiers' model client: each request goes to the episode it belongs to (by its
    session id, the trace's id), which answers it with the policy's reply."""

    def __init__(self, host: _Host) -> None:
        self.host = host

    async def get_response(self, dialect: Any, body: dict[str, Any], sampling: Any,
                           session_id: str | None = None, turn: Any = None,
                           headers: Any = None) -> Any:
        episode = self.host.routes[str(session_id)]
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        episode.answer = answer
        episode.events.put(_Request(list(body.get("messages", []))))
        text = await answer
        raw = {"id": f"prefixgym-{session_id}", "object": "chat.completion",
               "created": int(time.time()), "model": MODEL,
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": text}}]}
        response = dialect.parse_response(dialect.validate_response(raw))
        response.raw = raw
        return response


class _Host:
    """verifiers loaded for one taskset, on its own event loop thread, serving."""

    _hosts: dict[str, _Host] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, name: str, config: dict[str, Any]) -> _Host:
        key = f"{name}:{sorted(config.items())!r}"
        with cls._lock:
            if key not in cls._hosts:
                cls._hosts[key] = cls(name, config)
            return cls._hosts[key]

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.routes: dict[str, _Episode] = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"verifiers:{name}",
                         daemon=True).start()
        settings = {**config, "taskset": {"id": name, **config.get("taskset", {})},
                    "agent": {"harness": {"id": HARNESS},
                              "runtime": {"type": "subprocess"}},
                    "interception": {"type": "server"}}
        self.env, self.tasks = asyncio.run_coroutine_threadsafe(
            self._serve(settings), self.loop).result()
        if not self.tasks:
            raise ValueError(f"verifiers:{name} has no tasks")
        self.client = vf.EvalClientConfig(base_url="http://prefixgym.invalid/v1",
                                          api_key_var=KEY_VARIABLE)
        self.env._interception.clients[self.client.model_dump_json()] = _Bridge(self)

    async def _serve(self, settings: dict[str, Any]) -> tuple[Any, list[Any]]:
        env = vf.load_environment(vf.resolve_env_config(settings))
        self.serving = env.serving()  # held open for the process's life
        await self.serving.__aenter__()
        return env, list(env.taskset)

    def start(self, index: int) -> _Episode:
        episode = _Episode(self.loop)
        task = self.tasks[index % len(self.tasks)]
        episode.run = asyncio.run_coroutine_threadsafe(self._run(episode, task), self.loop)
        return episode

    async def _run(self, episode: _Episode, task: Any) -> None:
        traces: list[str] = []

        def route(trace: Any) -> None:
            traces.append(trace.id)
            self.routes[trace.id] = episode

        try:
            ran = await self.env.run_episode(
                task, vf.ModelContext(model=MODEL, client=self.client), on_trace=route)
        except Exception as e:  # noqa: BLE001 - told to the env, which ends as an env error
            episode.events.put(_End(error=f"{type(e).__name__}: {e}"))
            return
        finally:
            for trace_id in traces:
                self.routes.pop(trace_id, None)
        trace = ran.traces[0] if ran.traces else None
        if trace is None or not ran.ok:
            errors = [str(e) for e in getattr(ran, "errors", [])]
            if trace is not None:
                errors += [str(e) for e in trace.errors]
            episode.events.put(_End(error="; ".join(errors) or "the episode failed"))
            return
        rewards = {k: float(r.score) * float(r.weight) for k, r in trace.rewards.items()}
        episode.events.put(_End(float(trace.reward), rewards))


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: their text
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


class VerifiersEnv(AgentEnv):
    """A verifiers taskset's episodes, one per reset; `create` builds it."""

    expert_available = False

    def __init__(self, host: _Host, success_reward: float = 1.0, max_turns: int = 64,
                 timeout_s: float = 120.0) -> None:
        super().__init__(max_turns=max_turns)
        self.host, self.success_reward, self.timeout_s = host, float(success_reward), timeout_s
        self.episode: _Episode | None = None

    @classmethod
    def create(cls, name: str, kwargs: dict[str, Any]) -> VerifiersEnv:
        config = kwargs.pop("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"config must be an object (verifiers' env config), got {config!r}")
        unknown = set(kwargs) - {"success_reward", "max_turns", "timeout_s"}
        if unknown:
            raise ValueError(f"verifiers:{name} takes success_reward, max_turns, timeout_s "
                             f"and config; not {sorted(unknown)}")
        try:
            host = _Host.of(name, config)
        except (ImportError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"verifiers cannot load {name!r}: {type(e).__name__}: {e}") from None
        return cls(host, **kwargs)

    def _reset_task(self) -> str:
        self.close()
        self.episode = self.host.start(self.task_seed())
        event = self.episode.next(self.timeout_s)
        if isinstance(event, _End):
            raise RuntimeError(event.error or "the episode ended before asking the model")
        system = [_text(m) for m in event.messages if m.get("role") == "system"]
        self.system_prompt = system[0] if system else ""
        return "\n\n".join(_text(m) for m in event.messages if m.get("role") == "user")

    def _act(self, text: str) -> Outcome:
        assert self.episode is not None
        self.episode.reply(text)
        event = self.episode.next(self.timeout_s)
        if isinstance(event, _End):
            self.episode = None
            if event.error:
                raise RuntimeError(f"verifiers: {event.error}")
            return Outcome("", rewards=event.rewards or {"reward": event.reward}, done=True,
                           success=event.reward >= self.success_reward)
        last = max((i for i, m in enumerate(event.messages) if m.get("role") == "assistant"),
                   default=-1)
        return Outcome("\n\n".join(_text(m) for m in event.messages[last + 1:]
                                   if m.get("role") in ("user", "tool")))

    def close(self) -> None:
        """Abandon an episode still running (a truncated one, or at the next reset)."""
        if self.episode is not None:
            self.episode.cancel()
            self.episode = None
