"""reasoning-gym's procedural datasets as envs: `--env reasoning_gym:TASK`.

One question per episode, one reply: `--env-kwargs` is the dataset's config
(`{"min_animals": 1, "max_animals": 3}` for leg_counting), and the episode's reset seed
picks the question (`dataset[seed]`, so the evaluation's held-out seeds ask questions
the run never trained on; `size` does not bound them). The reply (or what it holds in
`<answer>` tags) is scored by the dataset's own `score_answer`: the reward is that
score, success a full score. Some scorers pay part of the score for a reply that
merely contains the answer; `partial_credit=false` pays only a full score. The
dataset's answer is the expert's reply, so the default warm start, then GRPO, runs on
any task. Two more kwargs are ours: `partial_credit` and `system_prompt`.

Knows reasoning-gym's dataset API (`create_dataset`, `score_answer`, entries with
`question` and `answer`); nothing of tokens.

The dataset's `seed` defaults to 0 here (reasoning-gym's None would draw one per env
instance, and a GRPO group's envs would ask different questions for one seed).
"""

from __future__ import annotations

from typing import Any

from prefixgym.envs.base import AgentEnv, Outcome

SYSTEM_PROMPT = "Answer with the final answer alone."


class ReasoningGymTask(AgentEnv):
    """One reasoning-gym task; `create` builds it from `--env`'s name and kwargs."""

    system_prompt = SYSTEM_PROMPT

    def __init__(self, dataset: Any, task: str, partial_credit: bool = True,
                 system_prompt: str = SYSTEM_PROMPT) -> None:
        super().__init__(max_turns=1)
        self.dataset, self.task, self.partial_credit = dataset, task, partial_credit
        self.system_prompt = system_prompt
        self.entry: dict[str, Any] = {}

    @classmethod
    def create(cls, task: str, kwargs: dict[str, Any]) -> ReasoningGymTask:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            raise ValueError(f"reasoning-gym has no task {task!r}; its {len(DATASETS)} tasks "
                             f"include {', '.join(sorted(DATASETS)[:8])}, ...")
        ours = {k: kwargs.pop(k) for k in ("partial_credit", "system_prompt") if k in kwargs}
        if not isinstance(ours.get("partial_credit", True), bool):
            raise ValueError(f"partial_credit must be true or false, got "
                             f"{ours['partial_credit']!r}")
        kwargs.setdefault("seed", 0)  # (its default, None, draws one per env instance)
        try:
            dataset = reasoning_gym.create_dataset(task, **kwargs)
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"reasoning-gym refuses {task} with {kwargs}: {e}") from None
        return cls(dataset, task, **ours)

    def _reset_task(self) -> str:
        index = self.task_seed()
        try:
            self.entry = self.dataset[index]
        except IndexError:  # (a dataset over a fixed list of items)
            self.entry = self.dataset[index % len(self.dataset)]
        return str(self.entry["question"])

    def _act(self, text: str) -> Outcome:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(text) or text.strip()
        score = float(self.dataset.score_answer(answer=answer, entry=self.entry))
        success = score >= 1.0
        reward = score if self.partial_credit else float(success)
        return Outcome("", rewards={"score": reward}, done=True, success=success)

    def expert_action(self) -> str:
        return str(self.entry["answer"])
