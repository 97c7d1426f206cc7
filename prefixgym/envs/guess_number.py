"""GuessNumber: find a hidden integer in [low, high] from "Higher"/"Lower" hints.

The default training env: small enough for a ~5M-parameter model learning from
scratch on a CPU (short replies, the state in the latest message).
This module knows text only.
"""

from __future__ import annotations

import math
import re

from prefixgym.envs.base import AgentEnv, Outcome, share

_INT_RE = re.compile(r"\s*([+-]?\d{1,12})\s*\.?\s*")


class GuessNumber(AgentEnv):
    """Guess a hidden integer drawn uniformly from [low, high].

    Rules: each reply is one integer, e.g. "8". The env answers "Higher." or
    "Lower." and, with `show_range=True` (default), the range still possible:
    "Higher. The number is between 9 and 16." A correct guess ends the episode.
    A reply that is not an integer, or is outside [low, high], is invalid.

    Reward: 1.0 for finding the number, plus `speed_bonus * (1 - (turns-1)/max_turns)`
    for finding it early; `-invalid_penalty` for each invalid reply; 0 otherwise.
    With `progress_credit` > 0, each valid guess also earns
    `progress_credit * log(size_before / size_after) / log(high - low + 1)`, where size
    is the count of numbers still possible (1 once found): the credits of an episode
    sum to `progress_credit * (1 - log(size_left) / log(high - low + 1))`, all of it
    for finding the number, and a guess outside the possible range earns none. A
    dense signal for RL that binary search maximises.
    `is_success` is True iff the number was found. The expert does binary search,
    which needs at most ceil(log2(high - low + 1)) + 1 guesses; with `expert_noise` p
    it guesses, on each turn with probability p, a number drawn uniformly from the
    range still possible instead (drawn from `np_random` at reset, so an episode's
    expert is replayed by its seed): a warm start on such an expert leaves GRPO a
    better strategy than the one it imitated.
    """

    system_prompt = (
        "You play a guessing game. Guess the hidden integer. "
        "Reply with one integer only, for example: 8"
    )

    def __init__(
        self,
        *,
        low: int = 1,
        high: int = 16,
        max_turns: int = 8,
        show_range: bool = True,
        speed_bonus: float = 0.2,
        progress_credit: float = 0.0,
        invalid_penalty: float = 0.1,
        expert_noise: float = 0.0,
        render_mode: str | None = None,
    ) -> None:
        if not (isinstance(low, int) and isinstance(high, int)) or low >= high:
            raise ValueError(f"need integers low < high, got low={low!r}, high={high!r}")
        if speed_bonus < 0:
            raise ValueError(f"speed_bonus must be >= 0, got {speed_bonus!r}")
        if not 0 <= progress_credit <= 1:
            raise ValueError(f"progress_credit must be in 0..1, got {progress_credit!r}")
        noise = share("expert_noise", expert_noise)
        super().__init__(max_turns=max_turns, invalid_penalty=invalid_penalty,
                         render_mode=render_mode)
        self.low, self.high = low, high
        self.show_range = show_range
        self.speed_bonus = float(speed_bonus)
        self.progress_credit = float(progress_credit)
        self.expert_noise = noise
        self._expert_draws_T2 = [(1.0, 0.0)] * max_turns  # (noise?, which) per turn
        self._secret = low
        self._lo, self._hi = low, high

    def _reset_task(self) -> str:
        self._secret = int(self.np_random.integers(self.low, self.high + 1))
        self._lo, self._hi = self.low, self.high
        if self.expert_noise:  # after the secret: the task does not depend on the noise
            draws = self.np_random.random((self.max_turns, 2))
            self._expert_draws_T2 = [(float(a), float(b)) for a, b in draws]
        return f"Guess a number between {self.low} and {self.high}."

    def _act(self, text: str) -> Outcome:
        match = _INT_RE.fullmatch(text)
        guess = int(match.group(1)) if match else None
        if guess is None or not self.low <= guess <= self.high:
            return Outcome(f"Invalid. Reply with one integer between {self._lo} and "
                           f"{self._hi}.", invalid=True)
        size_before = self._hi - self._lo + 1
        if guess == self._secret:
            bonus = self.speed_bonus * (1.0 - (self.turn - 1) / self.max_turns)
            rewards = {"success": 1.0, "speed": bonus, **self._progress(size_before, 1)}
            return Outcome("Correct!", rewards=rewards, done=True, success=True)
        if guess < self._secret:
            hint, self._lo = "Higher.", max(self._lo, guess + 1)
        else:
            hint, self._hi = "Lower.", min(self._hi, guess - 1)
        if self.show_range:
            hint += f" The number is between {self._lo} and {self._hi}."
        return Outcome(hint, rewards=self._progress(size_before, self._hi - self._lo + 1))

    def _progress(self, size_before: int, size_after: int) -> dict[str, float]:
        """The progress credit of narrowing the possible numbers (none when off)."""
        if not self.progress_credit:
            return {}
        total = math.log(self.high - self.low + 1)
        return {"progress": self.progress_credit * math.log(size_before / size_after) / total}

    def expert_action(self) -> str:
        noise, which = self._expert_draws_T2[min(self.turn, self.max_turns - 1)]
        if noise < self.expert_noise:
            return str(self._lo + int(which * (self._hi - self._lo + 1)))
        return str((self._lo + self._hi) // 2)

    def _leak_probes(self) -> list[str]:
        return [f"number is {self._secret}", f"answer is {self._secret}"]
