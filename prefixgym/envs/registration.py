"""Gymnasium ids for the built-in envs: "prefixgym/<Name>-v0", and `make_env`.

`register_envs()` runs when `prefixgym` is imported; it is idempotent. Keyword
arguments of `gym.make` go to the env's constructor (difficulty, `max_turns`, ...).
Turn limits live in the env (`max_turns`), so no TimeLimit wrapper is added.
`make_env(env_id, kwargs)` is `gym.make` with one clear ValueError for an unknown id
or bad keyword arguments; `make_agent_env` also refuses an env that is not an
`AgentEnv` (rollouts need its system prompt, tools and text actions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gymnasium as gym

if TYPE_CHECKING:  # `import prefixgym` registers ids without loading the envs
    from prefixgym.envs.base import Observation

BUILTIN_ENVS: dict[str, str] = {
    "prefixgym/GuessNumber-v0": "prefixgym.envs.guess_number:GuessNumber",
    "prefixgym/Arithmetic-v0": "prefixgym.envs.arithmetic:Arithmetic",
    "prefixgym/Mastermind-v0": "prefixgym.envs.mastermind:Mastermind",
    "prefixgym/GridMaze-v0": "prefixgym.envs.grid_maze:GridMaze",
    "prefixgym/KeyValueLookup-v0": "prefixgym.envs.key_value_lookup:KeyValueLookup",
}


def register_envs() -> None:
    """Register every built-in env with gymnasium (once)."""
    for env_id, entry_point in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)


def make_env(
    env_id: str, kwargs: Mapping[str, Any] | None = None,  # constructor kwargs: any types
) -> gym.Env[Any, Any]:  # any registered env: its own spaces decide the types
    """`gym.make(env_id, **kwargs)`; ValueError naming the id and kwargs when it fails.

    (`kwargs` are the env constructor's, whatever their types; the env's own spaces
    decide its observation and action types.)"""
    register_envs()
    try:
        return gym.make(env_id, **dict(kwargs or {}))
    except (gym.error.Error, TypeError, ValueError) as e:  # unknown id, bad kwargs
        raise ValueError(f"cannot make env {env_id!r} with {dict(kwargs or {})}: {e}") from e


def make_agent_env(env_id: str, kwargs: Mapping[str, Any] | None = None) -> gym.Env[Observation, str]:
    """`make_env`, refusing (ValueError) an env that is not a prefixgym `AgentEnv`."""
    from prefixgym.envs.base import agent_of

    env = make_env(env_id, kwargs)
    agent_of(env)
    return env
