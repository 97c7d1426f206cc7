"""Write a new env: a complete AgentEnv in a few lines, checked by check_agent_env.

A new env sets a system prompt and overrides two methods: `_reset_task` (draw a
task with `self.np_random`, return the first user message) and `_act` (answer one
assistant reply with an `Outcome`). The base class handles tool calls, invalid
replies, turn limits, the transcript and rendering. `expert_action` (a scripted
policy, for warm starts and tests) and `_leak_probes` (the hidden answer, which
must never show before the end) are what `check_agent_env` needs to test it.

Run: python examples/new_env.py
"""

from __future__ import annotations

import gymnasium as gym

from prefixgym.envs import AgentEnv, Outcome, check_agent_env

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "plant", "sugar"]


class ReverseWord(AgentEnv):
    """Spell a word backwards.

    Rules: the user gives a word; the reply is the word reversed, e.g. "elppa".
    Reward: 1.0 for the reversed word; 0.3 for the right letters in another order
    (partial credit); -invalid_penalty for an empty reply or one with spaces, after
    which the agent may try again. Any other reply ends the episode with 0.
    """

    system_prompt = "Reply with the given word spelled backwards, and nothing else."

    def __init__(self, max_turns: int = 3, render_mode: str | None = None) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.word = WORDS[0]

    def _reset_task(self) -> str:
        self.word = WORDS[int(self.np_random.integers(len(WORDS)))]
        return f"Word: {self.word}"

    def _act(self, text: str) -> Outcome:
        reply = text.strip().lower()
        if not reply or " " in reply:
            return Outcome("Reply with one word.", invalid=True)
        if reply == self.word[::-1]:
            return Outcome("Correct!", rewards={"success": 1.0}, done=True, success=True)
        if sorted(reply) == sorted(self.word):
            return Outcome("Right letters, wrong order.", rewards={"partial": 0.3}, done=True)
        return Outcome("Wrong.", done=True)

    def expert_action(self) -> str:
        return self.word[::-1]

    def _leak_probes(self) -> list[str]:
        return [self.word[::-1]]


ENV_ID = "prefixgym_examples/ReverseWord-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=ReverseWord)  # type: ignore[arg-type]

if __name__ == "__main__":
    env = gym.make(ENV_ID, render_mode="ansi")
    report = check_agent_env(env, seeds=range(8))
    print(report)
    obs, info = env.reset(seed=0)
    env.step(env.unwrapped.expert_action())  # type: ignore[attr-defined]
    print(env.render())
