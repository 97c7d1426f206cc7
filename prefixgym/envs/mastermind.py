"""Mastermind: find a hidden code of coloured pegs from exact/misplaced feedback.

This module knows text only.
"""

from __future__ import annotations

import itertools
import string
from collections import Counter

from prefixgym.envs.base import AgentEnv, Outcome


def score(guess: str, code: str) -> tuple[int, int]:
    """(exact, misplaced): pegs right in place, and right colour in the wrong place."""
    exact = sum(g == c for g, c in zip(guess, code))
    common = sum((Counter(guess) & Counter(code)).values())
    return exact, common - exact


class Mastermind(AgentEnv):
    """Find a code of `code_length` pegs, each one of `num_colors` colours (letters
    A, B, C, ...; repeats allowed).

    Rules: each reply is a guess, the letters only, e.g. "ABCD" (spaces and case
    are ignored). The env answers "ABCD: 1 exact, 2 misplaced." A reply with the
    wrong length or a letter outside the colours is invalid.

    Reward: 1.0 for finding the code (ends the episode). When the turns run out,
    partial credit `partial_credit * best_exact / code_length` (the most pegs any
    guess had in place). `-invalid_penalty` per invalid reply. The expert opens
    with "AABB" and then plays the first code (in order) consistent with all the
    feedback so far: at most 8 guesses for the default 4 pegs and 6 colours.
    """

    system_prompt = (
        "You play Mastermind. Find the hidden code. Reply with a guess, letters only, "
        "for example: AABB"
    )

    def __init__(
        self,
        *,
        code_length: int = 4,
        num_colors: int = 6,
        max_turns: int = 10,
        partial_credit: float = 0.3,
        invalid_penalty: float = 0.1,
        render_mode: str | None = None,
    ) -> None:
        if not 1 <= code_length <= 6:
            raise ValueError(f"code_length must be in 1..6, got {code_length!r}")
        if not 2 <= num_colors <= 10:
            raise ValueError(f"num_colors must be in 2..10, got {num_colors!r}")
        super().__init__(max_turns=max_turns, invalid_penalty=invalid_penalty,
                         render_mode=render_mode)
        self.code_length, self.num_colors = code_length, num_colors
        self.colors = string.ascii_uppercase[:num_colors]
        self.partial_credit = float(partial_credit)
        self._code = self.colors[0] * code_length
        self._history: list[tuple[str, tuple[int, int]]] = []

    def _reset_task(self) -> str:
        picks = self.np_random.integers(0, self.num_colors, size=self.code_length)
        self._code = "".join(self.colors[int(i)] for i in picks)
        self._history = []
        return (f"Guess the code: {self.code_length} letters from "
                f"{', '.join(self.colors)} (repeats allowed).")

    def _act(self, text: str) -> Outcome:
        guess = "".join(text.split()).upper()
        if len(guess) != self.code_length or any(ch not in self.colors for ch in guess):
            colors = f"{self.colors[0]}-{self.colors[-1]}"
            return Outcome(f"Invalid. Reply with {self.code_length} letters {colors}.",
                           rewards=self._partial(), invalid=True)
        exact, misplaced = score(guess, self._code)
        self._history.append((guess, (exact, misplaced)))
        if exact == self.code_length:
            return Outcome(f"{guess}: solved!", rewards={"success": 1.0},
                           done=True, success=True)
        return Outcome(f"{guess}: {exact} exact, {misplaced} misplaced.",
                       rewards=self._partial())

    def _partial(self) -> dict[str, float]:
        """On the last turn: credit for the most pegs any guess had in place."""
        if self.turn < self.max_turns or not self._history:
            return {}
        best = max(feedback[0] for _, feedback in self._history)
        return {"partial": self.partial_credit * best / self.code_length}

    def expert_action(self) -> str:
        if not self._history:  # a split opening ("AABB") tells more than "AAAA"
            half = self.code_length // 2
            return self.colors[0] * half + self.colors[1] * (self.code_length - half)
        for candidate in itertools.product(self.colors, repeat=self.code_length):
            code = "".join(candidate)
            if all(score(guess, code) == fb for guess, fb in self._history):
                return code
        return self.colors[0] * self.code_length  # unreachable: the code is consistent

    def _leak_probes(self) -> list[str]:
        return [self._code]
