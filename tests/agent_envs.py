"""Envs the tests share: `Lengthy`, registered as `tests/Lengthy-v0` by conftest.py.
(A module of its own, so that a test can subclass it: `from agent_envs import Lengthy`.)"""

from __future__ import annotations

from prefixgym.envs.base import AgentEnv, Outcome


class Lengthy(AgentEnv):
    """Two turns; reward = a function of the reply length, so random replies differ."""

    system_prompt = "Reply with anything."

    def __init__(self, *, raise_on_seed: int | None = None, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)
        self.raise_on_seed = raise_on_seed
        self.seed_used: int | None = None

    def reset(self, *, seed=None, options=None):
        self.seed_used = seed
        return super().reset(seed=seed, options=options)

    def _reset_task(self) -> str:
        return f"Say {int(self.np_random.integers(100))}."

    def _act(self, text: str) -> Outcome:
        if self.raise_on_seed is not None and self.seed_used == self.raise_on_seed:
            raise RuntimeError("this env is broken on purpose")
        reward = (len(text) % 5) / 4
        done = self.turn >= 2
        return Outcome("Again." if not done else "", rewards={"len": reward}, done=done,
                       success=reward > 0.5)

    def expert_action(self) -> str:
        return "abcd"
