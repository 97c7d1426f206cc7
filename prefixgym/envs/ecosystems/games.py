"""Text games of TextArena and GEM as envs: `--env textarena:ID`, `--env gem:ID`.

A game is played by one agent (TextArena's single-player games; their `-raw` ids are
the game's own text, without TextArena's wrappers), one reply per turn; the game's
messages are the user turns, its final reward the episode's, success a positive one.
`max_turns` (default 64) bounds a game that never ends; the game's own turn limit
usually comes first. Each game is reset with the episode's seed, which both libraries
honour: a GRPO group plays one game. `--env-kwargs` are the game's own arguments.

- TextArena: a reply the game calls an invalid move (its admin message) is an invalid
  reply; the game's reason for ending comes with its reward.
- GEM: the message is the observation and its `suffix` ("Enter your next guess."),
  as GEM's own wrappers show it; names hold a colon (`gem:game:GuessTheNumber-v0-easy`).
- An expert where the game has a simple one: GuessTheNumber's bisection on the
  "higher"/"lower" hints, in each library's answer syntax (`[n]`, `\\boxed{n}`); other
  games have none (train them with `--sft-steps 0`).

Knows TextArena's and GEM's env APIs; nothing of tokens.
"""

from __future__ import annotations

import re
from typing import Any

from prefixgym.envs.base import AgentEnv, Outcome

_RANGE = re.compile(r"between (-?\d+) and (-?\d+)")


class _Bisection:
    """GuessTheNumber's expert: the middle of what the hints leave."""

    def __init__(self, text: str, ask: str, answer: re.Pattern[str]) -> None:
        lo, hi = _RANGE.search(text).groups()  # type: ignore[union-attr]
        self.lo, self.hi, self.ask, self.answer = int(lo), int(hi), ask, answer

    def guess(self) -> str:
        return self.ask.format((self.lo + self.hi) // 2)

    def hear(self, reply: str, message: str) -> None:
        found = self.answer.findall(reply)
        if not found:
            return
        guess, said = int(found[-1]), message.lower()
        if "higher" in said:
            self.lo = max(self.lo, guess + 1)
        elif "lower" in said:
            self.hi = min(self.hi, guess - 1)


class _Game(AgentEnv):
    """What both libraries' adapters share: the seed, the expert, the turn bound."""

    ask = "{}"
    answer = re.compile(r"(-?\d+)")
    making = "{name}"  # how a failure to make the game begins

    @staticmethod
    def make_game(name: str, kwargs: dict[str, Any]) -> Any:
        """The library's game `name`, made with `kwargs`."""
        raise NotImplementedError

    @classmethod
    def create(cls, name: str, kwargs: dict[str, Any]) -> _Game:
        max_turns = kwargs.pop("max_turns", 64)
        try:
            game = cls.make_game(name, kwargs)
        except Exception as e:  # noqa: BLE001 - the library's own errors, said in one line
            raise ValueError(f"{cls.making.format(name=name)} with {kwargs}: "
                             f"{_first_line(e)}") from None
        return cls(game, name, max_turns)

    def __init__(self, game: Any, game_id: str, max_turns: int) -> None:
        super().__init__(max_turns=max_turns)
        self.game, self.game_id = game, game_id
        self.expert_available = "GuessTheNumber" in game_id
        self._expert: _Bisection | None = None

    def started(self, first: str) -> str:
        self._expert = (_Bisection(first, self.ask, self.answer)
                        if self.expert_available and _RANGE.search(first) else None)
        return first

    def heard(self, reply: str, message: str) -> None:
        if self._expert is not None:
            self._expert.hear(reply, message)

    def expert_action(self) -> str:
        if self._expert is None:
            raise NotImplementedError(f"{self.game_id} has no expert here")
        return self._expert.guess()


def _first_line(error: Exception) -> str:
    """`Type: ` and the error's first line that says something (not a rule of `*`s)."""
    lines = [line.strip() for line in str(error).splitlines() if any(c.isalnum() for c in line)]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class TextArenaGame(_Game):
    ask = "[{}]"
    answer = re.compile(r"\[(-?\d+)\]")

    making = "textarena cannot make {name} for one player"

    @staticmethod
    def make_game(name: str, kwargs: dict[str, Any]) -> Any:
        import textarena as ta

        game = ta.make(env_id=name, **kwargs)
        game.reset(num_players=1, seed=0)  # a game of more players refuses here
        return game

    def _reset_task(self) -> str:
        self.game.reset(num_players=1, seed=self.task_seed())
        return self.started(self._observe())

    def _observe(self) -> str:
        player, messages = self.game.get_observation()
        return "\n".join(text for sender, text, _ in messages if sender != player)

    def _act(self, text: str) -> Outcome:
        done, _ = self.game.step(action=text)
        if not done:
            message = self._observe()
            self.heard(text, message)
            return Outcome(message, invalid="invalid move" in message.lower())
        rewards, info = self.game.close()
        reward, mine = float(rewards.get(0, 0.0)), info.get(0, {})
        return Outcome(str(mine.get("reason", "")), rewards={"game": reward}, done=True,
                       success=reward > 0, invalid=bool(mine.get("invalid_move")))


class GemEnv(_Game):
    ask = "\\boxed{{{}}}"
    answer = re.compile(r"\\boxed\{(-?\d+)\}")

    making = "gem cannot make {name}"

    @staticmethod
    def make_game(name: str, kwargs: dict[str, Any]) -> Any:
        import gem

        return gem.make(name, **kwargs)

    def _reset_task(self) -> str:
        observation, info = self.game.reset(seed=self.task_seed())
        return self.started(_with_suffix(observation, info))

    def _act(self, text: str) -> Outcome:
        observation, reward, terminated, truncated, info = self.game.step(text)
        message = _with_suffix(observation, info)
        self.heard(text, message)
        done = bool(terminated or truncated)
        return Outcome(message, rewards={"game": float(reward)}, done=done,
                       success=bool(terminated) and float(reward) > 0)

    def close(self) -> None:
        close = getattr(self.game, "close", None)  # (not every GEM env has one)
        if close is not None:
            close()


def _with_suffix(observation: Any, info: dict[str, Any]) -> str:
    suffix = info.get("suffix") if isinstance(info, dict) else None
    return f"{observation}\n{suffix}" if suffix else str(observation)
