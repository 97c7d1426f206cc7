"""A verifiers 0.4 taskset for the adapter's tests: one sum per task, one reply, the
reward 1 for the right number. verifiers loads it by module name (`verifiers:vf_sums`)."""

from __future__ import annotations

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)


class Sums(vf.Taskset[SumTask, vf.TasksetConfig]):
    @classmethod
    def task_type(cls) -> type[SumTask]:
        return SumTask

    def load(self):  # type: ignore[no-untyped-def]
        for a in range(1, 6):
            yield SumTask(SumData(prompt=f"What is {a} + {a}?", answer=str(2 * a),
                                  system_prompt="Answer with a number."), self.config.task)


__all__ = ["Sums"]
