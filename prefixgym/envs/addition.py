"""Addition: the sum of two (or more) integers, in one reply, read as a grader reads prose.

The shipped env for pretrained chat models (`--config addition`): an instruct model
answers in sentences ("5 + 33 = 38."), so the reply's last integer is its answer, as
graders of math answers read a free-form reply. A model of 135M parameters gets few
sums right at first and can learn the rest; with `terms=3` it must carry a partial sum
(`--config addition3`). This module knows text only.
"""

from __future__ import annotations

import re

from prefixgym.envs.base import AgentEnv, Outcome

_INT_RE = re.compile(r"[+-]?\d{1,30}")


class Addition(AgentEnv):
    """Add `terms` integers (default 2, at most 8) drawn uniformly from 1..`max_value`.

    Rules: one reply, whose last integer is its answer ("The sum is 38." answers 38).
    A reply without an integer is invalid (`-invalid_penalty`, default 0).

    Reward: `success` 1.0 for the right sum, 0 otherwise; the reply ends the episode.
    The expert replies with the sum alone.
    """

    system_prompt = "Add the two numbers. Reply with the sum only, as an integer."

    def __init__(self, *, max_value: int = 99, terms: int = 2, invalid_penalty: float = 0.0,
                 render_mode: str | None = None) -> None:
        if isinstance(max_value, bool) or not isinstance(max_value, int) \
                or not 1 <= max_value <= 10**9:
            raise ValueError(f"max_value must be an int in 1..10**9, got {max_value!r}")
        if isinstance(terms, bool) or not isinstance(terms, int) or not 2 <= terms <= 8:
            raise ValueError(f"terms must be an int in 2..8, got {terms!r}")
        super().__init__(max_turns=1, invalid_penalty=invalid_penalty,
                         render_mode=render_mode)
        self.max_value, self.terms = max_value, terms
        if terms > 2:
            self.system_prompt = "Add the numbers. Reply with the sum only, as an integer."
        self._answer = 2

    def _reset_task(self) -> str:
        numbers = [int(self.np_random.integers(1, self.max_value + 1)) for _ in range(self.terms)]
        self._answer = sum(numbers)
        return f"What is {' + '.join(map(str, numbers))}?"

    def _act(self, text: str) -> Outcome:
        numbers = _INT_RE.findall(text)
        if not numbers:
            return Outcome(f"No integer. The sum is {self._answer}.", done=True, invalid=True)
        if int(numbers[-1]) == self._answer:
            return Outcome("Correct!", rewards={"success": 1.0}, done=True, success=True)
        return Outcome(f"Wrong. The sum is {self._answer}.", done=True)

    def expert_action(self) -> str:
        return str(self._answer)
