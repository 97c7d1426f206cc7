"""A stateful game to train on: Nim against an opponent that never misses a win.

A pile of stones; each turn you take 1, 2 or 3, then the opponent does; whoever
takes the last stone wins. The position changes with every move of both players,
so a reply only makes sense for the current state. The winning rule (leave the
opponent a multiple of 4) is simple enough for the built-in `tiny` model to learn,
and the warm start on the expert plus GRPO gets there on two CPU cores; the recipe
and its figures are in docs/training-your-env.md:

    prefixgym train --env examples/nim.py:Nim --sft-steps 10 --steps 40 --out runs/nim

Rules: the pile starts with 5-11 stones, never a multiple of 4 (so the first player
can always win). A reply is one number, 1, 2 or 3 (at most
the stones left); anything else is an invalid move: the feedback asks again and the
step costs `invalid_penalty`. The opponent takes the winning number when there is one
(leaving you a multiple of 4) and a random 1-3 when there is none, so one wrong move
loses the game. Reward: 1.0 for taking the last stone (success), 0 for a loss.

Run: python examples/nim.py   (checks the env and plays one expert episode)
"""

from __future__ import annotations

import gymnasium as gym

from prefixgym.envs import AgentEnv, Outcome, check_agent_env


class Nim(AgentEnv):
    system_prompt = (
        "We play Nim. Each turn you take 1, 2 or 3 stones; whoever takes the last stone "
        "wins. Reply with the number of stones you take, and nothing else."
    )

    def __init__(self, min_stones: int = 5, max_stones: int = 11, max_turns: int = 6,
                 render_mode: str | None = None) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.starts = [n for n in range(max(1, min_stones), max_stones + 1) if n % 4]
        if not self.starts:
            raise ValueError(f"no start in [{min_stones}, {max_stones}] that is not a multiple "
                             "of 4")
        self.stones = self.starts[0]

    def _reset_task(self) -> str:
        self.stones = self.starts[int(self.np_random.integers(len(self.starts)))]
        return f"There are {self.stones} stones. How many do you take?"

    def _act(self, text: str) -> Outcome:
        reply = text.strip()
        if reply not in ("1", "2", "3") or int(reply) > self.stones:
            return Outcome(f"Take 1, 2 or 3 stones (at most {self.stones}). "
                           f"There are {self.stones} stones.", invalid=True)
        self.stones -= int(reply)
        if self.stones == 0:
            return Outcome("You took the last stone. You win!", rewards={"win": 1.0},
                           done=True, success=True)
        mine = self.stones % 4 or int(self.np_random.integers(1, 4))
        mine = min(mine, self.stones)
        self.stones -= mine
        if self.stones == 0:
            return Outcome(f"I take {mine}, the last stone. I win.", done=True)
        return Outcome(f"I take {mine}. There are {self.stones} stones. How many do you take?")

    def expert_action(self) -> str:
        """Leave a multiple of 4 when possible; otherwise take one and wait."""
        return str(self.stones % 4 or 1)


ENV_ID = "prefixgym_examples/Nim-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=Nim)  # type: ignore[arg-type]

if __name__ == "__main__":
    env = gym.make(ENV_ID, render_mode="ansi")
    print(check_agent_env(env, seeds=range(8)))
    obs, info = env.reset(seed=0)
    done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(env.unwrapped.expert_action())  # type: ignore[attr-defined]
        done = terminated or truncated
    print(env.render())
