"""prefixgym.envs: Gymnasium environments for LLM agents (text in, text out).

Importing this package registers the built-in envs as "prefixgym/<Name>-v0".
"""

from __future__ import annotations

from prefixgym.envs.addition import Addition
from prefixgym.envs.arithmetic import Arithmetic
from prefixgym.envs.base import AgentEnv, Message, Observation, Outcome, agent_of
from prefixgym.envs.check import CheckReport, check_agent_env
from prefixgym.envs.grid_maze import GridMaze
from prefixgym.envs.guess_number import GuessNumber
from prefixgym.envs.key_value_lookup import KeyValueLookup
from prefixgym.envs.mastermind import Mastermind
from prefixgym.envs.registration import BUILTIN_ENVS, register_envs
from prefixgym.envs.spaces import AnyText, messages_space

register_envs()

__all__ = [
    "BUILTIN_ENVS",
    "Addition",
    "AgentEnv",
    "AnyText",
    "Arithmetic",
    "CheckReport",
    "GridMaze",
    "GuessNumber",
    "KeyValueLookup",
    "Mastermind",
    "Message",
    "Observation",
    "Outcome",
    "agent_of",
    "check_agent_env",
    "messages_space",
    "register_envs",
]
