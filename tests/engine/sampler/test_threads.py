"""ThreadTuner: measures each candidate, settles on the fastest, restores the count,
measures again after `explore_every` uses. A fake clock makes the timings exact."""

import threading
from typing import Any

import pytest
import torch

from prefixgym.engine.sampler.threads import ThreadTuner, size_bucket
from prefixgym.local_service import LocalService
from prefixgym.types import SampleRequest, SamplingParams


class FakeMachine:
    """torch's thread setting and a clock where a step takes cost[threads] seconds."""

    def __init__(self, threads: int, cost: dict[int, float]) -> None:
        self.threads = threads
        self.cost = cost
        self.now = 0.0
        self.sets: list[int] = []

    def get(self) -> int:
        return self.threads

    def set(self, n: int) -> None:
        self.sets.append(n)
        self.threads = n

    def clock(self) -> float:
        return self.now

    def tuner(self, **kwargs: Any) -> ThreadTuner:
        kwargs.setdefault("explore_below", float("inf"))  # the fake steps take seconds
        return ThreadTuner(get_threads=self.get, set_threads=self.set, clock=self.clock,
                           **kwargs)

    def step(self, tuner: ThreadTuner, key: object) -> int:
        with tuner.run(key) as threads:
            assert self.threads == threads
            self.now += self.cost[threads]
        return threads


def test_size_bucket() -> None:
    assert [size_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_candidates_are_powers_of_two_up_to_the_maximum() -> None:
    assert ThreadTuner(max_threads=1).candidates == [1]
    assert ThreadTuner(max_threads=2).candidates == [1, 2]
    assert ThreadTuner(max_threads=6).candidates == [1, 2, 4, 6]


def test_settles_on_the_fastest_and_restores_the_count() -> None:
    machine = FakeMachine(threads=4, cost={1: 1.2, 2: 1.0, 4: 1.1})
    tuner = machine.tuner(trials=2)
    used = [machine.step(tuner, "decode") for _ in range(10)]
    assert sorted(used[:6]) == [1, 1, 2, 2, 4, 4]  # every candidate measured `trials` times
    assert used[6:] == [2, 2, 2, 2]
    assert tuner.best() == {"decode": 2}
    assert machine.threads == 4  # restored after every step


def test_one_slow_first_call_does_not_decide() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 2.0})
    tuner = machine.tuner(trials=2)
    used = []
    for _ in range(6):
        with tuner.run("k") as threads:
            first_on_one = threads == 1 and 1 not in used
            machine.now += 50.0 if first_on_one else machine.cost[threads]  # kernel setup
        used.append(threads)
    assert used == [2, 2, 1, 1, 1, 1]  # one thread still wins on its least time


def test_a_long_step_on_all_threads_is_not_tried_on_fewer() -> None:
    machine = FakeMachine(threads=4, cost={1: 0.01, 2: 0.5, 4: 0.2})
    tuner = machine.tuner(trials=2, explore_below=0.1)
    used = [machine.step(tuner, "prefill") for _ in range(4)]
    assert used == [4, 4, 4, 4] and tuner.best() == {"prefill": 4}


def test_times_are_compared_per_unit_of_work() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 1.0})
    tuner = machine.tuner(trials=1)
    with tuner.run("k", work=1.0) as first:
        machine.now += 1.0
    with tuner.run("k", work=4.0):  # 4x the work in 2x the time: faster per unit
        machine.now += 2.0
    assert tuner.choose("k") != first


def test_never_runs_more_threads_than_the_caller_set_since() -> None:
    machine = FakeMachine(threads=4, cost={1: 1.0, 2: 1.0, 4: 1.0})
    tuner = machine.tuner(trials=1)
    machine.threads = 2  # the user lowered torch's count after the tuner was built
    assert max(machine.step(tuner, "k") for _ in range(6)) == 2
    assert machine.threads == 2


def test_keys_are_tuned_separately() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 2.0})
    tuner = machine.tuner(trials=1)
    for _ in range(3):
        machine.step(tuner, "small")
    machine.cost = {1: 2.0, 2: 1.0}
    for _ in range(3):
        machine.step(tuner, "big")
    assert tuner.best() == {"small": 1, "big": 2}


def test_measures_again_after_explore_every_uses() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 2.0})
    tuner = machine.tuner(trials=1, explore_every=5)
    assert [machine.step(tuner, "k") for _ in range(5)][2:] == [1, 1, 1]
    machine.cost = {1: 5.0, 2: 1.0}  # the machine got busy
    used = [machine.step(tuner, "k") for _ in range(5)]
    assert used[2:] == [2, 2, 2]


