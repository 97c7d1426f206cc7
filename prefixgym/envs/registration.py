"""Gymnasium ids for the built-in envs: "prefixgym/<Name>-v0".

`register_envs()` runs when `prefixgym.envs` is imported; it is idempotent. Keyword
arguments of `gym.make` go to the env's constructor (difficulty, `max_turns`, ...).
Turn limits live in the env (`max_turns`), so no TimeLimit wrapper is added.
"""

from __future__ import annotations

import gymnasium as gym

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
