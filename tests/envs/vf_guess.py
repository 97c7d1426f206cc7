"""A multi-turn verifiers 0.4 taskset for the adapter's tests: guess a number from 1 to
8, told "higher" or "lower" after each guess, by the taskset's own `Env`; the reward
is 1 for a found number."""

from __future__ import annotations

import re

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def found(self, task: GuessData, trace: vf.Trace) -> float:
        return float(any(m.content.strip() == task.answer for m in trace.assistant_messages))


class Guesses(vf.Taskset[GuessTask, vf.TasksetConfig]):
    @classmethod
    def task_type(cls) -> type[GuessTask]:
        return GuessTask

    def load(self):  # type: ignore[no-untyped-def]
        for secret in (3, 6, 8):
            yield GuessTask(GuessData(prompt="Guess my number from 1 to 8.",
                                      answer=str(secret)), self.config.task)


class GuessConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_rounds: int = 4


class GuessEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents):  # type: ignore[no-untyped-def]
        secret = int(task.data.answer)
        async with agents.agent.interaction(task) as talk:
            segment = await talk.turn()
            for _ in range(self.config.max_rounds - 1):
                guess = re.search(r"-?\d+", segment.last_reply)
                if guess is not None and int(guess.group()) == secret:
                    break
                hint = ("Reply with a number." if guess is None
                        else "higher" if int(guess.group()) < secret else "lower")
                segment = await talk.turn(hint)
                if segment.terminated:
                    break


__all__ = ["Guesses", "GuessEnv"]