def test_a_failing_step_restores_the_count_and_records_nothing() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 1.0})
    tuner = machine.tuner(trials=1)
    with pytest.raises(RuntimeError), tuner.run("k"):
        raise RuntimeError("boom")
    assert machine.threads == 2
    assert tuner.choose("k") == 2  # the failed 2-thread step left no sample: 2 again


def test_disabled_or_single_candidate_never_touches_the_count() -> None:
    machine = FakeMachine(threads=2, cost={1: 1.0, 2: 1.0})
    for tuner in (machine.tuner(enabled=False), machine.tuner(max_threads=1)):
        for _ in range(4):
            with tuner.run("k") as threads:
                assert threads == 2
        assert machine.sets == [] and tuner.best() == {}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="trials"):
        ThreadTuner(max_threads=2, trials=0)
    with pytest.raises(ValueError, match="explore_below"):
        ThreadTuner(max_threads=2, explore_below=0.0)


class Alternating(ThreadTuner):
    """A tuner whose choices flip between 1 and 2 threads every step: what measured
    times on a machine with a changing load could make it do."""

    def __init__(self) -> None:
        super().__init__(max_threads=2)
        self.chosen: list[int] = []

    def choose(self, key: object) -> int:
        self.chosen.append(1 + len(self.chosen) % 2)
        return self.chosen[-1]


def _round(svc: LocalService) -> list[tuple[list[int], list[float]]]:
    """Seven requests, two samples each: prefills and decodes of 5-14 rows (MKL's
    5-11-row matmuls are the ones whose kernels change with the thread count)."""
    sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
    requests = [SampleRequest([(7 * i + j) % 300 + 1 for j in range(20 + 11 * i)], 2,
                              SamplingParams(max_tokens=10, seed=i)) for i in range(7)]
    return [(s.tokens, s.logprobs) for f in sampler.sample_many(requests)
            for s in f.result().sequences]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's strict mode")
def test_engine_outputs_are_the_same_bits_on_any_thread_count_and_tuner_choice() -> None:
    """Sampled tokens and their logprobs, bit for bit, at 1 thread, at 2, and with the
    tuner switching between them step by step (fails without MKL_CBWR=AUTO,STRICT)."""
    before = torch.get_num_threads()
    try:
        outputs = []
        flipping = Alternating()
        for threads, tuner in ((1, None), (2, None), (2, flipping)):
            torch.set_num_threads(threads)
            with LocalService("tiny", seed=0, thread_tuning=False, deterministic=True) as svc:
                if tuner is not None:
                    svc.engine.threads = svc.engine.runner.threads = tuner
                outputs.append(_round(svc))
                assert torch.get_num_threads() == threads
        assert set(flipping.chosen) == {1, 2}
        assert outputs[1] == outputs[0]
        assert outputs[2] == outputs[0]
    finally:
        torch.set_num_threads(before)


def test_a_deterministic_engine_of_a_bf16_model_keeps_one_thread_count() -> None:
    """A bf16 model's matmuls run in oneDNN, which rounds by thread count (on an Intel
    Xeon with AMX, the tiny preset's round differs at 3 and 4 threads from 1): a
    deterministic engine of one does not tune, and a second run gives the same bits."""
    runs = []
    for _ in range(2):
        with LocalService("tiny", seed=0, dtype="bfloat16", deterministic=True) as svc:
            assert not svc.engine.threads.enabled
            runs.append(_round(svc))
    assert runs[0] == runs[1]
    with LocalService("tiny", seed=0, dtype="bfloat16") as svc:  # not deterministic: tunes
        assert svc.engine.threads.enabled
    with LocalService("tiny", seed=0, deterministic=True) as svc:  # fp32: MKL, any count
        assert svc.engine.threads.enabled


def test_engine_thread_choices_do_not_reach_a_training_thread() -> None:
    """An engine step on 1 thread (another Python thread) changes neither the count of a
    thread already running torch nor that of a training worker started meanwhile."""
    from prefixgym.engine.model import load_model
    from prefixgym.engine.trainer.training import TrainingClient

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    step_running, step_done = threading.Event(), threading.Event()

    def engine_step_on_one_thread() -> None:
        torch.set_num_threads(1)  # what ThreadTuner.run does for a small step
        step_running.set()
        step_done.wait()
        torch.set_num_threads(2)

    engine = threading.Thread(target=engine_step_on_one_thread)
    try:
        engine.start()
        step_running.wait()
        assert torch.get_num_threads() == 2  # this thread keeps its own count
        trainer = TrainingClient(load_model("tiny", seed=0))
        assert trainer._worker.submit(torch.get_num_threads).result() == 2
        trainer.close()
    finally:
        step_done.set()
        engine.join()
        torch.set_num_threads(before)
