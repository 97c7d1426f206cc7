"""An agent program's contract: how it is found, called, given a task, and read back.

A program is a function, sync or async, called with the keyword arguments `base_url`,
`api_key`, `model` and `task` (it may declare only those it uses): `AgentProgram` reads
which, and calls it (a sync one in a daemon thread of its own, so that one that never
returns is left behind at its timeout). `load_agent` finds it by `--agent` spec or
entry point; `EnvTasks` poses an env's first observation as its task (`--tasks env`);
`reward_of` reads its return value: a number, or a dict of named numbers.

Knows envs (for their tasks) and Python callables; nothing of gateways, samplers or
trajectories (`agent.py` runs the rollouts).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

from prefixgym.envs.base import agent_of
from prefixgym.envs.registration import import_source, located, make_agent_env
from prefixgym.types import JSONObject

PROGRAM_ARGS = ("base_url", "api_key", "model", "task")
AGENT_ENTRY_POINTS = "prefixgym.agents"
AgentTask = Any  # a JSON value (a line of --tasks), or whatever an iterable yields


class AgentProgram:
    """A user's program: which of `PROGRAM_ARGS` it takes, and how to call it."""

    def __init__(self, fn: Callable[..., Any], name: str = "") -> None:
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        if not callable(fn):
            raise ValueError(f"agent {self.name} is not callable")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            raise ValueError(f"agent {self.name}: cannot read its signature") from None
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [n for n, p in params.items() if n not in PROGRAM_ARGS
                   and p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if unknown:
            raise ValueError(f"agent {self.name} requires {unknown}; an agent is called with "
                             f"the keyword arguments {', '.join(PROGRAM_ARGS)} (any of them)")
        self.args = PROGRAM_ARGS if var_kw else tuple(n for n in PROGRAM_ARGS if n in params)
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None))

    async def __call__(self, **kwargs: Any) -> Any:
        given = {k: v for k, v in kwargs.items() if k in self.args}
        if self.is_async:
            return await self.fn(**given)
        result = await _in_daemon_thread(self.fn, given)
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            return await result
        return result


async def _in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)` in a daemon thread of its own: a program that never returns is
    given up on at its timeout and left behind, never waited for at exit (as threads of
    asyncio's default executor would be)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def target() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting rollout
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has closed: nobody waits for this program
            pass

    threading.Thread(target=target, name="agent-program", daemon=True).start()
    return await done


def load_agent(spec: str) -> AgentProgram:
    """The program `spec` names: `path/to/file.py:fn`, `module:fn`, or the name of an
    entry point in the `prefixgym.agents` group. ValueError when it cannot be loaded."""
    source, _, name = spec.rpartition(":")
    if not source:
        found = [ep for ep in importlib.metadata.entry_points(group=AGENT_ENTRY_POINTS)
                 if ep.name == spec]
        if not found:
            raise ValueError(f"--agent {spec!r}: write path/to/file.py:fn or module:fn, or name "
                             f"an entry point of the {AGENT_ENTRY_POINTS!r} group")
        try:
            return AgentProgram(found[0].load(), spec)
        except Exception as e:  # noqa: BLE001 - the program's module failed to import
            raise ValueError(f"--agent {spec!r}: {located(e)}") from None
    try:
        module = import_source(source)
    except ValueError as e:
        raise ValueError(f"--agent {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the program's module failed to import
        raise ValueError(f"--agent {spec!r}: importing {source} failed: {located(e)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"--agent {spec!r}: {source} has no {name!r}")
    return AgentProgram(fn, spec)


class EnvTasks:
    """Tasks posed by an env's `reset(seed)` (`--tasks env`): the task of a seed is
    {"env", "env_kwargs", "seed", "system", "tools", "messages"}: what the env says first,
    its system prompt and tool schemas, and how to make it again, so that a program can
    grade its answer with the env itself (`prefixgym.envs.make_env(task["env"],
    task["env_kwargs"])`, `reset(seed=task["seed"])`, `step(reply)`)."""

    def __init__(self, spec: str, kwargs: JSONObject) -> None:
        self.spec, self.kwargs = spec, dict(kwargs)
        self._env = make_agent_env(spec, self.kwargs)
        self._lock = threading.Lock()

    def __call__(self, seed: int) -> JSONObject:
        with self._lock:
            obs, _ = self._env.reset(seed=seed)
            system, tools = agent_of(self._env).prompt()
        return {"env": self.spec, "env_kwargs": self.kwargs, "seed": seed, "system": system,
                "tools": [t.schema() for t in tools], "messages": [dict(m) for m in obs]}

    def close(self) -> None:
        self._env.close()


def reward_of(result: Any, weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """The program's return value as (reward, components); ValueError when it is none."""
    if isinstance(result, bool) or not isinstance(result, (int, float, Mapping)):
        raise ValueError(f"the program returned {_short(result)}, not a reward (a number, or "
                         "a dict of named numbers)")
    if not isinstance(result, Mapping):
        components = {"reward": float(result)}
        total = float(result)
    else:
        components = {}
        for name, value in result.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"the program's reward component {name!r} is "
                                 f"{_short(value)}, not a number")
            components[str(name)] = float(value)
        total = sum(v * weights.get(k, 1.0) for k, v in components.items())
    if not math.isfinite(total):
        raise ValueError(f"the program returned a reward that is not finite ({total})")
    return total, components


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
